"""Rank 0 sends two messages, then dies of an uncaught exception; rank 1, a second later,
receives both: ``python send_then_fail.py RANK PORT``; rank 1 prints ``GOT a b``."""

import sys
import time

import numpy as np

import arendez.sync as dist

rank, port = int(sys.argv[1]), int(sys.argv[2])
dist.init_process_group(init_method=f"tcp://127.0.0.1:{port}", world_size=2, rank=rank, timeout=30)
if rank == 0:
    dist.send(np.arange(4, dtype=np.float32), dst=1)
    dist.send(np.full(2, 7.0, np.float32), dst=1, tag=3)
    raise RuntimeError("rank 0 fails after sending")
time.sleep(1.5)  # (rank 0 is gone by now, and this rank knows it)
a, b = np.zeros(4, np.float32), np.zeros(2, np.float32)
dist.recv(a, src=0)
dist.irecv(b, src=0, tag=3).wait()
print("GOT", a.tolist(), b.tolist(), flush=True)
try:
    dist.recv(a, src=0)  # nothing more was sent: the failure now
except dist.RankFailedError as exc:
    print("THEN", type(exc).__name__, flush=True)
dist.destroy_process_group()
