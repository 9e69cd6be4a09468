#!/usr/bin/env bash
# Build a local Python base image from Debian packages, for hosts that cannot pull python:3.11-slim.
#
#   scripts/build-base-image.sh [TAG]          (default TAG: localhost/arendez-base:bookworm)
#   podman build --build-arg BASE_IMAGE=localhost/arendez-base:bookworm -t arendez:local .
#
# mmdebstrap builds a minimal Debian root file system (python3 and a venv at /opt/venv, first on
# PATH, so `python` and `pip` behave as in the python:3.11-slim image) from a Debian mirror only;
# `podman import` (or `docker import`, ENGINE=docker) turns it into an image. Needs root (or
# mmdebstrap's unshare mode) and the mmdebstrap package. Settings, from the environment:
#   SUITE   Debian suite (default bookworm, whose python3 is 3.11)
#   MIRROR  Debian mirror (default http://deb.debian.org/debian)
#   ENGINE  podman (default) or docker
#   LABEL   an extra image label, key=value (optional)
#   EXTRA_CA_DIR  PEM certificates (*.crt) to trust in the image besides Debian's, e.g. a proxy's
#                 (default /usr/local/share/ca-certificates, the host's own additions; "" for none)
set -euo pipefail

TAG=${1:-localhost/arendez-base:bookworm}
SUITE=${SUITE:-bookworm}
MIRROR=${MIRROR:-http://deb.debian.org/debian}
ENGINE=${ENGINE:-podman}
EXTRA_CA_DIR=${EXTRA_CA_DIR-/usr/local/share/ca-certificates}

for tool in mmdebstrap "$ENGINE"; do
  command -v "$tool" >/dev/null || { echo "build-base-image: $tool is not installed" >&2; exit 2; }
done

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/ca"
if [ -n "$EXTRA_CA_DIR" ] && [ -d "$EXTRA_CA_DIR" ]; then
  find "$EXTRA_CA_DIR" -maxdepth 1 -name '*.crt' -exec cp {} "$work/ca/" \;
fi

sources=("deb $MIRROR $SUITE main")
if [ "$SUITE" = bookworm ]; then
  sources+=("deb ${MIRROR%/debian}/debian-security $SUITE-security main" "deb $MIRROR $SUITE-updates main")
fi

mmdebstrap --variant=minbase --quiet \
  --include=python3,python3-venv,ca-certificates \
  --customize-hook="mkdir -p \"\$1/usr/local/share/ca-certificates\" && cp -r $work/ca/. \"\$1/usr/local/share/ca-certificates/\"" \
  --customize-hook='chroot "$1" update-ca-certificates' \
  --customize-hook='chroot "$1" python3 -m venv /opt/venv' \
  --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*' \
  "$SUITE" "$work/rootfs.tar" "${sources[@]}"

"$ENGINE" import \
  --change 'ENV PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt' \
  --change 'ENV LANG=C.UTF-8' \
  --change 'CMD ["python3"]' \
  ${LABEL:+--change "LABEL $LABEL"} \
  "$work/rootfs.tar" "$TAG" >/dev/null
echo "build-base-image: $TAG ($("$ENGINE" image inspect --format '{{.Size}}' "$TAG") bytes)"
