"""A blocking-API rank ended by SIGTERM says goodbye: ``python sync_sigterm.py RANK PORT WHERE``.

Rank 1 prints ``ready`` and then, with WHERE ``idle``, sleeps in plain Python; with ``busy``,
waits inside an all_reduce (rank 0 comes to it late). The test SIGTERMs rank 1; rank 0 prints
one JSON line with what its all_reduce raised."""

import json
import sys
import time

import numpy as np

import arendez.sync as dist

rank, port, where = int(sys.argv[1]), sys.argv[2], sys.argv[3]
dist.init_process_group("gloo", f"tcp://127.0.0.1:{port}", world_size=2, rank=rank, timeout=20)
dist.all_reduce(np.ones(4, np.float32))
print("ready", flush=True)
if rank == 1:
    if where == "idle":
        time.sleep(30)
    dist.all_reduce(np.ones(4, np.float32))  # (the signal ends the process in here)
    sys.exit(3)
if where == "busy":
    time.sleep(2.0)  # rank 1 waits in its all_reduce meanwhile
try:
    dist.all_reduce(np.ones(4, np.float32))
    outcome = {"error": None}
except dist.RankFailedError as exc:
    outcome = {"error": type(exc).__name__, "message": str(exc), "ranks": exc.ranks}
dist.destroy_process_group(timeout=2)
print(json.dumps(outcome), flush=True)
