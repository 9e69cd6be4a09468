"""A torch.distributed script ported to arendez.sync by its import line, run by torchrun, whose
agent holds MASTER_PORT with its own store (TORCHELASTIC_USE_AGENT_STORE): init twice."""

import os
import sys

import torch

import arendez.sync as dist

sums = []
for _ in range(2):  # (a re-init must not read the first init's server from the agent's store)
    dist.init_process_group("gloo")
    t = torch.full((4,), float(dist.get_rank() + 1))
    dist.all_reduce(t)
    sums.append(t.tolist())
    dist.destroy_process_group()
agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE")
sys.stdout.write(f"rank {os.environ['RANK']} agent store {agent} sums {sums}\n")
