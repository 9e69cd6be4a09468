"""Log lines that come in bursts, summarised per process.

A failure at scale is news to every rank: W ranks each logging each of F lost peers is W x F
lines and the first cause is buried (QA3-F9). A ``BurstLog`` logs the first line of a burst at
once and gathers what follows in the next ``WINDOW`` seconds into one summary line; a key
already logged (the same peer heard of by another rank of this process) is dropped.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from typing import Any

#: seconds after a logged line during which further ones are gathered into one summary
WINDOW = 1.0
#: keys remembered as already logged; past this the oldest half is forgotten
REMEMBERED = 100_000


class BurstLog:
    """The first line now, the rest of its burst as one line ``summarise(items)``.

    The summary is written by a timer on the event loop that logged the first line (no thread
    of its own), or, if that loop is gone before the window closes, by the next line noted after
    it, or at interpreter exit."""

    def __init__(self, log: logging.Logger, summarise: Callable[[Sequence[Any]], str]) -> None:
        self._log = log
        self._summarise = summarise
        self._lock = threading.Lock()
        self._told: dict[Hashable, None] = {}  # (insertion-ordered: the oldest go first)
        self._items: list[Any] | None = None  # the open window's items
        self._level = logging.NOTSET
        self._closes = 0.0  # when the open window closes (monotonic)
        atexit.register(self.flush)

    def note(self, key: Hashable, level: int, item: Any, message: str, *args: Any) -> None:
        """Log ``message % args`` at ``level`` if no burst is open; else gather ``item``.
        A ``key`` seen before (``None``: never) is dropped."""
        now = time.monotonic()
        if self._items is not None and now >= self._closes:  # (its timer's loop is gone)
            self.flush()
        with self._lock:
            if key is not None:
                if key in self._told:
                    return
                self._told[key] = None
                if len(self._told) > REMEMBERED:
                    for old in list(self._told)[: REMEMBERED // 2]:
                        del self._told[old]
            if self._items is not None:
                self._items.append(item)
                self._level = max(self._level, level)
                return
            self._items, self._level, self._closes = [], logging.NOTSET, now + WINDOW
        with contextlib.suppress(RuntimeError):  # (no loop here: the next note or the exit flushes)
            asyncio.get_running_loop().call_later(WINDOW, self.flush)
        self._log.log(level, message, *args)

    def flush(self) -> None:
        """Write the open window's summary now (if it gathered anything)."""
        with self._lock:
            items, self._items = self._items, None
        if items:
            self._log.log(self._level, "%s", self._summarise(items))


def listing(numbers: Sequence[int], shown: int = 16) -> str:
    """``1, 2, 5, ... and 40 more`` (sorted)."""
    ordered = sorted(numbers)
    text = ", ".join(map(str, ordered[:shown]))
    return text + (f", ... and {len(ordered) - shown} more" if len(ordered) > shown else "")


def span(numbers: Sequence[int]) -> str:
    """``3`` or ``0-15 (16)``."""
    low, high = min(numbers), max(numbers)
    return str(low) if low == high else f"{low}-{high} ({len(set(numbers))})"
