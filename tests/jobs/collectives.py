"""Collectives and point-to-point between rank processes, checked against numpy.

Each function is one rank's code: ``(rank, world_size, url, *args) -> JSON value``; it joins
and destroys by itself. ``tests.harness.run_ranks`` runs it as rank processes.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np

import arendez as dist
from tests.conformance import contribution, reduced
from tests.jobs import join


async def all_reduce_matrix(
    rank: int, ws: int, url: str, dtypes: list[str], sizes: list[int], ops: list[str]
) -> int:
    """all_reduce every (dtype, size, op); assert against numpy; return the number checked."""
    await join(url, ws, rank)
    checked = 0
    for dtype in dtypes:
        for size in sizes:
            for op in ops:
                kind = np.dtype(dtype).kind
                if (op.startswith("B") and kind not in "iub") or (op == "AVG" and kind != "f"):
                    continue
                if kind == "b" and op in ("SUM", "PRODUCT", "AVG"):
                    continue
                x = contribution(rank, size, dtype, checked)
                await dist.all_reduce(x, op=getattr(dist.ReduceOp, op))
                want = reduced(op, [contribution(r, size, dtype, checked) for r in range(ws)])
                np.testing.assert_array_equal(x, want.astype(x.dtype), err_msg=f"{dtype} {size} {op}")
                checked += 1
    await dist.destroy_process_group()
    return checked


async def overflowing_reductions(rank: int, ws: int, url: str, sizes: list[int]) -> list[str]:
    """Float sums and products that overflow (to inf; nan for a complex average), with numpy's
    warnings raised as errors: what each gave, and the rank's numpy error state after (its
    own, untouched)."""
    import warnings

    await join(url, ws, rank)
    seen = []
    np.seterr(over="raise")  # the rank's own setting: the library must neither trip nor change it
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for dtype, big in (("float16", 6e4), ("float32", 3e38), ("complex64", 3e38)):
            for size in sizes:
                for op in (dist.ReduceOp.SUM, dist.ReduceOp.PRODUCT, dist.ReduceOp.AVG):
                    x = np.full(size, big, dtype)
                    await dist.all_reduce(x, op=op)
                    seen.append(f"{dtype} {size} {op.name} {not np.isfinite(x).any()}")
    seen.append(f"over={np.geterr()['over']}")
    await dist.destroy_process_group()
    return seen


async def steady_all_reduce(rank: int, ws: int, url: str, rounds: int, size: int) -> float:
    """``rounds`` all_reduces, each checked; returns the last sum."""
    await join(url, ws, rank)
    total = 0.0
    for i in range(rounds):
        x = np.full(size, float(rank + i), np.float64)
        await dist.all_reduce(x)
        want = sum(r + i for r in range(ws))
        assert np.all(x == want), (i, x[:4], want)
        total = float(x[0])
    await dist.destroy_process_group()
    return total


async def point_to_point(rank: int, ws: int, url: str, size: int) -> list[int]:
    """Ring of send/recv, then every rank sends to rank 0, which receives from any source."""
    await join(url, ws, rank)
    right, left = (rank + 1) % ws, (rank - 1) % ws
    out = np.empty(size, np.float32)
    send = asyncio.create_task(dist.send(np.full(size, rank, np.float32), right, tag=5))
    sender = await dist.recv(out, left, tag=5)
    await send
    assert sender == left and np.all(out == left)
    senders = []
    if rank == 0:
        for _ in range(ws - 1):
            buf = np.empty(3, np.int64)
            who = await dist.recv(buf, None, tag=9)
            assert np.all(buf == who * 100), (who, buf)
            senders.append(who)
    else:
        await dist.send(np.full(3, rank * 100, np.int64), 0, tag=9)
    await dist.barrier()
    await dist.destroy_process_group()
    return sorted(senders)


async def overlapping(rank: int, ws: int, url: str, count: int) -> list[float]:
    """``count`` collectives of mixed kinds and sizes started at once with asyncio.gather."""
    await join(url, ws, rank)
    arrays = [np.full(10 ** (i % 6), float(rank + i), np.float64) for i in range(count)]
    coros = []
    for i, a in enumerate(arrays):
        if i % 3 == 2:
            coros.append(dist.broadcast(a, src=i % ws))
        else:
            coros.append(dist.all_reduce(a))
    await asyncio.gather(*coros)
    for i, a in enumerate(arrays):
        want = float((i % ws) + i) if i % 3 == 2 else float(sum(r + i for r in range(ws)))
        assert np.all(a == want), (i, a[:3], want)
    await dist.destroy_process_group()
    return [float(a[0]) for a in arrays]


async def zero_copy(rank: int, ws: int, url: str, mib: int) -> dict[str, int]:
    """A large all_reduce; returns the receive path's copy counters."""
    await join(url, ws, rank)
    x = np.ones(mib * 262144, np.float32)
    for _ in range(3):
        await dist.all_reduce(x)
    stats = dist.transport_stats()
    await dist.destroy_process_group()
    assert np.all(x == ws**3)
    return {"copied": stats.copied_bytes, "received": stats.received_bytes, "shm": stats.shm_bytes}


async def torch_tensors(rank: int, ws: int, url: str) -> list[float]:
    import torch

    await join(url, ws, rank)
    t = torch.full((4, 3), float(rank + 1))
    await dist.all_reduce(t)
    outs = [torch.empty(2) for _ in range(ws)]
    await dist.all_gather(outs, torch.tensor([rank, rank * 2.0]))
    await dist.destroy_process_group()
    return [float(t[0, 0])] + [float(o[1]) for o in outs]


async def p2p_back_to_back(rank: int, ws: int, url: str) -> Any:
    """Two small sends arrive in one read while two recvs are posted; then a recv pending at
    destroy gets GroupDestroyedError."""
    await join(url, ws, rank)
    if rank == 0:
        await dist.barrier()
        await dist.send(np.full(3, 1, np.int32), 1)
        await dist.send(np.full(5, 2, np.int32), 1)
        await dist.barrier()
        await dist.barrier()  # rank 1 has posted its last recv
        # leave after rank 1's destroy: a receive from any source fails once every other
        # member has left (RankFailedError), which would race the destroy it waits for
        await asyncio.sleep(0.5)
        await dist.destroy_process_group()
        return None
    first, second = np.zeros(3, np.int32), np.zeros(5, np.int32)
    a = asyncio.create_task(dist.recv(first, 0))
    b = asyncio.create_task(dist.recv(second, 0))
    await asyncio.sleep(0.05)
    await dist.barrier()
    senders = await asyncio.wait_for(asyncio.gather(a, b), 10)
    await dist.barrier()
    pending = asyncio.create_task(dist.recv(np.zeros(1), None, tag=77))  # any source: only destroy ends it
    await asyncio.sleep(0.05)
    await dist.barrier()
    await dist.destroy_process_group(timeout=1)
    try:
        await pending
        late = "no error"
    except dist.ArendezError as exc:
        late = type(exc).__name__
    return {"senders": senders, "first": first.tolist(), "second": second.tolist(), "late": late}
