"""Thousands of whole process groups against one arendez-server: a scale soak, not a race.

N simulated ranks run as asyncio tasks spread over P processes (each task has a registry of
its own, ``arendez.registry.fresh_context``). Every rank does what a training script does
around its first step: ``init_process_group("arendez://…", rank=-1)`` through a standalone
``arendez-server``, one ``all_reduce`` (checked), a ``barrier`` and ``destroy_process_group``.
The report gives the wall time, the slowest init, how many ranks finished, and every error by
kind: on a healthy run no rank is declared failed, times out or is lost.

It needs no torch: there is no torch peer for a process group per asyncio task (torch's
per-process default group), so this is arendez against itself across sessions
(``benchmarks/server_bench.py`` compares the rendezvous with TCPStore's).

Run it in a private network namespace (``--netns``): 10,000 ranks open about 150,000 loopback
connections, and a host whose firewall tracks connections (nf_conntrack, loaded by podman and
docker) drops packets once its table (``net.netfilter.nf_conntrack_max``) is full; a fresh
namespace tracks none.

    python benchmarks/pg_swarm.py --netns --ranks 5000 --procs 10
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import bench_common

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable


def _ranks(port: int, job: str, world: int, count: int, timeout: float) -> dict[str, Any]:
    """One worker process: ``count`` ranks of a job of ``world``; what became of them."""
    import numpy as np

    import arendez
    from arendez import loop, registry

    done: dict[str, Any] = {"ok": 0, "init_max": 0.0, "errors": []}

    async def rank() -> None:
        began = time.monotonic()
        try:
            url = f"arendez://127.0.0.1:{port}/{job}"
            await arendez.init_process_group(init_method=url, world_size=world, rank=-1, timeout=timeout)
            done["init_max"] = max(done["init_max"], time.monotonic() - began)
            x = np.ones(4, np.float32)
            await arendez.all_reduce(x)
            if x[0] != world:
                raise AssertionError(f"all_reduce gave {x[0]}, not {world}")
            await arendez.barrier()
            await arendez.destroy_process_group()
            done["ok"] += 1
        except Exception as exc:  # (reported by kind, not raised: the others go on)
            done["errors"].append(f"{type(exc).__name__}: {str(exc)[:600]}")

    async def main() -> None:
        running = asyncio.get_running_loop()
        await asyncio.gather(
            *(running.create_task(rank(), context=registry.fresh_context()) for _ in range(count))
        )

    loop.run(main())
    done["rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
    done["errors_total"] = len(done["errors"])
    done["errors"] = [f"{n} x {e}" for e, n in collections.Counter(done["errors"]).most_common(5)]
    return done


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run(ranks: int, procs: int, timeout: float) -> dict[str, Any]:
    """One swarm through a fresh server; its report."""
    port, http_port = _free_port(), _free_port()
    server = subprocess.Popen(
        [
            PY,
            "-m",
            "arendez_server",
            "--port",
            str(port),
            "--log-level",
            "WARNING",
            "--http-port",
            str(http_port),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    workers: list[subprocess.Popen[str]] = []
    try:
        assert server.stdout is not None and "listening" in server.stdout.readline()
        shares = [ranks // procs + (1 if i < ranks % procs else 0) for i in range(procs)]
        began = time.monotonic()
        for count in shares:
            cmd = [PY, __file__, "--worker", str(port), "swarm", str(ranks), str(count), str(timeout)]
            workers.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True))
        results = []
        for worker in workers:
            out, _ = worker.communicate(timeout=timeout * 3 + 60)
            lines = out.strip().splitlines()
            if lines:
                results.append(json.loads(lines[-1]))
            else:  # (killed: by the kernel's OOM killer if dmesg says so)
                lost = f"worker process ended with {worker.returncode} and no report"
                results.append({"ok": 0, "init_max": 0.0, "rss_mib": 0, "errors_total": 1, "errors": [lost]})
        seconds = time.monotonic() - began
        departures = _departures(http_port)
    finally:
        for proc in [*workers, server]:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
    errors = [e for r in results for e in r["errors"]]
    return {
        "ranks": ranks,
        "procs": procs,
        "seconds": round(seconds, 1),
        "init_max": round(max(r["init_max"] for r in results), 1),
        "rss_mib": max(r["rss_mib"] for r in results),
        "ok": sum(r["ok"] for r in results),
        "errors": sum(r["errors_total"] for r in results),
        "error_kinds": errors[:10],
        "left": departures.get("left", 0),
        "failed": departures.get("failed", 0),
    }


def _departures(http_port: int) -> dict[str, int]:
    """The server's count of ranks that left and that it declared failed (its /metrics)."""
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/metrics", timeout=10) as page:
        text = page.read().decode()
    found: dict[str, int] = {}
    for line in text.splitlines():
        if line.startswith("arendez_departures_total{"):
            kind = line.split('kind="', 1)[1].split('"', 1)[0]
            found[kind] = int(float(line.rsplit(" ", 1)[1]))
    return found


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[2000, 5000])
    p.add_argument("--procs", type=int, default=10)
    p.add_argument("--timeout", type=float, default=300.0, help="init and collective timeout of every rank")
    p.add_argument("--netns", action="store_true", help="re-run inside unshare -n with loopback up")
    p.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        port, job, world, count, timeout = args.worker
        print(json.dumps(_ranks(int(port), job, int(world), int(count), float(timeout))), flush=True)
        return 0
    if args.netns and (status := bench_common.rerun_in_netns(__file__)) is not None:
        return status
    print(
        "| ranks | processes | wall s | slowest init s | finished | errors | left | declared failed "
        "| peak MiB per process |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for n in args.ranks:
        r = run(n, args.procs, args.timeout)
        print(
            f"| {r['ranks']} | {r['procs']} | {r['seconds']} | {r['init_max']} | {r['ok']} | {r['errors']} "
            f"| {r['left']} | {r['failed']} | {r['rss_mib']} |",
            flush=True,
        )
        for kind in r["error_kinds"]:
            print(f"  {kind}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
