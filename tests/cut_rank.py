"""One rank of the link-cut tests: ``python -m tests.cut_rank URL WORLD RANK``.

Joins, prints ``READY``, then all_reduces 64 KiB (a few per second) until one fails; prints
``FAILED <wall time> <error type>: <message>`` and exits 3. The timeout of its collectives
(120 s) is far beyond what the tests wait, so an error means something noticed the cut.
"""

from __future__ import annotations

import asyncio
import sys
import time

import numpy as np

import arendez as dist
from arendez import loop


async def main(url: str, world: int, rank: int) -> int:
    await dist.init_process_group(init_method=url, world_size=world, rank=rank, timeout=120)
    print("READY", flush=True)
    x = np.empty(16384, np.float32)
    try:
        while True:
            x.fill(rank + 1)
            await dist.all_reduce(x)
            await asyncio.sleep(0.05)
    except dist.ArendezError as exc:
        print(f"FAILED {time.time():.3f} {type(exc).__name__}: {exc}", flush=True)
        await dist.destroy_process_group(timeout=2)
        return 3


if __name__ == "__main__":
    sys.exit(loop.run(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))))
