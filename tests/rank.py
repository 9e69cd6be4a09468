"""One rank of a test, as a process: ``python -m tests.rank [--join] MODULE:FUNCTION RANK WS URL ARGS``.

Runs ``FUNCTION(rank, world_size, url, *ARGS)`` (rank code that joins by itself, ``tests/jobs``)
or, with ``--join``, joins ``URL`` first, runs ``FUNCTION(rank, world_size, *ARGS)`` with the
default group initialised and destroys it after (``tests/conformance.py``). Prints
``RESULT <json>`` as its last line.
"""

from __future__ import annotations

import importlib
import json
import signal
import sys
from typing import Any

import arendez as dist
from arendez import loop


async def _main(join: bool, target: str, rank: int, ws: int, url: str, args: list[Any]) -> Any:
    module, _, name = target.partition(":")
    fn = getattr(importlib.import_module(module), name)
    if not join:
        return await fn(rank, ws, url, *args)
    await dist.init_process_group(init_method=url, world_size=ws, rank=rank, timeout=30)
    try:
        return await fn(rank, ws, *args)
    finally:
        await dist.destroy_process_group(timeout=5)


if __name__ == "__main__":
    # (a rank started under a background job, as `nohup .ci/run &`, inherits SIGINT ignored, and
    # asyncio then installs no Ctrl-C handler: the tests that press Ctrl-C want a terminal's)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    argv = sys.argv[1:]
    join = argv[0] == "--join"
    target, rank, ws, url, args = argv[1:6] if join else argv[:5]
    result = loop.run(_main(join, target, int(rank), int(ws), url, json.loads(args)))
    print("RESULT " + json.dumps(result), flush=True)
