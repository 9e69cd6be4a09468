"""Scenarios that test ranks run as real processes: ``python -m tests.scenarios NAME RANK WS URL ARGS``.

Each scenario is an async function ``(rank, world_size, url, *args) -> JSON value``; the
runner prints ``RESULT <json>`` as the rank's last line.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

import arendez as dist
from arendez import loop
from tests.conformance import _check, contribution, every_collective_once, reduced

SCENARIOS: dict[str, Callable[..., Awaitable[Any]]] = {}


def scenario(fn: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    SCENARIOS[fn.__name__] = fn
    return fn


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


@scenario
async def collectives_matrix(rank: int, ws: int, url: str, dtypes: list[str], sizes: list[int]) -> int:
    """Every collective x dtypes x sizes, on the default group and on a subgroup of all but rank 0."""
    await join(url, ws, rank)
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
    await dist.destroy_process_group()
    return checked


@scenario
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


@scenario
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


@scenario
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


@scenario
async def shm_job(rank: int, ws: int, url: str, size: int, rounds: int) -> dict[str, Any]:
    """Large all_reduces and broadcasts, checked; returns which transport carried the bytes and
    what the shared-memory directory held while the job ran."""
    await join(url, ws, rank)
    shm_dir = os.environ.get("ARENDEZ_SHM_DIR", "/dev/shm")
    during: list[str] = []
    for i in range(rounds):
        if i == 1:  # every rank has finished init (its offers were answered and unlinked)
            during = sorted(os.listdir(shm_dir))
        x = contribution(rank, size, "float32", salt=i)
        want = reduced("SUM", [contribution(r, size, "float32", salt=i) for r in range(ws)])
        await dist.all_reduce(x)
        _check(x, want, f"all_reduce round {i}")
        y = contribution(rank, size, "int64", salt=i)
        await dist.broadcast(y, src=i % ws)
        _check(y, contribution(i % ws, size, "int64", salt=i), f"broadcast round {i}")
    stats = dist.transport_stats()
    await dist.destroy_process_group()
    return {
        "shm": stats.shm_bytes,
        "full": stats.shm_full,
        "received": stats.received_bytes,
        "copied": stats.copied_bytes,
        "during": during,
        "after": sorted(os.listdir(shm_dir)),
    }


@scenario
async def forged_shm_reference(rank: int, ws: int, url: str) -> str:
    """Rank 1 points a data frame far outside its shared-memory segment; rank 0 must drop the
    link and fail its all_reduce naming rank 1."""
    from arendez import frames

    await join(url, ws, rank)
    world = dist.current_world()
    assert world.mesh is not None
    if rank == 1:
        assert world.shm.carries(0, 1 << 20), "the link should have shared memory"
        seq = world.groups[0].next_seq
        world.mesh.send(0, frames.ShmData(0, seq, 0, 0, "forged", 1 << 40, 4096))
        await asyncio.wait_for(asyncio.shield(world.mesh.conns[0].closed), 10)
        await dist.destroy_process_group()
        return "sent"
    try:
        await dist.all_reduce(np.ones(1000, np.float32))
        outcome = "no error"
    except dist.ArendezError as exc:
        outcome = f"{type(exc).__name__}: {exc}"
    await dist.destroy_process_group()
    return outcome


async def _until(seen: Callable[[Any], bool], what: str, seconds: float = 10.0) -> None:
    """Wait (bounded) until ``seen(world)`` holds for this rank's world; fail with ``what``."""
    world = dist.current_world()
    deadline = time.monotonic() + seconds
    while not seen(world) and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    assert seen(world), what


@scenario
async def left_after_sending(rank: int, ws: int, url: str, size: int) -> str:
    """Rank 1 broadcasts and leaves at once; rank 0 starts its broadcast only after the goodbye.
    The data it needs already came, so it must succeed; the next collective must fail fast."""
    await join(url, ws, rank)
    x = np.full(size, float(rank + 7), np.float32)
    if rank == 1:
        await dist.broadcast(x, src=1)
        await dist.destroy_process_group()
        return "left"
    await _until(lambda world: 1 in world.dead, "rank 1's goodbye never came")
    await dist.broadcast(x, src=1)
    assert np.all(x == 8.0), x[:4]
    started = time.monotonic()
    try:
        await dist.all_reduce(x)
        outcome = "no error"
    except dist.RankFailedError as exc:
        outcome = f"{exc} after {time.monotonic() - started:.2f}s"
    await dist.destroy_process_group()
    return outcome


@scenario
async def dies_between_collectives(rank: int, ws: int, url: str) -> str:
    """The last rank dies right after a collective; the others start the next one once they know:
    the error names the rank and the collective that could not run."""
    await join(url, ws, rank)
    world = dist.current_world()
    await dist.all_reduce(np.ones(10, np.float32))
    if rank == ws - 1:  # once every rank has its result (dying earlier fails that collective)
        await world.store.wait([f"reduced-{r}" for r in range(ws - 1)], timeout=10)
        os._exit(0)  # no goodbye: a crash
    await world.store.set(f"reduced-{rank}", "1")
    await _until(lambda world: ws - 1 in world.failed, f"rank {ws - 1}'s death was never seen")
    try:
        await dist.all_reduce(np.ones(10, np.float32))
        outcome = "no error"
    except dist.RankFailedError as exc:
        outcome = f"{exc.rank} {exc.collective}"
    await dist.destroy_process_group()
    return outcome


@scenario
async def torch_tensors(rank: int, ws: int, url: str) -> list[float]:
    import torch

    await join(url, ws, rank)
    t = torch.full((4, 3), float(rank + 1))
    await dist.all_reduce(t)
    outs = [torch.empty(2) for _ in range(ws)]
    await dist.all_gather(outs, torch.tensor([rank, rank * 2.0]))
    await dist.destroy_process_group()
    return [float(t[0, 0])] + [float(o[1]) for o in outs]


@scenario
async def reduce_until_failure(
    rank: int, ws: int, url: str, ready_dir: str, size: int, seconds: float
) -> dict[str, Any]:
    """all_reduce in a loop until a peer fails; report the error and when it was raised."""
    from pathlib import Path

    await join(url, ws, rank, timeout=float(seconds))
    x = np.ones(size, np.float32)
    rounds = 0
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            await dist.all_reduce(x)
            x.fill(1)
            rounds += 1
            if rounds == 3:
                Path(ready_dir, f"ready-{rank}").write_text("1")
        outcome: dict[str, Any] = {"error": None}
    except dist.ArendezError as exc:
        outcome = {
            "error": type(exc).__name__,
            "message": str(exc),
            "at": time.time(),
            "rank_named": getattr(exc, "rank", None),
        }
    started = time.monotonic()
    await dist.destroy_process_group(timeout=2)
    outcome["destroy_seconds"] = time.monotonic() - started
    outcome["rounds"] = rounds
    return outcome


@scenario
async def straggler(rank: int, ws: int, url: str, timeout: float) -> str:
    """Every rank but the last calls all_reduce; the last never does."""
    await dist.init_process_group(init_method=url, world_size=ws, rank=rank, timeout=timeout)
    if rank == ws - 1:
        await asyncio.sleep(timeout + 2.5)
        await dist.destroy_process_group()
        return "skipped"
    started = time.monotonic()
    try:
        await dist.all_reduce(np.ones(10))
        return "no error"
    except dist.CollectiveTimeoutError as exc:
        took = time.monotonic() - started
        assert isinstance(exc, TimeoutError)
        return f"{exc} | took {took:.1f}"
    finally:
        await dist.destroy_process_group(timeout=1)


@scenario
async def guarded_job(rank: int, ws: int, url: str, out_dir: str) -> list[float]:
    """all_reduce, publish this rank's peer address, wait until the test has probed it, reduce again."""
    from pathlib import Path

    await join(url, ws, rank)
    x = np.full(1000, rank + 1.0)
    await dist.all_reduce(x)
    Path(out_dir, f"addr-{rank}").write_text(dist.current_world().address)
    deadline = time.monotonic() + 20
    while not Path(out_dir, "probed").exists() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    y = np.full(1000, rank + 1.0)
    await dist.all_reduce(y)
    await dist.destroy_process_group()
    return [float(x[0]), float(y[0])]


@scenario
async def server_outage(rank: int, ws: int, url: str, out_dir: str) -> dict[str, Any]:
    """Collectives go on while the server is down; store calls fail, then recover."""
    from pathlib import Path

    def wait_for(name: str) -> Awaitable[None]:
        async def poll() -> None:
            deadline = time.monotonic() + 30
            while not Path(out_dir, name).exists():
                assert time.monotonic() < deadline, f"no {name}"
                await asyncio.sleep(0.05)

        return poll()

    await join(url, ws, rank)
    store = dist.current_world().store
    x = np.ones(50_000)
    await dist.all_reduce(x)
    Path(out_dir, f"ready-{rank}").write_text("1")
    await wait_for("killed")
    sums = []
    for _ in range(20):
        x = np.ones(50_000)
        await dist.all_reduce(x)
        sums.append(float(x[0]))
    started = time.monotonic()
    try:
        await store.set(f"during/{rank}", "x", timeout=1.0)
        during = "no error"
    except dist.StoreError as exc:
        during = f"{type(exc).__name__} after {time.monotonic() - started:.1f}s"
    Path(out_dir, f"checked-{rank}").write_text("1")
    await wait_for("back")
    await store.set(f"after/{rank}", str(rank), timeout=15)
    await store.wait([f"after/{r}" for r in range(ws)], timeout=15)
    x = np.ones(10)
    await dist.all_reduce(x)
    await asyncio.sleep(3.5)  # longer than the lease: the re-attached ranks must not be declared failed
    await dist.barrier()
    await dist.destroy_process_group()
    return {"sums": sums, "during": during, "after": float(x[0])}


@scenario
async def destroy_while_peer_dies(rank: int, ws: int, url: str, ready_dir: str) -> dict[str, Any]:
    """Rank 0 destroys with a collective in flight that rank 1 never joins; the test kills rank 1
    during the drain. Destroy must end at once, not at its 20 s timeout."""
    from pathlib import Path

    await join(url, ws, rank)
    await dist.barrier()
    if rank != 0:
        Path(ready_dir, f"ready-{rank}").write_text("1")
        await asyncio.sleep(60)  # killed by the test
        return {}
    pending = asyncio.create_task(dist.all_reduce(np.ones(1000)))
    await asyncio.sleep(0.05)
    Path(ready_dir, "ready-0").write_text("1")
    started = time.monotonic()
    await dist.destroy_process_group(timeout=20)
    took = time.monotonic() - started
    try:
        await pending
        outcome = "no error"
    except dist.ArendezError as exc:
        outcome = f"{type(exc).__name__}: {exc}"
    return {"destroy_seconds": took, "outcome": outcome, "initialized": dist.is_initialized()}


@scenario
async def late_joiner(rank: int, ws: int, url: str, delay: float) -> float:
    """The last rank joins ``delay`` seconds after the others (longer than the lease)."""
    if rank == ws - 1:
        await asyncio.sleep(delay)
    await join(url, ws, rank)
    await asyncio.sleep(1.0)  # give the server's lease check time to (wrongly) fire
    x = np.ones(10)
    await dist.all_reduce(x)
    await dist.destroy_process_group()
    return float(x[0])


@scenario
async def p2p_back_to_back(rank: int, ws: int, url: str) -> Any:
    """Two small sends arrive in one read while two recvs are posted; then a recv pending at
    destroy gets GroupDestroyedError."""
    await join(url, ws, rank)
    if rank == 0:
        await dist.barrier()
        await dist.send(np.full(3, 1, np.int32), 1)
        await dist.send(np.full(5, 2, np.int32), 1)
        await dist.barrier()
        await dist.barrier()  # rank 1 has posted its last recv: leaving now cannot fail it
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


@scenario
async def busy_loop(rank: int, ws: int, url: str, seconds: float) -> float:
    """The last rank blocks its event loop (a long synchronous step) for longer than the lease."""
    await join(url, ws, rank)
    await dist.barrier()
    if rank == ws - 1:
        time.sleep(seconds)  # deliberately blocks the loop: no await for ``seconds``
    x = np.ones(10)
    await dist.all_reduce(x)
    await dist.destroy_process_group()
    return float(x[0])


def main() -> None:
    name, rank, ws, url, args = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
    result = loop.run(SCENARIOS[name](rank, ws, url, *json.loads(args)))
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
