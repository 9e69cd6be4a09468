"""arendez vs torch.distributed (gloo): latency and bus bandwidth on one machine.

Three backends, for every requested world size, in the same run (in this order):

- ``arendez``: the default, ranks run with ``ARENDEZ_SHM=1`` and ``ARENDEZ_LOCAL_SOCKETS=1`` (set
  explicitly, so an outer environment cannot change it): payloads between ranks on this host go
  through shared memory, frames over Unix sockets;
- ``arendez-tcp``: the same server, rank code and method, but ranks run with ``ARENDEZ_SHM=0`` and
  ``ARENDEZ_LOCAL_SOCKETS=0``: every byte over loopback TCP, as gloo;
- ``gloo``: ``torch.distributed`` with the gloo backend (skipped when torch is not importable).

::

    python benchmarks/bench.py [--ranks 2 4] [--sizes 8 1KiB ...] [--iters N] [--json out.json] [--quick]

Ranks are real processes: the driver (this file) starts ``bench_rank.py SPEC RANK`` per rank;
``bench_report.py`` builds the table, ``bench_common.py`` holds what all three share. For both
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
import contextlib
import importlib.metadata
import importlib.util
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from bench_common import (
    ARENDEZ_SHM_ENV,
    BACKENDS,
    COLLECTIVES,
    DEFAULT_DATA_SIZES,
    DEFAULT_SIZES,
    HERE,
    MEMORY_SIZE,
    POLICY_FULL,
    POLICY_QUICK,
    ROOT,
    fmt_size,
    fmt_time,
    parse_size,
)
from bench_report import (
    compare,
    machine_info,
    markdown,
)


# ============================================================================ driver side
def _child_env(backend: str, algorithm: str | None) -> dict[str, str]:
    env = dict(os.environ)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "ARENDEZ_URL"):
        env.pop(name, None)
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("OMP_NUM_THREADS", "1")
    if backend in ARENDEZ_SHM_ENV:
        env["ARENDEZ_SHM"] = ARENDEZ_SHM_ENV[backend]  # explicit: the outer environment does not leak in
        env["ARENDEZ_LOCAL_SOCKETS"] = ARENDEZ_SHM_ENV[backend]  # arendez-tcp: TCP only, as gloo
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
                        [sys.executable, str(HERE / "bench_rank.py"), str(spec_path), str(r)],
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
                            f"{fmt_time(res['median_us']):>10}  ({res['iters']} iters, "
                            f"CPU {fmt_time(res.get('cpu_s_per_iter', 0.0) * 1e6)} per iter and rank)"
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
