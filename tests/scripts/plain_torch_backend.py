"""A torch script that names backend "arendez" and never imports arendez (torchrun runs it)."""

import torch
import torch.distributed as dist

dist.init_process_group("arendez")
t = torch.full((4,), float(dist.get_rank() + 1))
dist.all_reduce(t)
print("rank", dist.get_rank(), "of", dist.get_world_size(), "backend", dist.get_backend(), "sum", t.tolist())
dist.destroy_process_group()
