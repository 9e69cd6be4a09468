"""``Work.wait(timeout)`` in a blocking script cancels the collective on every rank:
``python wait_timeout.py RANK PORT``; prints one JSON line."""

import json
import sys
import time

import numpy as np

import arendez.sync as dist

rank, port = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", f"tcp://127.0.0.1:{port}", world_size=2, rank=rank, timeout=20)
x = np.full(1 << 20, rank + 1.0, np.float32)
outcome = {}
if rank == 0:
    work = dist.all_reduce(x, async_op=True)
    try:
        work.wait(timeout=0.2)
        outcome["first"] = "finished"
    except TimeoutError as exc:
        outcome["first"] = f"TimeoutError: {exc}"
else:
    time.sleep(1.0)  # rank 0 has given up by now
    started = time.monotonic()
    try:
        dist.all_reduce(x)
        outcome["first"] = "finished"
    except dist.CollectiveCancelledError as exc:
        outcome["first"] = f"CollectiveCancelledError: {exc}"
    outcome["seconds"] = time.monotonic() - started
y = np.full(1 << 20, rank + 1.0, np.float32)
dist.all_reduce(y)
outcome["next"] = float(y.min()), float(y.max())
dist.destroy_process_group()
print(json.dumps(outcome), flush=True)
