"""Algorithms over an in-memory transport: several ranks in one event loop, no sockets."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from arendez import algo_comm
from arendez import algorithms as algo
from arendez.arrays import ReduceOp


class MemComm:
    """Ranks of one group exchanging tagged messages through shared futures (copying, as a wire would)."""

    def __init__(
        self, rank: int, size: int, boxes: dict[tuple[int, ...], asyncio.Future[bytes]], seq: int = 0
    ):
        self.rank, self.size, self._boxes, self.seq = rank, size, boxes, seq

    def next(self) -> MemComm:
        """The comm of this rank's next collective (its own sequence number, as in a group)."""
        return MemComm(self.rank, self.size, self._boxes, self.seq + 1)

    def _box(self, src: int, dst: int, tag: int) -> asyncio.Future[bytes]:
        key = (self.seq, src, dst, tag)
        if key not in self._boxes:
            self._boxes[key] = asyncio.get_running_loop().create_future()
        return self._boxes[key]

    def scratch(self, nbytes: int) -> Any:
        return np.full(nbytes, 0xAB, np.uint8)  # garbage, as a reused buffer would hold

    def recycle(self, buffer: Any) -> None:
        buffer.fill(0xCD)  # a recycled buffer must no longer be read

    def send(self, peer: int, tag: int, data: Any) -> None:
        box = self._box(self.rank, peer, tag)
        assert not box.done(), f"tag {tag} reused from {self.rank} to {peer}"
        box.set_result(np.ascontiguousarray(data).tobytes())

    async def recv_into(self, peer: int, tag: int, out: Any) -> None:
        data = await self._box(peer, self.rank, tag)
        out.view(np.uint8)[:] = np.frombuffer(data, np.uint8)

    async def recv_any(self, peer: int, tag: int, scratch: Any = None) -> memoryview:
        return memoryview(bytearray(await self._box(peer, self.rank, tag)))

    def release(self, buffer: memoryview) -> None:
        buffer[:] = b"\xee" * buffer.nbytes  # a released buffer may be overwritten at once


async def _run(size: int, body) -> list[Any]:
    boxes: dict = {}
    return await asyncio.wait_for(asyncio.gather(*(body(MemComm(r, size, boxes)) for r in range(size))), 10)


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("size", "algorithm"),
    [
        (s, a)
        for s in (2, 3, 5, 8)
        for a in ("direct", "ring", "rdb", "rhd")
        if a in ("direct", "ring", "rdb") or not s & (s - 1)
    ],
)
@pytest.mark.parametrize("n", [0, 1, 4, 1000, 300_001])
async def test_all_reduce_every_algorithm(size, algorithm, n, monkeypatch):
    monkeypatch.setattr(algo_comm, "LANE_BYTES", 4096)  # many lanes even for small arrays
    data = [np.random.default_rng(r).integers(-50, 50, n).astype(np.float64) for r in range(size)]

    async def body(comm):
        x = data[comm.rank].copy()
        await algo.all_reduce(comm, x, ReduceOp.SUM, algorithm)
        return x

    for got in await _run(size, body):
        np.testing.assert_array_equal(got, np.sum(data, axis=0))


@pytest.mark.timeout(30)
@pytest.mark.parametrize("size", [2, 3, 4])
@pytest.mark.parametrize("algorithm", ["direct", "ring"])
async def test_broadcast_reduce_scatter_allgather(size, algorithm, monkeypatch):
    monkeypatch.setattr(algo_comm, "LANE_BYTES", 1024)
    n = 5003
    data = [np.arange(n, dtype=np.int64) * (r + 1) for r in range(size)]

    async def body(comm):
        r = comm.rank
        b = data[r].copy()
        await algo.broadcast(comm, b, size - 1, algorithm)
        red = data[r].copy()
        await algo.reduce(comm := comm.next(), red, 0, ReduceOp.MAX, algorithm)
        out = np.empty(n, np.int64)
        await algo.reduce_scatter(
            comm := comm.next(), out, [data[r] + i for i in range(size)], ReduceOp.SUM, algorithm
        )
        blocks = [np.zeros(n * 8, np.uint8) for _ in range(size)]
        blocks[r][:] = data[r].view(np.uint8)
        await algo.all_gather(comm.next(), blocks, algorithm)
        return b, red, out, blocks

    results = await _run(size, body)
    for r, (b, red, out, blocks) in enumerate(results):
        np.testing.assert_array_equal(b, data[-1])
        if r == 0:
            np.testing.assert_array_equal(red, data[-1])
        np.testing.assert_array_equal(out, np.sum(data, axis=0) + size * r)
        for p in range(size):
            np.testing.assert_array_equal(blocks[p].view(np.int64), data[p])


def test_choice_depends_on_size_and_group():
    assert algo.choose("all_reduce", 8, 4) == "direct"
    assert algo.choose("all_reduce", 8, 16) == "rdb"
    assert algo.choose("all_reduce", 8, 12) == "rdb"  # (folded: direct would connect all pairs)
    assert algo.choose("all_reduce", 8 << 20, 4) == "rhd"
    assert algo.choose("all_reduce", 8 << 20, 3) == "ring"
    assert algo.choose("all_reduce", 8 << 20, 2) == "ring"
    assert algo.choose("broadcast", 8 << 20, 2) == "direct"
