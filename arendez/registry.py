"""The one registry of this process: the current world, its default group, and what it answers.

The registry lives in a context variable: a process has one, except that ranks run as tasks of
one event loop (``arendez.testing``) each get their own (``fresh_context``).

Every API call that takes ``group=`` resolves it here, once (``on_group``): ``None`` or
``GroupMember.WORLD`` means the default group; a rank outside the group gets the call's
"not a member" value without any work.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import datetime
import functools
import inspect
import os
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, ParamSpec, TypeVar

from . import validate
from .errors import AlreadyInitializedError, ArendezError, InvalidArgumentError, NotInitializedError
from .group import GroupMember, ProcessGroup, Stats, not_member
from .world import World

P = ParamSpec("P")
R = TypeVar("R")

DEFAULT_TIMEOUT = 300.0


class Registry:
    """The current world (with its default group and subgroups)."""

    def __init__(self) -> None:
        self.forget()

    def forget(self) -> None:
        """No world (and none forming)."""
        self.world: World | None = None
        self.default: ProcessGroup | None = None
        self.forming = False  # an init_process_group of this registry is forming its world
        self.ended: str | None = None  # why the last world went without destroy, if it did
        #: a forked child's copy of its parent's world: why no call may run on it (None: not one)
        self.forked: str | None = None


_process = Registry()  # the registry of code not run through ``fresh_context``
_current: contextvars.ContextVar[Registry | None] = contextvars.ContextVar("arendez_registry", default=None)


#: why a world is gone that its registry still held (its event loop ended under it)
_ENDED = (
    "the process group closed when the event loop that created it ended (asyncio.run returned "
    "without destroy_process_group()); call init_process_group() again"
)


def _get() -> Registry:
    registry = _current.get() or _process
    world = registry.world
    if world is not None and world.loop is not None and world.loop.is_closed():
        # (its event loop ended under it: ``farewell`` said its goodbye)
        registry.forget()
        registry.ended = _ENDED
    return registry


def _forget_after_fork() -> None:
    """In a forked child: it is not a rank of the parent's world (its sockets are the parent's).
    As torch's, it still answers the queries (``get_rank`` in a DataLoader's ``worker_init_fn``);
    a call on the group is refused naming the fork, destroy only lets go of it, and
    ``init_process_group`` gives the child a world of its own."""
    for registry in (_process, _current.get()):
        if registry is None or registry.forked:
            continue
        world, default = registry.world, registry.default
        registry.forget()
        if world is not None and default is not None:
            registry.world, registry.default = world, default
            registry.forked = (
                f"this process was forked (pid {os.getpid()}) from rank {world.rank} (pid "
                f"{os.getppid()}) after init_process_group: the process group stays with the parent; "
                "call init_process_group() here for a world of its own"
            )


os.register_at_fork(after_in_child=_forget_after_fork)


def fresh_context() -> contextvars.Context:
    """A copy of this context with an empty registry: a rank that runs as a task in it has its
    own world (tasks it creates share that world)."""
    context = contextvars.copy_context()
    context.run(_current.set, Registry())
    return context


@contextlib.contextmanager
def forming() -> Iterator[None]:
    """Hold the default group's place while a world forms: a second ``init_process_group`` of
    the same context (a concurrent task, say) fails at once instead of replacing the first."""
    registry = _get()
    forget_forked()  # (a forked child's copy of its parent's world: the child forms its own)
    if registry.default is not None:
        raise AlreadyInitializedError("the default process group is already initialized")
    if registry.forming:
        raise AlreadyInitializedError(
            "another init_process_group of this context is forming the default process group; "
            "ranks that run as tasks of one process each need their own context "
            "(loop.create_task(rank_main(), context=arendez.registry.fresh_context()))"
        )
    registry.forming = True
    try:
        yield
    finally:
        registry.forming = False


def install(world: World) -> None:
    """Make ``world`` (and its group 0) the current world and default group."""
    registry = _get()
    registry.world, registry.default, registry.ended = world, world.groups[0], None
    GroupMember.WORLD = world.groups[0]


def forget_forked() -> bool:
    """In a forked child, let go of the parent's world (no goodbye, nothing closed: it is the
    parent's); True if there was one."""
    registry = _get()
    if registry.forked is None:
        return False
    uninstall()
    registry.forked = None
    return True


def uninstall() -> None:
    """Forget the current world (destroy does this before it closes anything)."""
    registry = _get()
    if GroupMember.WORLD is registry.default:
        GroupMember.WORLD = None
    registry.world = registry.default = None


def current_world() -> World:
    """The world ``init_process_group`` built in this process (a hook for tests and tools)."""
    world = _get().world
    if world is None:
        raise NotInitializedError("no process group: call init_process_group() first")
    return world


def world_or_none() -> World | None:
    return _get().world


def default_group() -> ProcessGroup | None:
    return _get().default


def seconds(timeout: float | datetime.timedelta | None, default: float) -> float:
    """``timeout`` in seconds (``default`` if None); anything but a finite positive number of
    seconds is a ``ValueError`` (``TypeError`` for a non-number)."""
    return default if timeout is None else validate.seconds(timeout, "timeout")


def resolve(group: Any) -> ProcessGroup | None:
    """The group a call acts on; None for a rank outside ``group``."""
    return _resolve(_get(), group)


def _resolve(registry: Registry, group: Any) -> ProcessGroup | None:
    if not_member(group):
        return None
    if group is None or group is GroupMember.WORLD:
        if registry.default is None:
            raise NotInitializedError(
                registry.ended or "no default process group: call init_process_group() first"
            )
        return registry.default
    if not isinstance(group, ProcessGroup):
        raise TypeError(f"group must be a ProcessGroup, got {type(group).__name__}")
    if group.destroyed or group.world is not registry.world:
        raise NotInitializedError(
            registry.ended
            or "this process group was destroyed; call init_process_group() / new_group() again"
        )
    return group


def resolve_to_run(group: Any) -> ProcessGroup | None:
    """``resolve`` for a call that runs on the group (a collective, a message, a new group): it
    must run on its world's event loop, where nothing else would ever serve it (the owner may be
    blocked in this very call) or wake it. Queries (``get_rank``) answer from anywhere."""
    registry = _get()
    if registry.forked is not None:
        raise NotInitializedError(registry.forked)
    g = _resolve(registry, group)
    if g is not None:
        owner = g.world.loop
        if owner is not None and owner is not asyncio.get_running_loop():
            _wrong_loop(owner)
    return g


def _wrong_loop(owner: asyncio.AbstractEventLoop) -> None:
    """Raise the error that says which loop ``owner`` is and what to call instead."""
    from .loop import shared  # (the loop thread's module, imported late: it is the sync side's)

    if shared.runs(owner):
        raise ArendezError(
            "this process group was initialised through arendez.sync (or the torch backend): its "
            "calls run on arendez's loop thread, so call them through arendez.sync, not awaited "
            "from this event loop"
        )
    raise ArendezError(
        "this process group was initialised on another event loop (the async API's groups live on "
        "the loop that called init_process_group): in a notebook or other async code await the "
        "async API there (await dist.all_reduce(x)); arendez.sync needs a group of its own "
        "(arendez.sync.init_process_group)"
    )


class Call(Coroutine[Any, Any, R]):
    """An API call's coroutine, which a task cancelled before its first step still counts.

    A task cancelled before it ran (``asyncio.wait_for(call, 0)``, ``create_task`` then
    ``cancel()``, a ``TaskGroup`` whose body failed first) never runs the call's body, so the
    collective would never take its sequence number while the other ranks' copies of it wait:
    the ranks would then pair each later collective with the wrong one. ``abandon`` takes the
    number here and cancels it on every member instead, as a cancel after the start does.
    Awaited directly (``await all_reduce(x)``) it hands over the inner coroutine: no cost.
    """

    __slots__ = ("_abandon", "_coro", "_started")

    def __init__(self, coro: Coroutine[Any, Any, R], abandon: Callable[[], None]) -> None:
        self._coro = coro
        self._abandon = abandon
        self._started = False

    def send(self, value: Any) -> Any:
        self._started = True
        return self._coro.send(value)

    def throw(self, typ: Any, val: Any = None, tb: Any = None) -> Any:
        if not self._started:
            self._started = True
            self._abandon()
        if val is None and tb is None:
            return self._coro.throw(typ)
        return self._coro.throw(typ, val, tb)  # pragma: no cover (the deprecated signature)

    def close(self) -> None:
        self._coro.close()

    def __await__(self) -> Any:
        self._started = True
        return self._coro.__await__()


def _as_coroutine_function(fn: Callable[P, Coroutine[Any, Any, R]]) -> Callable[P, Coroutine[Any, Any, R]]:
    """``fn`` (a function returning a ``Call``) marked so ``inspect`` and ``asyncio`` call it
    a coroutine function, as the API's ``async def`` functions were."""
    mark = getattr(inspect, "markcoroutinefunction", None)  # (Python 3.12+)
    if mark is not None:
        return mark(fn)  # type: ignore[no-any-return]
    fn._is_coroutine = asyncio.coroutines._is_coroutine  # type: ignore[attr-defined]
    return fn


def on_group(
    missing: Any = None, *, sequenced: bool = True
) -> Callable[[Callable[P, Coroutine[Any, Any, R]]], Callable[P, Coroutine[Any, Any, R]]]:
    """Decorate an API coroutine whose ``group`` parameter it receives resolved.

    The wrapped function sees a ``ProcessGroup`` as ``group``; on a rank outside the group the
    call returns ``missing`` at once. A ``sequenced`` call (a collective, not a point-to-point
    message) cancelled before it started still takes its sequence number (``Call``).
    """

    def wrap(fn: Callable[P, Coroutine[Any, Any, R]]) -> Callable[P, Coroutine[Any, Any, R]]:
        at = list(inspect.signature(fn).parameters).index("group")

        def given(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            return args[at] if len(args) > at else kwargs.get("group")

        @functools.wraps(fn)  # (a call never awaited is then warned of by its own name)
        async def run(*args: P.args, **kwargs: P.kwargs) -> R:
            g = resolve_to_run(given(args, kwargs))
            if g is None:
                return missing  # type: ignore[no-any-return]
            if len(args) > at:
                args = (*args[:at], g, *args[at + 1 :])  # type: ignore[assignment]
            else:
                kwargs["group"] = g
            return await fn(*args, **kwargs)

        if not sequenced:
            return run

        @functools.wraps(fn)
        def call(*args: P.args, **kwargs: P.kwargs) -> Coroutine[Any, Any, R]:
            def abandon() -> None:
                try:
                    g = resolve(given(args, kwargs))
                except (NotInitializedError, TypeError):
                    return  # (the call would have raised this: nothing to cancel)
                if g is not None:
                    g.abandon(fn.__name__)

            return Call(run(*args, **kwargs), abandon)

        return _as_coroutine_function(call)

    return wrap


def named_rank(
    g: ProcessGroup, rank: int | None, group_rank: int | None, what: str, default: int | None = None
) -> int | None:
    """The global rank named by ``rank`` (global) or ``group_<what>`` (its rank in ``g``, as
    torch's ``group_dst``/``group_src``), not both; ``default`` when neither is given."""
    if rank is not None and group_rank is not None:
        raise InvalidArgumentError(f"give {what} or group_{what}, not both")
    if group_rank is not None:
        group_rank = validate.index(group_rank, f"group_{what}")
        if not 0 <= group_rank < g.size:
            raise InvalidArgumentError(f"group_{what} {group_rank} is not in 0..{g.size - 1}")
        return g.ranks[group_rank]
    return default if rank is None else rank


def root_rank(g: ProcessGroup, rank: int | None, group_rank: int | None, what: str, call: str) -> int:
    """``named_rank`` for a call that needs one: neither given is an error naming ``call``."""
    found = named_rank(g, rank, group_rank, what)
    if found is None:
        raise InvalidArgumentError(f"{call} needs {what} (or group_{what})")
    return found


# -- queries ---------------------------------------------------------------------------------
def is_initialized() -> bool:
    """True between a successful ``init_process_group`` and ``destroy_process_group``."""
    return _get().default is not None


def get_rank(group: Any = None) -> int:
    """This process's rank in ``group`` (-1 if it is not a member)."""
    g = resolve(group)
    return -1 if g is None else g.rank


def get_world_size(group: Any = None) -> int:
    """How many ranks ``group`` has (-1 if this process is not a member)."""
    g = resolve(group)
    return -1 if g is None else g.size


def get_process_group_ranks(group: Any = None) -> list[int]:
    """The global ranks of ``group`` (empty if this process is not a member)."""
    g = resolve(group)
    return [] if g is None else list(g.ranks)


def transport_stats() -> Stats:
    """Transport counters of the current world: payload bytes received, those the receive path
    had to copy (a frame that arrived before its receive was posted), those that came through
    shared memory, and large sends that took TCP because the peer's ring was full."""
    return current_world().stats
