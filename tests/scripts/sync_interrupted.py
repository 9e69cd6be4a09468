"""Two ranks of ``arendez.sync``; rank 0's blocking all_reduce is interrupted (SIGINT to its
process group, as a terminal's Ctrl-C) while rank 1 is late: argv RANK WORLD PORT."""

import sys
import time

import numpy as np

import arendez.sync as dist

rank, world, port = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
dist.init_process_group(init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=30)
x = np.ones(4, np.float32)
if rank == 0:
    print("waiting", flush=True)
    try:
        dist.all_reduce(x)
        print("all_reduce returned", flush=True)
    except KeyboardInterrupt:
        print(f"interrupted x={x[0]:g}", flush=True)
    time.sleep(4)  # rank 1 arrives meanwhile: nothing may land in x now
    print(f"later x={x[0]:g}", flush=True)
else:
    time.sleep(3)
    try:
        dist.all_reduce(x)
        print("all_reduce returned", flush=True)
    except dist.CollectiveCancelledError as exc:
        print(f"cancelled: {exc}", flush=True)
y = np.ones(2, np.float32)
dist.all_reduce(y)
print(f"next sum {y[0]:g}", flush=True)
dist.destroy_process_group()
