"""``arendez-run``: env of the ranks, prefixed output, first-failure exit, signals, no leftovers."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from arendez.launch import exit_code, job_url
from tests.harness import ROOT, ServerProcess, _env, popen

SCRIPTS = ROOT / "tests" / "launch_scripts"


def _launch(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return popen([sys.executable, "-m", "arendez.launch", *args], env)


@pytest.fixture
def launcher() -> Iterator[list[subprocess.Popen[str]]]:
    """Launchers started by a test; killed with their session if the test fails midway."""
    started: list[subprocess.Popen[str]] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()


def _running(pid: int) -> bool:
    """The process exists and is not a zombie (init here reaps orphans slowly)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2 :].split()[0] not in (b"Z", b"X")


def _descendants(root: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_bytes()
            except OSError:
                continue
            ppid = int(stat[stat.rfind(b")") + 2 :].split()[1])
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = set(), [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def _wait_gone(pids: set[int], timeout: float = 5.0) -> set[int]:
    """The pids still running after ``timeout`` (an orphan may take a moment to die)."""
    deadline = time.monotonic() + timeout
    while (left := {p for p in pids if _running(p)}) and time.monotonic() < deadline:
        time.sleep(0.02)
    return left


def _rank_pids(piddir: Path, n: int, proc: subprocess.Popen[str], timeout: float = 30.0) -> set[int]:
    """Wait until ``n`` sleeper ranks wrote ``"<pid> <child pid>"``; all those pids."""
    deadline = time.monotonic() + timeout
    while len(files := sorted(piddir.glob("rank?"))) < n:
        assert proc.poll() is None, f"launcher exited early: {proc.communicate()}"
        assert time.monotonic() < deadline, "the ranks did not start"
        time.sleep(0.02)
    return {int(p) for f in files for p in f.read_text().split()}


def _lines(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln]


@pytest.mark.timeout(60)
def test_runs_ranks_with_env_and_prefixed_output(launcher: list[subprocess.Popen[str]]) -> None:
    launcher.append(proc := _launch("--nproc", "4", str(SCRIPTS / "allreduce.py")))
    out, err = proc.communicate(timeout=50)
    assert proc.returncode == 0, err
    for line in _lines(out):
        assert re.match(r"\[rank [0-3]\] ", line), line
    urls = set()
    for k in range(4):
        mine = [ln[len(f"[rank {k}] ") :] for ln in _lines(out) if ln.startswith(f"[rank {k}] ")]
        assert (
            f"hello from {k}/4 env={{'RANK': '{k}', 'WORLD_SIZE': '4', 'LOCAL_RANK': '{k}', "
            "'LOCAL_WORLD_SIZE': '4'}" in mine
        )
        (url,) = [ln.split("url=")[1] for ln in mine if ln.startswith("sum=10 url=")]
        urls.add(url)
        assert f"[rank {k}] to stderr from {k}" in _lines(err)
    (url,) = urls  # one job for all ranks, on the embedded loopback server
    assert re.fullmatch(r"arendez://127\.0\.0\.1:\d+/run-\d+-[0-9a-f]+", url), url


@pytest.mark.timeout(60)
def test_joins_a_given_server_and_job(
    arendez_server: ServerProcess, launcher: list[subprocess.Popen[str]]
) -> None:
    args = ["--server", arendez_server.url, "--job", "given", "--nproc", "2", str(SCRIPTS / "allreduce.py")]
    launcher.append(proc := _launch(*args))
    out, err = proc.communicate(timeout=50)
    assert proc.returncode == 0, err
    assert out.count(f"sum=3 url={arendez_server.url}/given") == 2, out


@pytest.mark.timeout(60)
def test_first_failure_kills_the_rest_and_sets_the_exit_code(
    tmp_path: Path, launcher: list[subprocess.Popen[str]]
) -> None:
    args = ["--nproc", "4", str(SCRIPTS / "sleeper.py"), "--fail-rank", "1", "--code", "3"]
    launcher.append(proc := _launch(*args, env={"PIDDIR": str(tmp_path)}))
    pids = _rank_pids(tmp_path, 4, proc)
    started = time.monotonic()
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 3, err
    assert time.monotonic() - started < 5, "the sleeping ranks (120 s) were not terminated"
    assert "rank 1 failed with exit code 3" in err
    assert "[rank 1] rank 1 failing with 3" in err
    assert not _wait_gone(pids), "ranks or their children outlived the launcher"


@pytest.mark.timeout(60)
def test_failure_during_a_collective_reports_the_failed_rank(launcher: list[subprocess.Popen[str]]) -> None:
    launcher.append(proc := _launch("--nproc", "4", str(SCRIPTS / "fail_after_init.py")))
    _, err = proc.communicate(timeout=50)
    assert proc.returncode == 3, err  # not the exit 1 of the ranks that lost it
    assert "rank 1 failed with exit code 3" in err
    assert "failed with exit code 1" not in err


@pytest.mark.timeout(60)
def test_the_rank_that_failed_first_is_blamed_not_the_first_to_exit(
    launcher: list[subprocess.Popen[str]],
) -> None:
    """Rank 1 exits 1 and ends slowly; the others fail on its goodbye and exit first (QA saw the
    launcher blame one of them in 6 runs of 7). Both modes; rank 1 named in each."""
    for mode in ("after", "during"):
        launcher.append(proc := _launch("--nproc", "4", str(SCRIPTS / "exit_in_collective.py"), mode))
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 1, err
        said = [ln for ln in _lines(err) if ln.startswith("arendez-run: ")]
        assert said[0].startswith(
            "arendez-run: rank 1 failed with exit code 1, the first to fail (its process ended with "
            "an uncaught SystemExit: 1)"
        ), (mode, err)
        assert "RankFailedError: rank 1 failed" in err  # the others did fail on its news
        assert not re.search(r"rank [023] failed with exit code", err), (mode, err)


@pytest.mark.timeout(60)
def test_a_stopped_rank_is_blamed_not_the_first_survivor_to_exit(
    launcher: list[subprocess.Popen[str]],
) -> None:
    """Rank 2 SIGSTOPs itself: it never ends or notes a failure; the others fail on the server's
    declaration and exit 1 (QA: the launcher named the first of them as the first to fail)."""
    launcher.append(proc := _launch("--nproc", "3", "--grace", "1", str(SCRIPTS / "stop_self.py")))
    _, err = proc.communicate(timeout=50)
    assert proc.returncode == 1, err
    said = [ln for ln in _lines(err) if ln.startswith("arendez-run: ")]
    assert re.match(
        r"arendez-run: rank 2 stopped answering \(it has not ended: stopped or hung\), the first to fail, "
        r"as rank [01] reported \(declared failed by the server \(no heartbeat.*\); "
        r"it exited with code 1\)",
        said[0],
    ), err
    assert not re.search(r"rank [01] failed with exit code", err), err


@pytest.mark.timeout(60)
def test_an_unreachable_server_is_named_early_and_at_the_end(launcher: list[subprocess.Popen[str]]) -> None:
    """Nothing listens at --server (a bound port that never listens): each rank says so once,
    seconds before its 6 s join timeout, and the launcher ends naming the address (QA item 14:
    silence until the timeout)."""
    with socket.socket() as idle:
        idle.bind(("127.0.0.1", 0))  # refused, and no one else can take it meanwhile
        url = f"arendez://127.0.0.1:{idle.getsockname()[1]}/j"
        args = ["--server", url, "--nproc", "2", str(SCRIPTS / "short_timeout.py"), "6"]
        launcher.append(proc := _launch(*args))
        _, err = proc.communicate(timeout=40)
    assert proc.returncode == 1, err
    host_port = url[len("arendez://") : -len("/j")]
    for k in range(2):
        mine = [ln for ln in _lines(err) if ln.startswith(f"[rank {k}] ")]
        said = [i for i, ln in enumerate(mine) if f"cannot reach the store at {host_port}" in ln]
        assert len(said) == 1, err  # once, not a flood
        left = re.search(r"retrying until the timeout \((\d+\.\d) s left\)", mine[said[0]])
        assert left and float(left.group(1)) >= 2, mine[said[0]]  # said early, not at the deadline
    assert re.search(
        rf"StoreConnectTimeoutError: store at {host_port} unreachable until the deadline", err
    ), err
    last = _lines(err)[-1]
    assert last.startswith(f"arendez-run: the server at {url} cannot be reached (ConnectionRefusedError"), err


@pytest.mark.timeout(60)
def test_ranks_ignoring_sigterm_are_killed_after_the_grace_period(
    tmp_path: Path, launcher: list[subprocess.Popen[str]]
) -> None:
    args = [
        "--grace",
        "0.5",
        "--nproc",
        "3",
        str(SCRIPTS / "sleeper.py"),
        "--ignore-term",
        "--fail-rank",
        "0",
    ]
    launcher.append(proc := _launch(*args, env={"PIDDIR": str(tmp_path)}))
    pids = _rank_pids(tmp_path, 3, proc)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 3, err
    assert not _wait_gone(pids), "SIGTERM-proof ranks survived"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signals_are_forwarded_and_nothing_is_left(
    sig: signal.Signals, tmp_path: Path, launcher: list[subprocess.Popen[str]]
) -> None:
    launcher.append(
        proc := _launch("--nproc", "3", str(SCRIPTS / "sleeper.py"), env={"PIDDIR": str(tmp_path)})
    )
    pids = _rank_pids(tmp_path, 3, proc)
    family = _descendants(proc.pid)  # the embedded server, the ranks and their children
    assert pids <= family and len(family) >= 7
    os.kill(proc.pid, sig)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 128 + sig, err
    assert f"got {sig.name}" in err
    assert not _wait_gone(family), "processes outlived the launcher"


@pytest.mark.timeout(60)
def test_a_sigkilled_launcher_leaves_nothing(tmp_path: Path, launcher: list[subprocess.Popen[str]]) -> None:
    """SIGKILL gives the launcher no chance to clean up: its watchdog stops every rank's session
    (children of ranks included) and the server, and removes the launcher's notes directory."""
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    launcher.append(
        proc := _launch(
            "--nproc",
            "3",
            "--grace",
            "1",
            str(SCRIPTS / "sleeper.py"),
            env={"PIDDIR": str(tmp_path), "TMPDIR": str(scratch)},
        )
    )
    pids = _rank_pids(tmp_path, 3, proc)
    family = _descendants(proc.pid)  # the watchdog, the embedded server, the ranks and their children
    assert pids <= family and len(family) >= 8
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=10)
    assert not _wait_gone(family, timeout=10), "processes outlived the SIGKILLed launcher"
    assert [p.name for p in scratch.iterdir() if p.name.startswith("arendez-run-")] == []


@pytest.mark.timeout(60)
def test_env_init_with_torchrun_variables() -> None:
    """MASTER_ADDR/MASTER_PORT without ARENDEZ_URL: rank 0 hosts the store (tcp:// semantics)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    world = 3
    procs = []
    for rank in range(world):
        env = {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world),
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, str(SCRIPTS / "allreduce.py")],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=_env(env),
                cwd=ROOT,
            )
        )
    try:
        results = [p.communicate(timeout=40) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for rank, (p, (out, err)) in enumerate(zip(procs, results, strict=True)):
        assert p.returncode == 0, err
        assert f"hello from {rank}/{world}" in out
        assert "sum=6 url=None" in out


@pytest.mark.timeout(30)
def test_console_script_and_usage_errors() -> None:
    script = Path(sys.executable).with_name("arendez-run")
    ok = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=20)
    assert ok.returncode == 0 and "--nproc" in ok.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "arendez.launch", "--nproc", "0", "x.py"],
        capture_output=True,
        text=True,
        timeout=20,
    )
    assert bad.returncode == 2 and "--nproc must be at least 1" in bad.stderr


@pytest.mark.timeout(10)
def test_job_url_and_exit_code() -> None:
    assert job_url("arendez://h:1", "j") == "arendez://h:1/j"
    assert job_url("tok@h:1/given", None) == "arendez://tok@h:1/given"
    assert job_url("arendez://h:1/", None).startswith(f"arendez://h:1/run-{os.getpid()}-")
    with pytest.raises(ValueError, match="names job"):
        job_url("arendez://h:1/a", "b")
    with pytest.raises(ValueError, match="arendez://"):
        job_url("tcp://h:1", None)
    assert (exit_code(3), exit_code(-signal.SIGKILL)) == (3, 128 + signal.SIGKILL)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("original", "status"), [(False, 0), (True, 5)])
def test_a_late_replacement_failing_after_the_job_finished_does_not_count(
    launcher: list[subprocess.Popen[str]], original: bool, status: int
) -> None:
    """Elastic: the job finished on the other ranks while slot 1's replacement was still on its
    way: its failure is reported, not counted (0); an original rank failing after the others
    finished still sets the status (5)."""
    args = ["--nproc", "3", "--max-restarts", "1", "--min-nproc", "2", "--finish-timeout", "10"]
    script = [str(SCRIPTS / "late_replacement.py"), *(["--original"] if original else [])]
    launcher.append(proc := _launch(*args, *script))
    _, err = proc.communicate(timeout=50)
    assert proc.returncode == status, err
    assert "rank 1 failed with exit code 5 (a rank had already finished" in err
    assert ("a replacement: not counted" in err) is not original


@pytest.mark.timeout(30)
async def test_a_killed_rank_is_blamed_when_a_survivors_note_is_timed_before_its_exit(tmp_path: Path) -> None:
    """QA (1 of 44 kill -9 runs): a survivor noted its failure on rank 1 a few ms before the
    launcher timed rank 1's exit, and was blamed. A peer named by a note that died without a note
    of its own is the one blamed."""
    import asyncio
    import json
    import types

    from arendez import blame

    notes = [str(tmp_path / "rank0"), str(tmp_path / "rank1")]
    killed = await asyncio.create_subprocess_exec(sys.executable, "-c", "import time; time.sleep(30)")
    survivor = await asyncio.create_subprocess_exec(
        sys.executable, "-c", "import time; time.sleep(0.3); exit(1)"
    )
    killed_at = time.time()
    os.kill(killed.pid, signal.SIGKILL)
    note = {"time": killed_at - 0.003, "why": "its process ended with an uncaught RankFailedError"}
    Path(notes[0]).write_text(json.dumps(note))
    heard = {"rank": 1, "why": "connection lost"}  # (what errorfile.heard wrote when it heard)
    Path(f"{notes[0]}.peer").write_text(json.dumps(heard))
    ranks = [
        types.SimpleNamespace(proc=survivor, ended=None),
        types.SimpleNamespace(proc=killed, ended=killed_at),
    ]

    async def ended() -> None:
        await survivor.wait()
        ranks[0].ended = time.time()

    timing = asyncio.ensure_future(ended())
    found = await blame.first_failure(ranks, notes)  # type: ignore[arg-type]
    await timing
    assert found == blame.Blame(1, -signal.SIGKILL, None)
