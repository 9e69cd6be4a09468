"""One rank of a test, as a process: ``python -m tests.rank MODULE:FUNCTION RANK WS URL ARGS``.

Joins ``URL`` as ``RANK`` of ``WS``, runs ``FUNCTION(rank, world_size, *ARGS)`` with the
default group initialised, destroys it, and prints ``RESULT <json>`` as its last line.
"""

from __future__ import annotations

import importlib
import json
import sys
from typing import Any

import arendez as dist
from arendez import loop


async def _main(target: str, rank: int, ws: int, url: str, args: list[Any]) -> Any:
    module, _, name = target.partition(":")
    fn = getattr(importlib.import_module(module), name)
    await dist.init_process_group(init_method=url, world_size=ws, rank=rank, timeout=30)
    try:
        return await fn(rank, ws, *args)
    finally:
        await dist.destroy_process_group(timeout=5)


if __name__ == "__main__":
    target, rank, ws, url, args = sys.argv[1:6]
    result = loop.run(_main(target, int(rank), int(ws), url, json.loads(args)))
    print("RESULT " + json.dumps(result), flush=True)
