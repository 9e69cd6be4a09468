"""A rank that all-reduces (rank + 1) and prints what the launcher's environment told it."""

import os
import sys

import numpy as np

import arendez as dist
from arendez import loop


async def main() -> int:
    await dist.init_process_group()  # env://, no arguments
    rank, world = dist.get_rank(), dist.get_world_size()
    x = np.full(4, rank + 1, dtype=np.int64)
    await dist.all_reduce(x)
    env = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    print(f"hello from {rank}/{world} env={env}")
    print(f"to stderr from {rank}", file=sys.stderr)
    print(f"sum={int(x[0])} url={os.environ.get('ARENDEZ_URL')}")
    await dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(loop.run(main()))
