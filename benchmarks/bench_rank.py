"""The benchmark's rank process: ``python benchmarks/bench_rank.py SPEC RANK`` (the driver starts it).

Runs every case of the spec on one backend (arendez or gloo) and reports times and counters.
"""

from __future__ import annotations

import asyncio
import datetime
import gc
import json
import math
import os
import statistics
import sys
import time
import traceback
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from bench_common import (
    ARENDEZ_SHM_ENV,
    KiB,
    MiB,
    _busy_cpu_seconds,
    _own_cpu_seconds,
    _peak_rss_kib,
    _reset_peak_rss,
    _status_kib,
)


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
    # user + system CPU seconds a rank spends per iteration (all its threads; barrier included)
    result["cpu_s_per_iter"] = statistics.mean(p["own_cpu_s"] for p in per_rank) / iters
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


if __name__ == "__main__":
    sys.exit(worker(sys.argv[1], int(sys.argv[2])))
