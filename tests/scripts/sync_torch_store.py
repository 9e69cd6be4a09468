"""A script ported by its import line that meets through torch's own ``TCPStore``:
``python sync_torch_store.py RANK WORLD PORT``; prints ``RANK r SUM s``."""

import sys
from datetime import timedelta

import torch
from torch.distributed import TCPStore

import arendez.sync as dist

rank, world, port = (int(a) for a in sys.argv[1:4])
store = TCPStore("127.0.0.1", port, world, rank == 0, timeout=timedelta(seconds=30))
dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
t = torch.tensor([float(rank + 1)])
dist.all_reduce(t)
print(f"RANK {rank} SUM {t.item()}", flush=True)
dist.destroy_process_group()
