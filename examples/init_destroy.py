"""Scenario 1: initialise a one-process group and destroy it (no server, no socket)."""

import arendez as dist
from arendez import loop


async def main() -> None:
    await dist.init_process_group(backend="gloo", init_method=None, world_size=1, rank=0)
    print("Group initialized:", dist.is_initialized())
    await dist.destroy_process_group()
    print("Group destroyed; initialized:", dist.is_initialized())


if __name__ == "__main__":
    loop.run(main())
