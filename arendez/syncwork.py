"""The handles of ``arendez.sync``'s calls started with ``async_op=True``, shaped as torch's:
``Work`` (``wait``, ``get_future``, ``cancel``) and its future: a ``torch.futures.Future`` for a
call on torch tensors (torch's ``wait_all``/``collect_all`` take only those), else ``Future``
(``wait``, ``then``)."""

from __future__ import annotations

import datetime
import sys
from collections.abc import Callable
from typing import Any

from . import callbacks
from .errors import CallCancelledError, WaitTimeoutError, received_from
from .loop import CANCEL_GRACE_SECONDS, Completion, shared
from .registry import seconds

__all__ = ["Future", "Work"]


class Future:
    """The outcome of a ``Work``, shaped as torch's ``Future``: ``wait()`` blocks, then returns
    the call's output tensors (``[tensor]`` for ``all_reduce``, as torch's) or re-raises its
    error; ``then(callback)`` chains."""

    def __init__(self, done: Completion, outputs: Any = None, *, chained: bool = False) -> None:
        self._done = done
        self._outputs = outputs
        self._chained = chained  # the value is the Completion's own (a then() callback's result)

    def done(self) -> bool:
        return self._done.done()

    def wait(self) -> Any:
        """Block until done; return the value or re-raise the error."""
        result = self._done.result()
        return result if self._chained else self._outputs

    def value(self) -> Any:
        return self.wait()

    def then(self, callback: Callable[[Future], Any]) -> Future:
        """A future of ``callback(self)``, called once this one is done: at once if it is, else
        on a callback thread (``arendez.callbacks``), where it may make blocking arendez calls."""
        child = Completion()

        def run(_: Completion) -> None:
            try:
                value = callback(self)
            except Exception as exc:  # the chained future holds it, as torch's does
                child.set(None, exc)
            else:
                child.set(value)

        def deliver(done: Completion) -> None:
            if shared.in_loop_thread():
                callbacks.shared.submit(run, done)
            else:
                run(done)

        self._done.add_done_callback(deliver)
        return Future(child, chained=True)


class Work:
    """Handle of a call started with ``async_op=True``, ``isend`` or ``irecv``."""

    def __init__(self, done: Completion, outputs: Any = None) -> None:
        self._done = done
        self._outputs = outputs  # what get_future() holds once done

    def wait(self, timeout: float | datetime.timedelta | None = None) -> bool:
        """Block until the call is done; re-raises its error. After ``timeout`` seconds raises
        ``WaitTimeoutError`` (a ``TimeoutError``) and the call goes on, as with torch's gloo:
        a later ``wait()`` returns once it finishes."""
        limit = None if timeout is None else seconds(timeout, 0.0)
        shared.wait_spinning(self._done)
        if not self._done.wait(limit):
            raise WaitTimeoutError("the call", limit or 0.0)
        self._done.result()
        return True

    def cancel(self, grace: float = CANCEL_GRACE_SECONDS) -> bool:
        """Cancel the call as an asyncio ``task.cancel()`` would (an arendez extension: its
        peers get ``CollectiveCancelledError`` naming this rank, its buffers are not written any
        more; ``wait()`` then raises ``CallCancelledError``); True once it has ended, within
        ``grace`` seconds."""
        return self._done.cancel(grace)

    def is_completed(self) -> bool:
        return self._done.done()

    def is_success(self) -> bool:
        return self._done.done() and self._done.error is None

    def exception(self) -> BaseException | None:
        return self._done.error

    def get_future(self) -> Any:
        """The call's future: a ``torch.futures.Future`` when its outputs are torch tensors (so
        ``torch.futures.wait_all``/``collect_all`` take it, as gloo's), else a ``Future``."""
        torch = _torch_of(self._outputs)
        if torch is None:
            return Future(self._done, self._outputs)
        return _torch_future(torch, self._done, self._outputs)

    def source_rank(self) -> int:
        """The rank a finished ``irecv`` received from."""
        return received_from(self._done)

    def result(self) -> Any:
        """Wait, then the call's output tensors, as ``get_future().wait()`` (gloo's)."""
        self._done.result()
        return self._outputs

    def _source_rank(self) -> int:  # (torch's private spelling, which some scripts use)
        return self.source_rank()


def _torch_of(outputs: Any) -> Any:
    """The torch module if ``outputs`` (a tensor list, or a list of them) holds torch tensors."""
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(outputs, list) or not outputs:
        return None
    first = outputs[0][0] if isinstance(outputs[0], list) and outputs[0] else outputs[0]
    return torch if isinstance(first, torch.Tensor) else None


def _torch_future(torch: Any, done: Completion, outputs: Any) -> Any:
    """A ``torch.futures.Future`` completed with ``outputs`` (or the call's error) when ``done``
    is; off the loop thread, since its ``then`` callbacks run where it completes and may make
    blocking arendez calls."""
    future = torch.futures.Future()

    def settle(finished: Completion) -> None:
        error = finished.error
        if error is None:
            future.set_result(outputs)
        elif isinstance(error, Exception):
            future.set_exception(error)
        else:  # (torch's future takes Exceptions only: a KeyboardInterrupt would leave it pending)
            future.set_exception(CallCancelledError(f"the call ended with {type(error).__name__}"))

    def deliver(finished: Completion) -> None:
        if shared.in_loop_thread():
            callbacks.shared.submit(settle, finished)
        else:
            settle(finished)

    done.add_done_callback(deliver)
    return future
