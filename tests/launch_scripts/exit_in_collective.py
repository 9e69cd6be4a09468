"""Rank 1 calls ``sys.exit(1)`` after a few all_reduces (``after``) or while the others already
wait in the next one (``during``), then takes 0.3 s to end (an atexit hook, as a job flushing
logs would). The others fail at once on its goodbye (an uncaught ``RankFailedError``) and end
before it: the launcher must still blame rank 1.
"""

import atexit
import sys
import time

import numpy as np

import arendez as dist
from arendez import loop


async def main() -> None:
    await dist.init_process_group()
    x = np.ones(4)
    for _ in range(3):
        await dist.all_reduce(x)
    if dist.get_rank() == 1:
        atexit.register(time.sleep, 0.3)
        if sys.argv[1] == "during":
            time.sleep(0.2)  # the others are in the all_reduce by now
        sys.exit(1)
    await dist.all_reduce(x)


if __name__ == "__main__":
    loop.run(main())
