"""The key-value store beside the collectives, through a server outage.

Each function is one rank's code: ``(rank, world_size, url, *args) -> JSON value``; it joins
and destroys by itself. ``tests.harness.run_ranks`` runs it as rank processes.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np

import arendez as dist
from tests.jobs import join


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


async def _file_appears(out_dir: str, name: str, seconds: float = 30.0) -> None:
    """Wait (bounded) until the test creates ``out_dir/name``."""
    from pathlib import Path

    deadline = time.monotonic() + seconds
    while not Path(out_dir, name).exists():
        assert time.monotonic() < deadline, f"no {name}"
        await asyncio.sleep(0.05)


async def server_outage(rank: int, ws: int, url: str, out_dir: str) -> dict[str, Any]:
    """Collectives go on while the server is down; store calls fail, then recover."""
    from pathlib import Path

    await join(url, ws, rank)
    store = dist.current_world().store
    x = np.ones(50_000)
    await dist.all_reduce(x)
    Path(out_dir, f"ready-{rank}").write_text("1")
    await _file_appears(out_dir, "killed")
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
    await _file_appears(out_dir, "back")
    await store.set(f"after/{rank}", str(rank), timeout=15)
    await store.wait([f"after/{r}" for r in range(ws)], timeout=15)
    x = np.ones(10)
    await dist.all_reduce(x)
    await asyncio.sleep(3.5)  # longer than the lease: the re-attached ranks must not be declared failed
    await dist.barrier()
    await dist.destroy_process_group()
    return {"sums": sums, "during": during, "after": float(x[0])}


async def destroy_after_server_died(rank: int, ws: int, url: str, out_dir: str) -> dict[str, Any]:
    """The server dies for good mid-job: collectives go on, and destroy (group timeout 30 s)
    does not sit out its timeout saying goodbye to the dead server."""
    from pathlib import Path

    await join(url, ws, rank)
    Path(out_dir, f"ready-{rank}").write_text("1")
    await _file_appears(out_dir, "killed")
    x = np.ones(1000)
    await dist.all_reduce(x)
    started = time.monotonic()
    await dist.destroy_process_group()
    return {"sum": float(x[0]), "destroy_seconds": time.monotonic() - started}
