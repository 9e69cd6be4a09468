"""When and why a rank failed, for ``arendez-run`` to blame the rank that failed first.

Exit times alone mislead: a rank that fails tells its peers at once (``arendez.farewell``), and
they may fail on that news and exit before the first one has finished ending. So a rank started
by ``arendez-run`` (``ARENDEZ_ERROR_FILE`` set) notes the wall-clock time and reason of its
failure here before it tells anyone; its peers' failures come later by cause, and the launcher
orders ranks by the earlier of that time and their exit (torchrun's error files, in spirit).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass

#: The file a rank writes its failure to (set by ``arendez-run``, one per rank).
ENV = "ARENDEZ_ERROR_FILE"


@dataclass(frozen=True)
class Failure:
    """A rank's own note of its failure: wall-clock ``time`` and ``why``."""

    time: float
    why: str


def record(why: str) -> None:
    """Note this process's failure in ``$ARENDEZ_ERROR_FILE`` (the first note stays)."""
    path = os.environ.get(ENV)
    if not path or os.path.exists(path):
        return
    _write(path, json.dumps({"time": time.time(), "why": why}))


_heard = False


def heard(peer: int, why: str) -> None:
    """Note the first peer this process saw fail, and why (``$ARENDEZ_ERROR_FILE.peer``), when
    it hears of it: if the process then fails (with a note, or exiting 1 after catching the
    error), the launcher knows which peer it failed on."""
    global _heard
    path = os.environ.get(ENV)
    if _heard or not path:
        return
    _heard = True
    _write(f"{path}.peer", json.dumps({"rank": peer, "why": why}))


def _write(path: str, text: str) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)  # whole or absent for a reader
    except OSError:
        pass  # best effort: the launcher falls back to exit times


def failed_on(path: str) -> tuple[int, str] | None:
    """The first peer the rank of note ``path`` heard fail, and why (``heard``); None if none."""
    try:
        with open(f"{path}.peer", encoding="utf-8") as f:
            data = json.load(f)
        return int(data["rank"]), str(data["why"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def read(path: str) -> Failure | None:
    """The note at ``path``, or None when there is none (or it is unreadable)."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        return Failure(float(data["time"]), str(data["why"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None
