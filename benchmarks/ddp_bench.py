"""DDP training step and 8 B all_reduce latency: torch backend "arendez" vs "gloo", one run.

::

    python benchmarks/ddp_bench.py [--ranks 2 4] [--steps 6] [--iters 2000] [--json out.json]

For every world size, gloo then arendez, each in a fresh set of rank processes (this script
re-runs itself with ``--worker``), over ``tcp://127.0.0.1:<free port>``; every rank uses one
intra-op thread (``torch.set_num_threads(1)``) so the backends share the cores alike.

- DDP step: an MLP of about 25M float32 parameters (``--width``, ``--depth``), DDP's default
  buckets (25 MiB, first 1 MiB), SGD, a batch of ``--batch`` rows per rank; 2 warm-up steps, then
  ``--steps`` timed steps; a step's time is the max over ranks (barrier before each), the median
  is reported. The compute part of a step is also timed on one process without DDP, so the
  communication share is visible.
- 8 B all_reduce (two float32): ``dist.all_reduce`` through each backend; on the arendez run also
  ``arendez.sync.all_reduce`` on a torch tensor and the async API awaited inside the loop (no
  thread hop) as the floor; the median over ``--iters`` calls after 200 warm-up calls, per rank,
  max over ranks.

Ratios are arendez/gloo (time: lower is better). The machine's other load is not controlled:
run it when the machine is quiet, and read the ranges over several runs, not one number.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
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


def _max_over_ranks(dist: Any, value: float) -> float:
    import torch

    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def worker(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if args.backend == "arendez":
        import arendez.torch  # registers the backend
    dist.init_process_group(
        args.backend,
        init_method=args.init,
        rank=args.rank,
        world_size=args.world_size,
        timeout=datetime.timedelta(seconds=120),
    )
    out: dict[str, Any] = {}
    # 8 B all_reduce latency
    lat: dict[str, float] = {}
    small = torch.ones(2)

    def timed(call: Any) -> float:
        for _ in range(200):
            call()
        dist.barrier()
        times = []
        for _ in range(args.iters):
            t0 = time.perf_counter()
            call()
            times.append(time.perf_counter() - t0)
        return _max_over_ranks(dist, statistics.median(times))

    lat["torch.distributed"] = timed(lambda: dist.all_reduce(small, op=dist.ReduceOp.MAX))
    if args.backend == "arendez":
        import arendez
        import arendez.sync
        from arendez.loop import shared

        lat["arendez.sync"] = timed(lambda: arendez.sync.all_reduce(small, op="max"))

        async def in_loop() -> float:
            x = torch.ones(2)
            for _ in range(200):
                await arendez.all_reduce(x, op="max")
            times = []
            for _ in range(args.iters):
                t0 = time.perf_counter()
                await arendez.all_reduce(x, op="max")
                times.append(time.perf_counter() - t0)
            return statistics.median(times)

        dist.barrier()
        lat["async API (no hop)"] = _max_over_ranks(dist, shared.call(in_loop))

        async def noop() -> None:
            return None

        hop = statistics.median(_hop_times(shared, noop, args.iters))
        lat["hop only (no-op coroutine)"] = _max_over_ranks(dist, hop)
    out["latency"] = lat
    # DDP step
    net = model(args.width, args.depth)
    out["params"] = sum(p.numel() for p in net.parameters())
    ddp = torch.nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-4)
    x = torch.randn(args.batch, args.width)
    steps = []
    for i in range(2 + args.steps):
        dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad()
        ddp(x).square().mean().backward()
        opt.step()
        took = _max_over_ranks(dist, time.perf_counter() - t0)
        if i >= 2:
            steps.append(took)
    out["step"] = statistics.median(steps)
    out["step_range"] = [min(steps), max(steps)]
    dist.destroy_process_group()
    return out


def _hop_times(shared: Any, noop: Any, n: int) -> list[float]:
    """Round trips of a no-op coroutine through the loop thread: the hop alone."""
    for _ in range(200):
        shared.call(noop)
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        shared.call(noop)
        out.append(time.perf_counter() - t0)
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


def run(backend: str, ws: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    init = f"tcp://127.0.0.1:{_free_port()}"
    common = ["--width", str(args.width), "--depth", str(args.depth), "--batch", str(args.batch)]
    common += ["--steps", str(args.steps), "--iters", str(args.iters)]
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "ARENDEZ_URL"):
        env.pop(name, None)
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--worker",
                backend,
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
                raise RuntimeError(f"{backend} W={ws}: a rank exited {p.returncode}")
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return results


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
    ap.add_argument("--worker", choices=["gloo", "arendez"])
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--world-size", type=int, default=1)
    ap.add_argument("--init", default="")
    args = ap.parse_args()
    if args.worker:
        args.backend = args.worker
        print(json.dumps(worker(args)), flush=True)
        return
    report: dict[str, Any] = {"args": {k: v for k, v in vars(args).items() if k != "json"}, "runs": []}
    compute = compute_only(args)
    report["compute_only_step"] = compute
    rows = []
    for ws in args.ranks:
        got = {b: run(b, ws, args)[0] for b in ("gloo", "arendez")}
        report["runs"].append({"world_size": ws, **got})
        g, a = got["gloo"], got["arendez"]
        rows.append(
            f"| DDP step, {a['params'] / 1e6:.1f}M params | {ws} | {g['step'] * 1e3:.0f} ms | "
            f"{a['step'] * 1e3:.0f} ms | {g['step'] / a['step']:.2f}x |"
        )
        gl = g["latency"]["torch.distributed"]
        for name, value in a["latency"].items():
            rows.append(
                f"| 8 B all_reduce: {name} | {ws} | {gl * 1e6:.0f} us | {value * 1e6:.1f} us | "
                f"{value / gl:.2f} of gloo |"
            )
    print(f"compute part of a step (1 process, no DDP): {compute * 1e3:.0f} ms")
    print("| case | ranks | gloo | arendez | arendez vs gloo |")
    print("|---|---|---|---|---|")
    print("\n".join(rows))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
