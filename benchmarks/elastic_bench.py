"""Recovery from a kill -9: arendez's elastic re-form against torchrun's restart of all workers.

    python benchmarks/elastic_bench.py                 # W=2 and 4, 3 trials each (~2-3 minutes)
    python benchmarks/elastic_bench.py --sizes 4 --trials 5

Each trial starts W real rank processes running a training-like loop (an 8-float all_reduce
every ``--step-time`` s), waits until they run, kills one with SIGKILL and reads the wall-clock
times the ranks print (one host: one clock):

- arendez (``arendez-run --nproc W --max-restarts 1 --min-nproc 1``, rank loop below): the
  survivors catch ``RankFailedError``, ``reform()`` and all_reduce in the shrunk world
  (*kill -> survivors running*); the launcher restarts the slot, the replacement joins, the
  survivors see ``joiners_waiting()`` in their all_reduce and re-form to full size (*replacement
  start -> full world*, the replacement's process start time from ``/proc``, Python start-up
  included; and *kill -> full world*).
- torchrun (``python -m torch.distributed.run --standalone --nproc-per-node W --max-restarts 1
  --monitor-interval 0.1``, gloo): the agent sees the dead worker, stops the others, starts all
  W again, which init and all_reduce (*kill -> full world*; there is no shrunk world).

W=16 with inproc ranks is not measured: inproc:// worlds have no server and no elastic rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable


# ============================================================================ rank side
def _process_start() -> float:
    """Wall-clock time this process started: its age from ``/proc`` (clock ticks since boot,
    10 ms resolution) against CLOCK_BOOTTIME, taken from now."""
    ticks = os.sysconf("SC_CLK_TCK")
    stat = Path("/proc/self/stat").read_text()
    started = int(stat[stat.rfind(")") + 2 :].split()[19]) / ticks
    age = time.clock_gettime(time.CLOCK_BOOTTIME) - started
    return time.time() - age


def _say(**event: Any) -> None:
    """One line in one write: torchrun's workers share one stdout, and a print of a line is
    two writes (text, newline) that another worker's may come between."""
    sys.stdout.flush()
    os.write(1, ("BENCH " + json.dumps(event) + "\n").encode())


async def _arendez_rank(step_time: float) -> None:
    import numpy as np

    import arendez as dist
    from arendez import elastic

    await dist.init_process_group(timeout=30)
    buf = np.zeros(8)
    first = True  # the first all_reduce of each world is reported
    while True:
        try:
            buf[0] = elastic.joiners_waiting()
            await dist.all_reduce(buf)
            if first:
                _say(kind="ok", size=dist.get_world_size(), t=time.time(), start=_process_start())
                first = False
            if buf[0] > 0:
                await elastic.reform(timeout=30)
                first = True
            await asyncio.sleep(step_time)
        except dist.RankFailedError:
            await elastic.reform(timeout=30)
            first = True


def _torch_rank(step_time: float) -> None:
    import torch
    import torch.distributed as tdist

    tdist.init_process_group("gloo")
    buf = torch.zeros(8)
    tdist.all_reduce(buf)
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    _say(kind="ok", size=tdist.get_world_size(), t=time.time(), start=_process_start(), restart=restart)
    while True:
        tdist.all_reduce(buf)
        time.sleep(step_time)


# ============================================================================ driver side
class _Watch:
    """A launcher's output, read in a thread; BENCH events parsed."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
        )
        self.events: list[dict[str, Any]] = []
        self.lines: list[str] = []
        self.cond = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self.cond:
                self.lines.append(line.rstrip())
                for m in re.finditer(r"BENCH (\{[^{}]*\})", line):
                    self.events.append(json.loads(m.group(1)))
                self.cond.notify_all()

    def until(self, pred: Any, timeout: float) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout
        with self.cond:
            while not (found := [e for e in self.events if pred(e)]) or not pred.enough(found):
                left = deadline - time.monotonic()
                if left <= 0 or self.proc.poll() is not None:
                    raise TimeoutError("\n".join(self.lines[-40:]))
                self.cond.wait(min(left, 0.2))
            return found

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


class _Restarted:
    """``size`` workers of one torchrun restart (the first that got them all running)."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __call__(self, e: dict[str, Any]) -> bool:
        return bool(e.get("kind") == "ok" and e.get("restart", 0) >= 1)

    def enough(self, found: list[dict[str, Any]]) -> bool:
        counts: dict[int, int] = {}
        for e in found:
            counts[e["restart"]] = counts.get(e["restart"], 0) + 1
        return any(n >= self.size for n in counts.values())


class _Count:
    """``n`` events with these fields (and, with ``after``, a time ``t`` past it)."""

    def __init__(self, n: int, after: float = 0.0, **match: Any) -> None:
        self.n, self.after, self.match = n, after, match

    def __call__(self, e: dict[str, Any]) -> bool:
        return e.get("t", 0.0) > self.after and all(e.get(k) == v for k, v in self.match.items())

    def enough(self, found: list[dict[str, Any]]) -> bool:
        return len(found) >= self.n


def _worker(root: int, local_rank: int) -> int:
    """The pid under ``root`` of the rank process with ``LOCAL_RANK=local_rank``."""
    kids: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            kids.setdefault(int(stat[stat.rfind(")") + 2 :].split()[1]), []).append(int(entry.name))
    todo = [root]
    while todo:
        for pid in kids.get(todo.pop(), []):
            todo.append(pid)
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
                env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"--rank" in cmd and f"LOCAL_RANK={local_rank}".encode() in env:
                return pid
    raise RuntimeError(f"no rank process with LOCAL_RANK={local_rank} under {root}")


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "ARENDEZ_URL"):
        env.pop(name, None)
    return env


def arendez_trial(size: int, step_time: float) -> dict[str, float]:
    me = str(Path(__file__).resolve())
    argv = [PY, "-m", "arendez.launch", "--nproc", str(size), "--max-restarts", "1", "--min-nproc", "1"]
    run = _Watch([*argv, me, "--rank", "arendez", "--step-time", str(step_time)], _env())
    try:
        run.until(_Count(size, kind="ok", size=size), 60)
        time.sleep(0.5)
        victim = _worker(run.proc.pid, size - 1)
        killed = time.time()
        os.kill(victim, signal.SIGKILL)
        shrunk = run.until(_Count(size - 1, kind="ok", size=size - 1, after=killed), 30)
        full = run.until(_Count(size, kind="ok", size=size, after=killed), 30)
        replacement = max(e["start"] for e in full)  # the one process started after the kill
        back = max(e["t"] for e in full)
        return {
            "kill_to_survivors": max(e["t"] for e in shrunk) - killed,
            "replacement_start_to_full": back - replacement,
            "kill_to_full": back - killed,
        }
    finally:
        run.stop()


def torchrun_trial(size: int, step_time: float) -> dict[str, float]:
    me = str(Path(__file__).resolve())
    argv = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(size)]
    argv += ["--max-restarts", "3", "--monitor-interval", "0.1"]  # (a restart here fails now and then)
    run = _Watch([*argv, me, "--rank", "torch", "--step-time", str(step_time)], _env())
    try:
        run.until(_Count(size, kind="ok", restart=0), 120)
        time.sleep(0.5)
        victim = _worker(run.proc.pid, size - 1)
        killed = time.time()
        os.kill(victim, signal.SIGKILL)
        found = run.until(_Restarted(size), 120)
        first = min(r for r in {e["restart"] for e in found} if sum(e["restart"] == r for e in found) >= size)
        full = [e for e in found if e["restart"] == first]
        return {
            "restarts": float(first),
            "replacement_start_to_full": max(e["t"] for e in full) - min(e["start"] for e in full),
            "kill_to_full": max(e["t"] for e in full) - killed,
        }
    finally:
        run.stop()


def _torchrun_runs() -> bool:
    try:
        import torch.distributed.run  # noqa: F401
    except ImportError:
        return False
    return True


def _stats(values: list[float]) -> str:
    if not values:
        return "-"
    ms = sorted(v * 1000 for v in values)
    return f"{statistics.median(ms):.0f} ms ({ms[0]:.0f}-{ms[-1]:.0f})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[2, 4])
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--step-time", type=float, default=0.01)
    p.add_argument("--rank", choices=["arendez", "torch"], help=argparse.SUPPRESS)
    p.add_argument("--json", type=Path, help="also write the raw results here")
    args = p.parse_args()
    if args.rank == "arendez":
        from arendez import loop

        loop.run(_arendez_rank(args.step_time))
        return
    if args.rank == "torch":
        _torch_rank(args.step_time)
        return
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so every trial's launcher is stopped
    torchrun = _torchrun_runs()
    results: dict[str, Any] = {}
    for size in args.sizes:
        for trial in range(args.trials):  # alternate, so both see the same load
            for name, fn in (("arendez", arendez_trial), ("torchrun", torchrun_trial)):
                if name == "torchrun" and not torchrun:
                    continue
                try:
                    got = fn(size, args.step_time)
                except TimeoutError as exc:
                    print(f"W={size} {name} trial {trial}: timed out\n{exc}", file=sys.stderr)
                    continue
                shown = ", ".join(
                    f"{k} {v:g}" if k == "restarts" else f"{k} {v * 1000:.0f} ms" for k, v in got.items()
                )
                print(f"W={size} {name} trial {trial}: {shown}", flush=True)
                for key, value in got.items():
                    results.setdefault(f"{size}/{name}/{key}", []).append(value)
    print()
    print(
        "| W | arendez: kill -> survivors running | arendez: replacement start -> full world | "
        "arendez: kill -> full world | torchrun: kill -> full world | torchrun / arendez (kill -> running) |"
    )
    print("|---|---|---|---|---|---|")
    for size in args.sizes:
        a = results.get(f"{size}/arendez/kill_to_survivors", [])
        t = results.get(f"{size}/torchrun/kill_to_full", [])
        ratio = f"{statistics.median(t) / statistics.median(a):.0f}x" if a and t else "-"
        start = _stats(results.get(f"{size}/arendez/replacement_start_to_full", []))
        full = _stats(results.get(f"{size}/arendez/kill_to_full", []))
        print(f"| {size} | {_stats(a)} | {start} | {full} | {_stats(t)} | {ratio} |")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
