"""A torchrun worker on gloo: all_reduce of rank + 1, printed as ``RANK r SUM s``."""

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
print(f"RANK {dist.get_rank()} SUM {t.item()}", flush=True)
dist.destroy_process_group()
