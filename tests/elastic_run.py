"""Helpers of the elastic tests: ``arendez-run`` on ``examples/elastic_sgd.py``, watched line by
line, with the rank processes found by their launcher slot (to kill -9 or SIGSTOP them)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from tests.harness import ROOT, _env

EXAMPLE = str(ROOT / "examples" / "elastic_sgd.py")
STEPS = 200
ARGS = ["--steps", str(STEPS), "--step-time", "0.02", "--log-every", "10", "--timeout", "30"]


def _stat(pid: int) -> list[bytes] | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    return stat[stat.rfind(b")") + 2 :].split()


def running(pid: int) -> bool:
    """The process exists and is not a zombie."""
    fields = _stat(pid)
    return fields is not None and fields[0] not in (b"Z", b"X")


def descendants(root: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            fields = _stat(int(entry.name))
            if fields is not None:
                children.setdefault(int(fields[1]), []).append(int(entry.name))
    found, todo = set(), [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


class Run:
    """One ``arendez-run`` of the example; its output (stdout and stderr) gathered as it comes."""

    def __init__(self, *launcher_args: str, example_args: list[str] | None = None) -> None:
        argv = [sys.executable, "-m", "arendez.launch", *launcher_args, EXAMPLE, *(example_args or ARGS)]
        self.proc = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=_env(),
            cwd=ROOT,
            start_new_session=True,
        )
        self.lines: list[str] = []
        self.seen: set[int] = set()  # every pid of the launcher's tree we saw
        self._cond = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._cond:
                self.lines.append(line.rstrip("\n"))
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def count(self, pattern: str) -> int:
        with self._cond:
            return sum(1 for ln in self.lines if re.search(pattern, ln))

    def world_rank(self, slot: int) -> int:
        """The rank slot ``slot``'s process last said it holds (slots and ranks differ once a
        world formed without a late starter, or re-formed)."""
        said = re.compile(rf"^\[rank {slot}\] (?:re-formed as )?rank (\d+) of \d+")
        with self._cond:
            ranks = [int(m.group(1)) for ln in self.lines if (m := said.search(ln))]
        assert ranks, f"slot {slot} never said its rank:\n" + "\n".join(self.lines[-40:])
        return ranks[-1]

    def wait_for(self, pattern: str, n: int = 1, timeout: float = 30.0) -> None:
        """Until ``n`` output lines match ``pattern``; AssertionError with the output if not."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while sum(1 for ln in self.lines if re.search(pattern, ln)) < n:
                left = deadline - time.monotonic()
                if left <= 0 or (self.proc.poll() is not None and not self._reader.is_alive()):
                    raise AssertionError(
                        f"no {n} line(s) matching {pattern!r}:\n" + "\n".join(self.lines[-80:])
                    )
                self._cond.wait(min(left, 0.2))

    def slot_pids(self) -> dict[int, int]:
        """The pid of the rank process in each launcher slot (``LOCAL_RANK``) now."""
        found: dict[int, int] = {}
        tree = descendants(self.proc.pid)
        self.seen |= tree
        for pid in tree:
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
                env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"elastic_sgd.py" not in cmd or not running(pid):
                continue
            for item in env:
                if item.startswith(b"LOCAL_RANK="):
                    found[int(item.split(b"=", 1)[1])] = pid
        return found

    def signal_slot(self, slot: int, sig: int) -> int:
        pid = self.slot_pids()[slot]
        os.kill(pid, sig)
        return pid

    def finish(self, timeout: float = 60.0) -> int:
        """Wait for the launcher; its exit status."""
        self.slot_pids()
        self.proc.wait(timeout)
        self._reader.join(5)
        return self.proc.returncode

    def kill(self) -> None:
        """Kill the launcher's session and everything it started (a test that failed midway)."""
        self.seen |= descendants(self.proc.pid)
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        for pid in self.seen:
            if running(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        self._reader.join(5)

    def leftovers(self, timeout: float = 5.0) -> set[int]:
        """Processes of the launcher's tree still running ``timeout`` s after it ended."""
        deadline = time.monotonic() + timeout
        while (left := {p for p in self.seen if running(p)}) and time.monotonic() < deadline:
            time.sleep(0.05)
        return left

    def finals(self) -> list[dict[str, Any]]:
        """The ``final`` results the ranks printed."""
        out = []
        for line in self.lines:
            match = re.match(r"\[rank \d+\] final (\{.*\})$", line)
            if match:
                out.append(json.loads(match.group(1)))
        return out

    def losses(self) -> list[float]:
        return [float(m.group(1)) for ln in self.lines if (m := re.search(r" loss ([0-9.e+-]+)$", ln))]

    def text(self) -> str:
        return "\n".join(self.lines)


def check_training(run: Run, world_size: int | None, steps: int = STEPS) -> None:
    """The final round of ``world_size`` ranks finished every step with the same weights, which
    match one process doing the same steps, and the loss went down.

    ``world_size=None`` (chaos): a failure in the very last all_reduce can leave the ranks split
    over whether it completed; those that completed it finish, the others re-form and do the
    last step again. Then every rank that finished did every step, the ranks of each final
    round agree on the weights, and all match one process's."""
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        from elastic_sgd import reference
    finally:
        sys.path.pop(0)
    finals = run.finals()
    story = "\n".join(ln[:200] for ln in run.lines if " step " not in ln or "re-form" in ln)[-6000:]
    assert finals, story
    rounds: dict[int, list[dict[str, Any]]] = {}
    for f in finals:
        rounds.setdefault(f["generation"], []).append(f)
    if world_size is not None:
        assert len(rounds) == 1, story
    for members in rounds.values():
        size = members[0]["world_size"]
        assert size == (world_size or size), story
        assert {f["world_size"] for f in members} == {size}, story
        if world_size is not None or len(rounds) == 1:
            assert sorted(f["rank"] for f in members) == list(range(size)), story
        assert len({f["digest"] for f in members}) == 1, f"the ranks disagree on the weights\n{story}"
    assert {f["step"] for f in finals} == {steps}, story
    expected = reference(steps, 2048, 16, 0.1)
    for f in finals:
        np.testing.assert_allclose(np.array(f["w"]), expected, rtol=1e-9, atol=1e-12)
    losses = run.losses()
    assert len(losses) >= 3 and losses[-1] < losses[0] / 100, losses
