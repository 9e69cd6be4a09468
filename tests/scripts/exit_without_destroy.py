"""A plain blocking script that ends without destroy_process_group (as torch's tutorials do):
``python exit_without_destroy.py RANK WORLD_SIZE PORT [raise|crash]``."""

import sys
import time

import numpy as np

import arendez.sync as dist

rank, world_size, port = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
dist.init_process_group("gloo", f"tcp://127.0.0.1:{port}", world_size=world_size, rank=rank, timeout=20)
x = np.full(4, rank + 1.0)
dist.all_reduce(x)
print(f"rank {rank} sum {x[0]:g}", flush=True)
if sys.argv[4:] == ["raise"] and rank == world_size - 1:
    raise SystemExit("rank ends with an error after its last collective")
if sys.argv[4:] == ["crash"] and rank == world_size - 1:
    time.sleep(0.5)  # (the others have finished the collective: only this rank's exit is looked at)
    raise RuntimeError("rank crashes after its last collective")
