"""Stops a launcher's process groups when the launcher dies without saying it is done.

``arendez-run`` starts ``python -m arendez.watchdog GRACE`` in a session of its own and writes
one process-group id per line to its stdin as it starts the server and the ranks, then ``done``
once it has stopped them itself; ``dir PATH`` names a scratch directory of the launcher's. End of
input without ``done`` means the launcher was killed (SIGKILL, a crash, the OOM killer): the
watchdog sends SIGTERM to every group, waits up to ``GRACE`` seconds, SIGKILLs what is left, and
removes the scratch directories. So nothing outlives the launcher, however it ends.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import time
from collections.abc import Sequence


def _alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _signal(groups: list[int], sig: int) -> list[int]:
    """Send ``sig`` to every group; return those that still exist."""
    left = []
    for pgid in groups:
        try:
            os.killpg(pgid, sig)
            left.append(pgid)
        except ProcessLookupError:
            pass
        except PermissionError:
            left.append(pgid)
    return left


def main(argv: Sequence[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    grace = float(args[0]) if args else 5.0
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the launcher's to handle
    groups: list[int] = []
    scratch: list[str] = []
    for line in sys.stdin:
        word = line.strip()
        if word == "done":
            return 0
        if word.isdigit():
            groups.append(int(word))
        elif word.startswith("dir "):
            scratch.append(word[4:])
    left = _signal(groups, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = [g for g in left if _alive(g)]
    _signal(left, signal.SIGKILL)
    for path in scratch:
        shutil.rmtree(path, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
