"""A torch script that names backend "arendez" and never imports arendez (torchrun runs it)."""

import sys

import torch
import torch.distributed as dist

dist.init_process_group("arendez")
t = torch.full((4,), float(dist.get_rank() + 1))
dist.all_reduce(t)
line = f"rank {dist.get_rank()} of {dist.get_world_size()} backend {dist.get_backend()} sum {t.tolist()}\n"
sys.stdout.write(line)  # one write: the ranks share torchrun's stdout (print would write in pieces)
dist.destroy_process_group()
