"""The mailbox and the world's routing, driven frame by frame without sockets."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from arendez import frames
from arendez.errors import CollectiveMismatchError, RankFailedError
from arendez.mailbox import Mailbox, Outcome, Stats
from arendez.world import World

KEY = (1, 0, 0, 0, 0)


async def test_a_frame_before_its_receive_is_stashed_then_taken_and_given_back():
    box, returned = Mailbox(Stats()), []
    outcome = box.deliver(KEY, "fp", memoryview(b"abc"), lambda: returned.append(1), shared=False)
    assert outcome is Outcome.STASHED and box.destination(KEY, "fp", 3) is None
    slot = box.take(KEY)
    assert bytes(slot.data) == b"abc" and slot.fp == "fp" and len(box) == 0
    box.deliver(KEY, "fp", memoryview(b"x"), lambda: returned.append(2), shared=False)
    box.drop([KEY])  # a receive that will never be posted: the buffer goes back
    assert returned == [2] and len(box) == 0


async def test_a_posted_receive_names_its_buffer_only_for_the_same_fingerprint_and_size():
    stats = Stats()
    box, out = Mailbox(stats), bytearray(4)
    fut = box.post(KEY, memoryview(out), "fp")
    assert box.destination(KEY, "fp", 4) is not None
    assert box.destination(KEY, "other", 4) is None and box.destination(KEY, "fp", 5) is None
    assert box.deliver(KEY, "fp", memoryview(b"wxyz"), None, shared=False) is Outcome.DELIVERED
    assert await fut is None and out == b"wxyz" and stats.copied_bytes == 4  # not in place: copied


async def test_a_payload_of_the_wrong_size_fails_the_receive():
    box = Mailbox(Stats())
    fut = box.post(KEY, memoryview(bytearray(4)), "fp")
    assert box.deliver(KEY, "fp", memoryview(b"toolong"), None, shared=False) is Outcome.MISMATCHED
    with pytest.raises(CollectiveMismatchError, match="expected 4 bytes, got 7"):
        await fut


async def test_expects_and_close():
    box = Mailbox(Stats())
    box.post(KEY, memoryview(bytearray(1)), "fp")
    assert box.expects([KEY], 1) and not box.expects([KEY], 2)
    box.close([KEY])
    assert not box.expects([KEY], 1) and len(box) == 0


def _data(seq: int, fp: str) -> frames.Data:
    return frames.Data(0, seq, 0, 0, fp)


@pytest.mark.timeout(10)
async def test_world_fails_a_collective_whose_peer_runs_another_one():
    world = World(rank=0, world_size=2, timeout=5)

    async def body(op):
        await op.recv_into(1, 0, np.zeros(1, np.float32))

    task = asyncio.create_task(world.groups[0].run("all_reduce", "all_reduce|<f4|1|SUM", body))
    await asyncio.sleep(0)
    world.route(1, _data(0, "broadcast|<f4|1|1"), memoryview(b"\0" * 4))
    with pytest.raises(CollectiveMismatchError, match="rank 1 runs broadcast"):
        await asyncio.wait_for(task, 2)


@pytest.mark.timeout(10)
async def test_world_poisons_a_collective_from_an_early_mismatched_frame():
    world = World(rank=0, world_size=2, timeout=5)
    world.route(1, _data(0, "broadcast|<f4|1|1"), memoryview(b"\0" * 4))  # before we start seq 0

    async def body(op):
        await op.recv_into(1, 0, np.zeros(1, np.float32))

    with pytest.raises(CollectiveMismatchError, match="rank 1 runs broadcast"):
        await asyncio.wait_for(world.groups[0].run("all_reduce", "all_reduce|<f4|1|SUM", body), 2)


@pytest.mark.timeout(10)
async def test_peer_loss_fails_the_waiting_collective_and_a_goodbye_only_what_it_still_owes():
    world = World(rank=0, world_size=3, timeout=5)
    got = np.zeros(1, np.float32)

    async def body(op):
        await op.recv_into(1, 0, got)  # rank 1's frame already came
        await op.recv_into(2, 0, np.zeros(1, np.float32))

    world.route(1, _data(0, "fp"), memoryview(np.ones(1, np.float32).tobytes()))
    task = asyncio.create_task(world.groups[0].run("all_reduce", "fp", body))
    await asyncio.sleep(0)
    world.route(1, frames.Bye({}), None)  # rank 1 left after sending all it owed: no failure
    await asyncio.sleep(0)
    assert not task.done() and got[0] == 1
    world.route(2, frames.Bye({}), None)  # rank 2 left owing a frame
    with pytest.raises(RankFailedError, match="rank 2 failed during all_reduce"):
        await asyncio.wait_for(task, 2)
    assert world.failed == {} and set(world.dead) == {1, 2}


@pytest.mark.timeout(10)
async def test_drain_fails_what_is_in_flight_and_drops_early_frames():
    world = World(rank=0, world_size=2, timeout=5)
    group = world.groups[0]
    world.route(1, _data(5, "fp"), memoryview(b"x"))  # for a collective never started here
    started = asyncio.Event()

    async def body(op):
        started.set()
        await op.recv_into(1, 0, np.zeros(1, np.uint8))

    task = asyncio.create_task(group.run("barrier", "fp", body))
    await started.wait()
    await group.drain(0.01)
    assert group.destroyed and len(world.mail) == 0
    with pytest.raises(Exception, match="process group was destroyed"):
        await task


@pytest.mark.timeout(10)
async def test_a_rank_that_is_leaving_does_not_answer_progress_queries():
    sent: list[tuple[int, frames.Frame]] = []
    world = World(rank=0, world_size=2, timeout=5)
    world.send_control = lambda peer, frame: sent.append((peer, frame)) or True  # type: ignore[method-assign]
    world.route(1, frames.Query(0, 7), None)
    assert sent == [(1, frames.Answer(7, 0))]
    world.closed = True  # destroy cleared the groups: answering -1 would read as "never started"
    world.route(1, frames.Query(0, 8), None)
    assert sent == [(1, frames.Answer(7, 0))]
