"""Frame matching: the decoder, the sink and the router (in one process, and between ranks)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import arendez
from arendez import frames, wire
from arendez.arrays import byte_view
from arendez.testing import run_ranks
from arendez.world import World


def _p2p(gid: int, tag: int, data: np.ndarray) -> bytes:
    return b"".join(bytes(b) for b in wire.encode(frames.encode(frames.P2P(gid, tag, "fp")), byte_view(data)))


def _in_one_read(world: World, peer: int, data: bytes) -> None:
    """Hand ``data`` (whole frames) to a decoder in one read and route what completes: the sink
    sees each later frame before the earlier ones are routed."""
    decoder = wire.Decoder(lambda h, n: world.sink(peer, h, n))
    decoder.set_parser(frames.decode)
    buf = decoder.get_buffer()
    assert len(buf) >= len(data)  # (all of it in one read)
    buf[: len(data)] = data
    for header, payload in decoder.feed(len(data)):
        world.route(peer, header, payload)


@pytest.mark.timeout(10)
async def test_back_to_back_p2p_frames_in_one_read_reach_their_own_recvs():
    world = World(rank=1, world_size=2, timeout=5)
    first, second = np.zeros(3, np.int32), np.zeros(5, np.int32)
    a = world.p2p.post(0, 0, 0, byte_view(first), world.dead)
    b = world.p2p.post(0, 0, 0, byte_view(second), world.dead)
    _in_one_read(world, 0, _p2p(0, 0, np.full(3, 1, np.int32)) + _p2p(0, 0, np.full(5, 2, np.int32)))
    assert await asyncio.wait_for(a, 1) == 0 and await asyncio.wait_for(b, 1) == 0
    assert first.tolist() == [1, 1, 1] and second.tolist() == [2] * 5
    assert world.stats.copied_bytes == 0  # both landed in place


@pytest.mark.timeout(10)
async def test_an_empty_p2p_message_followed_by_another_in_one_read_claims_its_own_recv():
    """QA: MoE-style all_to_all with 0-element splits on a subgroup failed with 'recv of 0 bytes
    got a send of 8': the next frame's sink claimed the empty message's recv before it was routed."""
    world = World(rank=1, world_size=2, timeout=5)
    empty, full = np.zeros(0, np.float32), np.zeros(4, np.float32)
    a = world.p2p.post(0, 0, 0, byte_view(empty), world.dead)
    b = world.p2p.post(0, 0, 0, byte_view(full), world.dead)
    _in_one_read(world, 0, _p2p(0, 0, np.zeros(0, np.float32)) + _p2p(0, 0, np.arange(4, dtype=np.float32)))
    assert await asyncio.wait_for(a, 1) == 0 and await asyncio.wait_for(b, 1) == 0
    assert full.tolist() == [0.0, 1.0, 2.0, 3.0] and world.stats.copied_bytes == 0


@pytest.mark.timeout(10)
async def test_a_message_whose_recv_gave_up_before_it_arrived_goes_to_the_next_recv():
    """(review) In memory the sink runs at the sender's send and the frame arrives a turn
    later: a recv that gave up meanwhile must not take the message with it."""
    world = World(rank=1, world_size=2, timeout=5)
    first = np.zeros(2, np.float32)
    gave_up = world.p2p.post(0, 0, 0, byte_view(first), world.dead)
    assert world.p2p.sink(0, 0, 0, first.nbytes, "") is not None  # (claimed at the send)
    gave_up.cancel()
    world.p2p.cancel(gave_up)
    world.p2p.deliver(0, 0, 0, memoryview(np.full(2, 3.0, np.float32)).cast("B"), "")
    second = np.zeros(2, np.float32)
    taken = world.p2p.post(0, 0, 0, byte_view(second), world.dead)
    assert await asyncio.wait_for(taken, 1) == 0 and second.tolist() == [3.0, 3.0]


@pytest.mark.parametrize("over", ["inproc", "server"])
@pytest.mark.timeout(30)
async def test_empty_and_full_p2p_messages_back_to_back_match_in_order(over: str, request) -> None:
    async def rank(r: int) -> list[list[float]]:
        got = []
        for _ in range(20):
            if r == 0:
                works = [arendez.isend(np.zeros(0, np.float32), 1), arendez.isend(np.ones(4, np.float32), 1)]
            else:
                outs = [np.zeros(0, np.float32), np.zeros(4, np.float32)]
                works = [arendez.irecv(outs[0], 0), arendez.irecv(outs[1], 0)]
            for w in works:
                await w.wait()  # type: ignore[union-attr]
            if r == 1:
                got.append(outs[1].tolist())
        return got

    url = None
    if over == "server":
        url = f"arendez://127.0.0.1:{request.getfixturevalue('arendez_server').port}/emptyp2p"
    results = await run_ranks(2, rank, init_method=url) if url else await run_ranks(2, rank)
    assert results[1] == [[1.0] * 4] * 20


def _feed(world: World, peer: int, frame: bytes) -> None:
    """Push ``frame`` through a decoder in the pieces it asks for, routing what completes."""
    decoder = wire.Decoder(lambda h, n: world.sink(peer, h, n))
    decoder.set_parser(frames.decode)
    view = memoryview(frame)
    while view.nbytes:
        buf = decoder.get_buffer()
        n = min(len(buf), view.nbytes)
        buf[:n] = view[:n]
        view = view[n:]
        for header, payload in decoder.feed(n):
            world.route(peer, header, payload)


@pytest.mark.timeout(10)
async def test_early_payloads_land_in_a_pooled_buffer_that_is_reused():
    """A frame that arrives before its receive lands in a pool buffer (fresh pages would fault
    on every call); the receive takes it, releases it, and the next early frame reuses it."""
    world = World(rank=1, world_size=2, timeout=5)
    group = world.groups[0]
    landed: list[tuple[object, float]] = []  # (the buffer itself: ids of dead objects recur)

    async def body(op):
        got = await op.recv_any(0, 0)
        landed.append((got.obj, float(np.frombuffer(got, np.float32)[0])))
        op.release(got)

    for seq in range(3):
        data = np.full(1 << 15, seq + 1, np.float32)  # 128 KiB: above the pooling threshold
        header = frames.encode(frames.Data(0, seq, 0, 0, "fp"))
        _feed(world, 0, b"".join(bytes(b) for b in wire.encode(header, byte_view(data))))
        await group.run("test", "fp", body)
    assert [value for _, value in landed] == [1.0, 2.0, 3.0]
    assert all(buffer is landed[0][0] for buffer, _ in landed), "each early frame got a fresh buffer"


@pytest.mark.timeout(10)
@pytest.mark.parametrize("posted_first", [True, False])
async def test_a_shorter_message_fills_the_start_of_a_recv_and_a_longer_one_is_refused(posted_first: bool):
    """As gloo's and MPI's recv: a buffer larger than the message takes it at its start, the
    rest untouched (QA: 5 floats sent into a recv of 10 were a CollectiveMismatchError); a
    message longer than the buffer is refused, and the next message still matches in order."""
    world = World(rank=1, world_size=2, timeout=5)
    big, small, after = np.full(10, -1.0, np.float32), np.zeros(2, np.float32), np.zeros(3, np.float32)
    wire_bytes = (
        _p2p(0, 0, np.arange(5, dtype=np.float32))
        + _p2p(0, 0, np.arange(4, dtype=np.float32))
        + _p2p(0, 0, np.full(3, 7.0, np.float32))
    )
    if not posted_first:
        _in_one_read(world, 0, wire_bytes)  # (all three stashed: no recv was posted)
    a = world.p2p.post(0, 0, 0, byte_view(big), world.dead)
    b = world.p2p.post(0, 0, 0, byte_view(small), world.dead)
    c = world.p2p.post(0, 0, 0, byte_view(after), world.dead)
    if posted_first:
        _in_one_read(world, 0, wire_bytes)
    assert await asyncio.wait_for(a, 1) == 0
    assert big.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0] + [-1.0] * 5
    with pytest.raises(arendez.CollectiveMismatchError, match="recv of 8 bytes from rank 0 got a send of 16"):
        await asyncio.wait_for(b, 1)
    assert await asyncio.wait_for(c, 1) == 0 and after.tolist() == [7.0] * 3
