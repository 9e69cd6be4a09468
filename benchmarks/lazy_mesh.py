"""Peer connections of a W-rank job of real processes: opened on first use vs all pairs.

Starts one ``arendez-server`` and W rank processes (each one ``init_process_group`` over
``arendez://``), and reports, per rank and in total: the peer connections open after init,
after the first (small) and a large ``all_reduce``, how long init took, and the latency of the
first and of a later small ``all_reduce`` (the first one pays for any connection it opens).

``--compare PATH`` runs the same job a second time with the ranks importing ``arendez`` from
another checkout (e.g. ``/work/main`` before lazy connections: every pair at init), in the same
run, and prints both. Only the ranks' code differs: the server is this tree's.

    python benchmarks/lazy_mesh.py --world 64 --compare /work/main
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable


async def _rank(url: str, world_size: int, rank: int) -> dict[str, Any]:
    import numpy as np

    import arendez as dist

    start = time.perf_counter()
    await dist.init_process_group(init_method=url, world_size=world_size, rank=rank, timeout=120)
    init = time.perf_counter() - start
    world = dist.current_world()
    at_init = len(world.mesh.conns)
    store = world.store
    await store.set(f"init-{rank}", "1")  # a barrier that opens no peer connection
    await store.wait([f"init-{r}" for r in range(world_size)], timeout=120)
    x = np.ones(16, np.float32)
    start = time.perf_counter()
    await dist.all_reduce(x)
    first = time.perf_counter() - start
    after_first = len(world.mesh.conns)
    y = np.ones(1 << 20, np.float32)  # 4 MiB: the large-message algorithm
    await dist.all_reduce(y)
    after_large = len(world.mesh.conns)
    later = []
    for _ in range(5):
        start = time.perf_counter()
        await dist.all_reduce(x)
        later.append(time.perf_counter() - start)
    assert float(x[0]) == float(world_size) ** 6 and float(y[0]) == world_size, (x[0], y[0])
    await dist.destroy_process_group(timeout=30)
    return {
        "rank": rank,
        "init_s": init,
        "conns_init": at_init,
        "conns_first": after_first,
        "conns_large": after_large,
        "first_ms": first * 1e3,
        "later_ms": statistics.median(later) * 1e3,
    }


def _run_job(
    port: int, world_size: int, pythonpath: str, job: str, timeout: float, log_dir: str
) -> list[dict[str, Any]]:
    env = dict(os.environ, PYTHONPATH=pythonpath, PYTHONUNBUFFERED="1")
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "ARENDEZ_URL"):
        env.pop(name, None)
    url = f"arendez://127.0.0.1:{port}/{job}"
    if log_dir:
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        logs = [open(Path(log_dir, f"{job}-rank{r}.log"), "w+") for r in range(world_size)]  # noqa: SIM115
    else:
        logs = [tempfile.TemporaryFile("w+") for _ in range(world_size)]  # noqa: SIM115
    procs = [
        subprocess.Popen(
            [PY, __file__, "--rank", str(r), "--world", str(world_size), "--url", url],
            stdout=subprocess.PIPE,
            stderr=logs[r],
            text=True,
            env=env,
            cwd=pythonpath,
        )
        for r in range(world_size)
    ]
    deadline = time.monotonic() + timeout
    try:
        while any(p.poll() is None for p in procs):  # a failed rank ends the run at once
            failed = [r for r, p in enumerate(procs) if p.returncode not in (None, 0)]
            if failed or time.monotonic() > deadline:
                r = failed[0] if failed else 0
                logs[r].seek(0)
                why = f"rank {r} failed" if failed else f"not done in {timeout:g}s; rank 0"
                raise RuntimeError(f"{why}: {logs[r].read()[-3000:]}")
            time.sleep(0.1)
        out = []
        for r, p in enumerate(procs):
            if p.returncode != 0:
                logs[r].seek(0)
                raise RuntimeError(f"rank {r} failed: {logs[r].read()[-3000:]}")
            assert p.stdout is not None
            out.append(json.loads(p.stdout.read().strip().splitlines()[-1]))
        return out
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for f in logs:
            f.close()


def _summary(name: str, ranks: list[dict[str, Any]], world_size: int) -> dict[str, Any]:
    def pairs(key: str) -> int:
        return sum(r[key] for r in ranks) // 2

    return {
        "tree": name,
        "W": world_size,
        "all_pairs": world_size * (world_size - 1) // 2,
        "pairs_init": pairs("conns_init"),
        "pairs_after_first_all_reduce": pairs("conns_first"),
        "pairs_after_large_all_reduce": pairs("conns_large"),
        "per_rank_init_max": max(r["conns_init"] for r in ranks),
        "init_s_max": round(max(r["init_s"] for r in ranks), 2),
        "first_all_reduce_ms_median": round(statistics.median(r["first_ms"] for r in ranks), 2),
        "first_all_reduce_ms_max": round(max(r["first_ms"] for r in ranks), 2),
        "later_all_reduce_ms_median": round(statistics.median(r["later_ms"] for r in ranks), 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, default=64)
    ap.add_argument("--compare", default="", help="another checkout to run the same job with")
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument(
        "--lease",
        type=float,
        default=30.0,
        help="the server's lease: 64 processes on 2 busy cores can miss the default 2.5 s",
    )
    ap.add_argument("--logs", default="", help="keep each rank's stderr in this directory")
    ap.add_argument("--rank", type=int, default=-1, help=argparse.SUPPRESS)
    ap.add_argument("--url", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank >= 0:
        from arendez import loop

        print(json.dumps(loop.run(_rank(args.url, args.world, args.rank))), flush=True)
        return
    server = subprocess.Popen(
        [
            PY,
            "-m",
            "arendez_server",
            "--port",
            "0",
            "--host",
            "127.0.0.1",
            "--log-level",
            "WARNING",
            "--lease",
            str(args.lease),
        ],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    try:
        assert server.stdout is not None
        line = server.stdout.readline()
        port = int(line.strip().rsplit(":", 1)[1])
        trees = [("this tree", str(ROOT))] + ([(args.compare, args.compare)] if args.compare else [])
        rows = []
        for i, (name, path) in enumerate(trees):
            print(f"running W={args.world} with {name} ...", file=sys.stderr, flush=True)
            ranks = _run_job(port, args.world, path, f"lazy-{i}-{os.getpid()}", args.timeout, args.logs)
            rows.append(_summary(name, ranks, args.world))
        keys = list(rows[0])
        print("| " + " | ".join(keys) + " |")
        print("|" + "---|" * len(keys))
        for row in rows:
            print("| " + " | ".join(str(row[k]) for k in keys) + " |")
    finally:
        server.terminate()
        server.wait(10)


if __name__ == "__main__":
    main()
