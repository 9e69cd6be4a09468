"""TLS for server and peer links, configured from the environment.

- ``ARENDEZ_TLS_CA``: CA bundle; when set, every link (to the server and between peers) is TLS,
  and certificates are verified against it (host names / IP SANs included).
- ``ARENDEZ_TLS_CERT`` / ``ARENDEZ_TLS_KEY``: this rank's certificate, presented by its peer
  listener (and by an embedded server) and as its client certificate.
"""

from __future__ import annotations

import os
import ssl
from collections.abc import Mapping
from dataclasses import dataclass

from .errors import RendezvousError


@dataclass(frozen=True)
class TLS:
    client: ssl.SSLContext  # for connections this process opens
    server: ssl.SSLContext | None  # for its listeners (None without a certificate)


def client_context(ca: str, cert: str | None = None, key: str | None = None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca)
    if cert:
        ctx.load_cert_chain(cert, key)
    return ctx


def server_context(cert: str, key: str | None, client_ca: str | None = None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(cert, key)
    if client_ca:
        ctx.load_verify_locations(client_ca)
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def from_env(env: Mapping[str, str] | None = None) -> TLS | None:
    """The TLS settings the ``ARENDEZ_TLS_*`` variables describe, or None for plain TCP."""
    env = os.environ if env is None else env
    ca = env.get("ARENDEZ_TLS_CA")
    cert, key = env.get("ARENDEZ_TLS_CERT"), env.get("ARENDEZ_TLS_KEY")
    if not ca:
        if cert or key:
            raise RendezvousError("ARENDEZ_TLS_CERT/KEY need ARENDEZ_TLS_CA to verify peers")
        return None
    try:
        client = client_context(ca, cert, key)
        server = server_context(cert, key, ca) if cert else None
    except (OSError, ssl.SSLError) as exc:
        raise RendezvousError(f"cannot load the TLS files: {exc}") from None
    return TLS(client, server)
