"""One rank of the multi-host benchmark: ``python multihost_rank.py SPEC_JSON``.

SPEC: backend (arendez | gloo), rank, world, master (host:port), sizes (bytes), iters, warmup.
Per size: one checked all_reduce (exact sum), warm-up calls, then ``iters`` timed calls, each
after a barrier. Prints one JSON line: per size, each call's wall time and the CPU seconds
(getrusage of the whole process, user + system, all threads) it cost this rank; for arendez also
the transport counters (``stats``: received and shared-memory bytes).
"""

from __future__ import annotations

import json
import resource
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np


def _cpu() -> tuple[float, float]:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime, usage.ru_stime


async def _measure(
    spec: dict[str, Any], reduce: Callable[[Any], Awaitable[None]], barrier: Callable[[], Awaitable[None]]
) -> dict[str, Any]:
    rank, world = spec["rank"], spec["world"]
    out: dict[str, Any] = {}
    for nbytes in spec["sizes"]:
        x = np.empty(nbytes // 4, np.float32)
        x.fill(rank + 1)
        await barrier()
        await reduce(x)
        ok = bool(np.all(x == world * (world + 1) / 2))
        for _ in range(spec["warmup"]):
            await barrier()
            await reduce(x)
        times, cpus, users = [], [], []
        for _ in range(spec["iters"]):
            await barrier()
            c0, t0 = _cpu(), time.perf_counter()
            await reduce(x)
            t1, c1 = time.perf_counter(), _cpu()
            times.append(t1 - t0)
            cpus.append(c1[0] + c1[1] - c0[0] - c0[1])
            users.append(c1[0] - c0[0])
        out[str(nbytes)] = {"ok": ok, "times": times, "cpu": cpus, "user": users}
    return out


async def _arendez(spec: dict[str, Any]) -> dict[str, Any]:
    import arendez as dist

    await dist.init_process_group(
        init_method=f"tcp://{spec['master']}", world_size=spec["world"], rank=spec["rank"], timeout=120
    )
    try:

        async def reduce(x: Any) -> None:
            await dist.all_reduce(x)

        result = await _measure(spec, reduce, dist.barrier)
        stats = dist.transport_stats()
        result["stats"] = {"received_bytes": stats.received_bytes, "shm_bytes": stats.shm_bytes}
        return result
    finally:
        await dist.destroy_process_group()


async def _gloo(spec: dict[str, Any]) -> dict[str, Any]:
    import datetime

    import torch
    import torch.distributed as d

    torch.set_num_threads(1)
    d.init_process_group(
        "gloo",
        init_method=f"tcp://{spec['master']}",
        world_size=spec["world"],
        rank=spec["rank"],
        timeout=datetime.timedelta(seconds=120),
    )
    try:

        async def reduce(x: Any) -> None:
            d.all_reduce(torch.from_numpy(x))

        async def barrier() -> None:
            d.barrier()

        return await _measure(spec, reduce, barrier)
    finally:
        d.destroy_process_group()


def main() -> int:
    spec = json.loads(sys.argv[1])
    if spec["backend"] == "gloo":
        import asyncio

        result = asyncio.run(_gloo(spec))
    else:
        from arendez import loop

        result = loop.run(_arendez(spec))
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
