"""Two ranks of the torch backend; rank 0's blocking dist.all_reduce is interrupted (SIGINT to
its process group, as a terminal's Ctrl-C) while rank 1 is late: argv RANK WORLD PORT."""

import datetime
import sys
import time

import torch
import torch.distributed as dist

import arendez.torch  # noqa: F401  (registers the backend)

rank, world, port = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
dist.init_process_group(
    "arendez", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
    timeout=datetime.timedelta(seconds=30),
)  # fmt: skip
x = torch.ones(4)
if rank == 0:
    print("waiting", flush=True)
    try:
        dist.all_reduce(x)
        print("all_reduce returned", flush=True)
    except KeyboardInterrupt:
        print(f"interrupted x={x[0].item():g}", flush=True)
    time.sleep(4)  # rank 1 arrives meanwhile: nothing may land in x now
    print(f"later x={x[0].item():g}", flush=True)
else:
    time.sleep(3)
    try:
        dist.all_reduce(x)
        print("all_reduce returned", flush=True)
    except RuntimeError as exc:
        print(f"{type(exc).__name__}: {exc}", flush=True)
y = torch.ones(2)
dist.all_reduce(y)
print(f"next sum {y[0].item():g}", flush=True)
dist.destroy_process_group()
