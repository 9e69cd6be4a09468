"""Every rank joins; rank 1 then exits 3 while the others wait in an all_reduce it never joins.

The others see ``RankFailedError`` and exit 1 a second later (as a job that saves a checkpoint on
the way out would): the launcher must have reported rank 1 and terminated them by then.
"""

import os
import sys
import time

import numpy as np

import arendez as dist
from arendez import loop


async def main() -> int:
    await dist.init_process_group()
    if dist.get_rank() == 1:
        print("rank 1 exits 3", file=sys.stderr, flush=True)
        os._exit(3)
    try:
        await dist.all_reduce(np.ones(4))
    except dist.RankFailedError as exc:
        print(f"rank {dist.get_rank()}: {exc}", file=sys.stderr, flush=True)
        time.sleep(1)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(loop.run(main()))
