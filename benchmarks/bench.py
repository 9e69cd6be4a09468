"""arendez vs torch.distributed (gloo): latency and bus bandwidth on one machine.

Three backends, for every requested world size, in the same run (in this order):

- ``arendez``: the default, ranks run with ``ARENDEZ_SHM=1`` (set explicitly, so an outer
  environment cannot change it): payloads between ranks on this host go through shared memory;
- ``arendez-tcp``: the same server, rank code and method, but ranks run with ``ARENDEZ_SHM=0``:
  every byte over loopback TCP, as gloo;
- ``gloo``: ``torch.distributed`` with the gloo backend (skipped when torch is not importable).

::

    python benchmarks/bench.py [--ranks 2 4] [--sizes 8 1KiB ...] [--iters N] [--json out.json] [--quick]

Ranks are real processes: this script re-runs itself with ``--worker SPEC RANK``. For both
arendez backends the driver starts one ``python -m arendez_server --port 0`` per run and every
configuration joins it under its own job name; gloo ranks meet over ``tcp://127.0.0.1:<free port>``.

Method, the same for all backends: per (collective, size) one correctness check, warm-up
iterations, then timed iterations, each preceded by a barrier and timed on every rank; an
iteration's time is the max over ranks, and the reported latency is the median of those.
Bus bandwidth follows nccl-tests (all_reduce ``S*2(n-1)/n/t``, broadcast ``S/t``, all_gather
``S*(n-1)/n/t`` with ``S`` the gathered output size). The table shows latency and bus bandwidth
of the three side by side and the ratios arendez/gloo and arendez-tcp/gloo; the arendez ranks also
record ``transport_stats()`` deltas per iteration (``copied_bytes``, ``received_bytes`` and
``shm_bytes``, the part of the received bytes that came through shared memory).

A configuration (backend, ranks) that hangs or crashes is killed after a bounded time; its
current case is reported as failed and the remaining cases run in a fresh process group.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import gc
import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import re
import resource
import select
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
KiB = 1024
MiB = 1024 * KiB
DEFAULT_SIZES = [8, KiB, 64 * KiB, MiB, 16 * MiB, 64 * MiB]
DEFAULT_DATA_SIZES = [MiB, 16 * MiB]
MEMORY_SIZE = 64 * MiB
COLLECTIVES = ("all_reduce", "broadcast", "all_gather")
BACKENDS = ("arendez", "arendez-tcp", "gloo")
#: the arendez backends and the ``ARENDEZ_SHM`` their ranks run with
ARENDEZ_SHM_ENV = {"arendez": "1", "arendez-tcp": "0"}

# (budget seconds of timed iterations per case, min iters, max iters, warm-up by size class)
POLICY_FULL = {"budget": 6.0, "min_iters": 5, "max_iters": 2000, "warmup": (20, 5, 2)}
POLICY_QUICK = {"budget": 0.25, "min_iters": 5, "max_iters": 200, "warmup": (5, 2, 2)}


# ============================================================================ shared helpers
def fmt_size(n: int) -> str:
    for unit, scale in (("MiB", MiB), ("KiB", KiB)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmg]?)(i?b)?\s*", text, re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (try 8, 1KiB, 64K, 16MiB)")
    scale = {"": 1, "k": KiB, "m": MiB, "g": 1024 * MiB}[m.group(2).lower()]
    value = int(float(m.group(1)) * scale)
    if value <= 0 or value % 4:
        raise argparse.ArgumentTypeError(f"size {text!r} must be a positive multiple of 4 bytes (float32)")
    return value


def fmt_time(us: float | None) -> str:
    if us is None:
        return "—"
    if us >= 1000:
        return f"{us / 1000:.2f} ms"
    return f"{us:.1f} µs"


def fmt_bw(gbps: float | None) -> str:
    if gbps is None:
        return "—"
    return f"{gbps:.3g}" if gbps >= 0.001 else f"{gbps:.2e}"


def bus_bytes(collective: str, nbytes: int, n: int) -> float:
    """nccl-tests bus bytes for one operation of ``nbytes`` (all_gather: the output size)."""
    if collective == "all_reduce":
        return nbytes * 2 * (n - 1) / n
    if collective == "all_gather":
        return nbytes * (n - 1) / n
    return float(nbytes)


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark (VmHWM); False where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _busy_cpu_seconds() -> float | None:
    """CPU seconds the whole machine has spent busy (all processes, /proc/stat)."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    busy = sum(fields[:8]) - idle  # user nice system idle iowait irq softirq steal
    return busy / os.sysconf("SC_CLK_TCK")


def _own_cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system


def _peak_rss_kib() -> int:
    hwm = _status_kib("VmHWM")
    return hwm if hwm is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


# ============================================================================ worker side
class _Case:
    """Buffers and the timed operation of one (collective, size) on one rank."""

    def __init__(
        self,
        op: Callable[[], Awaitable[None]],
        verify: Callable[[], Awaitable[bool]],
    ) -> None:
        self.op = op
        self.verify = verify


def _touched(a: Any) -> Any:
    """Zero ``a`` by writing it, so its pages are resident before any measurement (np.zeros
    maps untouched zero pages, which would count the array itself as collective memory)."""
    a.fill(0)
    return a


class _Rank:
    """One benchmark rank of some backend: its spec, rank and world size."""

    def __init__(self, spec: dict[str, Any], rank: int) -> None:
        self.spec = spec
        self.rank = rank
        self.world = spec["world"]


class ArendezRank(_Rank):
    """Rank of ``arendez`` or ``arendez-tcp``: same code, only ``ARENDEZ_SHM`` differs."""

    def __init__(self, spec: dict[str, Any], rank: int) -> None:
        super().__init__(spec, rank)
        self.name = spec["backend"]

    async def start(self) -> None:
        import arendez as dist

        self.dist = dist
        await dist.init_process_group(
            init_method=f"{self.spec['url']}/{self.spec['job']}",
            world_size=self.world,
            rank=self.rank,
            timeout=self.spec["op_timeout"],
        )

    async def barrier(self) -> None:
        await self.dist.barrier()

    def make_case(self, collective: str, nbytes: int) -> _Case:
        import numpy as np

        dist, w, r = self.dist, self.world, self.rank
        if collective == "all_reduce":
            x = _touched(np.empty(nbytes // 4, np.float32))

            async def op() -> None:
                await dist.all_reduce(x)

            async def verify() -> bool:
                x.fill(r + 1)
                await dist.all_reduce(x)
                ok = bool(np.all(x == w * (w + 1) / 2))
                x.fill(0)
                return ok

        elif collective == "broadcast":
            x = _touched(np.empty(nbytes // 4, np.float32))

            async def op() -> None:
                await dist.broadcast(x, src=0)

            async def verify() -> bool:
                x.fill(r + 1)
                await dist.broadcast(x, src=0)
                return bool(np.all(x == 1))

        else:
            out = _touched(np.empty(nbytes // 4, np.float32))
            inp = _touched(np.empty(nbytes // 4 // w, np.float32))

            async def op() -> None:
                await dist.all_gather_into_tensor(out, inp)

            async def verify() -> bool:
                inp.fill(r + 1)
                await dist.all_gather_into_tensor(out, inp)
                return bool(np.all(out.reshape(w, -1) == np.arange(1, w + 1, dtype=np.float32)[:, None]))

        return _Case(op, verify)

    async def max_float(self, value: float) -> float:
        import numpy as np

        v = np.array([value], np.float64)
        await self.dist.all_reduce(v, op=self.dist.ReduceOp.MAX)
        return float(v[0])

    async def gather(self, payload: dict[str, Any]) -> list[dict[str, Any]]:
        out: list[Any] = [None] * self.world
        await self.dist.all_gather_object(out, payload)
        return out

    def stats(self) -> dict[str, int]:
        from arendez import api

        s = api.transport_stats()
        return {
            "copied_bytes": int(s.copied_bytes),
            "copied_messages": int(getattr(s, "copied_messages", 0)),
            "received_bytes": int(s.received_bytes),
            "shm_bytes": int(getattr(s, "shm_bytes", 0)),
        }

    async def close(self, clean: bool) -> None:
        if self.dist.is_initialized():
            await self.dist.destroy_process_group(timeout=10.0 if clean else 2.0)


class GlooRank(_Rank):
    name = "gloo"

    async def start(self) -> None:
        import torch
        import torch.distributed as d

        torch.set_num_threads(1)
        self.torch, self.d = torch, d
        d.init_process_group(
            "gloo",
            init_method=self.spec["url"],
            world_size=self.world,
            rank=self.rank,
            timeout=datetime.timedelta(seconds=self.spec["op_timeout"]),
        )
        # torch 2.13 deprecates all_gather_into_tensor in favour of all_gather_single
        self.gather_into = getattr(d, "all_gather_single", None) or d.all_gather_into_tensor

    async def barrier(self) -> None:
        self.d.barrier()

    def make_case(self, collective: str, nbytes: int) -> _Case:
        torch, d, w, r = self.torch, self.d, self.world, self.rank
        if collective == "all_reduce":
            x = torch.zeros(nbytes // 4, dtype=torch.float32)

            async def op() -> None:
                d.all_reduce(x)

            async def verify() -> bool:
                x.fill_(r + 1)
                d.all_reduce(x)
                ok = bool(torch.all(x == w * (w + 1) / 2))
                x.fill_(0)
                return ok

        elif collective == "broadcast":
            x = torch.zeros(nbytes // 4, dtype=torch.float32)

            async def op() -> None:
                d.broadcast(x, src=0)

            async def verify() -> bool:
                x.fill_(r + 1)
                d.broadcast(x, src=0)
                return bool(torch.all(x == 1))

        else:
            out = torch.zeros(nbytes // 4, dtype=torch.float32)
            inp = torch.zeros(nbytes // 4 // w, dtype=torch.float32)
            gather_into = self.gather_into

            async def op() -> None:
                gather_into(out, inp)

            async def verify() -> bool:
                inp.fill_(r + 1)
                gather_into(out, inp)
                want = torch.arange(1, w + 1, dtype=torch.float32)[:, None]
                return bool(torch.all(out.reshape(w, -1) == want))

        return _Case(op, verify)

    async def max_float(self, value: float) -> float:
        v = self.torch.tensor([value], dtype=self.torch.float64)
        self.d.all_reduce(v, op=self.d.ReduceOp.MAX)
        return float(v[0])

    async def gather(self, payload: dict[str, Any]) -> list[dict[str, Any]]:
        """All-gather a dict of floats and float lists (same shape on every rank) as one tensor."""
        torch = self.torch
        keys = sorted(payload)
        flat: list[float] = []
        shape: list[tuple[str, int | None]] = []
        for k in keys:
            v = payload[k]
            if isinstance(v, list):
                flat.extend(float(e) for e in v)
                shape.append((k, len(v)))
            else:
                flat.append(float(v) if v is not None else math.nan)
                shape.append((k, None))
        t = torch.tensor(flat, dtype=torch.float64)
        outs = [torch.empty_like(t) for _ in range(self.world)]
        self.d.all_gather(outs, t)
        result = []
        for o in outs:
            vals = o.tolist()
            item: dict[str, Any] = {}
            i = 0
            for k, n in shape:
                if n is None:
                    item[k] = None if math.isnan(vals[i]) else vals[i]
                    i += 1
                else:
                    item[k] = vals[i : i + n]
                    i += n
            result.append(item)
        return result

    def stats(self) -> None:
        return None

    async def close(self, clean: bool) -> None:
        if self.d.is_initialized():
            try:
                if clean:
                    self.d.barrier()  # nobody tears its pairs down while a peer still sends
            finally:
                self.d.destroy_process_group()


async def _run_case(
    b: ArendezRank | GlooRank, case: dict[str, Any], policy: dict[str, Any]
) -> dict[str, Any]:
    collective, nbytes = case["collective"], case["size"]
    memory = bool(case.get("memory"))
    gc.collect()
    c = b.make_case(collective, nbytes)
    rss0 = hwm_reset = None
    if memory:
        hwm_reset = _reset_peak_rss()
        rss0 = _status_kib("VmRSS")
        hwm0 = _peak_rss_kib()
    ok = await c.verify()
    small, medium, large = policy["warmup"]
    warm = small if nbytes <= 64 * KiB else medium if nbytes <= MiB else large
    t0 = time.perf_counter()
    for _ in range(warm):
        await b.barrier()
        await c.op()
    per_iter = await b.max_float((time.perf_counter() - t0) / max(1, warm))
    if policy.get("iters"):
        iters = int(policy["iters"])
    else:
        iters = math.ceil(policy["budget"] / max(per_iter, 1e-7))
        iters = max(policy["min_iters"], min(policy["max_iters"], iters))
    times = [0.0] * iters
    s0 = b.stats()
    clock = time.perf_counter_ns
    busy0, own0, wall0 = _busy_cpu_seconds(), _own_cpu_seconds(), time.perf_counter()
    for i in range(iters):
        await b.barrier()
        start = clock()
        await c.op()
        times[i] = (clock() - start) / 1000.0
    busy1, own1, wall1 = _busy_cpu_seconds(), _own_cpu_seconds(), time.perf_counter()
    s1 = b.stats()
    payload: dict[str, Any] = {
        "times": times,
        "ok": 1.0 if ok else 0.0,
        "own_cpu_s": own1 - own0,
        "busy_cpu_s": None if busy0 is None or busy1 is None else busy1 - busy0,
        "wall_s": wall1 - wall0,
    }
    if s0 is not None and s1 is not None:
        for k in s0:
            payload[k] = s1[k] - s0[k]
    if memory:
        payload["rss0_kib"] = rss0
        payload["hwm_growth_kib"] = (_peak_rss_kib() - rss0) if (rss0 is not None and hwm_reset) else None
        payload["maxrss_growth_kib"] = _peak_rss_kib() - hwm0 if not hwm_reset else None
        if isinstance(b, ArendezRank):
            import tracemalloc

            await b.barrier()
            tracemalloc.start()
            base = tracemalloc.get_traced_memory()[0]
            await c.op()
            payload["tracemalloc_peak_bytes"] = tracemalloc.get_traced_memory()[1] - base
            tracemalloc.stop()
    per_rank = await b.gather(payload)
    per_iter_max = [max(p["times"][i] for p in per_rank) for i in range(iters)]
    result: dict[str, Any] = {
        "backend": b.name,
        "collective": collective,
        "ranks": b.world,
        "size": nbytes,
        "warmup": warm,
        "iters": iters,
        "verified": all(p["ok"] == 1.0 for p in per_rank),
        "median_us": statistics.median(per_iter_max),
        "min_us": min(per_iter_max),
        "p90_us": sorted(per_iter_max)[min(iters - 1, int(0.9 * iters))],
        "rank_median_us": [statistics.median(p["times"]) for p in per_rank],
        "times_us": [round(t, 2) for t in per_iter_max],
    }
    busy = per_rank[0]["busy_cpu_s"]
    if busy is not None:
        # CPUs' worth of work done by processes other than these ranks while they were timed:
        # other jobs on the machine (and the rendezvous server), i.e. measurement noise
        own = sum(p["own_cpu_s"] for p in per_rank)
        result["foreign_cpus"] = max(0.0, busy - own) / max(per_rank[0]["wall_s"], 1e-9)
    result["rank_cpu_util"] = [p["own_cpu_s"] / max(p["wall_s"], 1e-9) for p in per_rank]
    if s0 is not None:
        for k in s0:
            result[k + "_per_iter"] = [p[k] / iters for p in per_rank]
    if memory:
        result["memory"] = {
            k: [p.get(k) for p in per_rank]
            for k in ("rss0_kib", "hwm_growth_kib", "maxrss_growth_kib", "tracemalloc_peak_bytes")
            if any(p.get(k) is not None for p in per_rank)
        }
    return result


async def _inject_fault(spec: dict[str, Any], rank: int, case: int) -> None:
    """Self-test of the watchdog: ``ARENDEZ_BENCH_FAULT=hang|crash:BACKEND:CASE:RANK``."""
    fault = os.environ.get("ARENDEZ_BENCH_FAULT", "")
    if fault.count(":") == 3:
        kind, backend, index, who = fault.split(":")
        if (backend, index, who) == (spec["backend"], str(case), str(rank)) and not spec.get("retry"):
            if kind == "crash":
                os._exit(3)
            await asyncio.sleep(3600)


async def _worker_main(spec: dict[str, Any], rank: int) -> int:
    out_path = Path(spec["out_dir"]) / f"rank{rank}.jsonl"
    current = -1

    def emit(event: dict[str, Any]) -> None:
        with open(out_path, "a", encoding="utf-8") as f:
            f.write(json.dumps(event) + "\n")

    b: ArendezRank | GlooRank = (
        ArendezRank(spec, rank) if spec["backend"] in ARENDEZ_SHM_ENV else GlooRank(spec, rank)
    )
    code = 0
    try:
        await b.start()
        ready: dict[str, Any] = {"event": "ready", "loop": type(asyncio.get_running_loop()).__module__}
        if isinstance(b, ArendezRank):
            from arendez import shm

            ready["shm_env"] = os.environ.get("ARENDEZ_SHM")
            ready["shm_enabled"] = shm.enabled()
        emit(ready)
        for i, case in enumerate(spec["cases"]):
            current = i
            emit({"event": "begin", "case": i})
            await _inject_fault(spec, rank, i)
            result = await _run_case(b, case, spec["policy"])
            if rank == 0:
                result["loop"] = type(asyncio.get_running_loop()).__module__
                emit({"event": "result", "case": i, "result": result})
        current = -1
        if isinstance(b, ArendezRank):
            emit({"event": "stats", "stats": b.stats()})
    except BaseException as exc:
        emit({"event": "error", "case": current, "error": f"{type(exc).__name__}: {exc}"[:500]})
        traceback.print_exc()
        code = 1
    finally:
        try:
            await asyncio.wait_for(b.close(code == 0), 15.0)
        except BaseException as exc:
            print(f"close failed: {type(exc).__name__}: {exc}", file=sys.stderr)
            code = code or 2
    emit({"event": "exit", "code": code})
    return code


def worker(spec_path: str, rank: int) -> int:
    with open(spec_path, encoding="utf-8") as f:
        spec = json.load(f)
    if spec["backend"] in ARENDEZ_SHM_ENV:
        from arendez import loop

        return loop.run(_worker_main(spec, rank))
    return asyncio.run(_worker_main(spec, rank))


# ============================================================================ driver side
def _child_env(backend: str, algorithm: str | None) -> dict[str, str]:
    env = dict(os.environ)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "ARENDEZ_URL"):
        env.pop(name, None)
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("OMP_NUM_THREADS", "1")
    if backend in ARENDEZ_SHM_ENV:
        env["ARENDEZ_SHM"] = ARENDEZ_SHM_ENV[backend]  # explicit: the outer environment does not leak in
        if algorithm:
            env["ARENDEZ_ALGORITHM"] = algorithm
    return env


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _kill(proc: subprocess.Popen[Any], grace: float = 3.0) -> None:
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        proc.terminate()
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        proc.wait(5)


class ArendezServer:
    """The one standalone ``arendez-server`` of a run."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.proc: subprocess.Popen[str] | None = None
        self.url = ""

    def ensure(self) -> str:
        if self.proc is not None and self.proc.poll() is None:
            return self.url
        if self.proc is not None:
            log(f"arendez-server exited with {self.proc.returncode}; starting a new one")
        err = open(self.tmp / "server.log", "a", encoding="utf-8")  # noqa: SIM115 (owned by the process)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "arendez_server", "--port", "0", "--log-level", "WARNING"],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            env=_child_env("arendez", None),
            start_new_session=True,
        )
        err.close()
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], 20.0)
        line = self.proc.stdout.readline() if ready else ""
        if "listening on" not in line:
            self.stop()
            raise RuntimeError(f"arendez-server did not start (got {line!r}); see {self.tmp / 'server.log'}")
        self.url = line.strip().rsplit(" ", 1)[-1]
        return self.url

    def stop(self) -> None:
        if self.proc is not None:
            _kill(self.proc, 10.0)
            if self.proc.stdout is not None:
                self.proc.stdout.close()


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _read_events(path: Path) -> list[dict[str, Any]]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError:
        return []
    events = []
    for line in text.splitlines(keepends=True):
        if line.endswith("\n"):
            with contextlib.suppress(json.JSONDecodeError):
                events.append(json.loads(line))
    return events


def _tail(path: Path, lines: int = 6) -> str:
    try:
        return "\n".join(path.read_text(encoding="utf-8", errors="replace").strip().splitlines()[-lines:])
    except OSError:
        return ""


def launch(
    backend: str,
    world: int,
    cases: list[dict[str, Any]],
    args: argparse.Namespace,
    policy: dict[str, Any],
    tmp: Path,
    server: ArendezServer | None,
    attempt: int = 1,
) -> tuple[list[dict[str, Any]], dict[str, Any] | None, dict[str, Any]]:
    """Run ``cases`` in one process group of ``world`` ranks.

    Returns (results in order, the failure that stopped the launch or None, extra info).
    """
    job = f"bench-{backend}-w{world}-{uuid.uuid4().hex[:8]}"
    out_dir = tmp / job
    out_dir.mkdir()
    if backend in ARENDEZ_SHM_ENV:
        assert server is not None
        url = server.ensure()
    else:
        url = f"tcp://127.0.0.1:{_free_port()}"
    spec = {
        "backend": backend,
        "world": world,
        "url": url,
        "job": job,
        "cases": cases,
        "policy": policy,
        "op_timeout": args.op_timeout,
        "out_dir": str(out_dir),
        "retry": attempt > 1,
    }
    spec_path = out_dir / "spec.json"
    spec_path.write_text(json.dumps(spec), encoding="utf-8")
    env = _child_env(backend, args.algorithm)
    procs: list[subprocess.Popen[bytes]] = []
    logs = [out_dir / f"rank{r}.log" for r in range(world)]
    failure: dict[str, Any] | None = None
    try:
        for r in range(world):
            with open(logs[r], "wb") as f:
                procs.append(
                    subprocess.Popen(
                        [sys.executable, str(Path(__file__).resolve()), "--worker", str(spec_path), str(r)],
                        stdout=f,
                        stderr=subprocess.STDOUT,
                        env=env,
                        start_new_session=True,
                        cwd=str(ROOT),
                    )
                )
        rank0 = out_dir / "rank0.jsonl"
        last_progress = time.monotonic()
        seen = 0
        started = False
        first_exit: float | None = None
        while True:
            events = _read_events(rank0)
            if len(events) > seen:
                for e in events[seen:]:
                    if e["event"] == "begin":
                        started = True
                    if e["event"] == "result":
                        res = e["result"]
                        log(
                            f"  [{backend} n={world}] {res['collective']:<10} {fmt_size(res['size']):>7}: "
                            f"{fmt_time(res['median_us']):>10}  ({res['iters']} iters)"
                        )
                seen = len(events)
                last_progress = time.monotonic()
            codes = [p.poll() for p in procs]
            now = time.monotonic()
            if all(c is not None for c in codes):
                break
            if any(c is not None for c in codes) and first_exit is None:
                first_exit = now
            limit = args.case_timeout if started else args.init_timeout
            if now - last_progress > limit:
                failure = {"reason": f"timeout: no progress for {limit:.0f} s, killed"}
                break
            if first_exit is not None and now - first_exit > args.exit_grace:
                failure = {"reason": f"rank exited with {codes}; the others did not finish, killed"}
                break
            time.sleep(0.05)
    finally:
        for p in procs:
            _kill(p)
    per_rank = [_read_events(out_dir / f"rank{r}.jsonl") for r in range(world)]
    results = [e["result"] for e in per_rank[0] if e["event"] == "result"]
    info: dict[str, Any] = {}
    for e in per_rank[0]:
        if e["event"] == "ready":
            info["loop"] = e["loop"]
            for k in ("shm_env", "shm_enabled"):
                if k in e:
                    info[k] = e[k]
        if e["event"] == "stats":
            info["final_stats_rank0"] = e["stats"]
    errors = [(r, e) for r in range(world) for e in per_rank[r] if e["event"] == "error"]
    codes = [p.returncode for p in procs]
    if failure is None and (errors or any(codes)):
        failure = {
            "reason": "; ".join(f"rank {r}: {e['error']}" for r, e in errors[:2]) or f"exit codes {codes}"
        }
    if failure is None and len(results) < len(cases):
        failure = {"reason": "ranks exited before finishing"}
    if failure is not None:
        failure["exit_codes"] = codes
        failure["log_tail"] = {r: _tail(logs[r]) for r in range(world)}
        begun = [e["case"] for e in per_rank[0] if e["event"] == "begin"]
        failure["case"] = begun[-1] if begun and len(begun) > len(results) else None
        if len(results) == len(cases):
            failure["phase"] = "shutdown"  # every case finished; closing the group failed
    return results, failure, info


def run_config(
    backend: str,
    world: int,
    cases: list[dict[str, Any]],
    args: argparse.Namespace,
    policy: dict[str, Any],
    tmp: Path,
    server: ArendezServer | None,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict[str, Any]]:
    """All ``cases`` of one (backend, ranks); after a failure the rest run in a fresh group."""
    results: list[dict[str, Any]] = []
    failures: list[dict[str, Any]] = []
    info: dict[str, Any] = {}
    todo = list(cases)
    attempts = 0
    while todo and attempts < 1 + args.retries:
        attempts += 1
        got, failure, extra = launch(backend, world, todo, args, policy, tmp, server, attempts)
        info.update(extra)
        results.extend(got)
        todo = todo[len(got) :]
        if failure is None:
            break
        if failure.get("phase") == "shutdown":
            failures.append({"backend": backend, "ranks": world, "collective": None, "size": None, **failure})
            log(f"  [{backend} n={world}] shutdown failed (results kept): {failure['reason']}")
            break
        idx = failure.pop("case", None)
        # the case it hung or failed in is reported and skipped; a failure before (or between)
        # cases retries the same list
        bad = todo.pop(0) if idx is not None and idx == len(got) and todo else None
        failures.append(
            {
                "backend": backend,
                "ranks": world,
                "collective": bad["collective"] if bad else None,
                "size": bad["size"] if bad else None,
                **failure,
            }
        )
        what = f"{bad['collective']} {fmt_size(bad['size'])}" if bad else "(startup)"
        log(f"  [{backend} n={world}] FAILED {what}: {failure['reason']}")
    for case in todo:
        failures.append(
            {
                "backend": backend,
                "ranks": world,
                "collective": case["collective"],
                "size": case["size"],
                "reason": "not run: too many failures in this configuration",
            }
        )
    return results, failures, info


def build_cases(args: argparse.Namespace, world: int) -> list[dict[str, Any]]:
    cases: list[dict[str, Any]] = []
    if "all_reduce" in args.collectives:
        sizes = sorted(set(args.sizes))
        if MEMORY_SIZE in sizes and not args.no_memory:
            # measured first, in a fresh process, so no earlier case's freed memory hides its peak
            cases.append({"collective": "all_reduce", "size": MEMORY_SIZE, "memory": True})
            sizes.remove(MEMORY_SIZE)
        cases += [{"collective": "all_reduce", "size": s} for s in sizes]
    for coll in ("broadcast", "all_gather"):
        if coll in args.collectives:
            for s in sorted(set(args.data_sizes)):
                if coll == "all_gather" and s % (4 * world):
                    continue
                cases.append({"collective": coll, "size": s})
    return cases


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def machine_info(args: argparse.Namespace) -> dict[str, Any]:
    commit = None
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        commit = (
            subprocess.run(
                ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                capture_output=True,
                text=True,
                timeout=5,
            ).stdout.strip()
            or None
        )
    cpu_model = None
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
        for line in f:
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    return {
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "cpu_model": cpu_model,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "numpy": _version("numpy"),
        "torch": _version("torch"),
        "uvloop": _version("uvloop"),
        "msgpack": _version("msgpack"),
        "arendez": _version("arendez"),
        "git_commit": commit,
        "uvloop_disabled_env": os.environ.get("ARENDEZ_NO_UVLOOP") == "1",
        "arendez_algorithm": args.algorithm or os.environ.get("ARENDEZ_ALGORITHM") or "auto",
    }


def key_prefix(backend: str) -> str:
    """Prefix of a backend's keys in a comparison row: ``arendez``, ``arendez_tcp``, ``gloo``."""
    return backend.replace("-", "_")


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def compare(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (collective, ranks, size) with every backend's numbers side by side.

    Ratios: ``latency_ratio`` / ``busbw_ratio`` are arendez/gloo, ``tcp_latency_ratio`` /
    ``tcp_busbw_ratio`` arendez-tcp/gloo, ``shm_tcp_busbw_ratio`` arendez/arendez-tcp.
    """
    by_key: dict[tuple[str, int, int], dict[str, dict[str, Any]]] = {}
    for r in results:
        n = r["ranks"]
        t = r["median_us"] * 1e-6
        r["algbw_gbps"] = r["size"] / t / 1e9
        r["busbw_gbps"] = bus_bytes(r["collective"], r["size"], n) / t / 1e9
        by_key.setdefault((r["collective"], n, r["size"]), {})[r["backend"]] = r
    order = {c: i for i, c in enumerate(COLLECTIVES)}
    rows = []
    for (coll, n, size), per in sorted(by_key.items(), key=lambda kv: (order[kv[0][0]], kv[0][1], kv[0][2])):
        row: dict[str, Any] = {"collective": coll, "ranks": n, "size": size}
        for backend in BACKENDS:
            res, name = per.get(backend), key_prefix(backend)
            row[f"{name}_median_us"] = res["median_us"] if res else None
            row[f"{name}_busbw_gbps"] = res["busbw_gbps"] if res else None
            row[f"{name}_verified"] = res["verified"] if res else None
            row[f"{name}_foreign_cpus"] = res.get("foreign_cpus") if res else None
            if backend in ARENDEZ_SHM_ENV:
                # which transport carried the payload: shm bytes / received bytes, over all ranks
                shm = res.get("shm_bytes_per_iter") if res else None
                rcv = res.get("received_bytes_per_iter") if res else None
                frac = None
                if shm is not None and rcv is not None:
                    frac = sum(shm) / sum(rcv) if sum(rcv) else 0.0
                row[f"{name}_shm_fraction"] = frac
        row["latency_ratio"] = _ratio(row["arendez_median_us"], row["gloo_median_us"])
        row["busbw_ratio"] = _ratio(row["arendez_busbw_gbps"], row["gloo_busbw_gbps"])
        row["tcp_latency_ratio"] = _ratio(row["arendez_tcp_median_us"], row["gloo_median_us"])
        row["tcp_busbw_ratio"] = _ratio(row["arendez_tcp_busbw_gbps"], row["gloo_busbw_gbps"])
        row["shm_tcp_busbw_ratio"] = _ratio(row["arendez_busbw_gbps"], row["arendez_tcp_busbw_gbps"])
        rows.append(row)
    return rows


def _failed_cell(failures: list[dict[str, Any]], backend: str, coll: str, n: int, size: int) -> str | None:
    for f in failures:
        if (f["backend"], f["collective"], f["ranks"], f["size"]) == (backend, coll, n, size):
            return "FAILED"
    return None


def markdown(
    info: dict[str, Any],
    rows: list[dict[str, Any]],
    results: list[dict[str, Any]],
    failures: list[dict[str, Any]],
    backends: list[str],
    policy: dict[str, Any],
) -> str:
    loop = info.get("arendez_loop") or "?"
    head = (
        f"arendez vs torch.distributed gloo — {info['cpu_count']} CPUs ({info.get('cpu_model') or '?'}), "
        f"Python {info['python']}, numpy {info['numpy']}, torch {info['torch'] or 'n/a'}, "
        f"uvloop {'on' if 'uvloop' in loop else 'off'} ({info['uvloop'] or 'n/a'}), "
        f"algorithm {info['arendez_algorithm']}, arendez {info['git_commit'] or '?'}"
    )
    lines = [
        f"**{head}**",
        "",
        "arendez: the default, shared memory between ranks on this host (ARENDEZ_SHM=1); "
        "arendez-tcp: arendez with ARENDEZ_SHM=0: every byte over loopback TCP, as gloo. "
        "Latency: median over iterations of the max over ranks. Bus bandwidth in GB/s (nccl-tests). "
        "Ratios a/g are arendez/gloo, tcp/g arendez-tcp/gloo: latency < 1 and bandwidth > 1 mean "
        "that arendez backend is faster. all_gather size = gathered output. Other load "
        "(arendez/arendez-tcp/gloo): CPUs' worth of work by other processes while timing "
        "(noise; 0 on a quiet machine).",
        "",
        "| collective | ranks | size | arendez | arendez-tcp | gloo "
        "| arendez busbw | arendez-tcp busbw | gloo busbw | busbw a/g | busbw tcp/g "
        "| latency a/g | latency tcp/g | other load a/tcp/g |",
        "|---|---:|---:|" + "---:|" * 11,
    ]
    all_keys = {(r["collective"], r["ranks"], r["size"]) for r in rows} | {
        (f["collective"], f["ranks"], f["size"]) for f in failures if f["collective"]
    }
    have = {(r["collective"], r["ranks"], r["size"]): r for r in rows}
    order = {c: i for i, c in enumerate(COLLECTIVES)}
    for key in sorted(all_keys, key=lambda k: (order[k[0]], k[1], k[2])):
        coll, n, size = key
        row = have.get(key, {})
        cells = [coll, str(n), fmt_size(size)]
        for b in BACKENDS:
            v = row.get(f"{key_prefix(b)}_median_us")
            bad = "" if row.get(f"{key_prefix(b)}_verified") in (True, None) else " (WRONG)"
            cells.append(
                (fmt_time(v) + bad) if v is not None else (_failed_cell(failures, b, coll, n, size) or "—")
            )
        cells += [fmt_bw(row.get(f"{key_prefix(b)}_busbw_gbps")) for b in BACKENDS]
        for k in ("busbw_ratio", "tcp_busbw_ratio", "latency_ratio", "tcp_latency_ratio"):
            ratio = row.get(k)
            cells.append(f"{ratio:.2f}" if ratio is not None else "—")
        loads = [row.get(f"{key_prefix(b)}_foreign_cpus") for b in BACKENDS]
        cells.append("/".join("—" if v is None else f"{v:.2f}" for v in loads))
        lines.append("| " + " | ".join(cells) + " |")
    mem = [r for r in results if r.get("memory")]
    if mem:
        lines += [
            "",
            f"Memory and copies, all_reduce {fmt_size(MEMORY_SIZE)} (max over ranks; growth of peak RSS "
            "from just before the first call to after the timed iterations, relative to the array):",
            "",
            "| backend | ranks | peak RSS growth | / array | tracemalloc peak (1 call) | / array "
            "| copied B/iter | received B/iter | copied/received | shm B/iter |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        rank_of = {b: i for i, b in enumerate(BACKENDS)}
        for r in sorted(mem, key=lambda r: (rank_of.get(r["backend"], len(BACKENDS)), r["ranks"])):
            m = r["memory"]
            growth = [
                g for g in (m.get("hwm_growth_kib") or m.get("maxrss_growth_kib") or []) if g is not None
            ]
            g_mib = max(growth) / 1024 if growth else None
            tm = [t for t in m.get("tracemalloc_peak_bytes", []) if t is not None]
            tm_mib = max(tm) / MiB if tm else None
            cp = r.get("copied_bytes_per_iter")
            rv = r.get("received_bytes_per_iter")
            sh = r.get("shm_bytes_per_iter")
            arr = MEMORY_SIZE / MiB
            lines.append(
                "| "
                + " | ".join(
                    [
                        r["backend"],
                        str(r["ranks"]),
                        f"{g_mib:.1f} MiB" if g_mib is not None else "—",
                        f"{g_mib / arr:.2f}" if g_mib is not None else "—",
                        f"{tm_mib:.1f} MiB" if tm_mib is not None else "—",
                        f"{tm_mib / arr:.2f}" if tm_mib is not None else "—",
                        f"{max(cp):,.0f}" if cp else "—",
                        f"{max(rv):,.0f}" if rv else "—",
                        f"{sum(cp) / sum(rv):.3f}" if cp and rv and sum(rv) else "—",
                        f"{max(sh):,.0f}" if sh else "—",
                    ]
                )
                + " |"
            )
    if failures:
        lines += ["", "Failures:", ""]
        for f in failures:
            what = (
                f"{f['collective']} {fmt_size(f['size'])}"
                if f["collective"]
                else f"({f.get('phase', 'startup')})"
            )
            lines.append(f"- {f['backend']} n={f['ranks']} {what}: {f['reason']}")
    skipped = [b for b in BACKENDS if b not in backends]
    if skipped:
        lines += ["", f"Not run: {', '.join(skipped)}."]
    budget = f"fixed {policy['iters']} iters" if policy.get("iters") else f"~{policy['budget']} s per case"
    bounds = f"min {policy['min_iters']}, max {policy['max_iters']}"
    lines += ["", f"Iterations: {budget} ({bounds}), barrier before each."]
    return "\n".join(lines)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4], help="world sizes (default 2 4)")
    p.add_argument(
        "--sizes", type=parse_size, nargs="+", default=None, help="all_reduce sizes (default 8B..64MiB)"
    )
    p.add_argument(
        "--data-sizes",
        type=parse_size,
        nargs="+",
        default=None,
        help="broadcast / all_gather sizes (default 1MiB 16MiB)",
    )
    p.add_argument("--collectives", nargs="+", choices=COLLECTIVES, default=list(COLLECTIVES))
    p.add_argument(
        "--backends",
        nargs="+",
        choices=BACKENDS,
        default=list(BACKENDS),
        help="backends to run, always in the order arendez, arendez-tcp, gloo (default: all three)",
    )
    p.add_argument(
        "--iters", type=int, default=None, help="fixed timed iterations per case (default: adaptive)"
    )
    p.add_argument("--budget", type=float, default=None, help="seconds of timed iterations per case")
    p.add_argument("--json", type=Path, default=HERE / "results" / "latest.json", help="JSON output path")
    p.add_argument("--quick", action="store_true", help="few iterations (under ~90 s)")
    p.add_argument(
        "--algorithm",
        choices=("ring", "direct", "rdb"),
        default=None,
        help="force an arendez algorithm (sets ARENDEZ_ALGORITHM for the arendez and arendez-tcp ranks)",
    )
    p.add_argument("--no-memory", action="store_true", help="skip the 64 MiB memory/copy measurement")
    p.add_argument("--op-timeout", type=float, default=60.0, help="collective timeout inside the ranks (s)")
    p.add_argument(
        "--case-timeout", type=float, default=None, help="kill a configuration stuck this long (s)"
    )
    p.add_argument(
        "--init-timeout", type=float, default=60.0, help="kill a configuration not started after (s)"
    )
    p.add_argument(
        "--exit-grace", type=float, default=20.0, help="kill the others this long after a rank exits"
    )
    p.add_argument("--retries", type=int, default=2, help="fresh process groups after failures, per config")
    args = p.parse_args(argv)
    if any(n < 2 for n in args.ranks):
        p.error("--ranks must be >= 2")
    args.sizes = args.sizes or list(DEFAULT_SIZES)
    args.data_sizes = args.data_sizes or list(DEFAULT_DATA_SIZES)
    if args.case_timeout is None:
        args.case_timeout = 60.0 if args.quick else 150.0
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--worker":
        return worker(argv[1], int(argv[2]))
    args = parse_args(argv)
    policy = dict(POLICY_QUICK if args.quick else POLICY_FULL)
    if args.budget is not None:
        policy["budget"] = args.budget
    if args.iters:
        policy["iters"] = args.iters
    backends = [b for b in BACKENDS if b in args.backends]  # runs in this order per world size
    notes = []
    if "gloo" in backends and importlib.util.find_spec("torch") is None:
        backends.remove("gloo")
        notes.append("torch is not importable: gloo skipped")
        log("torch is not importable: running the arendez backends only")
    info = machine_info(args)

    def on_signal(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_signal)
    t_start = time.monotonic()
    results: list[dict[str, Any]] = []
    failures: list[dict[str, Any]] = []
    configs: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="arendez-bench-") as tmpdir:
        tmp = Path(tmpdir)
        server = ArendezServer(tmp) if any(b in ARENDEZ_SHM_ENV for b in backends) else None
        try:
            for world in args.ranks:
                cases = build_cases(args, world)
                for backend in backends:
                    log(f"{backend}, {world} ranks: {len(cases)} cases")
                    t0 = time.monotonic()
                    try:
                        got, bad, extra = run_config(backend, world, cases, args, policy, tmp, server)
                    except Exception as exc:  # e.g. the server did not start
                        got, extra = [], {}
                        bad = [
                            {
                                "backend": backend,
                                "ranks": world,
                                "collective": c["collective"],
                                "size": c["size"],
                                "reason": str(exc),
                            }
                            for c in cases
                        ]
                    results += got
                    failures += bad
                    configs[f"{backend}/{world}"] = {**extra, "seconds": round(time.monotonic() - t0, 1)}
                    if backend in ARENDEZ_SHM_ENV and "loop" in extra:
                        info.setdefault("arendez_loop", extra["loop"])
        except KeyboardInterrupt:
            log("interrupted: stopping")
            notes.append("interrupted")
        finally:
            if server is not None:
                server.stop()
    rows = compare(results)
    table = markdown(info, rows, results, failures, backends, policy)
    print(table, flush=True)
    elapsed = time.monotonic() - t_start
    doc = {
        "machine": info,
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "policy": policy,
        "elapsed_s": round(elapsed, 1),
        "configs": configs,
        "comparison": rows,
        "results": results,
        "failures": failures,
        "notes": notes,
        "markdown": table,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(doc, indent=1), encoding="utf-8")
    log(f"wrote {args.json} ({elapsed:.0f} s)")
    case_failures = [f for f in failures if f.get("phase") != "shutdown"]
    return 1 if case_failures or "interrupted" in notes else 0


if __name__ == "__main__":
    sys.exit(main())
