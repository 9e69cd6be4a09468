"""Last words: a process that ends with its world still up tells its peers what it knew.

A rank whose process ends without ``destroy_process_group`` (its ``asyncio.run`` returns or
raises, or it gets SIGTERM) sends every peer a ``Bye`` naming the ranks it saw fail, first
failure first, and (if it ended by an exception or a signal) itself last with why it ended; a
normal end without destroy is a clean leave. A survivor then blames the rank that failed
first, not the messenger whose connection closed next.

When the event loop ends, it cancels every task; a watcher task per world says the goodbye then,
while the connections are still open (uvloop closes them with the loop). A SIGTERM handler
(installed only over the default action) does it from the signal, then dies of the signal;
an ``atexit`` hook covers loops that leave their sockets open. Best effort and bounded: the
frame is written straight to each socket within ``ARENDEZ_FAREWELL_MS`` milliseconds in all;
a link with bytes still queued, or a TLS link, is skipped and its peer sees the close, as before.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import os
import signal
import sys
import threading
import weakref
from types import FrameType
from typing import Any

from . import errorfile, frames
from .settings import env_int
from .transports.tcp import Mesh
from .world import World

#: Default bound (milliseconds) on all goodbyes of one process together.
DEFAULT_BUDGET_MS = 500

_worlds: weakref.WeakSet[World] = weakref.WeakSet()
_watchers: dict[int, asyncio.Task[None]] = {}
_installed = False


def _forget_after_fork() -> None:
    """In a forked child: the parent's worlds are not the child's to say goodbye for (their
    sockets are the parent's too)."""
    _worlds.clear()
    _watchers.clear()


os.register_at_fork(after_in_child=_forget_after_fork)


def register(world: World) -> None:
    """Say goodbye for ``world`` if the process ends while it is still up."""
    global _installed
    if not isinstance(world.mesh, Mesh):
        return  # in-process ranks end together
    _worlds.add(world)
    owner = asyncio.current_task()
    _watchers[id(world)] = asyncio.get_running_loop().create_task(_watch(world, owner))
    if not _installed:
        _installed = True
        atexit.register(_at_exit)
    install_sigterm_handler()


_sigterm_installed = False


def install_sigterm_handler() -> bool:
    """Say goodbye on SIGTERM, then die of it, if the process has no handler of its own (only
    from the main thread: ``arendez.sync`` and the torch backend call this from the caller's
    thread, since their worlds are built on the loop thread); True if ours is in place."""
    global _sigterm_installed
    if _sigterm_installed:
        return True
    if threading.current_thread() is not threading.main_thread():
        return False
    try:
        if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
            return False
        signal.signal(signal.SIGTERM, _on_sigterm)
    except ValueError:  # pragma: no cover - not the main interpreter
        return False
    _sigterm_installed = True
    return True


async def forget(world: World) -> None:
    """``world`` is being destroyed (it says its own goodbye)."""
    _worlds.discard(world)
    watcher = _watchers.pop(id(world), None)
    if watcher is not None:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher


async def _watch(world: World, owner: asyncio.Task[Any] | None) -> None:
    """Wait forever; cancelled while ``world`` is still up, the event loop is ending under it."""
    try:
        await asyncio.get_running_loop().create_future()
    finally:
        if world in _worlds:
            _watchers.pop(id(world), None)
            _goodbye(world, _why_ended(owner))


def _goodbye(world: World, why: str | None) -> list[int]:
    _worlds.discard(world)
    if world.closed or not isinstance(world.mesh, Mesh):
        return []
    budget = env_int("ARENDEZ_FAREWELL_MS", DEFAULT_BUDGET_MS, minimum=0) / 1000
    failed = {r: reason for r, reason in world.failed.items() if r != world.rank}
    if why is not None:  # last: the sender names itself, and why it ended
        failed[world.rank] = why
        errorfile.record(why)  # before the peers hear of it (arendez-run's blame)
    world.closed = True
    return world.mesh.farewell(frames.Bye(failed, world.finished()), budget)


def say_last_words(why: str | None) -> list[int]:
    """Send every live world's goodbye now; return the peer ranks reached."""
    reached: list[int] = []
    for world in list(_worlds):
        reached += _goodbye(world, why)
    return reached


def _why_ended(owner: asyncio.Task[Any] | None) -> str | None:
    """Why the process ended, if it failed; None for a normal end (a clean leave, as torch's
    processes that never call destroy: the peers are told it left, not that it failed)."""
    exc: Any = None
    if owner is not None and owner.done() and owner.cancelled():  # Ctrl-C under asyncio.run
        return "its process ended with the task that initialized it cancelled (as by Ctrl-C)"
    if owner is not None and owner.done():
        exc = owner.exception()
    if exc is None:
        exc = uncaught()
    if isinstance(exc, BaseException):
        return crash_reason(exc)
    return None


def crash_reason(exc: BaseException) -> str:
    """What a rank's peers are told when its process ends with ``exc`` uncaught."""
    said = str(exc)[:200]
    return f"its process ended with an uncaught {type(exc).__name__}" + (f": {said}" if said else "")


def uncaught() -> BaseException | None:
    """The exception that is ending this process, if one is (``sys.last_value``, set when an
    uncaught exception was printed); None in an interactive session (a REPL, IPython), where
    it is one that an earlier input raised, printed and left behind."""
    exc = getattr(sys, "last_value", None)
    if not isinstance(exc, BaseException) or hasattr(sys, "ps1") or "IPython" in sys.modules:
        return None
    return exc


def _at_exit() -> None:
    with contextlib.suppress(Exception):  # never let a goodbye turn an exit into a traceback
        say_last_words(_why_ended(None))


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    why = "its process was terminated (SIGTERM)"
    try:
        _say_on_loop_thread(why) or say_last_words(why)
    finally:  # then die of the signal, as without this handler
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


def _say_on_loop_thread(why: str) -> bool:
    """Run the goodbye on the loop thread of ``arendez.sync`` / the torch backend, where the
    worlds' sockets are written (not from the signal's thread, which could cut into a frame the
    loop is writing); True once said there, False if there is no such thread or it did not
    answer within the goodbye budget."""
    from .loop import shared

    loop = shared.running_loop()
    if loop is None or shared.in_loop_thread():
        return False
    said = threading.Event()

    def say() -> None:
        try:
            say_last_words(why)
        finally:
            said.set()

    try:
        loop.call_soon_threadsafe(say)
    except RuntimeError:  # (the loop is closed)
        return False
    return said.wait(env_int("ARENDEZ_FAREWELL_MS", DEFAULT_BUDGET_MS, minimum=0) / 1000 + 0.5)
