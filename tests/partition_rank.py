"""One rank of the server-partition test: ``python -m tests.partition_rank URL WORLD RANK STOP``.

Prints ``READY``, then all_reduces (a few per second) until the file ``STOP`` exists, then 20 more,
a store round trip through the server and a clean destroy; prints ``DONE`` and exits 0. Any error
(a peer or this rank declared failed) ends it with a traceback and status 1.
"""

from __future__ import annotations

import asyncio
import os
import sys

import numpy as np

import arendez as dist
from arendez import loop


async def main(url: str, world: int, rank: int, stop: str) -> None:
    await dist.init_process_group(init_method=url, world_size=world, rank=rank, timeout=60)
    print("READY", flush=True)
    x = np.empty(1024, np.float32)
    after = 0
    while after < 20:
        if after or os.path.exists(stop):
            after += 1
        x.fill(rank + 1)
        await dist.all_reduce(x)
        assert x[0] == world * (world + 1) / 2, x[0]
        await asyncio.sleep(0.05)
    store = dist.current_world().store
    await store.set(f"after/{rank}", "ok", timeout=15)
    await store.wait([f"after/{r}" for r in range(world)], timeout=15)
    await dist.destroy_process_group(timeout=10)
    print("DONE", flush=True)


if __name__ == "__main__":
    loop.run(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]))
