"""Scenarios that test ranks run as real processes: ``python -m tests.scenarios NAME RANK WS URL ARGS``.

Each scenario is an async function ``(rank, world_size, url, *args) -> JSON value``; the
runner prints ``RESULT <json>`` as the rank's last line.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

import arendez as dist
from arendez import loop

SCENARIOS: dict[str, Callable[..., Awaitable[Any]]] = {}


def scenario(fn: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    SCENARIOS[fn.__name__] = fn
    return fn


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


async def join(url: str, world_size: int, rank: int, timeout: float = 30.0) -> None:
    await dist.init_process_group(init_method=url, world_size=world_size, rank=rank, timeout=timeout)


@scenario
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


@scenario
async def destroy_in_flight(rank: int, ws: int, url: str, drain_timeout: float) -> dict[str, Any]:
    """Rank 0 starts three all_reduces; rank 1 joins only the first two, so destroy drains
    those and cancels the third."""
    await join(url, ws, rank)
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


@scenario
async def subgroup_destroy(rank: int, ws: int, url: str) -> dict[str, Any]:
    """A subgroup of ranks {0, 1} is destroyed; the default group keeps working."""
    await join(url, ws, rank)
    sub = await dist.new_group([0, 1])
    result: dict[str, Any] = {
        "member": sub is not dist.GroupMember.NON_GROUP_MEMBER,
        "sub_rank": dist.get_rank(sub),
        "sub_size": dist.get_world_size(sub),
    }
    x = np.ones(4, np.int64)
    if result["member"]:
        await dist.all_reduce(x, group=sub)
        result["sub_sum"] = int(x[0])
        await dist.destroy_process_group(sub)
        await dist.destroy_process_group(sub)  # a second call is quiet
        try:
            await dist.all_reduce(x, group=sub)
            result["after"] = "no error"
        except dist.NotInitializedError as exc:
            result["after"] = f"NotInitializedError: {exc}"
    y = np.ones(4, np.int64)
    await dist.all_reduce(y)
    result["world_sum"] = int(y[0])
    result["initialized"] = dist.is_initialized()
    await dist.destroy_process_group()
    return result


@scenario
async def reinit(rank: int, ws: int, url: str, rounds: int) -> list[Any]:
    """init -> all_reduce -> destroy, ``rounds`` times; then a collective must fail clearly."""
    sums = []
    for i in range(rounds):
        await join(url, ws, rank)
        x = np.full(10, float(rank + i), np.float64)
        await dist.all_reduce(x)
        sums.append(float(x[0]))
        await dist.destroy_process_group()
        await dist.destroy_process_group()  # quiet when nothing is initialized
    try:
        await dist.all_reduce(np.ones(1))
        sums.append("no error")
    except dist.NotInitializedError as exc:
        sums.append(str(exc))
    return sums


@scenario
async def store_add(rank: int, ws: int, url: str, count: int) -> int:
    """Every rank adds 1 to one counter ``count`` times, then waits for the total."""
    host, port, job = _split(url)
    store = await dist.Store(host, port, job, timeout=20).connect()
    for _ in range(count):
        await store.add("counter", 1)
    await store.set(f"done/{rank}", "1")
    await store.wait([f"done/{r}" for r in range(ws)], timeout=20)
    total = int(await store.get("counter"))
    await store.close()
    return total


def _split(url: str) -> tuple[str, int, str]:
    rest = url.split("://", 1)[1]
    hostport, _, job = rest.partition("/")
    host, port = hostport.rsplit(":", 1)
    return host, int(port), job


@scenario
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


@scenario
async def store_and_reduce(rank: int, ws: int, url: str, rounds: int) -> list[int]:
    """Each round: a store add (through the server) and an all_reduce (through the mesh)."""
    await join(url, ws, rank)
    host, port, job = _split(url)
    store = await dist.Store(host, port, job, timeout=20).connect()
    seen = []
    for i in range(rounds):
        await store.add(f"round/{i}", rank + 1)
        x = np.full(256, i, np.int64)
        await dist.all_reduce(x)
        assert int(x[0]) == i * ws
        await dist.barrier()
        seen.append(int(await store.get(f"round/{i}")))
        await asyncio.sleep(0.01)
    await store.close()
    await dist.destroy_process_group()
    return seen


def main() -> None:
    name, rank, ws, url, args = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
    result = loop.run(SCENARIOS[name](rank, ws, url, *json.loads(args)))
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
