"""The one registry of this process: the current world, its default group, and what it answers.

Every API call that takes ``group=`` resolves it here, once (``on_group``): ``None`` or
``GroupMember.WORLD`` means the default group; a rank outside the group gets the call's
"not a member" value without any work.
"""

from __future__ import annotations

import datetime
import functools
import inspect
from collections.abc import Callable, Coroutine
from typing import Any, ParamSpec, TypeVar

from .errors import NotInitializedError
from .group import GroupMember, ProcessGroup, Stats
from .world import World

P = ParamSpec("P")
R = TypeVar("R")

DEFAULT_TIMEOUT = 300.0


class _Registry:
    """The only global state: the current world (with its default group and subgroups)."""

    world: World | None = None
    default: ProcessGroup | None = None


_registry = _Registry()


def install(world: World) -> None:
    """Make ``world`` (and its group 0) the current world and default group."""
    _registry.world, _registry.default = world, world.groups[0]
    GroupMember.WORLD = world.groups[0]


def uninstall() -> None:
    """Forget the current world (destroy does this before it closes anything)."""
    _registry.world = _registry.default = None
    GroupMember.WORLD = None


def current_world() -> World:
    """The world ``init_process_group`` built in this process (a hook for tests and tools)."""
    if _registry.world is None:
        raise NotInitializedError("no process group: call init_process_group() first")
    return _registry.world


def default_group() -> ProcessGroup | None:
    return _registry.default


def seconds(timeout: float | datetime.timedelta | None, default: float) -> float:
    """``timeout`` in seconds (``default`` if None); a non-positive value is a ``ValueError``."""
    if timeout is None:
        return default
    value = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else float(timeout)
    if value <= 0:
        raise ValueError(f"timeout must be positive, got {timeout!r}")
    return value


def resolve(group: Any) -> ProcessGroup | None:
    """The group a call acts on; None for a rank outside ``group``."""
    if group is GroupMember.NON_GROUP_MEMBER:
        return None
    if group is None or group is GroupMember.WORLD:
        if _registry.default is None:
            raise NotInitializedError("no default process group: call init_process_group() first")
        return _registry.default
    if not isinstance(group, ProcessGroup):
        raise TypeError(f"group must be a ProcessGroup, got {type(group).__name__}")
    if group.destroyed or group.world is not _registry.world:
        raise NotInitializedError(
            "this process group was destroyed; call init_process_group() / new_group() again"
        )
    return group


def on_group(
    missing: Any = None,
) -> Callable[[Callable[P, Coroutine[Any, Any, R]]], Callable[P, Coroutine[Any, Any, R]]]:
    """Decorate an API coroutine whose ``group`` parameter it receives resolved.

    The wrapped function sees a ``ProcessGroup`` as ``group``; on a rank outside the group the
    call returns ``missing`` at once.
    """

    def wrap(fn: Callable[P, Coroutine[Any, Any, R]]) -> Callable[P, Coroutine[Any, Any, R]]:
        at = list(inspect.signature(fn).parameters).index("group")

        @functools.wraps(fn)
        async def call(*args: P.args, **kwargs: P.kwargs) -> R:
            if len(args) > at:
                g = resolve(args[at])
                if g is None:
                    return missing  # type: ignore[no-any-return]
                args = (*args[:at], g, *args[at + 1 :])  # type: ignore[assignment]
            else:
                g = resolve(kwargs.get("group"))
                if g is None:
                    return missing  # type: ignore[no-any-return]
                kwargs["group"] = g
            return await fn(*args, **kwargs)

        return call

    return wrap


# -- queries ---------------------------------------------------------------------------------
def is_initialized() -> bool:
    """True between a successful ``init_process_group`` and ``destroy_process_group``."""
    return _registry.default is not None


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
