"""Reductions: all_reduce (direct, recursive doubling, ring, recursive halving-doubling),
reduce, reduce_scatter, and ``recv_reduce``, the receive that reduces as it lands.

Contributions are combined in a fixed order, so every rank ends with bit-identical results.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import cast

import numpy as np

from . import algo_comm
from .algo_choice import _choose_for, chose
from .algo_comm import (
    Array,
    Comm,
    _lanes,
    _release,
    _ring_schedule,
    _run_lanes,
    _view,
    exchange_nothing,
    link_kind,
    others,
    wait_all,
)
from .algo_move import _post_all_gather, _ring_all_gather_lane
from .arrays import Combine, ReduceOp, average, ufunc_for


def recv_reduce(comm: Comm, peer: int, tag: int, src: Array, out: Array, ufunc: Combine) -> Awaitable[None]:
    """Receive ``out.nbytes`` from ``peer`` and set ``out = ufunc(src, message)`` (``out`` may be
    ``src``; neither may be read or written until this is done).

    The comm's own ``recv_reduce`` if it has one (``Op``'s reduces the message piece by piece
    as it arrives, cache-hot); else the message lands in a scratch buffer and is reduced then.
    """
    own = getattr(comm, "recv_reduce", None)
    if own is not None:
        return cast(Awaitable[None], own(peer, tag, src, out, ufunc))
    landing = comm.scratch(out.nbytes)
    return _reduce_landed(comm, comm.recv_any(peer, tag, landing), landing, src, out, ufunc)


async def _reduce_landed(
    comm: Comm, receiving: Awaitable[memoryview], landing: Array, src: Array, out: Array, ufunc: Combine
) -> None:
    got = await receiving
    ufunc(src, _view(got, out.dtype).reshape(out.shape), out=out)
    comm.release(got)
    comm.recycle(landing)  # (not on failure: the transport may still be writing into it)


def _combine_in_rank_order(
    comm: Comm, mine: Array, received: dict[int, Array], ufunc: Combine, out: Array
) -> None:
    """``out = c0 op c1 op ... op c(n-1)``, the same on every rank (contribution ``rank`` is
    ``mine``)."""
    if comm.size == 2 and out is mine:  # (the common case, without the general bookkeeping)
        theirs = received[1 - comm.rank]
        if comm.rank == 0:
            ufunc(mine, theirs, out=out)
        else:
            ufunc(theirs, mine, out=out)
        return
    parts = [mine if p == comm.rank else received[p] for p in range(comm.size)]
    if out is mine and comm.rank == 0:
        acc = out
    else:
        acc = np.array(parts[0], copy=True) if parts[0] is mine else parts[0]
        if not acc.flags.writeable:
            acc = acc.copy()
    for part in parts[1:]:
        ufunc(acc, part, out=acc)
    if acc is not out:
        np.copyto(out, acc)


async def all_reduce(comm: Comm, x: Array, op: ReduceOp, algorithm: str | None = None) -> None:
    """Reduce ``x`` across the group in place."""
    ufunc = ufunc_for(op, x.dtype)
    if comm.size > 1 and not x.size:
        await exchange_nothing(comm)
    elif comm.size > 1:
        link = link_kind(comm)
        lane_bytes = algo_comm.TCP_LANE_BYTES if link == "tcp" else algo_comm.LANE_BYTES
        algo = chose(comm, algorithm or _choose_for(comm, "all_reduce", x.nbytes, comm.size, link))
        if algo == "direct":
            await _direct_all_reduce(comm, x, ufunc)
        elif algo == "rdb":
            await _recursive_doubling(comm, x, ufunc)
        elif algo == "rhd" and not comm.size & (comm.size - 1):
            await _halving_doubling_all_reduce(comm, x, ufunc, lane_bytes)
        else:
            await _ring_all_reduce(comm, x, ufunc, lane_bytes)
    if op is ReduceOp.AVG and comm.size > 1:
        average(x, comm.size, out=x)


async def _direct_all_reduce(comm: Comm, x: Array, ufunc: Combine) -> None:
    peers = others(comm)
    recvs = [comm.recv_any(p, 0) for p in peers]
    await wait_all([comm.send(p, 0, x) for p in peers])
    got = await wait_all(recvs)
    received = {p: _view(buf, x.dtype) for p, buf in zip(peers, got, strict=True)}
    _combine_in_rank_order(comm, x, received, ufunc, x)
    _release(comm, got)


#: Tags of the fold into (and the copy back out of) the power-of-two core of recursive doubling.
_FOLD_IN, _FOLD_OUT = 1 << 20, (1 << 20) + 1


async def _recursive_doubling(comm: Comm, x: Array, ufunc: Combine) -> None:
    """Recursive doubling over the largest power of two ``p`` of ranks; a rank ``r >= p`` first
    hands its data to ``r - p`` and gets the result back from it (every rank ends bitwise
    equal, and each talks to O(log n) peers)."""
    n, r = comm.size, comm.rank
    p = 1 << (n.bit_length() - 1)
    if r >= p:
        result = comm.recv_into(r - p, _FOLD_OUT, x)
        await wait_all([comm.send(r - p, _FOLD_IN, x)])
        await result
        return
    if r + p < n:
        got = await comm.recv_any(r + p, _FOLD_IN)
        ufunc(x, _view(got, x.dtype), out=x)
        comm.release(got)
    mask, step = 1, 0
    while mask < p:
        partner = r ^ mask
        recv = comm.recv_any(partner, step)
        await wait_all([comm.send(partner, step, x)])
        got = await recv
        ufunc(x, _view(got, x.dtype), out=x)  # IEEE +, *, min, max commute exactly: both agree
        comm.release(got)
        mask, step = mask << 1, step + 1
    if r + p < n:
        await wait_all([comm.send(r + p, _FOLD_OUT, x)])


async def _ring_reduce_scatter_lane(
    comm: Comm, blocks: list[Array], ufunc: Combine, out: Array | None, tag: int
) -> None:
    """Ring reduce-scatter of one lane: afterwards block ``rank`` is reduced.

    ``out is None`` reduces in place into ``blocks``; otherwise the inputs stay untouched and
    the result lands in ``out`` (three scratch blocks carry the partial sums around: one still
    being sent, one just reduced, one being received into). Every step's message is reduced as
    it arrives (``recv_reduce``) and goes on to the right once it has.
    """
    n, r, right, left = _ring_schedule(comm)
    steps = n - 1
    partials = [] if out is None else [np.empty(max(b.size for b in blocks), out.dtype) for _ in range(3)]

    def target(s: int) -> Array:
        b = (r - s - 2) % n
        if out is None:
            return blocks[b]
        return out if s == steps - 1 else partials[s % 3][: blocks[b].size]

    def post(s: int) -> Awaitable[None]:
        return recv_reduce(comm, left, tag + s, blocks[(r - s - 2) % n], target(s), ufunc)

    # In place, a block is reduced before this rank ever sends it: post every step's receive now
    # (they land in order). Into scratch, the next one once the one before it has landed.
    receiving = [post(s) for s in range(steps if out is None else 1)]
    sending = comm.send(right, tag, blocks[(r - 1) % n])
    for s in range(steps):
        await receiving[s]
        if len(receiving) == s + 1 and s + 1 < steps:
            receiving.append(post(s + 1))  # (its scratch is not the one still being sent)
        await wait_all([sending])
        sending = comm.send(right, tag + s + 1, target(s)) if s < steps - 1 else None
    await wait_all([sending])


async def _ring_all_reduce(
    comm: Comm, x: Array, ufunc: Combine, lane_bytes: int = algo_comm.LANE_BYTES
) -> None:
    n = comm.size
    lanes = [np.array_split(x[part], n) for part in _lanes(x.size, x.itemsize, n, lane_bytes=lane_bytes)]
    # every lane's final blocks land in place, however early they come
    gathering = [_post_all_gather(comm, blocks, 4 * n * i + 2 * n) for i, blocks in enumerate(lanes)]

    async def lane(i: int) -> None:
        await _ring_reduce_scatter_lane(comm, lanes[i], ufunc, None, 4 * n * i)
        await _ring_all_gather_lane(comm, lanes[i], 4 * n * i + 2 * n, gathering[i])

    await _run_lanes(len(lanes), lane)


async def _halving_doubling_lane(comm: Comm, seg: Array, ufunc: Combine, tag: int) -> None:
    """Rabenseifner's all-reduce of one lane (power-of-two group): reduce-scatter by recursive
    halving, then all-gather by recursive doubling. Same bytes as the ring in 2 log2(n) steps
    instead of 2(n-1)."""
    n, r = comm.size, comm.rank
    levels = []  # (partner, kept span, given span) per halving step
    lo, hi, mask = 0, seg.size, n >> 1
    while mask:
        mid = (lo + hi) // 2
        keep, give = ((lo, mid), (mid, hi)) if not r & mask else ((mid, hi), (lo, mid))
        levels.append((r ^ mask, keep, give))
        lo, hi = keep
        mask >>= 1
    steps = len(levels)
    # the halves we give away come back reduced during the all-gather: post those receives now,
    # so they land in place (safe: a half returns only after the partner has reduced our part)
    gathering = [
        comm.recv_into(partner, tag + 2 * steps - 1 - i, seg[give[0] : give[1]])
        for i, (partner, _, give) in enumerate(levels)
    ]
    for step, (partner, keep, give) in enumerate(levels):
        mine = seg[keep[0] : keep[1]]
        receiving = recv_reduce(comm, partner, tag + step, mine, mine, ufunc)
        await wait_all([comm.send(partner, tag + step, seg[give[0] : give[1]])])
        await receiving
    for i in reversed(range(steps)):
        partner, keep, give = levels[i]
        await wait_all([comm.send(partner, tag + 2 * steps - 1 - i, seg[lo:hi])])
        await gathering[i]
        lo, hi = min(lo, give[0]), max(hi, give[1])


async def _halving_doubling_all_reduce(
    comm: Comm, x: Array, ufunc: Combine, lane_bytes: int = algo_comm.LANE_BYTES
) -> None:
    lanes = _lanes(x.size, x.itemsize, comm.size, lane_bytes=lane_bytes)
    tags = 4 * comm.size.bit_length()

    async def lane(i: int) -> None:
        await _halving_doubling_lane(comm, x[lanes[i]], ufunc, tags * i)

    await _run_lanes(len(lanes), lane)


async def reduce(comm: Comm, x: Array, dst: int, op: ReduceOp, algorithm: str | None = None) -> None:
    """Reduce into ``x`` on ``dst``. Small arrays leave the other ranks' ``x`` untouched; large
    ones use it as scratch (as torch's NCCL backend does)."""
    ufunc = ufunc_for(op, x.dtype)
    n = comm.size
    if n > 1 and not x.size:
        await exchange_nothing(comm)
    elif n > 1:
        algo = chose(comm, algorithm or _choose_for(comm, "reduce", x.nbytes, n))
        if algo == "ring":
            await _ring_reduce(comm, x, dst, ufunc)
        elif comm.rank == dst:
            peers = others(comm)
            got = await wait_all([comm.recv_any(p, 0) for p in peers])
            received = {p: _view(b, x.dtype) for p, b in zip(peers, got, strict=True)}
            _combine_in_rank_order(comm, x, received, ufunc, x)
            _release(comm, got)
        else:
            await wait_all([comm.send(dst, 0, x)])
    if op is ReduceOp.AVG and comm.rank == dst and n > 1:
        average(x, n, out=x)


async def _ring_reduce(comm: Comm, x: Array, dst: int, ufunc: Combine) -> None:
    n, r = comm.size, comm.rank
    lanes = _lanes(x.size, x.itemsize, n)

    async def lane(i: int) -> None:
        blocks = np.array_split(x[lanes[i]], n)
        await _ring_reduce_scatter_lane(comm, blocks, ufunc, None, 4 * n * i)
        tag = 4 * n * i + 2 * n
        if r == dst:
            await wait_all([comm.recv_into(p, tag, blocks[p]) for p in range(n) if p != r])
        else:
            await wait_all([comm.send(dst, tag, blocks[r])])

    await _run_lanes(len(lanes), lane)


async def reduce_scatter(
    comm: Comm, out: Array, inputs: list[Array], op: ReduceOp, algorithm: str | None = None
) -> None:
    """``out`` on rank ``r`` = the reduction of every rank's ``inputs[r]`` (inputs untouched)."""
    n, r = comm.size, comm.rank
    ufunc = ufunc_for(op, out.dtype)
    if n == 1:
        np.copyto(out, inputs[0])
    elif not out.size:
        await exchange_nothing(comm)
    else:
        algo = chose(comm, algorithm or _choose_for(comm, "reduce_scatter", out.nbytes * n, n))
        if algo == "ring":
            lanes = _lanes(out.size, out.itemsize, 1)

            async def lane(i: int) -> None:
                part = lanes[i]
                await _ring_reduce_scatter_lane(
                    comm, [blk[part] for blk in inputs], ufunc, out[part], 4 * n * i
                )

            await _run_lanes(len(lanes), lane)
        else:
            peers = others(comm)
            recvs = [comm.recv_any(p, 0) for p in peers]
            await wait_all([comm.send(p, 0, inputs[p]) for p in peers])
            got = await wait_all(recvs)
            received = {p: _view(b, out.dtype) for p, b in zip(peers, got, strict=True)}
            _combine_in_rank_order(comm, inputs[r], received, ufunc, out)
            _release(comm, got)
    if op is ReduceOp.AVG and n > 1:
        average(out, n, out=out)
