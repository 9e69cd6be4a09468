"""Tensor collectives: argument checks and fingerprints, then a hand-off to the group.

Each function checks its arrays before the collective takes a sequence number (a bad call
fails on its own rank only), builds the fingerprint every frame of the collective carries, and
runs the matching algorithm as the group's next collective.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np

from . import algorithms as algo
from .arrays import ReduceOp, as_array, as_bytes, ufunc_for
from .errors import InvalidArgumentError
from .group import ProcessGroup
from .registry import named_rank, on_group, root_rank, seconds
from .validate import index


def _fp(name: str, x: np.ndarray[Any, Any], *extra: Any) -> str:
    return "|".join([name, x.dtype.str, str(x.size), *map(str, extra)])


@on_group()
async def barrier(group: Any = None, timeout: float | None = None) -> None:
    """Wait until every rank of ``group`` reaches the barrier."""
    g: ProcessGroup = group
    limit = None if timeout is None else seconds(timeout, g.timeout)
    flag = np.zeros(1, np.uint8)
    await g.run("barrier", "barrier", lambda c: algo.all_reduce(c, flag, ReduceOp.MAX), limit)


def _reduction(tensor: Any, op: Any, what: str = "tensor") -> tuple[np.ndarray[Any, Any], ReduceOp]:
    """The array and op of a reduction, checked before the collective takes a sequence number."""
    x = as_array(tensor, what=what)
    rop = ReduceOp.parse(op)
    ufunc_for(rop, x.dtype)
    return x, rop


@on_group()
async def all_reduce(
    tensor: Any, op: Any = ReduceOp.SUM, group: Any = None, *, algorithm: str | None = None
) -> None:
    """Reduce ``tensor`` across the group, in place, with ``op``."""
    g: ProcessGroup = group
    x, rop = _reduction(tensor, op)
    algo.check_algorithm(algorithm)
    await g.run("all_reduce", _fp("all_reduce", x, rop.name), lambda c: algo.all_reduce(c, x, rop, algorithm))


@on_group()
async def reduce(
    tensor: Any,
    dst: int | None = None,
    op: Any = ReduceOp.SUM,
    group: Any = None,
    *,
    algorithm: str | None = None,
    group_dst: int | None = None,
) -> None:
    """Reduce into ``tensor`` on global rank ``dst`` (or ``group_dst``, its rank in ``group``)."""
    g: ProcessGroup = group
    dst = root_rank(g, dst, group_dst, "dst", "reduce")
    x, rop = _reduction(tensor, op)
    algo.check_algorithm(algorithm)
    root = g.group_rank(index(dst, "dst"), "dst")
    await g.run("reduce", _fp("reduce", x, rop.name, dst), lambda c: algo.reduce(c, x, root, rop, algorithm))


@on_group()
async def broadcast(
    tensor: Any,
    src: int | None = None,
    group: Any = None,
    *,
    algorithm: str | None = None,
    group_src: int | None = None,
) -> None:
    """Copy ``tensor`` of global rank ``src`` (or ``group_src``) into every rank's ``tensor``."""
    g: ProcessGroup = group
    src = root_rank(g, src, group_src, "src", "broadcast")
    x = as_array(tensor)
    algo.check_algorithm(algorithm)
    root = g.group_rank(index(src, "src"), "src")
    await g.run("broadcast", _fp("broadcast", x, src), lambda c: algo.broadcast(c, x, root, algorithm))


def _blocks(
    arrays: Sequence[Any], size: int, like: np.ndarray[Any, Any], what: str
) -> list[np.ndarray[Any, Any]]:
    if len(arrays) != size:
        raise InvalidArgumentError(f"{what} must hold {size} tensors (one per rank), got {len(arrays)}")
    out = [as_array(a, what=what) for a in arrays]
    for a in out:
        if a.dtype != like.dtype or a.size != like.size:
            raise InvalidArgumentError(
                f"every tensor in {what} must be {like.dtype} x {like.size}, got {a.dtype} x {a.size}"
            )
    return out


@on_group()
async def all_gather(tensor_list: list[Any], tensor: Any, group: Any = None) -> None:
    """Fill ``tensor_list[i]`` with rank ``i``'s ``tensor``."""
    g: ProcessGroup = group
    x = as_array(tensor, writable=False)
    outs = _blocks(tensor_list, g.size, x, "tensor_list")
    if outs[g.rank].ctypes.data != x.ctypes.data:
        np.copyto(outs[g.rank], x)
    blocks = [as_bytes(o) for o in outs]
    await g.run("all_gather", _fp("all_gather", x), lambda c: algo.all_gather(c, blocks))


@on_group()
async def all_gather_into_tensor(output_tensor: Any, input_tensor: Any, group: Any = None) -> None:
    """Concatenate every rank's ``input_tensor`` into ``output_tensor`` (rank order)."""
    g: ProcessGroup = group
    x = as_array(input_tensor, writable=False)
    out = as_array(output_tensor, what="output_tensor")
    if out.dtype != x.dtype or out.size != x.size * g.size:
        raise InvalidArgumentError(
            f"output_tensor must be {x.dtype} x {x.size * g.size}, got {out.dtype} x {out.size}"
        )
    blocks = np.split(as_bytes(out), g.size) if out.size else [as_bytes(out)] * g.size
    mine = out[g.rank * x.size : (g.rank + 1) * x.size]
    if x.size and mine.ctypes.data != x.ctypes.data:
        np.copyto(mine, x)
    await g.run("all_gather", _fp("all_gather", x), lambda c: algo.all_gather(c, blocks))


@on_group()
async def gather(
    tensor: Any,
    gather_list: list[Any] | None = None,
    dst: int | None = None,
    group: Any = None,
    *,
    group_dst: int | None = None,
) -> None:
    """On ``dst`` (global rank 0 unless ``dst`` or ``group_dst`` names it), fill
    ``gather_list[i]`` with rank ``i``'s ``tensor``."""
    g: ProcessGroup = group
    dst = named_rank(g, dst, group_dst, "dst", default=0)
    x = as_array(tensor, writable=False)
    root = g.group_rank(index(dst, "dst"), "dst")
    outs = None
    if g.rank == root:
        if gather_list is None:
            raise InvalidArgumentError("gather_list is required on the dst rank")
        outs = _blocks(gather_list, g.size, x, "gather_list")
    await g.run("gather", _fp("gather", x, dst), lambda c: algo.gather(c, x, outs, root))


@on_group()
async def scatter(
    tensor: Any,
    scatter_list: list[Any] | None = None,
    src: int | None = None,
    group: Any = None,
    *,
    group_src: int | None = None,
) -> None:
    """Rank ``i`` receives ``scatter_list[i]`` of ``src`` (global rank 0 unless ``src`` or
    ``group_src`` names it) into ``tensor``."""
    g: ProcessGroup = group
    src = named_rank(g, src, group_src, "src", default=0)
    out = as_array(tensor)
    root = g.group_rank(index(src, "src"), "src")
    ins = None
    if g.rank == root:
        if scatter_list is None:
            raise InvalidArgumentError("scatter_list is required on the src rank")
        ins = [as_array(a, writable=False, what="scatter_list") for a in scatter_list]
        _blocks(ins, g.size, out, "scatter_list")
    await g.run("scatter", _fp("scatter", out, src), lambda c: algo.scatter(c, out, ins, root))


@on_group()
async def reduce_scatter(
    output: Any, input_list: list[Any], op: Any = ReduceOp.SUM, group: Any = None
) -> None:
    """``output`` on rank ``i`` = reduction over ranks of their ``input_list[i]``."""
    g: ProcessGroup = group
    out, rop = _reduction(output, op, "output")
    ins = _blocks([as_array(a, writable=False) for a in input_list], g.size, out, "input_list")
    await g.run(
        "reduce_scatter",
        _fp("reduce_scatter", out, rop.name),
        lambda c: algo.reduce_scatter(c, out, ins, rop),
    )


@on_group()
async def reduce_scatter_tensor(output: Any, input: Any, op: Any = ReduceOp.SUM, group: Any = None) -> None:
    """``output`` on rank ``i`` = reduction of block ``i`` of every rank's ``input``."""
    g: ProcessGroup = group
    out, rop = _reduction(output, op, "output")
    x = as_array(input, writable=False, what="input")
    if x.dtype != out.dtype or x.size != out.size * g.size:
        raise InvalidArgumentError(
            f"input must be {out.dtype} x {out.size * g.size}, got {x.dtype} x {x.size}"
        )
    ins = [x[i * out.size : (i + 1) * out.size] for i in range(g.size)]
    await g.run(
        "reduce_scatter",
        _fp("reduce_scatter", out, rop.name),
        lambda c: algo.reduce_scatter(c, out, ins, rop),
    )


@on_group()
async def all_to_all(output_tensor_list: list[Any], input_tensor_list: list[Any], group: Any = None) -> None:
    """``output_tensor_list[j]`` on rank ``i`` = ``input_tensor_list[i]`` of rank ``j``."""
    g: ProcessGroup = group
    if len(input_tensor_list) != g.size or len(output_tensor_list) != g.size:
        raise InvalidArgumentError(f"all_to_all needs {g.size} input and output tensors")
    ins = [as_array(a, writable=False, what="input_tensor_list") for a in input_tensor_list]
    outs = [as_array(a, what="output_tensor_list") for a in output_tensor_list]
    for i, (a, b) in enumerate(zip(ins, outs, strict=True)):
        if a.dtype != ins[0].dtype or b.dtype != ins[0].dtype:
            raise InvalidArgumentError(f"all_to_all tensors must share one dtype (tensor {i} differs)")
    ins = _apart_from(ins, outs)
    fp = "|".join(["all_to_all", ins[0].dtype.str, str(g.size)])
    await g.run("all_to_all", fp, lambda c: algo.all_to_all(c, outs, ins))


def _span(a: np.ndarray[Any, Any]) -> tuple[int, int]:
    """The bytes ``a`` may touch: [first, last) addresses (bounds, as ``may_share_memory``)."""
    utils: Any = getattr(np.lib, "array_utils", np)  # (numpy 2 moved it)
    low, high = utils.byte_bounds(a)
    return int(low), int(high)


def _apart_from(
    ins: list[np.ndarray[Any, Any]], outs: list[np.ndarray[Any, Any]]
) -> list[np.ndarray[Any, Any]]:
    """``ins``, with a copy of each that shares memory with an output (``all_to_all(ts, ts)``:
    a piece would be received over one still to be sent). O(n log n) in the group size."""
    spans = sorted(_span(o) for o in outs if o.size)
    starts = [low for low, _ in spans]
    reach = list(itertools.accumulate((high for _, high in spans), max))
    apart = []
    for a in ins:
        low, high = _span(a)
        before = bisect.bisect_left(starts, high)  # outputs starting before this input ends
        overlaps = a.size > 0 and before > 0 and reach[before - 1] > low
        apart.append(a.copy() if overlaps else a)
    return apart


def _split(
    array: np.ndarray[Any, Any], shape: tuple[int, ...], sizes: Sequence[int] | None, n: int, what: str
) -> list[np.ndarray[Any, Any]]:
    rows = shape[0] if shape else array.size
    row = array.size // rows if rows else 0
    if sizes is None:
        if rows % n:
            raise InvalidArgumentError(f"{what} has {rows} rows, not divisible by the group size {n}")
        sizes = [rows // n] * n
    if len(sizes) != n or sum(sizes) != rows:
        raise InvalidArgumentError(f"{what} split sizes {list(sizes)} must be {n} numbers summing to {rows}")
    bounds = np.cumsum([0, *sizes]) * row
    return [array[bounds[i] : bounds[i + 1]] for i in range(n)]


@on_group()
async def all_to_all_single(
    output: Any,
    input: Any,
    output_split_sizes: Sequence[int] | None = None,
    input_split_sizes: Sequence[int] | None = None,
    group: Any = None,
) -> None:
    """Split ``input`` by rows, send piece ``j`` to rank ``j``, gather the pieces into ``output``."""
    g: ProcessGroup = group
    out = as_array(output, what="output")
    x = as_array(input, writable=False, what="input")
    ins = _split(x, tuple(np.shape(input)), input_split_sizes, g.size, "input")
    outs = _split(out, tuple(np.shape(output)), output_split_sizes, g.size, "output")
    if out.size and x.size and np.may_share_memory(out, x):  # (in place: send from a copy)
        ins = _split(x.copy(), tuple(np.shape(input)), input_split_sizes, g.size, "input")
    fp = "|".join(["all_to_all_single", x.dtype.str, str(g.size)])
    await g.run("all_to_all_single", fp, lambda c: algo.all_to_all(c, outs, ins))
