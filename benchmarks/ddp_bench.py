"""DDP training step and 8 B all_reduce latency: torch backend "arendez" vs "gloo", one run.

::

    python benchmarks/ddp_bench.py [--ranks 2 4] [--steps 6] [--iters 2000] [--rounds 4] [--json out.json]

For every world size one set of rank processes (this script re-runs itself with ``--worker``)
joins over ``tcp://127.0.0.1:<free port>`` with the default group on backend ``arendez`` and a
second group over the same ranks on ``gloo``; the cases of the two backends alternate (in rounds,
order flipped each round), so both see the same machine load, which on a shared 2-core machine
swings by 2-3x within a minute. Every rank uses one intra-op thread (``torch.set_num_threads(1)``).

- DDP step: an MLP of about 25M float32 parameters (``--width`` x ``--depth`` linear layers), one
  model copy per backend with the same initial weights, DDP's default buckets (25 MiB, first
  1 MiB), SGD, ``--batch`` rows per rank; 2 warm-up steps, then ``--steps`` timed steps of each
  backend, alternating; a step's time is the max over ranks (barrier before each). The row shows
  the median and range, and the per-step ratio gloo/arendez (> 1: arendez faster). The compute part
  of a step is timed once on one process without DDP, so the communication share is visible.
- 8 B all_reduce (two float32): ``dist.all_reduce`` through each backend, ``arendez.sync.all_reduce``
  on a torch tensor, the async API awaited inside the loop (no thread hop: the floor), and the
  hop alone (a no-op coroutine through ``arendez.loop.shared``); per round, the median over
  ``--iters / --rounds`` calls after warm-up calls, max over ranks. Ratios are arendez/gloo
  (< 1: arendez faster).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def model(width: int, depth: int) -> Any:
    import torch

    torch.manual_seed(0)
    layers: list[Any] = [torch.nn.Linear(width, width)]
    for _ in range(depth - 1):
        layers += [torch.nn.ReLU(), torch.nn.Linear(width, width)]
    return torch.nn.Sequential(*layers)


def _max_over_ranks(dist: Any, value: float, group: Any = None) -> float:
    import torch

    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t.item())


def _mean_over_ranks(dist: Any, value: float, group: Any) -> float:
    import torch

    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, group=group)
    return float(t.item()) / dist.get_world_size()


def _cpu_seconds() -> float:
    """User + system CPU seconds of this process so far, all threads (gloo's and arendez's)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def worker(args: argparse.Namespace) -> dict[str, Any]:
    """One rank: the default group is arendez, ``gloo`` a gloo group over the same ranks; the
    cases of the two alternate in rounds, so both see the same machine load."""
    import torch
    import torch.distributed as dist

    import arendez
    import arendez.sync
    import arendez.torch  # registers the backend
    from arendez.loop import shared

    torch.set_num_threads(1)
    dist.init_process_group(
        "arendez",
        init_method=args.init,
        rank=args.rank,
        world_size=args.world_size,
        timeout=datetime.timedelta(seconds=120),
    )
    gloo = dist.new_group(backend="gloo")
    groups = {"gloo": gloo, "arendez": None}
    small = torch.ones(2)

    cpu: dict[str, list[float]] = {}

    def timed(call: Any, n: int, name: str = "") -> float:
        for _ in range(min(100, n)):
            call()
        dist.barrier(group=gloo)
        times = []
        c0 = _cpu_seconds()
        for _ in range(n):
            t0 = time.perf_counter()
            call()
            times.append(time.perf_counter() - t0)
        if name:
            cpu.setdefault(name, []).append(_mean_over_ranks(dist, (_cpu_seconds() - c0) / n, gloo))
        return _max_over_ranks(dist, statistics.median(times), gloo)

    async def in_loop(n: int) -> float:
        x = torch.ones(2)
        for _ in range(min(100, n)):
            await arendez.all_reduce(x, op="max")
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            await arendez.all_reduce(x, op="max")
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    async def noop() -> None:
        return None

    cases: dict[str, Any] = {
        "gloo: torch.distributed": lambda n: timed(
            lambda: dist.all_reduce(small, op=dist.ReduceOp.MAX, group=gloo), n, "gloo: torch.distributed"
        ),
        "arendez: torch.distributed": lambda n: timed(
            lambda: dist.all_reduce(small, op=dist.ReduceOp.MAX), n, "arendez: torch.distributed"
        ),
        "arendez: arendez.sync": lambda n: timed(
            lambda: arendez.sync.all_reduce(small, op="max"), n, "arendez: arendez.sync"
        ),
        "arendez: async API in the loop (no hop)": lambda n: _max_over_ranks(
            dist, shared.call(in_loop, n), gloo
        ),
        "arendez: hop only (no-op coroutine)": lambda n: timed(lambda: shared.call(noop), n),
    }
    lat: dict[str, list[float]] = {name: [] for name in cases}
    per_round = max(1, args.iters // args.rounds)
    for r in range(args.rounds):
        order = list(cases) if r % 2 == 0 else list(reversed(cases))
        for name in order:
            lat[name].append(cases[name](per_round))
    out: dict[str, Any] = {"latency": lat, "cpu": cpu}
    # DDP: one model copy per backend (same initial weights), steps alternating between them
    nets = {b: model(args.width, args.depth) for b in groups}
    out["params"] = sum(p.numel() for p in nets["gloo"].parameters())
    ddps = {b: torch.nn.parallel.DistributedDataParallel(nets[b], process_group=g) for b, g in groups.items()}
    opts = {b: torch.optim.SGD(ddps[b].parameters(), lr=1e-4) for b in groups}
    x = torch.randn(args.batch, args.width)
    steps: dict[str, list[float]] = {b: [] for b in groups}
    step_cpu: dict[str, list[float]] = {b: [] for b in groups}
    for i in range(2 + args.steps):
        order = list(groups) if i % 2 == 0 else list(reversed(groups))
        for b in order:
            dist.barrier(group=gloo)
            c0, t0 = _cpu_seconds(), time.perf_counter()
            opts[b].zero_grad()
            ddps[b](x).square().mean().backward()
            opts[b].step()
            took, used = time.perf_counter() - t0, _cpu_seconds() - c0
            took = _max_over_ranks(dist, took, gloo)
            used = _mean_over_ranks(dist, used, gloo)
            if i >= 2:
                steps[b].append(took)
                step_cpu[b].append(used)
    out["steps"] = steps
    out["step_cpu"] = step_cpu
    pairs = zip(nets["gloo"].parameters(), nets["arendez"].parameters(), strict=True)
    same = all(torch.allclose(p, q, rtol=1e-4, atol=1e-6) for p, q in pairs)
    out["same_weights_after"] = bool(same)
    dist.destroy_process_group()
    return out


def compute_only(args: argparse.Namespace) -> float:
    """One process, no communication: the forward/backward/step the DDP step contains."""
    import torch

    torch.set_num_threads(1)
    net = model(args.width, args.depth)
    opt = torch.optim.SGD(net.parameters(), lr=1e-4)
    x = torch.randn(args.batch, args.width)
    times = []
    for i in range(2 + args.steps):
        t0 = time.perf_counter()
        opt.zero_grad()
        net(x).square().mean().backward()
        opt.step()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run(ws: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    init = f"tcp://127.0.0.1:{_free_port()}"
    common = ["--width", str(args.width), "--depth", str(args.depth), "--batch", str(args.batch)]
    common += ["--steps", str(args.steps), "--iters", str(args.iters), "--rounds", str(args.rounds)]
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "ARENDEZ_URL"):
        env.pop(name, None)
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--worker",
                "--rank",
                str(r),
                "--world-size",
                str(ws),
                "--init",
                init,
                *common,
            ],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        for r in range(ws)
    ]
    results = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=args.timeout)
            if p.returncode != 0:
                raise RuntimeError(f"W={ws}: a rank exited {p.returncode}")
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return results


def _span(values: list[float], scale: float, unit: str) -> str:
    low, mid, high = min(values) * scale, statistics.median(values) * scale, max(values) * scale
    return f"{mid:.0f} {unit} ({low:.0f}-{high:.0f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--depth", type=int, default=6)  # 6 x (2048^2 + 2048) = 25.2M parameters
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--world-size", type=int, default=1)
    ap.add_argument("--init", default="")
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args)), flush=True)
        return
    report: dict[str, Any] = {"args": {k: v for k, v in vars(args).items() if k != "json"}, "runs": []}
    compute = compute_only(args)
    report["compute_only_step"] = compute
    rows, cpu_rows = [], []
    for ws in args.ranks:
        res = run(ws, args)[0]
        report["runs"].append({"world_size": ws, **res})
        g, a = res["steps"]["gloo"], res["steps"]["arendez"]
        ratio = [x / y for x, y in zip(g, a, strict=True)]
        rows.append(
            f"| DDP step, {res['params'] / 1e6:.1f}M params | {ws} | {_span(g, 1e3, 'ms')} | "
            f"{_span(a, 1e3, 'ms')} | {statistics.median(ratio):.2f}x faster "
            f"({min(ratio):.2f}-{max(ratio):.2f}) |"
        )
        gc, ac = res["step_cpu"]["gloo"], res["step_cpu"]["arendez"]
        share = [y / x for x, y in zip(gc, ac, strict=True)]
        cpu_rows.append(
            f"| DDP step | {ws} | {_span(gc, 1e3, 'ms')} | {_span(ac, 1e3, 'ms')} | "
            f"{statistics.median(share):.2f} of gloo ({min(share):.2f}-{max(share):.2f}) |"
        )
        gcpu = res["cpu"]["gloo: torch.distributed"]
        for name, values in res["cpu"].items():
            if name.startswith("gloo"):
                continue
            share = [y / x for x, y in zip(gcpu, values, strict=True)]
            cpu_rows.append(
                f"| 8 B all_reduce, {name} | {ws} | {_span(gcpu, 1e6, 'us')} | {_span(values, 1e6, 'us')} | "
                f"{statistics.median(share):.2f} of gloo ({min(share):.2f}-{max(share):.2f}) |"
            )
        lat = res["latency"]
        gl = lat["gloo: torch.distributed"]
        for name, values in lat.items():
            if name.startswith("gloo"):
                continue
            share = [v / x for v, x in zip(values, gl, strict=True)]
            rows.append(
                f"| 8 B all_reduce, {name} | {ws} | {_span(gl, 1e6, 'us')} | {_span(values, 1e6, 'us')} | "
                f"{statistics.median(share):.2f} of gloo ({min(share):.2f}-{max(share):.2f}) |"
            )
    print(f"compute part of a step (1 process, no DDP, before the runs): {compute * 1e3:.0f} ms")
    print("| case | ranks | gloo: median (min-max over rounds) | arendez | arendez vs gloo |")
    print("|---|---|---|---|---|")
    print("\n".join(rows))
    print()
    print("CPU seconds per call (user + system, all threads of a rank, mean over ranks; per round):")
    print("| case | ranks | gloo | arendez | arendez vs gloo |")
    print("|---|---|---|---|---|")
    print("\n".join(cpu_rows))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
