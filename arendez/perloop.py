"""Watches kept one per event loop (``stall``, ``linkwatch``) that must not keep their loop alive.

Each lives in a map keyed weakly by its loop, so the watch itself must not reach the loop: it
holds the loop weakly, and keeps no timer handle (a handle holds its loop), only whether one is
due.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Callable
from typing import TypeVar

W = TypeVar("W", bound="LoopWatch")


class LoopWatch:
    """The loop (held weakly) of one per-loop watch, and whether its timer is due."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = weakref.ref(loop)
        #: whether a timer is due (not its handle, which holds the loop)
        self._armed = False

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        loop = self._loop()
        assert loop is not None, f"a {type(self).__name__} outlived its event loop"
        return loop


def of_loop(
    watches: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, W],
    loop: asyncio.AbstractEventLoop,
    make: Callable[[asyncio.AbstractEventLoop], W],
) -> W:
    """``loop``'s watch in ``watches``, made with ``make(loop)`` the first time."""
    found = watches.get(loop)
    if found is None:
        found = watches[loop] = make(loop)
    return found
