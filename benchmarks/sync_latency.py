"""8 B all_reduce from a blocking caller: gloo vs ``arendez.sync``, each in processes of its own.

::

    python benchmarks/sync_latency.py [--ranks 2 4] [--rounds 3] [--iters 1000]

Each case starts ``--ranks`` fresh processes (this script re-run with ``--worker``) that join
over ``tcp://127.0.0.1:<free port>`` and time ``--iters`` calls of ``all_reduce`` on a torch tensor
of two float32 (after warm-up calls and a barrier), five times; the case's figure is rank 0's
median. Cases, alternating in every round so that all see the same machine load:

- ``gloo``: ``torch.distributed`` with gloo;
- ``arendez.sync``: the blocking facade as it comes: its loop thread kept on one CPU, and
  polling for a call's answer up to 1 ms when the host's ranks have a CPU each;
- ``arendez.sync, ARENDEZ_SPIN_US=0``: kept on one CPU, no polling;
- ``arendez.sync, neither``: also ``ARENDEZ_PIN_LOOP=0`` (as before both).

``ddp_bench.py`` measures the same call too, but with gloo as a second group in arendez's
processes, whose loop thread then shares them; here each backend has its processes to itself.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import time
from typing import Any

CASES: dict[str, dict[str, str]] = {
    "gloo": {},
    "arendez.sync": {"ARENDEZ_PIN_LOOP": "1", "ARENDEZ_SPIN_US": "1000"},
    "arendez.sync, ARENDEZ_SPIN_US=0": {"ARENDEZ_PIN_LOOP": "1", "ARENDEZ_SPIN_US": "0"},
    "arendez.sync, neither (ARENDEZ_PIN_LOOP=0 too)": {"ARENDEZ_PIN_LOOP": "0", "ARENDEZ_SPIN_US": "0"},
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(case: str, rank: int, world: int, port: int, iters: int) -> None:
    import torch

    dist: Any
    if case == "gloo":
        import torch.distributed as dist
    else:
        import arendez.sync as dist
    dist.init_process_group(
        "gloo" if case == "gloo" else "arendez",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
    )
    tensor = torch.ones(2)
    for _ in range(max(100, iters // 4)):
        dist.all_reduce(tensor)
    times = []
    for _ in range(5):
        dist.barrier()
        started = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(tensor)
        times.append((time.perf_counter() - started) / iters * 1e6)
    if rank == 0:
        print(f"RESULT {statistics.median(times):.1f}", flush=True)
    dist.destroy_process_group()


def _run(case: str, world: int, iters: int) -> float:
    port = _free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", **CASES[case])
    env.pop("LOCAL_RANK", None)
    argv = [sys.executable, __file__, "--worker", case, "--world", str(world), "--port", str(port)]
    procs = [
        subprocess.Popen(
            [*argv, "--rank", str(r), "--iters", str(iters)], env=env, stdout=subprocess.PIPE, text=True
        )
        for r in range(world)
    ]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit(f"{case}, {world} ranks: a rank failed")
    return float(next(line.split()[1] for line in outs[0].splitlines() if line.startswith("RESULT")))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=1000)
    ap.add_argument("--worker", metavar="CASE")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--port", type=int, default=0)
    args = ap.parse_args()
    if args.worker:
        _worker(args.worker, args.rank, args.world, args.port, args.iters)
        return
    print(f"load average at start: {os.getloadavg()[0]:.2f}")
    print("| ranks | case | µs per call, median of rounds (min-max) | vs gloo |")
    print("|---|---|---|---|")
    for world in args.ranks:
        seen: dict[str, list[float]] = {case: [] for case in CASES}
        order = list(CASES)
        for _ in range(args.rounds):
            for case in order:
                seen[case].append(_run(case, world, args.iters))
            order.reverse()
        gloo = statistics.median(seen["gloo"])
        for case, values in seen.items():
            mid = statistics.median(values)
            span = f"{min(values):.0f}-{max(values):.0f}"
            print(f"| {world} | {case} | {mid:.0f} ({span}) | {mid / gloo:.2f} |", flush=True)


if __name__ == "__main__":
    main()
