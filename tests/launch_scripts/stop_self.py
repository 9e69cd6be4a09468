"""Every rank joins; rank 2 then stops itself (SIGSTOP) while the others wait in an all_reduce.

The others raise ``RankFailedError`` once the server declares rank 2 failed (its lease runs
out: a stopped process sends no heartbeat) and exit 1. Rank 2 never ends on its own: the
launcher must blame it, not the first of the others to exit.
"""

import os
import signal
import sys

import numpy as np

import arendez as dist
from arendez import loop


async def main() -> int:
    await dist.init_process_group()
    await dist.barrier()
    if dist.get_rank() == 2:
        print("rank 2 stops itself", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)
    try:
        await dist.all_reduce(np.ones(4))
    except dist.RankFailedError as exc:
        print(f"rank {dist.get_rank()}: {exc}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(loop.run(main()))
