"""Object collectives: values ``objcodec`` carries (never pickle), sent as variable-size bytes.

A rank whose object cannot be encoded still takes its part, sending a failure in its place, so
every rank the bytes reach raises ``ObjectSerializationError`` naming that rank (no peer waits
for its timeout, and none blames a mismatch).
"""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np

from . import objcodec
from .algorithms import Comm, binomial_tree, others, tree_broadcast, wait_all
from .costmodel import DIRECT_MAX_RANKS
from .errors import InvalidArgumentError
from .group import ProcessGroup
from .registry import named_rank, on_group
from .validate import index


def _blocks(obj: Any) -> bytes:
    """The internal framing of byte blocks (a tree's gathered parts): plain msgpack."""
    packed: bytes = msgpack.packb(obj, use_bin_type=True)
    return packed


def _unblocks(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


@on_group()
async def all_gather_object(object_list: list[Any], obj: Any, group: Any = None) -> None:
    """Fill ``object_list[i]`` with rank ``i``'s ``obj`` (entries past the group's size are
    left as they are, as torch does)."""
    g: ProcessGroup = group
    if len(object_list) < g.size:
        raise InvalidArgumentError(f"object_list must have {g.size} entries, got {len(object_list)}")
    mine, failed = objcodec.encode_or_note(obj)
    parts = await g.run("all_gather_object", "all_gather_object", lambda c: _all_gather_bytes(c, mine))
    object_list[: g.size] = objcodec.decode_all(parts, g.ranks, "all_gather_object", failed)


@on_group()
async def broadcast_object_list(
    object_list: list[Any], src: int | None = None, group: Any = None, *, group_src: int | None = None
) -> None:
    """Replace ``object_list``'s entries with those of global rank ``src`` (or ``group_src``;
    global rank 0 if neither)."""
    g: ProcessGroup = group
    src = named_rank(g, src, group_src, "src", default=0)
    root = g.group_rank(index(src, "src"), "src")
    mine, failed = objcodec.encode_or_note(list(object_list)) if g.rank == root else (None, None)
    fp = f"broadcast_object_list|{src}|{len(object_list)}"
    data = await g.run("broadcast_object_list", fp, lambda c: _broadcast_bytes(c, mine, root))
    object_list[:] = objcodec.raise_if_note(
        objcodec.decode(data), g.ranks[root], "broadcast_object_list", failed
    )


@on_group()
async def gather_object(
    obj: Any,
    object_gather_list: list[Any] | None = None,
    dst: int | None = None,
    group: Any = None,
    *,
    group_dst: int | None = None,
) -> None:
    """On ``dst`` (or ``group_dst``; global rank 0 if neither), fill ``object_gather_list[i]``
    with rank ``i``'s ``obj``."""
    g: ProcessGroup = group
    dst = named_rank(g, dst, group_dst, "dst", default=0)
    root = g.group_rank(index(dst, "dst"), "dst")
    if g.rank == root and (object_gather_list is None or len(object_gather_list) < g.size):
        raise InvalidArgumentError(f"object_gather_list on the dst rank must have {g.size} entries")
    mine, failed = objcodec.encode_or_note(obj)
    parts = await g.run("gather_object", f"gather_object|{dst}", lambda c: _gather_bytes(c, mine, root))
    if parts is not None and object_gather_list is not None:
        object_gather_list[: g.size] = objcodec.decode_all(parts, g.ranks, "gather_object", failed)
    elif failed is not None:  # (only the root hears of it: as with any gather, the rest go on)
        raise objcodec.own_error(g.ranks[g.rank], "gather_object", failed) from failed


@on_group()
async def scatter_object_list(
    scatter_object_output_list: list[Any],
    scatter_object_input_list: list[Any] | None = None,
    src: int | None = None,
    group: Any = None,
    *,
    group_src: int | None = None,
) -> None:
    """Rank ``i`` gets ``scatter_object_input_list[i]`` of ``src`` (or ``group_src``; global rank
    0 if neither) in its output list's slot 0."""
    g: ProcessGroup = group
    src = named_rank(g, src, group_src, "src", default=0)
    root = g.group_rank(index(src, "src"), "src")
    parts, failed = None, None
    if g.rank == root:
        if scatter_object_input_list is None or len(scatter_object_input_list) != g.size:
            raise InvalidArgumentError(
                f"scatter_object_input_list on the src rank must have {g.size} entries"
            )
        parts, failed = objcodec.encode_each(scatter_object_input_list)  # (one bad: it fails everywhere)
    if not scatter_object_output_list:
        raise InvalidArgumentError("scatter_object_output_list must have at least one entry")

    fp = f"scatter_object_list|{src}"
    data = await g.run("scatter_object_list", fp, lambda c: _scatter_bytes(c, parts, root))
    mine = objcodec.decode(data)
    scatter_object_output_list[0] = objcodec.raise_if_note(mine, g.ranks[root], "scatter_object_list", failed)


# -- variable-size byte messages --------------------------------------------------------------
# Up to DIRECT_MAX_RANKS every rank talks to every other in one round; past it, binomial trees
# (ranks at distance 2^k: O(log n) peers each, the neighbours init connects), so an object
# collective at scale does not open every pair.


def _tree(comm: Comm) -> bool:
    return comm.size > DIRECT_MAX_RANKS


async def _tree_gather(comm: Comm, mine: bytes, root: int) -> list[bytes] | None:
    """Every rank's bytes at ``root`` (None elsewhere): each rank passes its subtree's up."""
    parent, children = binomial_tree(comm, root)
    arrivals = [comm.recv_any(child, 0) for child in children]
    blocks: dict[int, bytes] = {comm.rank: mine}
    for got in await wait_all(arrivals):
        blocks.update(_unblocks(bytes(got)))
    if parent is not None:
        await wait_all([comm.send(parent, 0, np.frombuffer(_blocks(blocks), np.uint8))])
        return None
    return [blocks[p] for p in range(comm.size)]


async def _tree_broadcast_bytes(comm: Comm, mine: bytes | None, root: int) -> bytes:
    data = np.frombuffer(mine if mine is not None else b"", np.uint8)
    got = await tree_broadcast(comm, data, root, lambda peer: comm.recv_any(peer, 1), tag=1)
    if got is None:  # (the root)
        assert mine is not None
        return mine
    return bytes(got)


async def _all_gather_bytes(comm: Comm, mine: bytes) -> list[bytes]:
    if _tree(comm):  # gather at rank 0, then a broadcast of all of them
        gathered = await _tree_gather(comm, mine, 0)
        every = await _tree_broadcast_bytes(comm, _blocks(gathered) if gathered is not None else None, 0)
        return gathered if gathered is not None else list(_unblocks(every))
    peers = others(comm)
    recvs = [comm.recv_any(p, 0) for p in peers]
    data = np.frombuffer(mine, np.uint8)
    await wait_all([comm.send(p, 0, data) for p in peers])
    got = await wait_all(recvs)
    out = [b""] * comm.size
    out[comm.rank] = mine
    for p, buf in zip(peers, got, strict=True):
        out[p] = bytes(buf)
    return out


async def _broadcast_bytes(comm: Comm, mine: bytes | None, src: int) -> bytes:
    if _tree(comm):
        return await _tree_broadcast_bytes(comm, mine, src)
    if comm.rank == src:
        assert mine is not None
        data = np.frombuffer(mine, np.uint8)
        await wait_all([comm.send(p, 0, data) for p in others(comm)])
        return mine
    return bytes(await comm.recv_any(src, 0))


async def _gather_bytes(comm: Comm, mine: bytes, dst: int) -> list[bytes] | None:
    if _tree(comm):
        return await _tree_gather(comm, mine, dst)
    if comm.rank != dst:
        await wait_all([comm.send(dst, 0, np.frombuffer(mine, np.uint8))])
        return None
    peers = others(comm)
    got = await wait_all([comm.recv_any(p, 0) for p in peers])
    out = [b""] * comm.size
    out[dst] = mine
    for p, buf in zip(peers, got, strict=True):
        out[p] = bytes(buf)
    return out


async def _scatter_bytes(comm: Comm, parts: list[bytes] | None, src: int) -> bytes:
    if comm.rank != src:
        return bytes(await comm.recv_any(src, 0))
    assert parts is not None
    await wait_all([comm.send(p, 0, np.frombuffer(parts[p], np.uint8)) for p in others(comm)])
    return parts[src]
