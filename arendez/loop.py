"""Event-loop selection, and the one loop thread that blocking callers hop into.

``LoopThread.call`` runs a coroutine on the loop thread and blocks the calling thread (without
the GIL) until it is done. The hop is one ``call_soon_threadsafe`` in and one lock release out:
no ``concurrent.futures.Future``, no condition variable, no chained asyncio future per call.
Once a world is up the loop thread keeps to one CPU and polls for the answer of a call a thread
blocks on (``arendez.loopcpu``): waking threads, not Python, was most of the hop.
"""

from __future__ import annotations

import _thread
import asyncio
import atexit
import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from .errors import CallCancelledError
from .loopcpu import Spin, cpus_to_spare, keep_to_one_cpu

T = TypeVar("T")

log = logging.getLogger("arendez")

#: How long the exit of a process may spend closing a world it left up (``LoopThread.stop``).
EXIT_SECONDS = 5.0
#: How long ``Completion.cancel`` waits for the cancelled call to wind down.
CANCEL_GRACE_SECONDS = 5.0
#: ... and a blocking call interrupted by Ctrl-C, before the ``KeyboardInterrupt`` goes on.
INTERRUPT_GRACE_SECONDS = 2.0


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


#: Guards the done-callbacks of every ``Completion`` (added from any thread, run once).
_CALLBACKS_LOCK = threading.Lock()


class Completion:
    """The outcome of one coroutine run on the loop thread, waitable from any thread.

    A pre-acquired lock is the cheapest thing a thread can block on without the GIL; the loop
    thread releases it once the result or error is stored.
    """

    __slots__ = ("_callbacks", "_coro", "_done", "_error", "_lock", "_loop", "_on_done", "_result", "_task")

    def __init__(self, on_done: Callable[[Completion], None] | None = None) -> None:
        self._lock = _thread.allocate_lock()
        self._lock.acquire()
        self._done = False
        self._result: Any = None
        self._error: BaseException | None = None
        self._on_done = on_done
        self._callbacks: list[Callable[[Completion], None]] = []  # add_done_callback's
        self._task: asyncio.Task[None] | None = None  # set on the loop thread when it starts
        self._coro: Coroutine[Any, Any, Any] | None = None  # until the task first runs it
        self._loop: asyncio.AbstractEventLoop | None = None

    def cancel(self, grace: float = CANCEL_GRACE_SECONDS) -> bool:
        """Cancel the coroutine on its loop, as ``task.cancel()`` would inside it (a collective
        tells its peers, its buffers are let go), and wait up to ``grace`` seconds for that to
        finish; True if it has ended. Works at once after ``start`` too (calls reach the loop in
        order, so the task exists by then, though it may not have run yet)."""
        if not self._done and self._loop is not None:
            with contextlib.suppress(RuntimeError):  # (a loop already closed)
                self._loop.call_soon_threadsafe(self._cancel_task)
        return self.wait(grace)

    def _cancel_task(self) -> None:  # on the loop thread
        task = self._task
        if self._done or task is None:
            return
        if self._coro is not None and self._loop is not None:
            # not run yet: let its first step start the call (a collective takes its place in the
            # group's sequence, so its peers hear of the cancel rather than wait for it), then cancel
            self._loop.call_soon(self._cancel_task)
            return
        task.cancel()

    def _finish(self, result: Any, error: BaseException | None) -> None:
        self._result, self._error = result, error
        self._done = True
        self._lock.release()
        if self._on_done is not None:
            self._on_done(self)
        with _CALLBACKS_LOCK:
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback(self)

    def add_done_callback(self, callback: Callable[[Completion], None]) -> None:
        """Call ``callback(self)`` once done: at once (in this thread) if it is, else in the
        thread that completes it (the loop thread)."""
        with _CALLBACKS_LOCK:
            if not self._done:
                self._callbacks.append(callback)
                return
        callback(self)

    def set(self, result: Any, error: BaseException | None = None) -> None:
        """Complete a ``Completion`` that runs no coroutine (a chained future's)."""
        self._finish(result, error)

    def done(self) -> bool:
        """True once the coroutine returned or raised."""
        return self._done

    def wait(self, timeout: float | None = None) -> bool:
        """Block until done (False if ``timeout`` seconds passed first); never raises the error."""
        if self._done:
            return True
        if not self._lock.acquire(timeout=-1 if timeout is None else max(0.0, timeout)):
            return False
        self._lock.release()  # the next waiter passes straight through
        return True

    def wait_or_cancel(self, timeout: float | None = None) -> bool:
        """``wait``; if the wait is interrupted (Ctrl-C's ``KeyboardInterrupt``, an exception
        from a signal handler), the call is cancelled first (up to ``INTERRUPT_GRACE_SECONDS``),
        as cancelling its task would: a collective's peers hear of it, and it writes no buffer
        of the caller's afterwards. Then the exception goes on."""
        try:
            return self.wait(timeout)
        except BaseException:
            self.cancel(INTERRUPT_GRACE_SECONDS)
            raise

    @property
    def error(self) -> BaseException | None:
        """The exception the coroutine raised (None while pending or after success)."""
        return self._error

    def result(self, timeout: float | None = None) -> Any:
        """Wait, then return the coroutine's value or raise its exception."""
        if not self.wait(timeout):
            raise TimeoutError(f"the arendez call did not finish within {timeout}s")
        if self._error is not None:
            raise self._error
        return self._result


class LoopThread:
    """One event loop in a daemon thread, started on first use, shared by every blocking caller."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        #: How long the loop polls for the answer of a call a thread blocks on (``spin_for``).
        self.spin = Spin()

    def loop(self) -> asyncio.AbstractEventLoop:
        """The running loop (starting its thread if needed)."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            return loop
        with self._lock:
            if self._loop is None or self._loop.is_closed():
                loop = loop_factory()()
                ready = threading.Event()

                def serve() -> None:
                    asyncio.set_event_loop(loop)
                    loop.call_soon(ready.set)
                    loop.run_forever()

                self._thread = threading.Thread(target=serve, name="arendez-loop", daemon=True)
                self._thread.start()
                ready.wait()
                self._loop = loop
                atexit.register(self.stop)
            return self._loop

    def runs(self, loop: asyncio.AbstractEventLoop | None) -> bool:
        """Whether ``loop`` is this thread's (without starting it)."""
        return loop is not None and loop is self._loop

    def forget(self) -> None:
        """Drop the loop and its thread without stopping them (a forked child's copy of them)."""
        if self._loop is not None:
            disown_tasks(self._loop)
        self._loop, self._thread, self._lock = None, None, threading.Lock()
        self.spin = Spin()  # (the parent's world's, not this process's)

    def running_loop(self) -> asyncio.AbstractEventLoop | None:
        """The loop if its thread runs it now (never starts one)."""
        loop, thread = self._loop, self._thread
        if loop is None or loop.is_closed() or thread is None or not thread.is_alive():
            return None
        return loop

    def stop(self, timeout: float = EXIT_SECONDS) -> None:
        """Wind the loop down before the interpreter does (runs at exit): a world still up is
        closed (with one warning that ``destroy_process_group`` was not called), the tasks left
        are cancelled, the loop stops and its thread ends, all within ``timeout``.

        A daemon thread that the interpreter freezes mid-call into a C++ library (torch's
        futures) can crash the exiting process; stopping it first makes the exit clean.
        """
        with self._lock:
            loop, thread = self._loop, self._thread
        if loop is None or thread is None or not thread.is_alive() or self.in_loop_thread():
            return
        deadline = time.monotonic() + timeout
        wound = asyncio.run_coroutine_threadsafe(_wind_down(timeout), loop)
        with contextlib.suppress(Exception):
            wound.result(max(0.0, deadline - time.monotonic()))
        loop.call_soon_threadsafe(loop.stop)
        thread.join(max(0.0, deadline - time.monotonic()))

    def in_loop_thread(self) -> bool:
        """True when called from the loop thread itself (where blocking would deadlock)."""
        return self._thread is not None and threading.current_thread() is self._thread

    def start(
        self,
        fn: Callable[..., Coroutine[Any, Any, Any]],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        on_done: Callable[[Completion], None] | None = None,
        *,
        spin: bool = False,
    ) -> Completion:
        """Run ``fn(*args, **kwargs)`` as a task on the loop; calls are started in call order.

        ``on_done`` runs on the loop thread right after the result is stored; with ``spin`` the
        caller will block on it at once (``wait_spinning``).
        """
        if self.in_loop_thread():
            raise RuntimeError("a blocking arendez call was made from the arendez loop thread itself")
        done = Completion(on_done)
        coro = fn(*args, **(kwargs or {}))  # building a coroutine runs none of its code
        done._loop = self.loop()
        done._loop.call_soon_threadsafe(_begin, done, coro, self.spin, self.spin.budget() if spin else 0.0)
        return done

    def spin_for(self, local_ranks: int) -> float:
        """Set (and return) how long the loop polls for a blocking call's answer before it
        sleeps (``loopcpu.Spin``): while this host's ``local_ranks`` have a CPU each. Only from
        the loop thread (a world it built), before ``keep_on_one_cpu``; elsewhere it changes
        nothing."""
        if not self.in_loop_thread():
            return self.spin.seconds
        return self.spin.configure(local_ranks, cpus_to_spare())

    def keep_on_one_cpu(self, index: int) -> int | None:
        """Keep the loop thread on one CPU, the ``index``-th (cyclically) of those the process
        may use, if called on the loop thread and ``ARENDEZ_PIN_LOOP`` is not ``0``; return it.
        A caller woken by a thread that stays put is placed next to it by the scheduler, so the
        hop stays on one CPU (``arendez.loopcpu``); the caller, and any thread it starts, keeps
        the CPUs it had, and so do the threads and processes the loop thread starts
        (``loopcpu.release_thread``, ``release_child``). Ranks of one host pass their local
        rank, so that their loop threads spread over the CPUs."""
        if not self.in_loop_thread():
            return None
        return keep_to_one_cpu(None if os.environ.get("ARENDEZ_PIN_LOOP", "1") == "0" else index)

    def wait_spinning(self, done: Completion) -> None:
        """The caller is about to block on ``done``: let the loop poll for its answer a while
        (``spin_for``) rather than sleep (a ``Work.wait``; ``call`` polls by itself)."""
        loop = done._loop
        if self.spin.seconds and not done._done and loop is not None:
            seconds = self.spin.budget()
            if seconds:
                with contextlib.suppress(RuntimeError):  # (a loop already closed)
                    loop.call_soon_threadsafe(self.spin.start, done.done, seconds)

    def call(self, fn: Callable[..., Coroutine[Any, Any, T]], *args: Any, **kwargs: Any) -> T:
        """Run ``fn(*args, **kwargs)`` on the loop and block until it returns (or re-raise); an
        interrupted wait cancels the call (``Completion.wait_or_cancel``)."""
        done = self.start(fn, args, kwargs, spin=True)
        done.wait_or_cancel()
        result: T = done.result()
        return result


async def _wind_down(timeout: float) -> None:
    from . import errorfile, farewell, registry  # (imported late: loop.py sits below the API)
    from .teardown import destroy_process_group

    world = registry.world_or_none()
    if world is not None:
        crashed = farewell.uncaught()
        if crashed is not None:  # the advice to call destroy would be beside the point
            log.info(
                "arendez: the program ended with an uncaught %s; closing its process group",
                type(crashed).__name__,
            )
            # the peers are told it failed, and why (not that it left): ``World.say_goodbye``
            world.ending = farewell.crash_reason(crashed)
            errorfile.record(world.ending)  # (arendez-run's blame: before the peers hear of it)
        else:
            log.warning(
                "arendez: destroy_process_group() was not called before the program exited; closing "
                "the process group now (at most %gs). Call destroy_process_group() at the end of the "
                "program.",
                timeout / 2,
            )
        with contextlib.suppress(Exception):
            await destroy_process_group(timeout=timeout / 2)
    me = asyncio.current_task()
    rest = [task for task in asyncio.all_tasks() if task is not me]
    for task in rest:
        task.cancel()
    if rest:
        await asyncio.wait(rest, timeout=timeout / 4)


def _begin(done: Completion, coro: Coroutine[Any, Any, Any], spin: Spin, seconds: float) -> None:
    done._coro = coro
    done._task = asyncio.get_running_loop().create_task(_drive(done, coro))
    if seconds:
        spin.start(done.done, seconds)


async def _drive(done: Completion, coro: Coroutine[Any, Any, Any]) -> None:
    """Await ``coro`` and store its outcome in the same step it finishes (no done-callback turn)."""
    done._coro = None  # (it runs now: a cancel from here on ends it inside)
    try:
        result = await coro
    except asyncio.CancelledError:
        # the waiting thread gets an error it can catch with ``except Exception``
        done._finish(None, CallCancelledError("the call was cancelled before it finished"))
        raise  # the task still ends cancelled
    except BaseException as exc:
        done._finish(None, exc)
        if not isinstance(exc, Exception):
            raise  # exits still end the task as they would
    else:
        done._finish(result, None)


def disown_tasks(loop: asyncio.AbstractEventLoop) -> None:
    """In a forked child: the tasks of a loop that no thread of this process runs will never
    finish; let them be collected without asyncio's "Task was destroyed but it is pending!"."""
    with contextlib.suppress(RuntimeError):  # (the set changed size: another thread at the fork)
        for task in asyncio.all_tasks(loop):
            task._log_destroy_pending = False  # type: ignore[attr-defined]


shared = LoopThread()
"""The loop thread of this process: ``arendez.sync`` and the torch backend both use it."""


def _forget_after_fork() -> None:
    """In a forked child: the parent's loop thread did not come along (only the forking thread
    does), so the next blocking call starts a loop thread of the child's own, rather than handing
    work to a loop that no thread runs (which would wait forever)."""
    global _CALLBACKS_LOCK
    _CALLBACKS_LOCK = threading.Lock()  # (another thread may have held it at the fork)
    shared.forget()


os.register_at_fork(after_in_child=_forget_after_fork)
