"""Two ranks, ``arendez.sync`` or torch's ``dist`` on the backend (argv MODE: sync or torch); rank
0's blocking all_reduce is interrupted (SIGINT to its process group, as a terminal's Ctrl-C)
while rank 1 is late: argv RANK WORLD PORT MODE."""

import datetime
import signal
import sys
import time

# (a script started from a background job, as `bash .ci/run &`, inherits SIGINT ignored: this
# one is about what a terminal's Ctrl-C does, so it takes Python's own handler back)
signal.signal(signal.SIGINT, signal.default_int_handler)

rank, world, port, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
if mode == "torch":
    import torch
    import torch.distributed as dist

    import arendez.torch  # noqa: F401  (registers the backend)

    backend, ones = "arendez", torch.ones
else:
    import numpy as np

    import arendez.sync as dist

    backend, ones = "gloo", np.ones
dist.init_process_group(
    backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
    timeout=datetime.timedelta(seconds=30),
)  # fmt: skip
x = ones(4)
if rank == 0:
    print("waiting", flush=True)
    try:
        dist.all_reduce(x)
        print("all_reduce returned", flush=True)
    except KeyboardInterrupt:
        print(f"interrupted x={float(x[0]):g}", flush=True)
    time.sleep(4)  # rank 1 arrives meanwhile: nothing may land in x now
    print(f"later x={float(x[0]):g}", flush=True)
else:
    time.sleep(3)
    try:
        dist.all_reduce(x)
        print("all_reduce returned", flush=True)
    except RuntimeError as exc:
        print(f"{type(exc).__name__}: {exc}", flush=True)
y = ones(2)
dist.all_reduce(y)
print(f"next sum {float(y[0]):g}", flush=True)
dist.destroy_process_group()
