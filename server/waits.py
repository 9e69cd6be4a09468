"""Store waits: requests waiting for keys to be set, each woken only by a change of its own keys."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

from arendez.errors import StoreTimeoutError

from .state import Job


class KeyWaits:
    """The futures waiting on each ``(job, key)``; empty (and so skipped by setters) while none waits."""

    def __init__(self) -> None:
        self.waiters: dict[tuple[str, str], list[asyncio.Future[None]]] = {}

    def changed(self, job: str, key: str) -> None:
        """Wake the waiters of ``key`` in ``job`` (at once when nothing waits at all)."""
        if not self.waiters:
            return
        waiters = self.waiters.pop((job, key), None)
        for fut in waiters or ():
            if not fut.done():
                fut.set_result(None)

    async def until_key(self, name: str, job: Job, key: str, deadline: float, what: str) -> None:
        """Wait until ``key`` is set in ``job`` (named ``name``); ``StoreTimeoutError`` naming
        ``what`` after ``deadline``."""
        await self.until(name, key, lambda: key in job.kv, deadline, what)

    async def until(self, name: str, key: str, ready: Callable[[], bool], deadline: float, what: str) -> None:
        """Wait until ``ready()`` holds, re-checked whenever ``key`` of job ``name`` changes;
        ``StoreTimeoutError`` naming ``what`` after ``deadline``."""
        loop = asyncio.get_running_loop()
        while not ready():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise StoreTimeoutError(what)
            fut = loop.create_future()
            self.waiters.setdefault((name, key), []).append(fut)
            try:
                async with asyncio.timeout(remaining):
                    await fut
            except TimeoutError:
                pass
            finally:
                self._forget(name, key, fut)

    def _forget(self, job: str, key: str, fut: asyncio.Future[None]) -> None:
        waiters = self.waiters.get((job, key))
        if waiters is not None and not fut.done():
            with contextlib.suppress(ValueError):
                waiters.remove(fut)
            if not waiters:
                del self.waiters[(job, key)]
