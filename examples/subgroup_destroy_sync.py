"""Scenario 2, blocking."""

import numpy as np

import arendez.sync as dist

try:
    from examples._spawn import spawn
except ImportError:
    from _spawn import spawn  # type: ignore[no-redef]


def worker(rank: int, world_size: int, init_method: str) -> None:
    dist.init_process_group("gloo", init_method, world_size=world_size, rank=rank)
    subgroup = dist.new_group(ranks=[0, 1])
    x = np.array([rank + 1.0])
    dist.all_reduce(x, group=subgroup)
    dist.destroy_process_group(subgroup)
    alive = dist.is_initialized()
    print(f"rank {rank}: subgroup sum {x[0]:g}; subgroup destroyed; default group alive: {alive}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {rank}: all destroyed; initialized: {dist.is_initialized()}", flush=True)


if __name__ == "__main__":
    spawn(worker, 2)
