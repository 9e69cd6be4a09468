"""Chaos, bounded: up to 20 random kill -9 / SIGSTOP events on the ranks of an elastic training
run (about 20 s at most); the training ends complete and correct, and nothing is left behind."""

from __future__ import annotations

import os
import random
import signal
import time

import pytest

from tests.elastic_run import Run, check_training

STEPS = 550
EVENTS = 20
BUDGET = 20.0  # seconds of chaos at most


@pytest.mark.timeout(150)
def test_chaos_kill9_and_sigstop_training_completes_correctly(runs: list[Run]) -> None:
    seed = int(os.environ.get("ARENDEZ_CHAOS_SEED", str(random.randrange(1 << 30))))
    rng = random.Random(seed)
    args = ["--steps", str(STEPS), "--step-time", "0.02", "--log-every", "50", "--timeout", "30"]
    launcher = ["--nproc", "4", "--max-restarts", str(EVENTS), "--min-nproc", "1", "--finish-timeout", "8"]
    runs.append(run := Run(*launcher, example_args=args))
    run.wait_for(r"^\[rank \d\] step 1 loss", timeout=40)
    stopped: dict[int, float] = {}  # pid -> when to let it go on
    log: list[str] = []
    started = time.monotonic()
    events = 0
    try:
        while events < EVENTS and time.monotonic() - started < BUDGET and run.proc.poll() is None:
            time.sleep(rng.uniform(0.4, 1.6))
            for pid, until in list(stopped.items()):
                if time.monotonic() >= until:
                    os.kill(pid, signal.SIGCONT)
                    del stopped[pid]
            if run.count(r"\] final ") or run.count(rf"step {STEPS - 100} loss"):
                break  # near the end: a rank killed now would have nobody left to join
            slots = {s: p for s, p in run.slot_pids().items() if p not in stopped}
            if not slots:
                continue
            slot = rng.choice(sorted(slots))
            if stopped or rng.random() < 0.7:  # at most one stopped rank at a time
                os.kill(slots[slot], signal.SIGKILL)
                log.append(f"kill -9 slot {slot}")
            else:
                os.kill(slots[slot], signal.SIGSTOP)
                stopped[slots[slot]] = time.monotonic() + rng.uniform(0.3, 4.0)
                log.append(f"SIGSTOP slot {slot}")
            events += 1
    finally:
        for pid in stopped:  # let every stopped rank go on (it re-joins or is restarted)
            os.kill(pid, signal.SIGCONT)
    code = run.finish(timeout=100)
    print(f"chaos seed {seed}: {len(log)} events: {log}")
    detail = f"seed {seed}, events: {log}\n" + run.text()[-3000:]
    assert code == 0, detail
    assert events >= 5, detail
    check_training(run, None, steps=STEPS)
