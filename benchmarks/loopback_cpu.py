"""all_reduce over loopback TCP only: arendez vs gloo, time and CPU per call, side by side.

    python benchmarks/loopback_cpu.py                          # 4 ranks, 16 and 64 MiB
    python benchmarks/loopback_cpu.py --lane-bytes 262144      # arendez with 256 KiB blocks
    python benchmarks/loopback_cpu.py --baseline /tmp/old      # also arendez from another tree
    python benchmarks/loopback_cpu.py --shm                    # arendez's default: shared memory
    perf record -F 1999 -o arendez.data -- python benchmarks/loopback_cpu.py --backends arendez
    perf report -i arendez.data --no-children --sort sym -n     # where its CPU goes

The ranks are ``multihost_rank.py``'s (one checked call, warm-ups, then timed calls after a
barrier each), started on this host with shared memory and local sockets off
(``ARENDEZ_SHM=0``, ``ARENDEZ_LOCAL_SOCKETS=0``): every byte crosses loopback TCP, as gloo's do.
Reports the median time of a call, its bus bandwidth, and the CPU seconds (user + system, all
threads, getrusage) one call costs a rank, mean over ranks and calls; then arendez/gloo ratios.
With ``--baseline DIR`` the ranks of an ``arendez@base`` row import the package from ``DIR`` (a
checkout, e.g. ``git archive main arendez | tar -x -C DIR``): before and after, in one run.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

RANK = str(Path(__file__).with_name("multihost_rank.py"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run(
    backend: str,
    world: int,
    sizes: list[int],
    iters: int,
    warmup: int,
    lane_bytes: int | None,
    base: str,
    shm: bool,
) -> Any:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if not shm:
        env.update(ARENDEZ_SHM="0", ARENDEZ_LOCAL_SOCKETS="0")
    if lane_bytes:
        env["ARENDEZ_TCP_LANE_BYTES"] = str(lane_bytes)
    if backend == "arendez@base":
        env["PYTHONPATH"] = os.pathsep.join(p for p in (base, env.get("PYTHONPATH", "")) if p)
        backend = "arendez"
    spec = {"backend": backend, "world": world, "master": f"127.0.0.1:{_free_port()}", "sizes": sizes}
    spec.update(iters=iters, warmup=warmup)
    procs = [
        subprocess.Popen(
            [sys.executable, RANK, json.dumps({**spec, "rank": r})],
            stdout=subprocess.PIPE,
            env=env,
            text=True,
        )
        for r in range(world)
    ]
    try:
        return [json.loads(p.communicate(timeout=600)[0].strip().splitlines()[-1]) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--sizes", type=int, nargs="+", default=[16, 64], help="MiB (default 16 64)")
    parser.add_argument("--backends", nargs="+", choices=["arendez", "gloo"], default=["arendez", "gloo"])
    parser.add_argument("--iters", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--lane-bytes", type=int, default=None, help="ARENDEZ_TCP_LANE_BYTES for arendez")
    parser.add_argument("--baseline", default="", help="also run arendez imported from this directory")
    parser.add_argument("--rounds", type=int, default=1, help="run every backend this many times, in turn")
    parser.add_argument("--shm", action="store_true", help="arendez's default (shared memory) instead of TCP")
    args = parser.parse_args()
    sizes = [mib << 20 for mib in args.sizes]
    backends = args.backends + (["arendez@base"] if args.baseline else [])
    found: dict[tuple[str, int], list[tuple[float, float, float]]] = {}
    print("| backend | ranks | size | time (median) | busbw GB/s | CPU ms per call (user) | checked |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for backend in backends * args.rounds:
        outs = _run(
            backend, args.ranks, sizes, args.iters, args.warmup, args.lane_bytes, args.baseline, args.shm
        )
        for n in sizes:
            key = str(n)
            t = statistics.median(x for o in outs for x in o[key]["times"])
            cpu = statistics.mean(x for o in outs for x in o[key]["cpu"])
            user = statistics.mean(x for o in outs for x in o[key]["user"])
            ok = all(o[key]["ok"] for o in outs)
            found.setdefault((backend, n), []).append((t, cpu, user))
            busbw = 2 * (args.ranks - 1) / args.ranks * n / t / 1e9
            print(
                f"| {backend} | {args.ranks} | {n >> 20} MiB | {t * 1e3:.1f} ms | {busbw:.2f} | "
                f"{cpu * 1e3:.1f} ({user * 1e3:.1f}) | {ok} |",
                flush=True,
            )
    if "gloo" in args.backends:
        print()
        for n in sizes:
            for backend in (b for b in backends if b != "gloo"):
                print(f"{n >> 20} MiB: {backend} {_ratios(found[(backend, n)], found[('gloo', n)])}")
    return 0


def _ratios(mine: list[tuple[float, float, float]], gloo: list[tuple[float, float, float]]) -> str:
    """Speed and CPU against gloo's, round by round (a range over the rounds)."""
    speed = sorted(g[0] / m[0] for m, g in zip(mine, gloo, strict=True))
    cpu = sorted(m[1] / g[1] for m, g in zip(mine, gloo, strict=True))
    return (
        f"{speed[0]:.2f}-{speed[-1]:.2f}x gloo's speed, {cpu[0]:.2f}-{cpu[-1]:.2f}x its CPU per call"
        f" ({len(mine)} round(s))"
    )


if __name__ == "__main__":
    sys.exit(main())
