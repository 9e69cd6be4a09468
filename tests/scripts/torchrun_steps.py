"""A torchrun worker: STEPS all_reduces on backend "arendez", a line at the start and the end."""

import os
import time

import torch
import torch.distributed as dist

import arendez.torch  # noqa: F401  (registers the backend)

dist.init_process_group("arendez")
rank, world = dist.get_rank(), dist.get_world_size()
restart = os.environ["TORCHELASTIC_RESTART_COUNT"]
with open(os.environ["WORKER_PIDS"], "a") as pids:  # (the test kills them, whatever happens)
    print(os.getpid(), file=pids)
print(f"start rank {rank} of {world} restart {restart} pid {os.getpid()}", flush=True)
for _ in range(int(os.environ.get("STEPS", "3"))):
    t = torch.full((4,), float(rank + 1))
    dist.all_reduce(t)
    assert t.tolist() == [world * (world + 1) / 2] * 4, t
    time.sleep(float(os.environ.get("STEP_SECONDS", "0")))
print(f"done rank {rank} of {world} restart {restart}", flush=True)
dist.destroy_process_group()
