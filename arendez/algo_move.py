"""Data movement: broadcast (direct, pipelined chain, binomial tree), all_gather (direct or
ring lanes), gather, scatter, all_to_all."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from .algo_choice import _choose_for, chose
from .algo_comm import Array, Comm, _lanes, _ring_schedule, _run_lanes, exchange_nothing, others, wait_all


async def broadcast(comm: Comm, x: Array, src: int, algorithm: str | None = None) -> None:
    """Copy ``src``'s ``x`` into every rank's ``x``."""
    n, r = comm.size, comm.rank
    if not x.size:
        await exchange_nothing(comm)
        return
    if n == 1:
        return
    algo = chose(comm, algorithm or _choose_for(comm, "broadcast", x.nbytes, n))
    if algo == "tree":
        await tree_broadcast(comm, x, src, lambda peer: comm.recv_into(peer, 0, x))
        return
    if algo != "ring":
        if r == src:
            await wait_all([comm.send(p, 0, x) for p in others(comm)])
        else:
            await comm.recv_into(src, 0, x)
        return
    # pipelined chain src -> src+1 -> ... : each chunk is forwarded as soon as it lands
    chunks = [x[s] for s in _lanes(x.size, x.itemsize, 1, min_lanes=4)]  # a chain needs several
    nxt, prev = (r + 1) % n, (r - 1) % n
    last = nxt == src
    if r == src:
        await wait_all([comm.send(nxt, i, c) for i, c in enumerate(chunks)])
        return
    recvs = [comm.recv_into(prev, i, c) for i, c in enumerate(chunks)]
    sends: list[Awaitable[None] | None] = []
    for i, c in enumerate(chunks):
        await recvs[i]
        if not last:
            sends.append(comm.send(nxt, i, c))
    await wait_all(sends)


def binomial_tree(comm: Comm, root: int) -> tuple[int | None, list[int]]:
    """This rank's parent (None at ``root``) and children in the binomial tree rooted at
    ``root``: ranks at distance 2^k, so O(log n) peers each (the neighbours init connects)."""
    size, me = comm.size, (comm.rank - root) % comm.size
    mask, parent = 1, None
    while mask < size:
        if me & mask:
            parent = (me - mask + root) % size
            break
        mask <<= 1
    children = []
    mask >>= 1
    while mask > 0:
        if me + mask < size:
            children.append((me + mask + root) % size)
        mask >>= 1
    return parent, children


async def tree_broadcast(
    comm: Comm, x: Array, root: int, receive: Callable[[int], Awaitable[Any]], tag: int = 0
) -> Any:
    """Binomial-tree broadcast of ``x`` (``root``'s) in ceil(log2 n) rounds: ``receive(parent)``
    gets it (returning what landed, or None when it lands in ``x``), then it goes on to the
    children. Returns what ``receive`` returned (None at the root)."""
    parent, children = binomial_tree(comm, root)
    got = None
    if parent is not None:
        got = await receive(parent)
        if got is not None:
            x = np.frombuffer(got, np.uint8)
    await wait_all([comm.send(child, tag, x) for child in children])
    return got


def _post_all_gather(comm: Comm, blocks: list[Array], tag: int) -> list[Awaitable[None]]:
    """Post the receives of a ring all-gather lane, so its frames land in place.

    Safe before the lane's reduce-scatter: a final block can only come back around after
    this rank has sent its own partial of it.
    """
    n, r, _, left = _ring_schedule(comm)
    return [comm.recv_into(left, tag + s, blocks[(r - s - 1) % n]) for s in range(n - 1)]


async def _ring_all_gather_lane(
    comm: Comm, blocks: list[Array], tag: int, recvs: list[Awaitable[None]] | None = None
) -> None:
    """Ring all-gather of one lane: block ``rank`` is ours, the rest arrive in place."""
    n, r, right, _ = _ring_schedule(comm)
    if recvs is None:
        recvs = _post_all_gather(comm, blocks, tag)
    for s in range(n - 1):
        sending = comm.send(right, tag + s, blocks[(r - s) % n])
        await recvs[s]
        await wait_all([sending])


async def all_gather(comm: Comm, blocks: list[Array], algorithm: str | None = None) -> None:
    """Fill every ``blocks[p]`` with rank ``p``'s block (``blocks[rank]`` already holds ours).

    Blocks are flat uint8 arrays of equal size.
    """
    n, r = comm.size, comm.rank
    if n == 1:
        return
    algo = chose(comm, algorithm or _choose_for(comm, "all_gather", blocks[r].nbytes * n, n))
    if algo != "ring":
        peers = others(comm)
        recvs = [comm.recv_into(p, 0, blocks[p]) for p in peers]
        await wait_all([comm.send(p, 0, blocks[r]) for p in peers])
        await wait_all(recvs)
        return
    lanes = [[b[part] for b in blocks] for part in _lanes(blocks[r].size, 1, 1)]
    gathering = [_post_all_gather(comm, lane_blocks, 2 * n * i) for i, lane_blocks in enumerate(lanes)]

    async def lane(i: int) -> None:
        await _ring_all_gather_lane(comm, lanes[i], 2 * n * i, gathering[i])

    await _run_lanes(len(lanes), lane)


async def gather(comm: Comm, x: Array, outs: list[Array] | None, dst: int) -> None:
    """``outs[p]`` on ``dst`` = rank ``p``'s ``x``."""
    if comm.rank != dst:
        await wait_all([comm.send(dst, 0, x)])
        return
    assert outs is not None
    np.copyto(outs[dst], x)
    await wait_all([comm.recv_into(p, 0, outs[p]) for p in others(comm)])


async def scatter(comm: Comm, out: Array, ins: list[Array] | None, src: int) -> None:
    """``out`` on rank ``p`` = ``ins[p]`` on ``src``."""
    if comm.rank != src:
        await comm.recv_into(src, 0, out)
        return
    assert ins is not None
    np.copyto(out, ins[src])
    await wait_all([comm.send(p, 0, ins[p]) for p in others(comm)])


async def all_to_all(comm: Comm, outs: list[Array], ins: list[Array]) -> None:
    """``outs[p]`` on rank ``r`` = ``ins[r]`` on rank ``p``."""
    peers = others(comm)
    recvs = [comm.recv_into(p, 0, outs[p]) for p in peers]
    np.copyto(outs[comm.rank], ins[comm.rank])
    await wait_all([comm.send(p, 0, ins[p]) for p in peers])
    await wait_all(recvs)
