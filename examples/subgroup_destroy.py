"""Scenario 2: destroy a subgroup while the default group lives on (2 processes)."""

import numpy as np

import arendez as dist
from arendez import loop

try:
    from examples._spawn import spawn
except ImportError:  # run as a script from inside examples/
    from _spawn import spawn  # type: ignore[no-redef]


async def main(rank: int, world_size: int, init_method: str) -> None:
    await dist.init_process_group("gloo", init_method, world_size=world_size, rank=rank)
    subgroup = await dist.new_group(ranks=[0, 1])
    x = np.array([rank + 1.0])
    await dist.all_reduce(x, group=subgroup)
    await dist.destroy_process_group(subgroup)
    alive = dist.is_initialized()
    print(f"rank {rank}: subgroup sum {x[0]:g}; subgroup destroyed; default group alive: {alive}", flush=True)
    await dist.barrier()  # the default group still works
    await dist.destroy_process_group()
    print(f"rank {rank}: all destroyed; initialized: {dist.is_initialized()}", flush=True)


def worker(rank: int, world_size: int, init_method: str) -> None:
    loop.run(main(rank, world_size, init_method))


if __name__ == "__main__":
    spawn(worker, 2)
