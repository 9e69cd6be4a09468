"""A 2-rank job that checks every result while strangers attack a rank's peer listener."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

import arendez as dist
from tests.jobs import join


async def reduce_under_attack(rank: int, ws: int, url: str, out_dir: str) -> dict[str, Any]:
    """all_reduce until the test creates ``out_dir/stop`` (the decision to stop is itself
    reduced, so every rank runs the same steps); count results that are not exact."""
    await join(url, ws, rank)
    world = dist.current_world()
    Path(out_dir, f"rank-{rank}.json").write_text(json.dumps({"address": world.address, "pid": os.getpid()}))
    stop = Path(out_dir, "stop")
    x = np.empty(4096, np.float64)
    steps = wrong = 0
    deadline = time.monotonic() + 100.0
    while time.monotonic() < deadline:
        x[0] = 1.0 if stop.exists() else 0.0
        x[1:] = np.arange(1, x.size) * (rank + 1) + steps
        await dist.all_reduce(x)
        expected = np.arange(1, x.size) * sum(r + 1 for r in range(ws)) + ws * steps
        wrong += int(not np.array_equal(x[1:], expected))
        steps += 1
        if steps == 20:
            Path(out_dir, f"ready-{rank}").write_text("1")
        if x[0] > 0:
            break
    await dist.destroy_process_group(timeout=5)
    return {"steps": steps, "wrong": wrong}
