"""Collectives as pure algorithms over point-to-point messages.

Every function takes a ``Comm`` (the ranks of one group and tagged send/receive within one
collective) and numpy arrays. Nothing here knows about sockets, so the algorithms run as well
over an in-memory transport in unit tests as over TCP.

Latency-bound sizes use direct exchange (every rank talks to every other in one round) or
recursive doubling; bandwidth-bound sizes a ring (or, for all_reduce on a power-of-two group,
recursive halving-doubling: the ring's bytes in fewer steps). Over TCP links (a comm's optional
``link_kind()``) an all_reduce takes the cheapest of these by the cost model of ``costmodel``: the
ring where the link is the limit. Bandwidth-bound messages are cut into *lanes* that run
concurrently so the reduction of one lane overlaps the transfer of the next. Reductions combine contributions
in a fixed order, so every rank ends with bit-identical results.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol, cast

import numpy as np

from . import costmodel
from .arrays import ReduceOp, ufunc_for
from .settings import env_int

Array = np.ndarray[Any, Any]

#: What ``ARENDEZ_ALGORITHM`` may force.
ALGORITHMS = ("direct", "rdb", "ring", "rhd")
#: Arrays up to this many bytes take the latency-bound path.
SMALL_BYTES = 64 * 1024
#: Bytes of one block of one ring lane; lanes of ``size`` blocks pipeline large messages.
LANE_BYTES = env_int("ARENDEZ_LANE_BYTES", 512 * 1024, minimum=4096)
#: Lane block over TCP links: the socket, not the reduction, paces a step there, and every
#: message costs the event loop (a frame, a future, a wake-up), so fewer, larger blocks. A
#: block's reduction streams through cache-sized pieces as it arrives (``recv_reduce``), so a
#: large block costs no more cache misses than a small one.
TCP_LANE_BYTES = env_int("ARENDEZ_TCP_LANE_BYTES", 4 << 20, minimum=4096)
#: Lanes a bandwidth-bound message is cut into at least (blocks permitting).
MIN_LANES = env_int("ARENDEZ_MIN_LANES", 1)
#: Smallest lane block: below it, per-message overhead outweighs the overlap lanes buy.
MIN_LANE_BYTES = 64 * 1024
#: Ring lanes in flight at once (bounds scratch memory to a fixed chunk budget).
LANES_IN_FLIGHT = env_int("ARENDEZ_LANES_IN_FLIGHT", 4)


class Comm(Protocol):
    """What an algorithm needs: its place in the group and tagged messages.

    A comm may also have ``recv_reduce(peer, tag, src, out, ufunc)``, which receives a message
    and sets ``out = ufunc(src, message)`` (``recv_reduce`` below falls back to ``recv_any``).
    """

    rank: int
    size: int

    def send(self, peer: int, tag: int, data: Array) -> Awaitable[None] | None:
        """Start sending ``data``; await the result before modifying ``data``."""

    def recv_into(self, peer: int, tag: int, out: Array) -> Awaitable[None]:
        """Receive exactly ``out.nbytes`` bytes into ``out``."""

    def scratch(self, nbytes: int) -> Array:
        """A uint8 work buffer of ``nbytes`` (pooled: give it back with ``recycle``)."""

    def recycle(self, buffer: Array) -> None:
        """Return a ``scratch`` buffer once nothing refers to it any more."""

    def recv_any(self, peer: int, tag: int, scratch: Array | None = None) -> Awaitable[memoryview]:
        """Receive a message into ``scratch`` if it fits and arrives after this call, else into a
        buffer the transport picked (the sender's shared memory, say); returns where it landed."""

    def release(self, buffer: memoryview) -> None:
        """Done with what ``recv_any`` returned: the transport may reuse it (the collective's
        end releases whatever is left)."""


def check_algorithm(name: str | None, what: str = "algorithm") -> str | None:
    """``name`` if it is an algorithm ``choose`` knows (or None); a clear error otherwise."""
    if name is not None and name not in ALGORITHMS:
        raise ValueError(f"{what} must be one of {', '.join(ALGORITHMS)}, got {name!r}")
    return name


def forced_algorithm() -> str | None:
    """The algorithm ``ARENDEZ_ALGORITHM`` forces, if any."""
    return check_algorithm(os.environ.get("ARENDEZ_ALGORITHM") or None, "ARENDEZ_ALGORITHM")


def choose(collective: str, nbytes: int, size: int, link: str | None = None) -> str:
    """Pick the algorithm (``ARENDEZ_ALGORITHM`` overrides).

    An all_reduce over TCP links (``link == "tcp"``) takes the cheapest by the cost model
    (``costmodel``); shared-memory links and the other collectives keep the measured size rule.
    """
    forced = forced_algorithm()
    tcp = costmodel.tcp_link() if not forced and link == "tcp" else None
    return _rule(collective, nbytes, size, link, forced, tcp)


def _rule(
    collective: str, nbytes: int, size: int, link: str | None, forced: str | None, tcp: costmodel.Link | None
) -> str:
    if forced:
        return forced
    if collective == "all_reduce" and link == "tcp" and size > 1 and tcp is not None:
        lanes = len(_lanes(max(1, nbytes // 4), 4, size, lane_bytes=TCP_LANE_BYTES))
        return costmodel.choose_all_reduce(nbytes, size, tcp, lanes)
    power_of_two = not size & (size - 1)
    if nbytes <= SMALL_BYTES or (size == 2 and collective == "broadcast"):
        if size > costmodel.DIRECT_MAX_RANKS:  # (direct would connect every pair)
            if collective == "all_reduce":
                return "rdb"
            if collective in ("all_gather", "reduce_scatter"):
                return "ring"
            if collective == "broadcast":
                return "tree"  # (the root would connect every rank)
        return "direct"
    if collective == "all_reduce" and size > 2 and power_of_two:
        return "rhd"
    return "ring"


class Chooser:
    """``choose`` for one world: the tuning variables read once (at init), choices remembered
    (a collective in a training loop asks the same question every step)."""

    MEMO = 4096

    def __init__(self) -> None:
        self.forced = forced_algorithm()
        self.tcp = costmodel.tcp_link()
        self._memo: dict[tuple[str, int, int, str | None], str] = {}

    def __call__(self, collective: str, nbytes: int, size: int, link: str | None = None) -> str:
        key = (collective, nbytes, size, link)
        found = self._memo.get(key)
        if found is None:
            if len(self._memo) >= self.MEMO:
                self._memo.clear()
            found = self._memo[key] = _rule(collective, nbytes, size, link, self.forced, self.tcp)
        return found


def _choose_for(comm: Comm, collective: str, nbytes: int, size: int, link: str | None = None) -> str:
    """``choose`` through ``comm``'s world when it has one (``Comm.choose``), else from the
    environment now."""
    chooser = getattr(comm, "choose", None)
    if chooser is not None:
        return str(chooser(collective, nbytes, size, link))
    return choose(collective, nbytes, size, link)


def chose(comm: Comm, algorithm: str) -> str:
    """Tell ``comm`` which algorithm runs (the flight recorder shows it); return it."""
    if hasattr(comm, "algorithm"):
        setattr(comm, "algorithm", algorithm)  # noqa: B010 - not part of the Comm protocol
    return algorithm


async def wait_all(awaitables: Sequence[Awaitable[Any] | None]) -> list[Any]:
    pending = [a for a in awaitables if a is not None]
    if not pending:
        return []
    if len(pending) == 1:
        return [await pending[0]]
    return list(await asyncio.gather(*pending))


def _view(buf: memoryview, dtype: np.dtype[Any]) -> Array:
    return np.frombuffer(buf, dtype=dtype) if buf.nbytes else np.empty(0, dtype)


def _release(comm: Comm, buffers: list[memoryview]) -> None:
    for buffer in buffers:
        comm.release(buffer)


def link_kind(comm: Comm) -> str | None:
    """``"shm"`` or ``"tcp"``: what links ``comm``'s large payloads take (None: the transport
    does not say, as the in-memory one of unit tests)."""
    kind = getattr(comm, "link_kind", None)
    return str(kind()) if callable(kind) else None


def others(comm: Comm) -> list[int]:
    """The group ranks other than this one."""
    return [p for p in range(comm.size) if p != comm.rank]


def _lanes(
    size: int, itemsize: int, parts: int, min_lanes: int | None = None, lane_bytes: int | None = None
) -> list[slice]:
    """Slices of ``size`` elements for ``parts``-block lanes: blocks of at most ``lane_bytes``
    (default ``LANE_BYTES``), and at least ``MIN_LANES`` lanes (of blocks no smaller than
    ``MIN_LANE_BYTES``) to overlap."""
    itemsize = max(1, itemsize)
    cut = MIN_LANES if min_lanes is None else min_lanes
    most = LANE_BYTES if lane_bytes is None else lane_bytes
    block = min(most, max(MIN_LANE_BYTES, size * itemsize // (parts * cut)))
    per_lane = max(1, block // itemsize) * parts
    return [slice(i, min(i + per_lane, size)) for i in range(0, size, per_lane)] or [slice(0, 0)]


async def _run_lanes(count: int, lane: Callable[[int], Awaitable[None]]) -> None:
    """Run ``lane(0..count-1)``, at most ``LANES_IN_FLIGHT`` at a time, in order.

    The first lane to fail cancels the others, and all have stopped before this returns: no
    lane may still read a received buffer once the collective has ended.
    """
    if count == 1:
        await lane(0)
        return
    gate = asyncio.Semaphore(LANES_IN_FLIGHT)

    async def gated(i: int) -> None:
        async with gate:
            await lane(i)

    try:
        async with asyncio.TaskGroup() as lanes:
            for i in range(count):
                lanes.create_task(gated(i))
    except BaseExceptionGroup as failed:
        raise failed.exceptions[0] from None


# -- reductions ------------------------------------------------------------------------------
def recv_reduce(comm: Comm, peer: int, tag: int, src: Array, out: Array, ufunc: np.ufunc) -> Awaitable[None]:
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
    comm: Comm, receiving: Awaitable[memoryview], landing: Array, src: Array, out: Array, ufunc: np.ufunc
) -> None:
    got = await receiving
    ufunc(src, _view(got, out.dtype).reshape(out.shape), out=out)
    comm.release(got)
    comm.recycle(landing)  # (not on failure: the transport may still be writing into it)


def _combine_in_rank_order(
    comm: Comm, mine: Array, received: dict[int, Array], ufunc: np.ufunc, out: Array
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
    if comm.size > 1 and x.size:
        link = link_kind(comm)
        lane_bytes = TCP_LANE_BYTES if link == "tcp" else LANE_BYTES
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
        np.divide(x, comm.size, out=x)


async def _direct_all_reduce(comm: Comm, x: Array, ufunc: np.ufunc) -> None:
    peers = others(comm)
    recvs = [comm.recv_any(p, 0) for p in peers]
    await wait_all([comm.send(p, 0, x) for p in peers])
    got = await wait_all(recvs)
    received = {p: _view(buf, x.dtype) for p, buf in zip(peers, got, strict=True)}
    _combine_in_rank_order(comm, x, received, ufunc, x)
    _release(comm, got)


#: Tags of the fold into (and the copy back out of) the power-of-two core of recursive doubling.
_FOLD_IN, _FOLD_OUT = 1 << 20, (1 << 20) + 1


async def _recursive_doubling(comm: Comm, x: Array, ufunc: np.ufunc) -> None:
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


def _ring_schedule(comm: Comm) -> tuple[int, int, int, int]:
    n, r = comm.size, comm.rank
    return n, r, (r + 1) % n, (r - 1) % n


async def _ring_reduce_scatter_lane(
    comm: Comm, blocks: list[Array], ufunc: np.ufunc, out: Array | None, tag: int
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


async def _ring_all_reduce(comm: Comm, x: Array, ufunc: np.ufunc, lane_bytes: int = LANE_BYTES) -> None:
    n = comm.size
    lanes = [np.array_split(x[part], n) for part in _lanes(x.size, x.itemsize, n, lane_bytes=lane_bytes)]
    # every lane's final blocks land in place, however early they come
    gathering = [_post_all_gather(comm, blocks, 4 * n * i + 2 * n) for i, blocks in enumerate(lanes)]

    async def lane(i: int) -> None:
        await _ring_reduce_scatter_lane(comm, lanes[i], ufunc, None, 4 * n * i)
        await _ring_all_gather_lane(comm, lanes[i], 4 * n * i + 2 * n, gathering[i])

    await _run_lanes(len(lanes), lane)


async def _halving_doubling_lane(comm: Comm, seg: Array, ufunc: np.ufunc, tag: int) -> None:
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
    comm: Comm, x: Array, ufunc: np.ufunc, lane_bytes: int = LANE_BYTES
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
    if n > 1 and x.size:
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
        np.divide(x, n, out=x)


async def _ring_reduce(comm: Comm, x: Array, dst: int, ufunc: np.ufunc) -> None:
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
    elif out.size:
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
        np.divide(out, n, out=out)


# -- data movement ---------------------------------------------------------------------------
async def broadcast(comm: Comm, x: Array, src: int, algorithm: str | None = None) -> None:
    """Copy ``src``'s ``x`` into every rank's ``x``."""
    n, r = comm.size, comm.rank
    if n == 1 or not x.size:
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
