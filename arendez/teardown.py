"""Teardown: drain a world's collectives, say goodbye, leave the server, close the streams."""

from __future__ import annotations

import asyncio
import datetime
from typing import Any

from . import farewell
from .group import GroupMember, ProcessGroup, not_member
from .registry import default_group, forget_forked, seconds, uninstall, world_or_none
from .world import World

#: The longest the rank hosting the embedded server waits for the others to leave.
LINGER_SECONDS = 10.0


async def destroy_process_group(group: Any = None, timeout: float | datetime.timedelta | None = None) -> None:
    """Drain in-flight collectives, cancel the rest, leave, close: all within ``timeout``.

    ``group=None`` destroys the default group and every subgroup; a subgroup leaves the
    default group alive. Quiet when nothing is initialized or the group is already gone.
    The rank that hosts the embedded server (``tcp://``) waits, within the same deadline, until
    the other ranks have said goodbye (or failed); the server itself stays up for the next
    ``init_process_group`` while the process lives (``arendez.embedded``).
    """
    if forget_forked():  # (a forked child: the parent's world is not its to close)
        return
    world, default = world_or_none(), default_group()
    if world is None or default is None or not_member(group):
        return
    loop = asyncio.get_running_loop()
    if group is not None and group is not GroupMember.WORLD and group is not default:
        if isinstance(group, ProcessGroup) and not group.destroyed and group.world is world:
            await group.drain(loop.time() + seconds(timeout, group.timeout))
            world.groups.pop(group.gid, None)
        return
    await _close_shielded(world, loop.time() + seconds(timeout, default.timeout))


async def abort_world(budget: float = 1.0) -> None:
    """destroy_process_group without draining: the calls in flight fail with
    ``GroupDestroyedError`` at once, and the rest (goodbyes, leaving the server, closing the
    connections) gets ``budget`` seconds (the torch backend's ``abort``)."""
    world = world_or_none()
    if world is None or default_group() is None:
        return
    now = asyncio.get_running_loop().time()
    await _close_shielded(world, now + budget, drain_by=now)


async def _close_shielded(world: World, deadline: float, drain_by: float | None = None) -> None:
    """``_close_world`` in a task of its own: a cancel of the caller (``asyncio.timeout``,
    ``task.cancel()``) is raised once the world has closed, within the same deadline."""
    closing = asyncio.get_running_loop().create_task(_close_world(world, deadline, drain_by))
    try:
        await asyncio.shield(closing)
    except asyncio.CancelledError:
        await asyncio.wait([closing])
        raise


async def _close_world(world: World, deadline: float, drain_by: float | None = None) -> None:
    """destroy_process_group's work for the whole world, bounded by ``deadline`` (loop time);
    the calls in flight may finish until ``drain_by`` (default: the deadline)."""
    loop = asyncio.get_running_loop()

    def left() -> float:
        return max(0.0, deadline - loop.time())

    done = world.finished()  # (a goodbye that names this rank's failure says how far it got)
    groups = sorted(world.groups.values(), key=lambda g: -g.gid)  # subgroups first
    for g in groups:
        g.closing = True  # new collectives now raise GroupDestroyedError
    try:
        await asyncio.gather(*(g.drain(deadline if drain_by is None else drain_by) for g in groups))
    finally:
        uninstall()
    world.groups.clear()
    world.closed = True
    hosting = world.server is not None
    if world.store is not None and not hosting:  # before the goodbye: it means "done with the store"
        await world.store.leave(left(), failed=world.ending)
    await farewell.forget(world)
    world.say_goodbye(done)
    if hosting:  # the others still need the store until they have left
        # (a member still, it hears the server declare a stopped peer failed: no full linger)
        await world.peers_gone(min(deadline, loop.time() + LINGER_SECONDS))
        if world.store is not None:
            await world.store.leave(left(), failed=world.ending)
    if world.mesh is not None:
        await world.mesh.close(left(), gone=set(world.failed))
    world.shm.close()
    if world.store is not None:
        await world.store.close()
