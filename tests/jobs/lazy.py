"""Peer connections opened on first use: what each rank connects to, and failures of ranks it
never connected to.

Each function is one rank's code: ``(rank, world_size, url, *args) -> JSON value``; it joins
and destroys by itself.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

import arendez as dist
from tests.jobs import join


def _peers() -> list[int]:
    world = dist.current_world()
    assert world.mesh is not None
    return sorted(world.mesh.conns)


async def _barrier_via_store(name: str, rank: int, ws: int) -> None:
    """Wait for every rank through the store (a collective would open connections)."""
    await _store_barrier(name, rank, range(ws))


async def _store_barrier(name: str, rank: int, ranks: Any) -> None:
    store = dist.current_world().store
    await store.set(f"{name}-{rank}", "1")
    await store.wait([f"{name}-{r}" for r in ranks], timeout=30)


async def connection_counts(rank: int, ws: int, url: str, a: int, b: int) -> dict[str, Any]:
    """Peers connected after init, after a small and a large all_reduce, and after ranks ``a``
    and ``b`` (not neighbours) send to each other at the same moment."""
    await join(url, ws, rank)
    out: dict[str, Any] = {"init": _peers()}
    await _barrier_via_store("counted", rank, ws)
    for size in (16, 1 << 18):
        x = np.full(size, float(rank), np.float32)
        await dist.all_reduce(x)
        assert np.all(x == sum(range(ws))), x[:4]
    out["all_reduce"] = _peers()
    await _barrier_via_store("reduced", rank, ws)
    if rank in (a, b):  # both dial at once: one connection must come out of it
        other = b if rank == a else a
        got = np.zeros(1000, np.int64)
        await asyncio.gather(dist.send(np.full(1000, rank, np.int64), other), dist.recv(got, other))
        assert np.all(got == other), got[:4]
    await _barrier_via_store("exchanged", rank, ws)
    out["p2p"] = _peers()
    out["opened"] = dist.transport_stats().connections
    await dist.destroy_process_group()
    return out


async def unconnected_failure(rank: int, ws: int, url: str, victim: int, run_dir: str) -> dict[str, Any]:
    """The victim dies (no goodbye) after init; rank 0, never connected to it, then sends to
    it: the dial fails and names it. The other survivors wait until they see the death (the
    server's declaration, for those never connected to it)."""
    await join(url, ws, rank)
    connected = victim in _peers()
    await _barrier_via_store("ready", rank, ws)
    if rank == victim:
        Path(run_dir, "died.tmp").write_text(repr(time.time()))
        os.replace(Path(run_dir, "died.tmp"), Path(run_dir, "died"))  # (whole: never read half-written)
        os._exit(0)
    while not Path(run_dir, "died").exists():
        await asyncio.sleep(0.01)
    died = float(Path(run_dir, "died").read_text())
    out: dict[str, Any] = {"connected": connected}
    if rank == 0:
        await asyncio.sleep(0.1)  # (the victim's process is gone: its listener refuses)
        try:
            await dist.send(np.ones(10, np.float32), victim)
            out["error"] = "no error"
        except dist.RankFailedError as exc:
            out["error"] = f"{exc.rank}: {exc}"
    else:
        world = dist.current_world()
        deadline = time.monotonic() + 10
        while victim not in world.failed and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        out["error"] = world.failed.get(victim, "never seen")
    out["seconds"] = time.time() - died
    survivors = [r for r in range(ws) if r != victim]  # (a goodbye would tell of the death)
    await _store_barrier("checked", rank, survivors)
    await dist.destroy_process_group(timeout=5)
    return out
