"""What the flight recorder costs per collective: an 8-byte all_reduce with it on and off.

::

    python benchmarks/flightrec_overhead.py [--iters 20000] [--rounds 5] [--procs]

Three figures:

- *recording alone*: ``Recorder.begin`` + the start stamp + ``Recorder.end`` on a real ``Op``
  of a live world, timed in a tight loop (what the hot path adds, without the noise of the
  collective around it);
- *in-process*: two ranks of one event loop (``arendez.testing.run_ranks``) run ``--iters``
  8-byte all_reduces, rounds alternating ``ARENDEZ_FLIGHT_RECORDER=1000`` and ``=0``;
- with ``--procs``: the same between two real processes over loopback (``arendez-run``).

The machine is shared: read the ranges, not one number.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time

import numpy as np

import arendez as dist
from arendez.group import Op
from arendez.testing import run_ranks


async def _reduce_loop(rank: int, iters: int) -> float:
    x = np.ones(2, np.float32)
    for _ in range(200):
        await dist.all_reduce(x, dist.ReduceOp.MAX)  # (MAX: the values stay finite)
    start = time.perf_counter()
    for _ in range(iters):
        await dist.all_reduce(x, dist.ReduceOp.MAX)
    return (time.perf_counter() - start) / iters * 1e6


async def _recording_alone(rank: int, iters: int) -> float:
    world = dist.current_world()
    group = world.groups[0]
    flight = world.flight
    op = Op(group, 0, "all_reduce", "all_reduce|<f4|2|SUM")
    start = time.perf_counter()
    for _ in range(iters):
        entry = flight.begin(op)
        assert entry is not None
        entry.started = time.time_ns()
        flight.end(entry, op)
    return (time.perf_counter() - start) / iters * 1e6


def in_process(iters: int, rounds: int) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"on": [], "off": []}
    for _ in range(rounds):
        for mode, size in (("on", "1000"), ("off", "0")):
            os.environ["ARENDEZ_FLIGHT_RECORDER"] = size
            per_op = asyncio.run(run_ranks(2, _reduce_loop, iters, timeout=300))
            out[mode].append(max(per_op))
    os.environ["ARENDEZ_FLIGHT_RECORDER"] = "1000"
    alone = [asyncio.run(run_ranks(1, _recording_alone, iters * 5))[0] for _ in range(rounds)]
    out["recording alone"] = alone
    return out


RANK_SCRIPT = """
import asyncio, json, os, time
import numpy as np
import arendez as dist

async def main():
    await dist.init_process_group()
    x = np.ones(2, np.float32)
    for _ in range(200):
        await dist.all_reduce(x, dist.ReduceOp.MAX)
    start = time.perf_counter()
    for _ in range(ITERS):
        await dist.all_reduce(x, dist.ReduceOp.MAX)
    took = (time.perf_counter() - start) / ITERS * 1e6
    rank = dist.get_rank()
    await dist.destroy_process_group()
    if rank == 0:
        print("PER_OP_US", took, flush=True)

asyncio.run(main())
"""


def processes(iters: int, rounds: int, script: str) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"on": [], "off": []}
    for _ in range(rounds):
        for mode, size in (("on", "1000"), ("off", "0")):
            env = dict(os.environ, ARENDEZ_FLIGHT_RECORDER=size)
            done = subprocess.run(
                ["arendez-run", "--nproc", "2", script], capture_output=True, text=True, env=env, timeout=300
            )
            lines = [ln for ln in done.stdout.splitlines() if "PER_OP_US" in ln]  # ("[rank 0] PER_OP_US x")
            if not lines:
                raise RuntimeError(f"arendez-run failed ({done.returncode}):\n{done.stderr[-2000:]}")
            line = lines[0]
            out[mode].append(float(line.split()[-1]))
    return out


def _summary(name: str, figures: dict[str, list[float]]) -> None:
    for mode, values in figures.items():
        lo, med, hi = min(values), statistics.median(values), max(values)
        print(f"{name:12s} {mode:16s} median {med:7.2f} us/op  range {lo:.2f}-{hi:.2f}")
    if figures["on"] and figures["off"]:
        diff = statistics.median(figures["on"]) - statistics.median(figures["off"])
        print(f"{name:12s} {'on - off':16s} {diff:+.2f} us/op (median of each)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--procs", action="store_true", help="also two real processes (arendez-run)")
    args = parser.parse_args()
    figures = in_process(args.iters, args.rounds)
    _summary("in-process", figures)
    if args.procs:
        script = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"flightrec-bench-{os.getpid()}.py")
        with open(script, "w") as f:
            f.write(RANK_SCRIPT.replace("ITERS", str(args.iters)))
        try:
            _summary("2 processes", processes(args.iters, args.rounds, script))
        finally:
            os.unlink(script)
    print(f"python {sys.version.split()[0]}, load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
