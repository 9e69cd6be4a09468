"""Scenario 3, blocking."""

import numpy as np

import arendez.sync as dist

try:
    from examples._spawn import spawn
except ImportError:
    from _spawn import spawn  # type: ignore[no-redef]


def worker(rank: int, world_size: int, init_method: str) -> None:
    dist.init_process_group("gloo", init_method, world_size=world_size, rank=rank)
    tensor = np.ones(3) * (rank + 1)
    dist.all_reduce(tensor)
    print(f"rank {rank}: after all_reduce {tensor}", flush=True)
    dist.destroy_process_group()
    try:
        dist.all_reduce(tensor)
    except RuntimeError as exc:
        print(f"rank {rank}: error after destroy: {type(exc).__name__}: {exc}", flush=True)


if __name__ == "__main__":
    spawn(worker, 2)
