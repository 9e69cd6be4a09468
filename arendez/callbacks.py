"""Run user callbacks off the event-loop thread, on threads that may block.

A future's ``then`` callback (yours, DDP's reducer's, a PowerSGD hook's) may itself make a
blocking arendez call and wait for it, as torch's gloo allows: its futures are completed on gloo's
worker threads. Run on the loop thread, such a callback would wait for the loop it holds. So the
loop thread hands each callback to an idle callback thread, and starts one more when none is idle
(a callback waiting for a second call's future then never waits for itself). Threads idle for
``IDLE_SECONDS`` end; at most ``MAX_THREADS`` run, beyond that callbacks queue.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
from collections.abc import Callable
from typing import Any

from . import loopcpu

log = logging.getLogger("arendez")

#: How long an idle callback thread waits for work before it ends.
IDLE_SECONDS = 10.0
#: The most callback threads alive at once (each blocked callback holds one).
MAX_THREADS = 64


class CallbackThreads:
    """A growing pool of daemon threads; ``submit`` never blocks the caller."""

    def __init__(self, max_threads: int = MAX_THREADS, idle_seconds: float = IDLE_SECONDS) -> None:
        self._max_threads = max_threads
        self._idle_seconds = idle_seconds
        self._queue: collections.deque[tuple[Callable[..., Any], tuple[Any, ...]]] = collections.deque()
        self._ready = threading.Condition(threading.Lock())
        self._idle = 0
        self._threads = 0

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        """Call ``fn(*args)`` on a callback thread; an exception it raises is logged."""
        with self._ready:
            self._queue.append((fn, args))
            if self._idle >= len(self._queue):
                self._ready.notify()
                return
            if self._threads >= self._max_threads:
                return  # an earlier callback's thread takes it once free
            self._threads += 1
        threading.Thread(target=self._serve, name="arendez-callback", daemon=True).start()

    def _serve(self) -> None:
        loopcpu.release_thread()  # (started by the loop thread, maybe pinned: not on its CPU)
        while True:
            with self._ready:
                while not self._queue:
                    self._idle += 1
                    woken = self._ready.wait(self._idle_seconds)
                    self._idle -= 1
                    if not woken and not self._queue:
                        self._threads -= 1
                        return
                fn, args = self._queue.popleft()
            try:
                fn(*args)
            except Exception:  # (a callback's error belongs to its future; this is a last resort)
                log.exception("arendez: a future callback raised")

    def forget(self) -> None:
        """In a forked child: the parent's threads did not come along."""
        self._queue.clear()
        self._ready = threading.Condition(threading.Lock())
        self._idle = self._threads = 0


shared = CallbackThreads()
"""The callback threads of this process."""

os.register_at_fork(after_in_child=shared.forget)
