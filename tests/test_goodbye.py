"""A process that ends with its world up says goodbye: survivors name the rank that failed first."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from tests.harness import collect, spawn_rank, wait_for_files
from tests.jobs import goodbye


def _stop_rank_2(server_url: str, tmp: Path, deaf: bool):
    url = f"{server_url}/stop-{tmp.name}"
    procs = [spawn_rank(goodbye.messenger_dies, r, 3, url, str(tmp), deaf) for r in range(3)]
    try:
        wait_for_files(tmp, "ready-*", 3)
        os.kill(procs[2].pid, signal.SIGSTOP)
        stopped_at = time.time()
        results = collect(procs[:2], 30)
    finally:
        procs[2].kill()
        procs[2].wait()
    return stopped_at, results


@pytest.mark.timeout(150)
@pytest.mark.parametrize("deaf", [False, True], ids=["with-server-events", "goodbye-only"])
def test_survivors_of_a_stopped_rank_name_it_not_the_messenger(arendez_server, tmp_path, deaf):
    """Ranks 0,1,2; rank 2 SIGSTOPped; rank 1 raises naming rank 2 and its process ends with
    the error. Rank 0 names rank 2 first (with ``goodbye-only`` it hears of rank 2 only from
    rank 1's goodbye), repeated."""
    for attempt in range(2):
        run = tmp_path / f"run{attempt}"
        run.mkdir()
        stopped_at, (zero, one) = _stop_rank_2(arendez_server.url, run, deaf)
        assert one.returncode != 0 and "RankFailedError: rank 2 failed" in one.stderr, one.stderr[-2000:]
        assert zero.returncode == 0, zero.stderr[-3000:]
        out = zero.value
        assert out["error"] == "RankFailedError" and out["ranks"][0] == 2, out
        assert out["message"].startswith("rank 2 failed during all_reduce"), out
        assert out["at"] - stopped_at < 8.0, f"rank 0 raised {out['at'] - stopped_at:.1f}s after the stop"
        if deaf:  # the news came from the messenger, and the messenger is named after it
            assert "reported by rank 1" in out["message"], out
            assert out["ranks"] == [2, 1], out


@pytest.mark.timeout(60)
def test_a_receive_from_the_messenger_names_the_root_cause_first(arendez_server, tmp_path):
    """Rank 0 is killed; rank 1's process ends of it; rank 2, receiving from rank 1, had seen
    rank 0 go: its error names rank 0 first, then rank 1."""
    url = f"{arendez_server.url}/messenger-recv-{tmp_path.name}"
    procs = [spawn_rank(goodbye.receiver_of_the_messenger, r, 3, url, str(tmp_path)) for r in range(3)]
    try:
        wait_for_files(tmp_path, "ready-*", 3)
        time.sleep(0.3)  # (rank 2 is in its recv, rank 1 in its all_reduce)
        os.kill(procs[0].pid, signal.SIGKILL)
        (res,) = collect(procs[2:], 30)
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    assert res.returncode == 0, res.stderr[-3000:]
    out = res.value
    assert out["error"] == "RankFailedError" and out["ranks"] == [0, 1], out
    assert out["message"].startswith("rank 0 failed during recv"), out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["exit", "raise", "sigterm", "sigint"])
def test_a_rank_that_ends_without_destroy_says_how(arendez_server, tmp_path, how):
    url = f"{arendez_server.url}/end-{how}-{tmp_path.name}"
    procs = [spawn_rank(goodbye.ends_without_destroy, r, 2, url, how) for r in range(2)]
    zero, one = collect(procs, 30)
    expected = {"exit": 0, "raise": 1, "sigterm": -signal.SIGTERM, "sigint": -signal.SIGINT}[how]
    assert one.returncode == expected, one.stderr[-2000:]
    assert zero.returncode == 0, zero.stderr[-3000:]
    out = zero.value
    assert out["error"] == "RankFailedError" and out["ranks"] == [1], out
    words = {
        "exit": "it left: it destroyed its process group, or its process ended",
        "raise": "uncaught RuntimeError: rank 1 gives up",
        "sigterm": "terminated (SIGTERM)",
        "sigint": "the task that initialized it cancelled (as by Ctrl-C)",
    }[how]
    assert words in out["message"], out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("where", ["idle", "busy"])
def test_a_blocking_api_rank_ended_by_sigterm_says_so(where: str) -> None:
    """``arendez.sync`` builds its world on the loop thread, where no signal handler can be
    installed; its ``init_process_group`` installs the SIGTERM goodbye from the caller's thread,
    and the goodbye is written on the loop thread, in plain Python code or inside a collective."""
    import json
    import socket
    import subprocess
    import sys

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    script = str(Path(__file__).parent / "scripts" / "sync_sigterm.py")
    procs = [
        subprocess.Popen([sys.executable, script, str(r), port, where], stdout=subprocess.PIPE, text=True)
        for r in range(2)
    ]
    try:
        for proc in procs:
            assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        time.sleep(0.5 if where == "idle" else 1.0)  # (busy: rank 1 is inside its all_reduce)
        procs[1].send_signal(signal.SIGTERM)
        assert procs[1].wait(10) == -signal.SIGTERM
        out, _ = procs[0].communicate(timeout=30)
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    outcome = json.loads(out.strip().splitlines()[-1])
    assert outcome["error"] == "RankFailedError" and outcome["ranks"] == [1], outcome
    assert "its process was terminated (SIGTERM)" in outcome["message"], outcome
