"""Rank programs for the etcd tests: ``python -m tests.etcd_scenarios NAME RANK WS URL ARGS``.

Like ``tests/scenarios.py`` (whose runner prints ``RESULT <json>`` last), for jobs that also
use the etcd store directly.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

import arendez as dist
from arendez import loop
from arendez.etcd import open_store


async def store_and_reduce(
    rank: int, ws: int, url: str, rounds: int, ready_dir: str, pause: float
) -> list[int]:
    """Each round: an add on the etcd store and a checked all_reduce; ``ready-<rank>`` after 3."""
    await dist.init_process_group(init_method=url, world_size=ws, rank=rank, timeout=30)
    store = await open_store(url, timeout=20).connect()
    seen = []
    try:
        for i in range(rounds):
            await store.add(f"round/{i}", rank + 1)
            x = np.full(256, i, np.int64)
            await dist.all_reduce(x)
            assert int(x[0]) == i * ws, (i, int(x[0]))
            await dist.barrier()
            seen.append(int(await store.get(f"round/{i}")))
            if i == 2:
                Path(ready_dir, f"ready-{rank}").write_text("1")
            await asyncio.sleep(pause)
    finally:
        await store.close()
    await dist.destroy_process_group()
    return seen


async def auto_rank(rank: int, ws: int, url: str) -> dict[str, Any]:
    """Join with rank -1 (etcd assigns it); all_gather the ranks to check they are a permutation."""
    started = time.monotonic()
    await dist.init_process_group(init_method=url, world_size=ws, rank=-1, timeout=30)
    me = dist.get_rank()
    out = [np.zeros(1, np.int64) for _ in range(ws)]
    await dist.all_gather(out, np.array([me], np.int64))
    await dist.destroy_process_group()
    return {"rank": me, "all": [int(o[0]) for o in out], "seconds": time.monotonic() - started}


async def destroy_after_etcd_is_gone(rank: int, ws: int, url: str, ready_dir: str) -> dict[str, Any]:
    """Join, say ``ready-<rank>``, wait for ``gone`` (etcd killed by the test), all_reduce
    (the peer links need no etcd), then time the destroy."""
    await dist.init_process_group(init_method=url, world_size=ws, rank=rank, timeout=30)
    Path(ready_dir, f"ready-{rank}").write_text("1")
    deadline = time.monotonic() + 30
    while not Path(ready_dir, "gone").exists() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    x = np.ones(4)
    await dist.all_reduce(x)
    started = time.monotonic()
    await dist.destroy_process_group()
    return {"sum": float(x[0]), "destroy": time.monotonic() - started}


SCENARIOS = {
    "store_and_reduce": store_and_reduce,
    "auto_rank": auto_rank,
    "destroy_after_etcd_is_gone": destroy_after_etcd_is_gone,
}


def main() -> None:
    name, rank, ws, url, args = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
    result = loop.run(SCENARIOS[name](rank, ws, url, *json.loads(args)))  # type: ignore[operator]
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
