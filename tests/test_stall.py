"""Losses seen just after the event loop stood still wait for the server's word (``arendez.stall``).

A rank stopped past its lease finds, once resumed, the server's declaration of its own failure
and its peers' closed connections in its sockets at once. These drive ``World`` without sockets:
a store whose answer brings the server's word, a loop that stood still.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from arendez import stall
from arendez.world import World

DECLARED = "this rank was declared failed by the server (no heartbeat for 2.5s)"


class _Server:
    """A store whose round trip delivers the server's word that this rank was declared failed
    (as the word sent before the answer would be read first)."""

    def __init__(self, world: World) -> None:
        self.world, self.checks = world, 0

    async def check(self, keys: list[str]) -> bool:
        self.checks += 1
        await asyncio.sleep(0.01)
        self.world.expelled(DECLARED)
        return False


def _after_a_stall(world: World) -> None:
    assert world.stall is not None
    world.stall.resumed_until = asyncio.get_running_loop().time() + stall.GRACE


async def test_the_watch_sees_the_loop_stand_still_and_forgets_it_after_the_grace() -> None:
    world = World(0, 2, 10.0)
    watch = world.stall
    assert watch is not None and not watch.just_resumed()
    time.sleep(stall.STALL + stall.TICK + 0.2)  # (blocks the loop: a long step, or SIGSTOP)
    assert watch.just_resumed()
    await asyncio.sleep(2 * stall.TICK)
    assert watch.just_resumed()  # (the late tick opened the grace)
    await asyncio.sleep(stall.GRACE)
    assert not watch.just_resumed()
    world.closed = True


async def test_a_link_lost_after_a_stall_is_blamed_once_the_server_is_heard() -> None:
    world = World(2, 3, 10.0)
    server = world.store = _Server(world)
    _after_a_stall(world)
    world.link_lost(1, "connection lost (closed)")
    assert 1 not in world.dead  # (not yet: the server's word may be unread)
    await asyncio.sleep(0.1)
    assert server.checks == 1 and world.expulsion == DECLARED
    assert world.dead[1] == "connection lost (closed)"
    world.closed = True


async def test_a_broken_link_after_a_stall_names_this_rank_when_the_server_declared_it() -> None:
    world = World(2, 3, 10.0)
    world.store = _Server(world)
    _after_a_stall(world)
    err = await world.blame(0, "broadcast", "connection lost ([Errno 32] Broken pipe)")
    assert err.rank == 2 and DECLARED in str(err), err
    world.closed = True


async def test_without_a_stall_a_lost_link_is_blamed_at_once() -> None:
    world = World(2, 3, 10.0)
    server = world.store = _Server(world)
    world.link_lost(1, "connection lost (closed)")
    assert world.dead[1] == "connection lost (closed)"
    err = await world.blame(0, "broadcast", "connection lost (closed)")
    assert err.rank == 0 and server.checks == 0 and world.expulsion is None
    world.closed = True


async def _hog(until: asyncio.Event, step: float) -> None:
    """A task that keeps the loop busy: ``step`` seconds of work between yields."""
    while not until.is_set():
        time.sleep(step)
        await asyncio.sleep(0)


async def test_a_patient_timeout_fires_on_time_on_an_idle_loop() -> None:
    loop = asyncio.get_running_loop()
    began = loop.time()
    with pytest.raises(TimeoutError):
        async with stall.patient_timeout(0.3):
            await asyncio.sleep(5)
    assert 0.3 <= loop.time() - began < 0.3 * stall.PATIENCE


async def test_a_patient_timeout_waits_while_the_loop_is_overloaded_then_gives_up() -> None:
    """A handshake's answer handled late because the loop is busy is not the peer's silence:
    what ends in 3 of the timeout's lengths ends; what never ends is cut by PATIENCE lengths."""
    stop = asyncio.Event()
    hogs = [asyncio.create_task(_hog(stop, 0.03)) for _ in range(4)]  # (each pass: ~0.12 s)
    loop = asyncio.get_running_loop()
    try:
        answer = loop.create_future()
        loop.call_later(0.9, answer.set_result, "hello")
        async with stall.patient_timeout(0.3):
            assert await answer == "hello"  # (asyncio.timeout(0.3) would have cut it)
        began = loop.time()
        with pytest.raises(TimeoutError):
            async with stall.patient_timeout(0.3):
                await asyncio.sleep(30)
        assert loop.time() - began < 0.3 * stall.PATIENCE + 1.0
    finally:
        stop.set()
        await asyncio.gather(*hogs)
