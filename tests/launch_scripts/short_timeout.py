"""Join with a short timeout (``sys.argv[1]`` seconds); print the sum of an all_reduce."""

import sys

import numpy as np

import arendez as dist
from arendez import loop


async def main() -> None:
    await dist.init_process_group(timeout=float(sys.argv[1]))
    x = np.ones(1)
    await dist.all_reduce(x)
    print(f"sum={x[0]:g}")


if __name__ == "__main__":
    loop.run(main())
