"""A blocking script whose last rank dies of an uncaught exception mid-job, its world up:
``python crash_mid_job.py URL RANK WORLD_SIZE``. The others print, as JSON, what their next
collective raised."""

import json
import sys
import time

import numpy as np

import arendez.sync as dist

url, rank, world_size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
dist.init_process_group(init_method=url, world_size=world_size, rank=rank, timeout=20)
x = np.full(4, rank + 1.0)
if rank == world_size - 1:
    dist.all_reduce(x)
    time.sleep(0.3)
    raise RuntimeError("rank crashes mid-job")
try:  # (the first all_reduce too: on a loaded machine the crash may be heard before it ends)
    for _ in range(2):
        dist.all_reduce(x)
except dist.RankFailedError as exc:
    print(json.dumps({"error": type(exc).__name__, "ranks": exc.ranks, "message": str(exc)}), flush=True)
dist.destroy_process_group()
