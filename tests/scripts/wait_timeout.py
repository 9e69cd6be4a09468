"""``Work.wait(timeout)`` in a blocking script: the call goes on (as with gloo) and a later
``wait()`` has its result; ``Work.cancel()`` cancels it on every rank.
``python wait_timeout.py RANK PORT``; prints one JSON line."""

import json
import sys
import time

import numpy as np

import arendez.sync as dist

rank, port = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", f"tcp://127.0.0.1:{port}", world_size=2, rank=rank, timeout=20)
outcome = {}

# 1. wait(timeout) passes before rank 1 arrives: a TimeoutError, then the result
x = np.full(1 << 20, rank + 1.0, np.float32)
if rank == 0:
    work = dist.all_reduce(x, async_op=True)
    try:
        work.wait(timeout=0.2)
        outcome["timed_out"] = "finished"
    except TimeoutError as exc:
        outcome["timed_out"] = f"{type(exc).__name__}: {exc}"
    outcome["waited_again"] = work.wait()
else:
    time.sleep(1.0)
    dist.all_reduce(x)
outcome["result"] = float(x.min()), float(x.max())

# 2. cancel(): the peer that comes later gets CollectiveCancelledError at once
y = np.full(1 << 20, rank + 1.0, np.float32)
if rank == 0:
    work = dist.all_reduce(y, async_op=True)
    outcome["ended"] = work.cancel()
    try:
        work.wait()
        outcome["cancelled"] = "finished"
    except Exception as exc:  # the caller can catch it as any error
        outcome["cancelled"] = f"{type(exc).__name__}: {exc}"
else:
    time.sleep(1.0)  # rank 0 has cancelled by now
    started = time.monotonic()
    try:
        dist.all_reduce(y)
        outcome["cancelled"] = "finished"
    except dist.CollectiveCancelledError as exc:
        outcome["cancelled"] = f"CollectiveCancelledError: {exc}"
    outcome["seconds"] = time.monotonic() - started

# 3. the group goes on
z = np.full(1 << 20, rank + 1.0, np.float32)
dist.all_reduce(z)
outcome["next"] = float(z.min()), float(z.max())
dist.destroy_process_group()
print(json.dumps(outcome), flush=True)
