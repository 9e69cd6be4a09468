"""Event-loop selection: uvloop when installed (the default), else asyncio's own loop."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop]:
    """uvloop's loop unless it is missing or ``ARENDEZ_NO_UVLOOP=1``."""
    if os.environ.get("ARENDEZ_NO_UVLOOP") != "1":
        try:
            import uvloop

            return uvloop.new_event_loop
        except ImportError:
            pass
    return asyncio.new_event_loop


def run(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run`` on the preferred loop."""
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        return runner.run(main)
