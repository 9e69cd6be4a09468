"""How long after a rank cancels a collective its peer gets ``CollectiveCancelledError``.

::

    python benchmarks/cancel_latency.py [--iters 20] [--sizes 16MiB 64MiB] [--shm]

Two real rank processes and one ``python -m arendez_server`` on loopback. Per iteration, after a
barrier: rank 0 broadcasts ``S`` bytes (``broadcast(x, src=0)``), rank 1 receives them and
cancels its task 2 ms into it (a large payload is then half-received; the rest is thrown
away). Rank 0, still sending, fails with ``CollectiveCancelledError``; the figure is
the time from rank 1's ``task.cancel()`` to that error on rank 0 (``CLOCK_MONOTONIC`` is shared
by the processes of one Linux host). Iterations where the broadcast completed before the cancel
are counted, not timed. The second figure is the issue's case: rank 0 cancels its
``all_reduce`` before rank 1 reaches it; rank 1's call then fails at once (time from its call
to the error). Every iteration ends with an exact ``all_reduce`` checked on both ranks.

There is no gloo figure to compare: gloo has no cancellation (its peers wait for the timeout).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
UNITS = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}


def parse_size(text: str) -> int:
    for unit, factor in UNITS.items():
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * factor)
    return int(text)


async def rank_main(rank: int, url: str, sizes: list[int], iters: int) -> dict[str, Any]:
    import numpy as np

    import arendez as dist

    await dist.init_process_group(init_method=url, world_size=2, rank=rank, timeout=60)
    loop = asyncio.get_running_loop()
    out: dict[str, Any] = {"waiting": {}, "late": []}
    check = np.ones(16)
    for size in sizes:
        x = np.zeros(size // 4, np.float32)
        marks: list[float | None] = []
        for _ in range(iters):
            await dist.barrier()
            task = loop.create_task(dist.broadcast(x, src=0))
            mark: float | None = None
            if rank == 1:
                await asyncio.sleep(0.002)  # the payload is streaming in
                mark = time.monotonic()
                task.cancel()
            try:
                await task
                mark = None  # over before the cancel: not timed
            except asyncio.CancelledError:
                pass
            except dist.CollectiveCancelledError:
                mark = time.monotonic()
            marks.append(mark)
            check.fill(1.0)
            await dist.all_reduce(check)
            assert float(check.sum()) == 32.0
        out["waiting"][str(size)] = marks
    for _ in range(iters):
        await dist.barrier()
        y = np.ones(1000)
        if rank == 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(dist.all_reduce(y), 0.0001)
        else:
            await asyncio.sleep(0.02)
            start = time.monotonic()
            try:
                await dist.all_reduce(y)
            except dist.CollectiveCancelledError:
                out["late"].append(time.monotonic() - start)
        check.fill(1.0)
        await dist.all_reduce(check)
        assert float(check.sum()) == 32.0
    await dist.destroy_process_group()
    return out


def start_server() -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "arendez_server",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--log-level",
            "WARNING",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if "listening on" not in line:
        proc.kill()
        raise SystemExit(f"server did not start: {line!r}")
    return proc, line.strip().rsplit(" ", 1)[-1]


def summary(values: list[float]) -> str:
    if not values:
        return "no timed iterations"
    ms = sorted(v * 1e3 for v in values)
    return f"median {statistics.median(ms):.3f} ms, min {ms[0]:.3f}, max {ms[-1]:.3f} ms (n={len(ms)})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--sizes", nargs="+", default=["16MiB", "64MiB"])
    parser.add_argument("--shm", action="store_true", help="allow shared memory (default: TCP only)")
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    args = parser.parse_args()
    sizes = [parse_size(s) for s in args.sizes]
    if args.rank is not None:
        from arendez import loop

        print("RESULT " + json.dumps(loop.run(rank_main(args.rank, args.url, sizes, args.iters))), flush=True)
        return
    server, base = start_server()
    env = dict(os.environ, ARENDEZ_SHM="1" if args.shm else "0")
    env["PYTHONPATH"] = str(HERE.parent) + os.pathsep + env.get("PYTHONPATH", "")
    url = f"{base}/cancel-latency-{os.getpid()}"
    argv = [sys.executable, __file__, "--iters", str(args.iters), "--sizes", *args.sizes, "--url", url]
    procs = [
        subprocess.Popen([*argv, "--rank", str(r)], stdout=subprocess.PIPE, text=True, env=env)
        for r in range(2)
    ]
    try:
        results = []
        for proc in procs:
            stdout, _ = proc.communicate(timeout=300)
            lines = [ln for ln in stdout.splitlines() if ln.startswith("RESULT ")]
            if proc.returncode != 0 or not lines:
                raise SystemExit(f"a rank failed (exit {proc.returncode})")
            results.append(json.loads(lines[-1][len("RESULT ") :]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        server.terminate()
        server.wait(10)
    transport = "shm allowed" if args.shm else "TCP (ARENDEZ_SHM=0)"
    print(f"cancel -> peer's CollectiveCancelledError, 2 ranks, {transport}, {args.iters} iterations each")
    for size_text, size in zip(args.sizes, sizes, strict=True):
        cancel_at, error_at = results[1]["waiting"][str(size)], results[0]["waiting"][str(size)]
        gaps = [e - c for c, e in zip(cancel_at, error_at, strict=True) if c is not None and e is not None]
        late = sum(1 for c in cancel_at if c is None)
        print(
            f"  broadcast {size_text}, receiver cancels mid-payload: {summary(gaps)}; completed first: {late}"
        )
    print(
        f"  all_reduce cancelled before the peer arrived, peer's call -> error: {summary(results[1]['late'])}"
    )


if __name__ == "__main__":
    main()
