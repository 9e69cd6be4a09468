"""A blocking script whose last rank dies of an uncaught exception right after a large
all_reduce: ``python crash_after_collective.py RANK WORLD_SIZE PORT``. Its goodbye comes after its
last frames, so the others' copy of that all_reduce must complete (exactly), and their next
collective raise naming it. The others print, as JSON, both outcomes."""

import json
import sys

import numpy as np

import arendez.sync as dist

rank, world_size, port = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
dist.init_process_group(init_method=f"tcp://127.0.0.1:{port}", world_size=world_size, rank=rank, timeout=20)
x = np.full(1 << 22, rank + 1.0, np.float32)  # 16 MiB
dist.all_reduce(x)  # (every rank connected, warm)
x.fill(rank + 1.0)
if rank == world_size - 1:
    dist.all_reduce(x)
    raise RuntimeError("crash right after the collective")
outcomes = []
for _ in range(2):
    try:
        dist.all_reduce(x)
        outcomes.append(f"sum {x[0]:g} {x[-1]:g}")
    except dist.RankFailedError as exc:
        outcomes.append(f"RankFailedError {exc.ranks}: {exc}")
print(json.dumps(outcomes), flush=True)
dist.destroy_process_group()
