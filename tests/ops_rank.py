"""A rank that joins its job from the environment (ARENDEZ_URL, RANK, WORLD_SIZE) and then idles.

    python -m tests.ops_rank SECONDS

It prints ``joined`` once the rendezvous completed, then keeps its lease alive (the background
heartbeat) for ``SECONDS`` and leaves cleanly. The dashboard tests stop one with SIGSTOP.
"""

from __future__ import annotations

import asyncio
import sys

import arendez as dist
from arendez import loop


async def main(seconds: float) -> int:
    await dist.init_process_group()
    print("joined", flush=True)
    await asyncio.sleep(seconds)
    await dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(loop.run(main(float(sys.argv[1]))))
