"""Elastic training with real processes: ranks killed (-9) or stopped, survivors re-form and go
on, the launcher's replacements join, and the final weights are the same on every rank and
equal to one process's (``examples/elastic_sgd.py`` under ``arendez-run``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.elastic_run import ARGS, EXAMPLE, STEPS, Run, check_training
from tests.harness import _env, start_server


@pytest.mark.timeout(90)
def test_kill9_one_of_four_survivors_reform_and_the_replacement_joins(runs: list[Run]) -> None:
    runs.append(run := Run("--nproc", "4", "--max-restarts", "1", "--min-nproc", "2"))
    run.wait_for(r"^\[rank \d+\] step 30 loss", timeout=40)
    before = {slot: run.world_rank(slot) for slot in (0, 2, 3)}  # (slot order, unless a late start)
    run.signal_slot(1, signal.SIGKILL)
    run.wait_for(r"re-formed as rank \d of 3 in", n=3, timeout=10)
    run.wait_for(r"restarting it \(restart 1 of 1\)", timeout=10)
    run.wait_for(r"took joiners in: rank \d of 4", n=3, timeout=20)
    assert run.finish() == 0, run.text()[-3000:]
    check_training(run, 4)
    # the survivors keep their relative order: ranked by their ranks before, they are 0, 1, 2
    for rank, slot in enumerate(sorted(before, key=before.__getitem__)):
        assert f"[rank {slot}] re-formed as rank {rank} of 3" in run.text()
    assert not run.leftovers()


@pytest.mark.timeout(90)
def test_sigstop_survivors_reform_and_the_stopped_rank_comes_back(runs: list[Run]) -> None:
    runs.append(run := Run("--nproc", "4", "--min-nproc", "2"))
    run.wait_for(r"^\[rank \d+\] step 30 loss", timeout=40)
    pid = run.signal_slot(2, signal.SIGSTOP)
    try:  # the server's lease (2.5 s) declares it failed; the others go on without it
        run.wait_for(r"re-formed as rank \d of 3 in", n=3, timeout=10)
    finally:
        time.sleep(0.5)
        pid_now = run.slot_pids().get(2)
        assert pid_now == pid
        os.kill(pid, signal.SIGCONT)
    # it finds its world gone, re-forms, and is taken in with the state of the others
    run.wait_for(r"took joiners in: rank \d of 4", n=3, timeout=20)
    assert run.finish() == 0, run.text()[-3000:]
    check_training(run, 4)
    assert "restarting it" not in run.text()


@pytest.mark.timeout(120)
def test_two_failures_in_a_row(runs: list[Run]) -> None:
    steps = 2 * STEPS  # (time enough for the second replacement to start and join under load)
    args = [*ARGS[:1], str(steps), *ARGS[2:]]
    runs.append(run := Run("--nproc", "4", "--max-restarts", "2", "--min-nproc", "2", example_args=args))
    run.wait_for(r"^\[rank \d+\] step 20 loss", timeout=40)
    run.signal_slot(1, signal.SIGKILL)
    run.wait_for(r"re-formed as rank \d of 3 in", n=3, timeout=10)
    run.signal_slot(3, signal.SIGKILL)  # right after the first re-form, before the replacement
    run.wait_for(r"restart 2 of 2", timeout=10)
    assert run.finish() == 0, run.text()[-3000:]
    check_training(run, 4, steps)


@pytest.mark.timeout(120)
def test_server_restarted_during_a_reform(runs: list[Run]) -> None:
    """The standalone server is killed with a rank; the survivors re-form once it is back."""
    srv = start_server()
    port = srv.port or int(srv.url.rsplit(":", 1)[1])
    try:
        runs.append(run := Run("--nproc", "3", "--min-nproc", "2", "--server", srv.url))
        run.wait_for(r"^\[rank \d+\] step 30 loss", timeout=40)
        srv.proc.kill()
        srv.proc.wait(5)
        killed = run.world_rank(2)  # (2, unless the world formed before slot 1 started)
        run.signal_slot(2, signal.SIGKILL)
        run.wait_for(rf"rank {killed} failed during all_reduce", n=2, timeout=10)
        time.sleep(1.0)  # the survivors are re-forming against no server
        assert run.count(r"re-formed as") == 0
        srv = start_server(port=port)
        run.wait_for(r"re-formed as rank \d of 2 in", n=2, timeout=20)
        assert run.finish() == 0, run.text()[-3000:]
        check_training(run, 2)
    finally:
        srv.stop()


@pytest.mark.timeout(90)
def test_restarts_used_up_and_fewer_than_min_left_fails_the_job(runs: list[Run]) -> None:
    runs.append(run := Run("--nproc", "2", "--min-nproc", "2"))  # elastic, no restarts
    run.wait_for(r"^\[rank \d+\] step 20 loss", timeout=40)
    run.signal_slot(1, signal.SIGKILL)
    assert run.finish() == 137, run.text()[-3000:]  # 128 + SIGKILL: the failure not recovered
    assert "rank 1 failed with exit code 137 (no restarts left)" in run.text()
    assert "only 1 rank(s) left, fewer than --min-nproc 2" in run.text()
    assert not run.finals()


def _launcher(*args: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "arendez.launch", *args]
    return subprocess.run(argv, capture_output=True, text=True, env=_env(), timeout=30)


def test_launcher_usage_errors() -> None:
    etcd = ["--server", "etcd://127.0.0.1:2379/j"]
    for args, words in (
        (["--nproc", "2", "--min-nproc", "3"], "--min-nproc must be at most --nproc (2), got 3"),
        (["--nproc", "2", "--max-restarts", "-1"], "--max-restarts must be at least 0"),
        (["--nproc", "2", "--min-nproc", "1", *etcd], "etcd:// has no elastic"),
    ):
        out = _launcher(*args, EXAMPLE)
        assert out.returncode == 2 and words in out.stderr, out.stderr
    shown = _launcher("--help").stdout
    assert "Exit status" in shown and "--max-restarts" in shown and "--min-nproc" in shown
