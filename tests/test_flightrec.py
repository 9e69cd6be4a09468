"""The flight recorder: what each rank's dump says when a job hangs or loses a rank, and what
the analyzer makes of the dumps (``arendez.flightrec``)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import arendez as dist
from arendez import flightrec, jobnames
from arendez.flightrec import analyze
from arendez.testing import run_ranks
from tests.harness import ROOT, collect, spawn_rank, wait_for_files
from tests.jobs import flightrec as jobs


def _dumps(folder: Path) -> dict[int, dict[str, Any]]:
    out = {}
    for f in folder.glob("arendez-flightrec-*.json"):
        data = json.loads(f.read_text())
        out[data["rank"]] = data
    return out


def _analyzer(*paths: Path) -> str:
    """The analyzer's report, run as an operator would."""
    done = subprocess.run(
        [sys.executable, "-m", "arendez.flightrec", *map(str, paths)],
        capture_output=True,
        text=True,
        timeout=30,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    print(done.stdout)  # (shown when a test fails)
    return done.stdout


def _wait_dumps(folder: Path, ranks: list[int], reason: str, timeout: float = 10.0) -> dict[int, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        dumps = _dumps(folder)
        if all(r in dumps and reason in dumps[r]["reason"] for r in ranks):
            return dumps
        time.sleep(0.05)
    have = sorted(_dumps(folder))
    raise AssertionError(f"no {reason} dump from each of ranks {ranks} in {timeout}s (have {have})")


# -- real processes ----------------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_sigusr1_on_a_hung_job_names_the_late_rank_and_every_rank_continues(arendez_server, tmp_path):
    """Ranks 0 and 1 wait in all_reduce #3 while rank 2 stays away: SIGUSR1 to each writes its
    dump without stopping it; the analyzer names rank 2 and seq 3; then the job completes."""
    dumps_dir, marks = tmp_path / "dumps", tmp_path / "marks"
    marks.mkdir()
    env = {"ARENDEZ_FLIGHT_RECORDER_DIR": str(dumps_dir)}
    url = f"{arendez_server.url}/fr-usr1-{tmp_path.name}"
    procs = [spawn_rank(jobs.late_rank, r, 3, url, str(marks), env=env) for r in range(3)]
    try:
        wait_for_files(marks, "ready-*", 3)
        time.sleep(0.3)  # ranks 0 and 1 are inside all_reduce #3 by now
        for p in procs:
            p.send_signal(signal.SIGUSR1)
        dumps = _wait_dumps(dumps_dir, [0, 1, 2], "SIGUSR1")
        for r in (0, 1):
            last = dumps[r]["entries"][-1]
            assert last["seq"] == 3 and last["op"] == "all_reduce", last
            assert last["state"] == "started" and last["peers_pending"] == [2], last
            assert last["dtype"] == "float32" and last["count"] == 2 and last["bytes"] == 8, last
            assert last["waited_ms"] > 0 and last["time_ended_ns"] is None
        assert dumps[2]["groups"]["0"]["last_completed_seq"] == 2
        assert [e["state"] for e in dumps[2]["entries"]] == ["completed"] * 3
        report = _analyzer(dumps_dir)
        assert "group 0 seq 3 all_reduce (float32 x 2): ranks 0,1 waiting on rank 2" in report, report
        assert "(rank 2 last completed seq 2)" in report, report
        (marks / "go").write_text("1")
        results = collect(procs, 30)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for res in results:
        assert res.returncode == 0, res.stderr[-3000:]
        assert res.value == {"sum": 9.0, "seqs": [0, 1, 2, 3, 4]}  # the job went on after the dumps


def _fail_one(
    server_url: str, tmp: Path, sig: int, timeout: float, stall_last: bool = False
) -> tuple[list[Any], Path]:
    dumps_dir, marks = tmp / "dumps", tmp / "marks"
    marks.mkdir()
    env = {"ARENDEZ_FLIGHT_RECORDER_DIR": str(dumps_dir)}
    url = f"{server_url}/fr-{sig}-{tmp.name}"
    procs = [
        spawn_rank(jobs.reduce_until_failure, r, 3, url, str(marks), timeout, stall_last, env=env)
        for r in range(3)
    ]
    try:
        wait_for_files(marks, "ready-*", 3)
        os.kill(procs[2].pid, sig)
        results = collect(procs[:2], 30)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    for res in results:
        assert res.returncode == 0, res.stderr[-3000:]
        assert res.value["dump"] is not None, res.value
        assert "flight recorder dump" in res.stderr and res.value["dump"] in res.stderr  # logged
    return [res.value for res in results], dumps_dir


@pytest.mark.timeout(60)
def test_hung_collective_dump_names_the_stopped_rank_and_the_seq(arendez_server, tmp_path):
    """Rank 2 is SIGSTOPped: the others' collective times out (or the lease declares rank 2
    failed); each one's dump shows that collective, its seq, and rank 2 pending."""
    values, dumps_dir = _fail_one(arendez_server.url, tmp_path, signal.SIGSTOP, 1.5)
    dumps = _dumps(dumps_dir)
    assert sorted(dumps) == [0, 1]
    for r, value in enumerate(values):
        assert value["error"] in ("CollectiveTimeoutError", "RankFailedError"), value
        last = dumps[r]["entries"][-1]
        assert last["state"] in ("timed out", "failed") and last["op"] == "all_reduce", last
        assert 2 in last["peers_pending"] or 2 in last.get("missing", []), last
        assert f"(seq {last['seq']})" in value["message"] or value["error"] == "RankFailedError", value
        assert last["seq"] >= 3 and dumps[r]["groups"]["0"]["last_completed_seq"] == last["seq"] - 1
    report = _analyzer(*dumps_dir.iterdir())
    assert "no dump from rank 2" in report and "waiting on rank 2" in report, report
    seq = dumps[0]["entries"][-1]["seq"]
    assert f"group 0 seq {seq} all_reduce (float32 x 2): " in report, report


@pytest.mark.timeout(60)
def test_kill_9_survivors_dump_the_failed_collective(arendez_server, tmp_path):
    # rank 2 stalls before its 4th all_reduce, so both survivors are inside it, waiting on rank 2,
    # when it is killed (killed mid-call instead, it may have sent its part to both, and a survivor
    # then fails sending to it with nobody pending: a race, not what this test is about)
    values, dumps_dir = _fail_one(arendez_server.url, tmp_path, signal.SIGKILL, 20.0, stall_last=True)
    dumps = _dumps(dumps_dir)
    assert sorted(dumps) == [0, 1]
    pending: set[int] = set()
    for r, value in enumerate(values):
        assert value["error"] == "RankFailedError", value
        dump = dumps[r]
        assert "RankFailedError" in dump["reason"] and "2" in dump["dead_ranks"], dump["reason"]
        failed = [e for e in dump["entries"] if e["state"] == "failed"]
        assert failed and failed[-1]["op"] == "all_reduce", dump["entries"][-3:]
        assert "RankFailedError: rank 2 failed during all_reduce" in failed[-1]["error"]
        assert failed[-1]["time_ended_ns"] >= failed[-1]["time_enqueued_ns"]
        assert 2 in failed[-1]["peers_pending"] and r not in failed[-1]["peers_pending"], failed[-1]
        pending.update(failed[-1]["peers_pending"])
    assert 2 in pending  # the survivor behind waits on rank 2
    report = _analyzer(dumps_dir)
    assert "rank 2 is gone" in report and "waiting on rank 2 (rank 2 gone" in report, report


# -- in-process ranks ---------------------------------------------------------------------------
async def test_the_ring_keeps_exactly_the_last_n(monkeypatch):
    monkeypatch.setenv("ARENDEZ_FLIGHT_RECORDER", "5")

    async def rank(r: int) -> dict[str, Any]:
        x = np.ones(3, np.float64)
        for _ in range(12):
            await dist.all_reduce(x)
        await dist.broadcast(np.zeros(4, np.int32), 1)
        return dist.flight_recorder()

    for dump in await run_ranks(2, rank):
        assert dump["capacity"] == 5 and dump["recorded"] == 13
        assert [e["seq"] for e in dump["entries"]] == [8, 9, 10, 11, 12]
        assert [e["op"] for e in dump["entries"]] == ["all_reduce"] * 4 + ["broadcast"]
        assert all(e["state"] == "completed" and e["algorithm"] == "direct" for e in dump["entries"])
        assert dump["entries"][-1]["dtype"] == "int32" and dump["entries"][-1]["bytes"] == 16
        assert dump["groups"]["0"]["last_completed_seq"] == 12


async def test_peers_and_algorithm_of_a_ring_all_reduce(monkeypatch):
    """A ring rank hears only from its left neighbour; an ended collective with many messages
    keeps only their senders (``KEEP_KEYS``), which says the same."""
    from arendez import flightrec

    monkeypatch.setattr(flightrec, "KEEP_KEYS", 1)

    async def rank(r: int) -> dict[str, Any]:
        await dist.all_reduce(np.ones(300_000, np.float32), algorithm="ring")
        assert len(dist.current_world().flight._ring[-1].keys) == 1
        return dist.flight_recorder()["entries"][-1]

    entries = await run_ranks(3, rank)
    for r, e in enumerate(entries):
        assert e["algorithm"] == "ring" and e["bytes"] == 1_200_000 and e["state"] == "completed"
        assert e["peers_done"] == [(r - 1) % 3] and e["peers_pending"] == [], e


async def test_a_rank_that_never_calls_gets_named_in_the_timeout_dump(monkeypatch, tmp_path):
    monkeypatch.setenv("ARENDEZ_FLIGHT_RECORDER_DIR", str(tmp_path))

    async def rank(r: int) -> str:
        await dist.all_reduce(np.ones(2, np.float32))
        if r == 2:
            await asyncio.sleep(2.5)
            return dist.dump_flight_recorder()
        try:
            await dist.barrier(timeout=1.0)
        except dist.CollectiveTimeoutError as exc:
            return str(exc)
        return "no error"

    job = f"fr-never-{os.getpid()}"
    results = await run_ranks(3, rank, job=job, timeout=20)
    assert "never arrived" in results[0] and "[2]" in results[0], results
    files = sorted(tmp_path.glob("arendez-flightrec-*.json"))
    assert len(files) == 3, files  # 0 and 1 on their timeout, 2 on demand
    report = "\n".join(analyze.analyze(analyze.load([tmp_path])[0]))
    expected = "group 0 seq 1 barrier: ranks 0,1 waiting on rank 2 (rank 2 last completed seq 0)"
    assert expected in report, report
    assert "timed out on ranks 0,1" in report, report


async def test_a_collective_refused_after_a_failure_is_recorded_and_dumped(monkeypatch, tmp_path):
    monkeypatch.setenv("ARENDEZ_FLIGHT_RECORDER_DIR", str(tmp_path))

    async def rank(r: int) -> Any:
        await dist.all_reduce(np.ones(2))
        if r == 1:
            return None
        dist.current_world().peer_lost(1, "declared failed by this test")
        with pytest.raises(dist.RankFailedError):
            await dist.all_reduce(np.ones(5, np.int64))
        return dist.flight_recorder()

    dump = (await run_ranks(2, rank))[0]
    refused = dump["entries"][-1]
    assert refused["seq"] == 1 and refused["state"] == "failed" and refused["peers_pending"] == [1]
    assert refused["dtype"] == "int64" and refused["count"] == 5 and refused["time_started_ns"] is None
    assert "it never started" in refused["error"]
    assert dump["dead_ranks"] == {"1": "declared failed by this test"}
    files = list(tmp_path.glob("arendez-flightrec-*-rank0.json"))
    assert len(files) == 1 and "RankFailedError" in json.loads(files[0].read_text())["reason"]


async def test_off_with_zero_records_nothing_and_writes_nothing(monkeypatch, tmp_path):
    monkeypatch.setenv("ARENDEZ_FLIGHT_RECORDER", "0")
    monkeypatch.setenv("ARENDEZ_FLIGHT_RECORDER_DIR", str(tmp_path))

    async def rank(r: int) -> dict[str, Any]:
        await dist.all_reduce(np.ones(2))
        if r == 0:
            with pytest.raises(dist.CollectiveTimeoutError):
                await dist.barrier(timeout=0.3)
        else:
            await asyncio.sleep(1.5)
        return dist.flight_recorder()

    for dump in await run_ranks(2, rank, timeout=20):
        assert dump["capacity"] == 0 and dump["entries"] == [] and dump["recorded"] == 0
    assert list(tmp_path.iterdir()) == []


async def test_a_failing_dump_never_masks_the_error(monkeypatch, tmp_path, caplog):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    monkeypatch.setenv("ARENDEZ_FLIGHT_RECORDER_DIR", str(blocker / "sub"))

    async def rank(r: int) -> str:
        if r == 0:
            try:
                await dist.barrier(timeout=0.3)
            except dist.CollectiveTimeoutError as exc:
                return type(exc).__name__
        await asyncio.sleep(1.5)
        return "slept"

    with caplog.at_level(logging.WARNING, logger="arendez.flightrec"):
        assert await run_ranks(2, rank, timeout=20) == ["CollectiveTimeoutError", "slept"]
    assert "flight recorder dump failed" in caplog.text


async def test_bad_size_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("ARENDEZ_FLIGHT_RECORDER", "-3")
    with pytest.raises(ValueError, match="ARENDEZ_FLIGHT_RECORDER must be at least 0, got -3"):
        await run_ranks(1, lambda r: asyncio.sleep(0))


def test_analyzer_reports_mismatched_collectives_and_unreadable_files(tmp_path):
    def dump(rank: int, op: str, state: str) -> dict[str, Any]:
        entry = {"group": 0, "seq": 4, "op": op, "state": state, "peers_pending": [], "waited_ms": 9.5}
        groups = {"0": {"ranks": [0, 1], "last_completed_seq": 3, "next_seq": 5}}
        return {"rank": rank, "world_size": 2, "job": "j", "groups": groups, "entries": [entry]}

    (tmp_path / "arendez-flightrec-j-rank0-1.json").write_text(json.dumps(dump(0, "all_reduce", "started")))
    (tmp_path / "arendez-flightrec-j-rank1-2.json").write_text(json.dumps(dump(1, "broadcast", "started")))
    (tmp_path / "arendez-flightrec-j-rank2-3.json").write_text("{not json")
    report = _analyzer(tmp_path)
    assert "skipped" in report and "rank2" in report
    assert "group 0 seq 4 MISMATCHED collectives: ranks 0,1" in report, report
    assert "rank 0 runs all_reduce" in report and "rank 1 runs broadcast" in report


def test_analyzer_of_a_large_job_names_ranges_and_does_not_blame_ranks_that_left():
    # 5,000 ranks: rank 7 waits on rank 9; ranks 100-3999 left in good order, 4000-4002 failed
    left = {str(r): "it left the job (the server says)" for r in range(100, 4000)}
    failed = {str(r): "declared failed by the server (no heartbeat for 2.5s)" for r in (4000, 4001, 4002)}
    entry = {"group": 0, "seq": 1, "op": "barrier", "state": "timed out", "peers_pending": [9]}
    entry["duration_ms"] = 5.0
    groups = {"0": {"ranks": list(range(5000)), "last_completed_seq": 0, "next_seq": 2}}
    dump = {"rank": 7, "world_size": 5000, "job": "j", "groups": groups, "entries": [entry]}
    dump["dead_ranks"] = {**left, **failed}
    lines = analyze.analyze([dump])
    assert lines[1] == "no dump from ranks 0-6,8-4999 (4999 ranks)", lines
    assert "ranks 100-3999 (3900 ranks) are gone: it left the job (the server says)" in lines, lines
    assert "ranks 4000-4002 are gone: declared failed by the server (no heartbeat for 2.5s)" in lines, lines
    waits = next(line for line in lines if line.startswith("group 0 seq 1 barrier"))
    assert waits.startswith("group 0 seq 1 barrier: rank 7 waiting on ranks 9,4000-4002 ("), waits
    assert analyze.ranks_text(range(0, 200, 2)).endswith(",... (100 ranks)")


@pytest.mark.timeout(20)
def test_the_blocking_facade_reads_and_dumps_on_its_loop_thread(tmp_path):
    import arendez.sync as sdist

    sdist.init_process_group("gloo", None, world_size=1, rank=0)
    try:
        for _ in range(3):
            sdist.all_reduce(np.ones(4, np.float32))
        entries = sdist.flight_recorder()["entries"]
        path = sdist.dump_flight_recorder(tmp_path / "mine.json")
    finally:
        sdist.destroy_process_group()
    assert [(e["seq"], e["state"], e["count"]) for e in entries] == [(i, "completed", 4) for i in range(3)]
    assert path == str(tmp_path / "mine.json") and json.loads(Path(path).read_text())["entries"] == entries


def test_made_up_job_names_share_one_dump_file_per_rank(monkeypatch, tmp_path):
    """A job named by the torch backend or ``arendez-run`` dumps under its kind, so every run
    overwrites the last one's file (as torch's dumps do) rather than adding a new set."""
    monkeypatch.setenv("ARENDEZ_FLIGHT_RECORDER_DIR", str(tmp_path))
    first, second = jobnames.for_torch(), jobnames.for_torch()
    assert first != second and jobnames.label(first) == jobnames.label(second) == "torch"
    assert jobnames.label(jobnames.for_launch(4242)) == "run"
    for named in ("torch", "torch-run-7", "run-12-abc", "exp-1f2e3d4c5b6a", "torch-1F2E3D4C5B6A"):
        assert jobnames.label(named) == named  # (a name the user chose is kept, whatever it looks like)
    recorder = flightrec.Recorder.__new__(flightrec.Recorder)
    recorder.rank = 3
    assert (
        recorder.default_path(first)
        == recorder.default_path(second)
        == str(tmp_path / "arendez-flightrec-torch-rank3.json")
    )
    assert recorder.default_path("exp-1f2e3d4c5b6a").endswith("arendez-flightrec-exp-1f2e3d4c5b6a-rank3.json")


def test_analyzer_reads_the_newest_job_and_says_which_older_dumps_it_left_out():
    def dump(job: str, rank: int, world_size: int, when: int) -> dict[str, Any]:
        entry = {"group": 0, "seq": 2, "op": "all_reduce", "state": "started", "peers_pending": [1]}
        groups = {"0": {"ranks": list(range(world_size)), "last_completed_seq": 1, "next_seq": 3}}
        return {"rank": rank, "world_size": world_size, "job": job, "time_ns": when, "groups": groups,
                "entries": [entry]}  # fmt: skip

    old = [dump("torch-aaaaaaaaaaaa", r, 4, 10 + r) for r in range(4)]
    new = [dump("torch-bbbbbbbbbbbb", 0, 2, 100)]
    lines = analyze.analyze(old + new)
    assert lines[0] == "job torch-bbbbbbbbbbbb: dumps from rank 0 of world size 2", lines
    assert "left out 4 dump(s) of other job(s), older: torch-aaaaaaaaaaaa" in lines, lines
    assert lines[2] == "no dump from rank 1", lines
