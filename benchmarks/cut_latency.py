"""How long after a network cut each rank raises, and with what (``arendez/linkwatch.py``).

::

    python benchmarks/cut_latency.py [--trials 1] [--link-timeout 20] [--lease 1.5]

Emulated hosts (network namespaces on one bridge, ``netns.py``; needs root): the server on host
0, rank 0 on host 1 and rank 1 on host 2, each rank in a loop of 64 KiB all_reduces
(``tests/cut_rank.py``, collective timeout 120 s). Two cuts, each on fresh hosts:

- ``host``: rank 1's switch port goes down (its host is cut off from everyone);
- ``pair``: the switch drops what it would forward between hosts 1 and 2 (nftables); both
  still reach the server.

Reports the seconds from the cut to each rank's error, and the error. (gloo has no figure to
compare: its ranks wait for the collective's timeout, 30 minutes by default under torch.)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from netns import ip  # noqa: E402

from tests.harness import emulated_hosts, failed_after, start_cut_job  # noqa: E402

PORT = 29481


def trial(kind: str, link_timeout: float, lease: float) -> list[tuple[float, str]]:
    with emulated_hosts("cl", 3) as hosts:
        _, _, outs, errs = start_cut_job(hosts, 2, f"cut-{kind}", PORT, lease, link_timeout)
        cut = time.time()
        if kind == "host":
            ip("-n", hosts.switch, "link", "set", "p2", "down")
        else:
            hosts.cut(1, 2)
        return [failed_after(outs[r], errs[r], cut, 4 * link_timeout + 30) for r in range(2)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--trials", type=int, default=1)
    p.add_argument("--link-timeout", type=float, default=20.0, help="ARENDEZ_LINK_TIMEOUT of the ranks")
    p.add_argument("--lease", type=float, default=1.5, help="the server's --lease")
    args = p.parse_args()
    print("| cut | trial | rank 0 raised after | rank 1 raised after | errors |")
    print("|---|---|---|---|---|")
    for kind in ("host", "pair"):
        for n in range(1, args.trials + 1):
            (t0, e0), (t1, e1) = trial(kind, args.link_timeout, args.lease)
            print(f"| {kind} | {n} | {t0:.1f} s | {t1:.1f} s | {e0[:90]} / {e1[:90]} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
