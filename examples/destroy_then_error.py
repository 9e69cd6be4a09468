"""Scenario 3: all_reduce, destroy, and the clear error of a collective afterwards."""

import numpy as np

import arendez as dist
from arendez import loop

try:
    from examples._spawn import spawn
except ImportError:
    from _spawn import spawn  # type: ignore[no-redef]


async def main(rank: int, world_size: int, init_method: str) -> None:
    await dist.init_process_group("gloo", init_method, world_size=world_size, rank=rank)
    tensor = np.ones(3) * (rank + 1)
    await dist.all_reduce(tensor)
    print(f"rank {rank}: after all_reduce {tensor}", flush=True)
    await dist.destroy_process_group()
    try:
        await dist.all_reduce(tensor)
    except RuntimeError as exc:  # NotInitializedError is an ArendezError, a RuntimeError
        print(f"rank {rank}: error after destroy: {type(exc).__name__}: {exc}", flush=True)


def worker(rank: int, world_size: int, init_method: str) -> None:
    loop.run(main(rank, world_size, init_method))


if __name__ == "__main__":
    spawn(worker, 2)
