"""Re-initialisation soak: init -> all_reduce -> new_group -> all_reduce(subgroup) -> destroy, in a loop.

Every rank is a real process. Two server kinds run side by side in one invocation, and the peer:

- ``embedded``: ``tcp://127.0.0.1:PORT`` (or ``env://`` with MASTER_ADDR/MASTER_PORT): rank 0 hosts the
  server in its own event loop;
- ``standalone``: an ``arendez-server`` process, ranks join ``arendez://127.0.0.1:PORT``;
- ``gloo`` (when torch is installed): the same loop on ``torch.distributed`` with gloo, ``tcp://``
  (rank 0's TCPStore), on torch tensors, on a new port each cycle: through one port gloo failed
  within a few cycles (``Gloo connectFullMesh failed ... Connection refused``: a rank met the
  previous cycle's store). Run it with ``--netns`` (a private network namespace): TCPStore
  reverse-resolves its peers and stalls on the resolver here.

It reports cycles per second and milliseconds per cycle (median and p99 of rank 0's cycles) for each,
the ratio embedded/standalone, and the count of ``WARNING`` lines the ranks logged (a planned destroy
should log none). A cycle that fails or a rank that hangs past its bound is reported and makes the
exit status non-zero.

    python benchmarks/reinit_soak.py --netns              # 2 ranks, 300 cycles per kind
    python benchmarks/reinit_soak.py --cycles 1000 --ranks 4 --init env
    python benchmarks/reinit_soak.py --kinds embedded --cycles 600 --trace   # timestamped log lines
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import bench_common

ROOT = Path(__file__).resolve().parent.parent
ELEMENTS = 64 * 1024  # float32: 256 KiB, as in issue 19
GLOO_BASE_PORT = 20000


# -- the rank side ---------------------------------------------------------------------------
class _Record:
    """One rank's cycle times and their phases (init, the collectives, destroy)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.phases: dict[str, list[float]] = {"init": [], "collectives": [], "destroy": []}

    def add(self, start: float, t_init: float, t_ops: float, end: float) -> None:
        self.times.append(end - start)
        self.phases["init"].append(t_init - start)
        self.phases["collectives"].append(t_ops - t_init)
        self.phases["destroy"].append(end - t_ops)

    def failed(self, rank: int, cycle: int, exc: BaseException) -> dict[str, Any]:
        logging.getLogger("soak").error("rank %d cycle %d failed: %r", rank, cycle, exc)
        traceback.print_exc()
        return {"ok": False, "cycle": cycle, "error": repr(exc), "times": self.times}

    def result(self) -> dict[str, Any]:
        medians = {k: 1000 * statistics.median(v) for k, v in self.phases.items()}
        worst = max(range(len(self.times)), key=self.times.__getitem__)
        slowest = {"cycle": worst, **{k: 1000 * v[worst] for k, v in self.phases.items()}}
        done = len(self.times)
        return {"ok": True, "cycles": done, "times": self.times, "phase_ms": medians, "slowest_ms": slowest}


async def _cycles(rank: int, world: int, url: str, cycles: int, timeout: float) -> dict[str, Any]:
    import numpy as np

    import arendez as dist

    record = _Record()
    x = np.ones(ELEMENTS, np.float32)
    init_method = None if url == "env://" else url
    for i in range(cycles):
        start = time.perf_counter()
        try:
            await dist.init_process_group(
                init_method=init_method or "env://", world_size=world, rank=rank, timeout=timeout
            )
            t_init = time.perf_counter()
            x[:] = 1
            await dist.all_reduce(x)
            assert float(x[0]) == world, f"cycle {i}: all_reduce gave {x[0]}, want {world}"
            sub = await dist.new_group(list(range(world)))
            await dist.all_reduce(x, group=sub)
            assert float(x[0]) == world * world, f"cycle {i}: subgroup all_reduce gave {x[0]}"
            t_ops = time.perf_counter()
            await dist.destroy_process_group()
        except BaseException as exc:
            return record.failed(rank, i, exc)
        record.add(start, t_init, t_ops, time.perf_counter())
    return record.result()


def _gloo_cycles(rank: int, world: int, url: str, cycles: int, timeout: float) -> dict[str, Any]:
    """The same loop on torch.distributed with gloo (the peer)."""
    import datetime

    import torch
    import torch.distributed as tdist

    record = _Record()
    x = torch.ones(ELEMENTS, dtype=torch.float32)
    limit = datetime.timedelta(seconds=timeout)
    for i in range(cycles):
        start = time.perf_counter()
        try:
            host, port = url.rsplit(":", 1)
            fresh = f"{host}:{int(port) + i}"  # (see the module docstring)
            tdist.init_process_group("gloo", init_method=fresh, world_size=world, rank=rank, timeout=limit)
            t_init = time.perf_counter()
            x[:] = 1
            tdist.all_reduce(x)
            assert float(x[0]) == world, f"cycle {i}: all_reduce gave {x[0]}, want {world}"
            sub = tdist.new_group(list(range(world)))
            tdist.all_reduce(x, group=sub)
            assert float(x[0]) == world * world, f"cycle {i}: subgroup all_reduce gave {x[0]}"
            t_ops = time.perf_counter()
            tdist.destroy_process_group()
        except BaseException as exc:
            return record.failed(rank, i, exc)
        record.add(start, t_init, t_ops, time.perf_counter())
    return record.result()


def worker(args: argparse.Namespace) -> int:
    fmt = "%(asctime)s.%(msecs)03d %(process)d %(name)s %(levelname)s %(message)s"
    logging.basicConfig(level=logging.DEBUG if args.trace else logging.WARNING, format=fmt, datefmt="%X")
    if args.kind == "gloo":
        result = _gloo_cycles(args.rank, args.ranks, args.url, args.cycles, args.timeout)
        print("RESULT " + json.dumps(result), flush=True)
        return 0 if result["ok"] else 1
    from arendez.loop import run

    result = run(_cycles(args.rank, args.ranks, args.url, args.cycles, args.timeout))
    print("RESULT " + json.dumps(result), flush=True)
    return 0 if result["ok"] else 1


# -- the driver ------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _env(extra: dict[str, str]) -> dict[str, str]:
    env = dict(os.environ)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "ARENDEZ_URL"):
        env.pop(name, None)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def start_standalone() -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "arendez_server", "--port", "0", "--log-level", "WARNING"],
        stdout=subprocess.PIPE,
        text=True,
        env=_env({}),
        start_new_session=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if "listening on" not in line:
        proc.kill()
        raise RuntimeError(f"arendez-server did not start: {line!r}")
    return proc, line.strip().rsplit(" ", 1)[-1]


def run_kind(kind: str, args: argparse.Namespace) -> dict[str, Any]:
    """Run the loop on ``args.ranks`` processes through one server kind; return the summary."""
    server = None
    extra: dict[str, str] = {}
    if kind == "standalone":
        server, url = start_standalone()
    elif kind == "gloo":  # (ports from here on, one per cycle: below the kernel's ephemeral ones)
        url = f"tcp://127.0.0.1:{GLOO_BASE_PORT}"
    elif args.init == "env":
        url = "env://"
        extra = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(args.ranks)}
    else:
        url = f"tcp://127.0.0.1:{free_port()}"
    logs = [tempfile.TemporaryFile("w+") for _ in range(args.ranks)]  # noqa: SIM115
    procs = []
    began = time.perf_counter()
    try:
        for rank in range(args.ranks):
            argv = [sys.executable, __file__, "--worker", "--rank", str(rank), "--ranks", str(args.ranks)]
            argv += ["--url", url, "--cycles", str(args.cycles), "--timeout", str(args.timeout)]
            argv += ["--kind", kind]
            argv += ["--trace"] if args.trace else []
            env = _env({**extra, "RANK": str(rank)} if extra else {})
            procs.append(
                subprocess.Popen(
                    argv,
                    stdout=subprocess.PIPE,
                    stderr=logs[rank],
                    text=True,
                    env=env,
                    start_new_session=True,
                )
            )
        outs = []
        deadline = time.monotonic() + args.bound
        for proc in procs:
            try:
                out, _ = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                out = ""
            outs.append(out)
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        if server is not None:
            server.send_signal(signal.SIGTERM)
            try:
                server.wait(10)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
    elapsed = time.perf_counter() - began
    results: list[dict[str, Any]] = []
    stderr: list[str] = []
    for out, log in zip(outs, logs, strict=True):
        lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
        results.append(json.loads(lines[-1][7:]) if lines else {"ok": False, "error": "no result (hung?)"})
        log.seek(0)
        stderr.append(log.read())
        log.close()
    times = results[0].get("times") or [float("nan")]
    done = min(len(r.get("times", [])) for r in results)
    warnings = sum(text.count(" WARNING ") + text.count("WARNING:") for text in stderr)
    summary = {
        "kind": kind,
        "init": url.split(":", 1)[0],
        "ranks": args.ranks,
        "cycles": done,
        "ok": all(r["ok"] for r in results),
        "seconds": elapsed,
        "cycles_per_s": done / elapsed if elapsed else 0.0,
        "ms_median": 1000 * statistics.median(times),
        "ms_p99": 1000 * sorted(times)[int(0.99 * (len(times) - 1))],
        "ms_max": 1000 * max(times),
        "warnings": warnings,
        "phase_ms": [r.get("phase_ms") for r in results],
        "slowest_ms": [r.get("slowest_ms") for r in results],
        "errors": [r.get("error") for r in results if not r["ok"]],
    }
    if not summary["ok"] or args.trace:
        for rank, text in enumerate(stderr):
            path = Path(tempfile.gettempdir()) / f"reinit_soak_{kind}_rank{rank}.log"
            path.write_text(text)
            summary.setdefault("logs", []).append(str(path))
    return summary


KINDS = ("embedded", "standalone", "gloo")


def _has_torch() -> bool:
    import importlib.util

    return importlib.util.find_spec("torch") is not None


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cycles", type=int, default=300)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument(
        "--kinds", nargs="+", choices=KINDS, default=[k for k in KINDS if k != "gloo" or _has_torch()]
    )
    parser.add_argument("--init", choices=["tcp", "env"], default="tcp", help="how the embedded kind joins")
    parser.add_argument("--timeout", type=float, default=20.0, help="init/collective timeout per cycle (s)")
    parser.add_argument("--bound", type=float, default=600.0, help="seconds before a kind's ranks are killed")
    parser.add_argument("--trace", action="store_true", help="DEBUG log lines with timestamps, kept in /tmp")
    parser.add_argument("--json", type=Path, help="also write the summaries here")
    parser.add_argument("--netns", action="store_true", help="re-run inside unshare -n with loopback up")
    # the rank side (internal)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--kind", default="embedded", help=argparse.SUPPRESS)
    parser.add_argument("--url", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    if args.netns and (status := bench_common.rerun_in_netns(__file__, torch=True)) is not None:
        return status
    if args.cycles < 1 or args.ranks < 2:
        parser.error("--cycles must be >= 1 and --ranks >= 2")
    summaries = []
    for kind in args.kinds:
        summary = run_kind(kind, args)
        summaries.append(summary)
        print(json.dumps(summary), file=sys.stderr, flush=True)
    print("| kind | init | ranks | cycles | cycles/s | ms/cycle median | p99 | max | warnings | ok |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for s in summaries:
        print(
            f"| {s['kind']} | {s['init']} | {s['ranks']} | {s['cycles']} | {s['cycles_per_s']:.1f} | "
            f"{s['ms_median']:.1f} | {s['ms_p99']:.1f} | {s['ms_max']:.1f} | {s['warnings']} | {s['ok']} |"
        )
    by_kind = {s["kind"]: s for s in summaries}
    if "embedded" in by_kind and "standalone" in by_kind:
        ratio = by_kind["embedded"]["ms_median"] / by_kind["standalone"]["ms_median"]
        print(f"\nembedded / standalone, median ms per cycle: {ratio:.2f}x")
    if "gloo" in by_kind:
        for kind in ("embedded", "standalone"):
            if kind in by_kind:
                ratio = by_kind["gloo"]["ms_median"] / by_kind[kind]["ms_median"]
                print(f"gloo / {kind}, median ms per cycle: {ratio:.2f}x (above 1: arendez is faster)")
    if args.json:
        args.json.write_text(json.dumps(summaries, indent=2))
    return 0 if all(s["ok"] for s in summaries) else 1


if __name__ == "__main__":
    sys.exit(main())
