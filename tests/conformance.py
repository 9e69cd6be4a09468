"""Rank code every transport must run the same way (inproc, tcp, tcp + shared memory).

Each function is ``async (rank, world_size, *args) -> JSON value`` and runs with the default
group initialised; ``tests/test_conformance.py`` runs it over each transport.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np

import arendez as dist


def contribution(rank: int, size: int, dtype: str, salt: int = 0) -> np.ndarray[Any, Any]:
    """Deterministic per-rank data, small enough that sums and products stay exact."""
    rng = np.random.default_rng(1000 * rank + 7 * salt + size)
    dt = np.dtype(dtype)
    if dt.kind == "f":
        return rng.integers(-8, 9, size).astype(dt) / 4
    if dt.kind == "b":
        return rng.integers(0, 2, size).astype(bool)
    if dt.kind == "u":
        return rng.integers(0, 4, size).astype(dt)
    return rng.integers(-4, 5, size).astype(dt)


REFERENCE = {
    "SUM": np.add,
    "AVG": np.add,
    "PRODUCT": np.multiply,
    "MIN": np.minimum,
    "MAX": np.maximum,
    "BAND": np.bitwise_and,
    "BOR": np.bitwise_or,
    "BXOR": np.bitwise_xor,
}


def reduced(op: str, parts: list[np.ndarray[Any, Any]]) -> np.ndarray[Any, Any]:
    acc = parts[0].copy()
    for p in parts[1:]:
        REFERENCE[op](acc, p, out=acc)
    if op == "AVG":
        acc = acc / len(parts)
    return acc


def _check(got: Any, want: Any, what: str) -> None:
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=what)


async def every_collective_once(
    rank: int, ws: int, dtype: str, size: int, group: Any, ranks: list[int]
) -> int:
    """Run each collective once on ``group`` (members ``ranks``) and check it; return how many."""
    me = ranks.index(rank)
    n = len(ranks)
    dt = np.dtype(dtype)
    mine = contribution(rank, size, dtype, 1)
    every = [contribution(r, size, dtype, 1) for r in ranks]
    what = f"{dtype} x {size} on ranks {ranks}"
    sum_op = "BOR" if dt.kind == "b" else "SUM"
    op = getattr(dist.ReduceOp, sum_op)

    x = mine.copy()
    await dist.all_reduce(x, op=op, group=group)
    _check(x, reduced(sum_op, every), f"all_reduce {what}")

    root = ranks[-1]
    x = mine.copy()
    await dist.broadcast(x, src=root, group=group)
    _check(x, every[-1], f"broadcast {what}")

    x = mine.copy()
    await dist.reduce(x, dst=root, op=op, group=group)
    if rank == root:
        _check(x, reduced(sum_op, every), f"reduce {what}")

    outs = [np.empty(size, dt) for _ in ranks]
    await dist.all_gather(outs, mine, group=group)
    for r, o in zip(ranks, outs, strict=True):
        _check(o, contribution(r, size, dtype, 1), f"all_gather {what}")

    flat = np.empty(size * n, dt)
    await dist.all_gather_into_tensor(flat, mine, group=group)
    _check(flat, np.concatenate(every) if size else flat, f"all_gather_into_tensor {what}")

    gl = [np.empty(size, dt) for _ in ranks] if rank == root else None
    await dist.gather(mine, gl, dst=root, group=group)
    if gl is not None:
        for r, o in zip(ranks, gl, strict=True):
            _check(o, contribution(r, size, dtype, 1), f"gather {what}")

    pieces = [contribution(root, size, dtype, 10 + i) for i in range(n)]
    out = np.empty(size, dt)
    await dist.scatter(out, pieces if rank == root else None, src=root, group=group)
    _check(out, pieces[me], f"scatter {what}")

    inputs = [contribution(rank, size, dtype, 20 + i) for i in range(n)]
    out = np.empty(size, dt)
    await dist.reduce_scatter(out, inputs, op=op, group=group)
    _check(
        out, reduced(sum_op, [contribution(r, size, dtype, 20 + me) for r in ranks]), f"reduce_scatter {what}"
    )
    _check(inputs[0], contribution(rank, size, dtype, 20), f"reduce_scatter left its input alone {what}")

    big = np.concatenate(inputs) if size else np.empty(0, dt)
    out = np.empty(size, dt)
    await dist.reduce_scatter_tensor(out, big, op=op, group=group)
    _check(out, reduced(sum_op, [contribution(r, size, dtype, 20 + me) for r in ranks]), f"rs_tensor {what}")

    ins = [contribution(rank, size, dtype, 30 + i) for i in range(n)]
    outs = [np.empty(size, dt) for _ in ranks]
    await dist.all_to_all(outs, ins, group=group)
    for i, r in enumerate(ranks):
        _check(outs[i], contribution(r, size, dtype, 30 + me), f"all_to_all {what}")

    # uneven splits: rank r sends (j + 1) rows to rank j
    send_splits = [j + 1 for j in range(n)]
    recv_splits = [me + 1] * n
    src = np.concatenate([np.full((j + 1) * 2, rank * 10 + j, dt) for j in range(n)]).reshape(-1, 2)
    dst = np.empty((sum(recv_splits), 2), dt)
    await dist.all_to_all_single(dst, src, recv_splits, send_splits, group=group)
    want = np.concatenate([np.full((me + 1) * 2, r * 10 + me, dt) for r in ranks]).reshape(-1, 2)
    _check(dst, want, f"all_to_all_single {what}")

    objs: list[Any] = [None] * n
    await dist.all_gather_object(objs, {"rank": rank, "size": size, "tag": [1, "x"]}, group=group)
    assert objs == [{"rank": r, "size": size, "tag": [1, "x"]} for r in ranks], objs

    lst: list[Any] = [rank, "from", rank] if rank == root else [None, None, None]
    await dist.broadcast_object_list(lst, src=root, group=group)
    assert lst == [root, "from", root], lst

    gathered: list[Any] | None = [None] * n if rank == root else None
    await dist.gather_object(f"hello from {rank}", gathered, dst=root, group=group)
    if gathered is not None:
        assert gathered == [f"hello from {r}" for r in ranks], gathered

    slot: list[Any] = [None]
    await dist.scatter_object_list(
        slot, [{"to": r} for r in ranks] if rank == root else None, src=root, group=group
    )
    assert slot == [{"to": rank}], slot

    await dist.barrier(group=group)
    return 16


async def every_collective(rank: int, ws: int, dtypes: list[str], sizes: list[int]) -> int:
    """Every collective x dtypes x sizes on the default group and on a subgroup of all but
    rank 0; return how many were checked."""
    checked = 0
    sub_ranks = list(range(1, ws))
    sub = await dist.new_group(sub_ranks)
    for dtype in dtypes:
        for size in sizes:
            checked += await every_collective_once(rank, ws, dtype, size, None, list(range(ws)))
            if rank in sub_ranks:
                checked += await every_collective_once(rank, ws, dtype, size, sub, sub_ranks)
            else:
                assert sub is dist.GroupMember.NON_GROUP_MEMBER
    return checked


async def destroy_in_flight(rank: int, ws: int, drain_timeout: float) -> dict[str, Any]:
    """Rank 0 starts three all_reduces; rank 1 joins only the first two, so destroy drains
    those and cancels the third."""
    arrays = [np.full(1000, rank + 1.0, np.float32) for _ in range(3)]
    if rank == 0:
        tasks = [asyncio.create_task(dist.all_reduce(a)) for a in arrays]
        await asyncio.sleep(0)
        started = time.monotonic()
        await dist.destroy_process_group(timeout=drain_timeout)
        elapsed = time.monotonic() - started
        outcomes = []
        for t in tasks:
            try:
                await t
                outcomes.append("ok")
            except dist.GroupDestroyedError as exc:
                outcomes.append(f"GroupDestroyedError: {exc}")
        return {
            "elapsed": elapsed,
            "outcomes": outcomes,
            "sums": [float(a[0]) for a in arrays],
            "initialized": dist.is_initialized(),
        }
    await dist.all_reduce(arrays[0])
    await dist.all_reduce(arrays[1])
    await asyncio.sleep(drain_timeout + 0.5)
    await dist.destroy_process_group()
    return {"sums": [float(a[0]) for a in arrays[:2]]}


async def mismatch(rank: int, ws: int, kind: str) -> str:
    """Ranks start different collectives at the same sequence number; the next one works."""
    x = np.ones(100 if kind != "count" or rank == 0 else 101, np.float32)
    if kind == "dtype" and rank == 1:
        x = np.ones(100, np.float64)
    try:
        if kind == "op" and rank == 1:
            await dist.broadcast(x, src=0)
        else:
            await dist.all_reduce(x)
        outcome = "no error"
    except dist.CollectiveMismatchError as exc:
        outcome = f"CollectiveMismatchError: {exc}"
    y = np.ones(4, np.float32)  # the group stays usable for the next collective
    await dist.all_reduce(y)
    return outcome + f" | next sum {y[0]:g}"


async def broadcast_roots_disagree(rank: int, ws: int) -> list[str]:
    """The last rank broadcasts from rank 1, the others from rank 0: rank 0, a root, has sent
    and is done before the last rank refuses its data. It must not go on unaware: the first
    collective it has not started when it hears fails on every rank, and the group goes on."""
    outcomes = []
    for step in range(4):
        x = np.full(4, rank + 1.0, np.float32)
        try:
            if step == 0:
                await dist.broadcast(x, src=1 if rank == ws - 1 else 0)
            else:
                await dist.all_reduce(x)
            outcomes.append(f"{x[0]:g}")
        except dist.CollectiveMismatchError as exc:
            outcomes.append(f"CollectiveMismatchError: {exc}")
    return outcomes


async def empty_parts(rank: int, ws: int) -> list[str]:
    """Collectives of empty arrays on every rank end together; one rank's empty part against
    the others' 100 elements is a mismatch on every rank (not a wait for the timeout)."""
    nothing = np.ones(0, np.float32)
    await dist.all_reduce(nothing)
    await dist.broadcast(nothing, src=ws - 1)
    await dist.reduce(nothing, dst=0)
    await dist.reduce_scatter_tensor(nothing, nothing)
    outcomes = []
    for name in ("all_reduce", "broadcast", "reduce_scatter_tensor"):
        x = np.ones(0 if rank == 0 else 100 * ws, np.float32)
        try:
            if name == "all_reduce":
                await dist.all_reduce(x)
            elif name == "broadcast":  # (from the empty rank: every other rank receives from it)
                await dist.broadcast(x, src=0)
            else:
                await dist.reduce_scatter_tensor(x[: x.size // ws], x)
            outcomes.append("no error")
        except dist.CollectiveMismatchError as exc:
            outcomes.append(f"CollectiveMismatchError: {exc}")
    y = np.ones(4, np.float32)  # the group stays usable
    await dist.all_reduce(y)
    return [*outcomes, f"next sum {y[0]:g}"]


async def peer_lost(rank: int, ws: int) -> str:
    """The last rank drops its links without a goodbye (as a crash would) once its barrier is
    done; the others fail (in the barrier, if its last frames were still unsent, or in the
    all_reduce after it) naming it."""
    if rank == ws - 1:
        await dist.barrier()
        mesh = dist.current_world().mesh
        assert mesh is not None
        mesh.abort()
        return "dropped"
    try:
        await dist.barrier()
        await dist.all_reduce(np.ones(10, np.float32))
        return "no error"
    except dist.RankFailedError as exc:
        return f"RankFailedError {exc.rank}"


async def destroy_beside_a_stuck_peer(rank: int, ws: int, marks: str, budget: float) -> float:
    """The last rank is stopped (SIGSTOP) by the test; the others then destroy with ``budget``
    seconds and return how long destroy took."""
    from pathlib import Path

    await dist.barrier()
    if rank == ws - 1:
        Path(marks, "ready").write_text("1")
        await asyncio.sleep(60)  # stopped, then killed by the test
        return -1.0
    deadline = time.monotonic() + 20
    while not Path(marks, "stopped").exists():
        assert time.monotonic() < deadline, "the test never stopped the last rank"
        await asyncio.sleep(0.01)
    started = time.monotonic()
    await dist.destroy_process_group(timeout=budget)
    return time.monotonic() - started
