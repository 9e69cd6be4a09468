"""One rank of the re-initialisation soak (issue 19), run as ``python -m tests.reinit_rank``.

``python -m tests.reinit_rank RANK WORLD URL CYCLES [swap]`` loops init -> all_reduce -> new_group ->
all_reduce(subgroup) -> destroy ``CYCLES`` times (``URL`` ``env://`` reads MASTER_ADDR/MASTER_PORT),
checks every sum (with ``swap`` the ranks rotate every cycle, so the process that hosts the
embedded server changes), and prints ``RESULT {json}``: the cycles done, the first error, the WARNING
records the library logged, and descriptors/threads/tasks after the first cycles and at the end.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
import threading
import time
from typing import Any

import numpy as np

import arendez as dist
from arendez.loop import run

ELEMENTS = 64 * 1024


class _Count(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(f"{record.name}: {record.getMessage()}")


def _usage() -> dict[str, int]:
    return {
        "fds": len(os.listdir("/proc/self/fd")),
        "threads": threading.active_count(),
        "tasks": len(asyncio.all_tasks()),
    }


async def cycles(first: int, world: int, url: str, count: int, swap: bool = False) -> dict[str, Any]:
    x = np.ones(ELEMENTS, np.float32)
    rank = first
    others = list(range(1, world))  # the subgroup leaves rank 0 out when the world allows
    members = others if len(others) >= 2 else list(range(world))
    early: dict[str, int] = {}
    started = time.monotonic()
    for i in range(count):
        rank = (first + i) % world if swap else first
        try:
            await dist.init_process_group(init_method=url, world_size=world, rank=rank, timeout=20)
            x[:] = rank + 1
            await dist.all_reduce(x)
            want = world * (world + 1) / 2
            if x[0] != want or x[-1] != want:
                raise AssertionError(f"cycle {i}: all_reduce gave {x[0]}, want {want}")
            sub = await dist.new_group(members)
            x[:] = 1
            await dist.all_reduce(x, group=sub)
            want = len(members) if rank in members else 1
            if x[0] != want:
                raise AssertionError(f"cycle {i}: subgroup all_reduce gave {x[0]}, want {want}")
            await dist.destroy_process_group()
        except Exception as exc:
            return {"cycles": i, "error": f"cycle {i}: {type(exc).__name__}: {exc}"}
        if i == min(4, count - 1):
            early = _usage()
    seconds = time.monotonic() - started
    end = _usage()
    for _ in range(30):  # (a destroy's last sockets close on the loop's next turns, and its
        # lease thread ends on its own: a busy machine sampled them still there; a leak stays)
        if end["fds"] <= early.get("fds", 0) and end["threads"] <= early.get("threads", 0):
            break
        await asyncio.sleep(0.1)
        end = _usage()
    return {"cycles": count, "error": None, "seconds": seconds, "early": early, "end": end}


def main() -> None:
    rank, world, url, count = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    swap = sys.argv[5:] == ["swap"]
    if os.environ.get("REINIT_LOG"):  # timestamped log lines on stderr, for hunting a race
        fmt = "%(asctime)s.%(msecs)03d %(process)d %(name)s %(levelname)s %(message)s"
        logging.basicConfig(level=logging.DEBUG, format=fmt, datefmt="%X")
    counter = _Count()
    logging.getLogger("arendez").addHandler(counter)
    result = run(cycles(rank, world, url, count, swap))
    result["warnings"] = counter.records[:20]
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
