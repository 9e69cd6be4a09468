"""torch ``Work`` for the torch backend (``arendez.torch``): one arendez call on the loop thread.

``wait()`` blocks on a lock (the GIL is released); ``get_future()`` is a ``torch.futures.Future``
built only when asked for, completed on a callback thread (``arendez.callbacks``): its callbacks
may make blocking arendez calls, as on gloo's worker threads.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable, Coroutine
from typing import Any

import torch
import torch.distributed as dist

from . import callbacks
from .errors import WaitTimeoutError
from .loop import Completion, shared
from .torchstore import seconds

# torch's stubs type this class's virtual methods with overloads our trampoline overrides do not
# mirror; it is subclassed through an Any alias (the overrides are exercised by the tests).
_TorchWork: Any = dist.Work


class Work(_TorchWork):  # type: ignore[misc]
    """torch ``Work`` over one arendez call on the loop thread."""

    def __init__(self, value: Any) -> None:
        super().__init__()
        self._value = value
        self._done: Completion | None = None
        # get_future() is built on demand (a torch future and its ``then`` child cost tens of
        # microseconds; a blocking call never asks for one). The lock makes exactly one of
        # get_future() and the loop thread's _settle() complete it.
        self._lock = threading.Lock()
        self._settled = False
        self._source: torch.futures.Future[None] | None = None
        self._future: torch.futures.Future[Any] | None = None

    def _start(self, fn: Callable[..., Coroutine[Any, Any, Any]], *args: Any) -> Work:
        self._done = shared.start(fn, args, None, self._settle)
        return self

    def _settle(self, done: Completion) -> None:  # on the loop thread
        if done.error is None and isinstance(done._result, int) and self._value is None:
            self._value = done._result  # recv from any source: the sender
        with self._lock:
            self._settled = True
            source = self._source
        if source is not None:  # its callbacks (DDP's, a comm hook's) may block on arendez calls
            callbacks.shared.submit(source.set_result, None)

    def _outcome(self, _: Any) -> Any:
        assert self._done is not None
        error = self._done.error
        if error is not None:  # (torch's message quotes its traceback: arendez's frames are not news)
            raise _bare(error)
        return self._value

    def get_future(self) -> torch.futures.Future[Any]:
        """A ``torch.futures.Future`` of the output tensors; an arendez failure is its error.

        C++ consumers (DDP's reducer) read the value as tensors, so an error must be a C++-level
        error: torch sets one on a ``then`` child whose callback raises.
        """
        with self._lock:
            if self._future is None:
                self._source = torch.futures.Future()
                self._future = self._source.then(self._outcome)
                fire = self._settled
            else:
                fire = False
        if fire:
            assert self._source is not None
            self._source.set_result(None)
        assert self._future is not None
        return self._future

    def wait(self, timeout: Any = None) -> bool:
        """Block until done (without the GIL); re-raise the arendez error (e.g. ``RankFailedError``).
        After ``timeout`` raises ``WaitTimeoutError`` (a ``RuntimeError``) and the call goes on,
        as with gloo: a later ``wait()`` returns once it finishes. A wait interrupted (Ctrl-C)
        cancels the call on every rank before the ``KeyboardInterrupt`` goes on (gloo defers
        Ctrl-C until the call ends)."""
        assert self._done is not None
        limit = seconds(timeout)
        shared.wait_spinning(self._done)
        if not self._done.wait_or_cancel(limit):  # (Ctrl-C: cancelled, as arendez.sync's calls)
            raise WaitTimeoutError("Work.wait: the call", limit or 0.0)
        if self._done.error is not None:
            raise self._done.error
        return True

    def is_completed(self) -> bool:
        return self._done is not None and self._done.done()

    def is_success(self) -> bool:
        return self.is_completed() and self._done is not None and self._done.error is None

    def exception(self) -> BaseException | None:
        return None if self._done is None else self._done.error

    def result(self) -> Any:
        self.wait()
        return self._value

    def _source_rank(self) -> int:
        """The sender of a ``recv`` from any source (group rank)."""
        self.wait()
        return int(self._done._result) if self._done is not None else -1

    def source_rank(self) -> int:
        """The public name of ``_source_rank`` (``dist.recv`` calls the private one; without
        this, torch's C++ ``sourceRank`` answered and refused)."""
        return self._source_rank()


def _bare(error: BaseException) -> BaseException:
    """A copy of ``error`` without its traceback (the original, which ``wait()`` raises and
    ``exception()`` returns, keeps its own)."""
    try:
        bare = copy.copy(error)
    except Exception:  # (an exception class whose arguments do not rebuild it)
        bare = RuntimeError(f"{type(error).__name__}: {error}")
    return bare.with_traceback(None)


def start(value: Any, fn: Callable[..., Coroutine[Any, Any, Any]], *args: Any) -> Work:
    """A ``Work`` over ``fn(*args)``, started on the loop thread; ``value`` (the output tensors)
    is its result."""
    return Work(value)._start(fn, *args)
