"""Run torch's own distributed test suite against the "arendez" backend (or gloo, to compare).

torch ships its multi-process collective tests in
``torch.testing._internal.distributed.distributed_test``: ``DistributedTest._DistTestBase`` holds
the tests (about 285 of them), ``TestDistBackend`` starts one process per rank and creates the
default group in each. This driver combines the two into one test class, sets the environment
the suite reads at import (``BACKEND``, ``WORLD_SIZE``, ``TEMP_DIR``, ``INIT_METHOD``), runs the
class under pytest with pytest-timeout's per-test timeout and prints a summary table::

    python scripts/torch_suite.py                          # arendez, 2 ranks, fork start
    python scripts/torch_suite.py --backend gloo           # torch's gloo, for comparison
    python scripts/torch_suite.py --as-gloo                # the suite's gloo tests, on arendez
    python scripts/torch_suite.py --as-gloo --world-size 3 -k "barrier or monitored"
    python scripts/torch_suite.py --start spawn --init env --timeout 300 --junit out.xml
    python scripts/torch_suite.py -- -x --tb=line          # after --: more pytest arguments

Skips by backend name. The suite decides what to run from the *name* in ``BACKEND``: most tests
are decorated like ``skip_if(BACKEND != "gloo")`` or look ``BACKEND`` up in tables that name
gloo, nccl and ucc only. With ``BACKEND=arendez`` those tests are reported as skipped: they were
not run, which says nothing about arendez.

Alias mode (``--as-gloo``) runs them: ``BACKEND=gloo``, so the suite enables its gloo tests, and
this driver wraps ``torch.distributed.distributed_c10d._new_process_group_helper`` (the one
function through which ``init_process_group``, ``new_group`` and ``new_subgroups`` create a
group) so that a group asked for as "gloo" is created as "arendez". Nothing else is changed, so
torch records those groups as "arendez", and some tests fail by construction: those comparing
``dist.get_backend()`` with "gloo", those matching gloo's own error messages, and those calling
``dist.monitored_barrier``, which refuses every backend not named gloo. Read failures in this
mode with that in mind.

``--init file`` (torch's default) creates each test's default group from a file store and sets
``INIT_METHOD`` to a ``file://`` URL (the tests that re-create the default group use it, and
``test_barrier_timeout_global`` runs only then); ``--init env`` goes through ``env://`` (a
TCPStore on a fresh ``MASTER_PORT`` per test). ``--start fork`` is much faster than ``spawn``.

Needs pytest and pytest-timeout (the repo's ``test`` extra) and ``expecttest``, which torch's
test utilities import (not an arendez dependency: ``pip install expecttest``).

Bounds: each test has pytest-timeout's ``--timeout`` (torch's own join timeout,
``DISTRIBUTED_TESTS_DEFAULT_TIMEOUT``, fires 30 s earlier and shows the ranks' tracebacks); all
temporary files go to one directory, removed at the end; then the processes this run started
(its rank processes, and their children such as arendez's server, found by a marker in their
environment) that are still alive are killed.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import re
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pytest

RUN_VAR = "TORCH_SUITE_RUN"  # this run's temporary directory: a marker in every process it starts
START_VAR = "TORCH_SUITE_START"
INIT_VAR = "TORCH_SUITE_INIT"
AS_GLOO_VAR = "TORCH_SUITE_AS_GLOO"


def alias_gloo_as_arendez() -> None:
    """Create every group asked for as "gloo" as an "arendez" group (the ``--as-gloo`` mode)."""
    import torch.distributed.distributed_c10d as c10d

    create: Callable[..., Any] = c10d._new_process_group_helper
    if getattr(create, "_as_arendez", False):
        return  # (a spawned rank imports this file twice: as __mp_main__ and by name)

    def as_arendez(size: int, rank: int, ranks: list[int], backend: Any, *args: Any, **kw: Any) -> Any:
        if str(backend).lower() == "gloo":
            backend = c10d.Backend("arendez")
        return create(size, rank, ranks, backend, *args, **kw)

    as_arendez._as_arendez = True  # type: ignore[attr-defined]
    c10d._new_process_group_helper = as_arendez  # type: ignore[assignment]  # (same call, looser types)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


if os.environ.get(RUN_VAR):  # main() has set the suite's environment: pytest is importing us
    import torch
    from torch.testing._internal.distributed.distributed_test import DistributedTest, TestDistBackend

    if os.environ.get(AS_GLOO_VAR) == "1":
        alias_gloo_as_arendez()

    class TestTorchSuite(TestDistBackend, DistributedTest._DistTestBase):
        """torch's distributed tests, one process per rank (``WORLD_SIZE``)."""

        if os.environ.get(INIT_VAR) == "env":

            @property
            def init_method(self) -> str:
                return "env://"

        def setUp(self) -> None:
            super().setUp()  # type: ignore[no-untyped-call]
            if os.environ.get(INIT_VAR) == "env":
                os.environ["MASTER_PORT"] = str(_free_port())  # (the ranks inherit it)
            if os.environ.get(START_VAR) == "spawn":
                self._spawn_processes()
            else:
                self._start_processes(torch.multiprocessing.get_context("fork").Process)


class Tally:
    """A pytest plugin: each test's outcome (a failure in any phase fails it) and error line."""

    def __init__(self) -> None:
        self.outcomes: dict[str, str] = {}
        self.errors: dict[str, str] = {}

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        name = report.nodeid.rpartition("::")[2]
        if report.failed:
            self.outcomes[name] = "failed"
            self.errors.setdefault(name, error_line(report.longreprtext))
        elif report.skipped and self.outcomes.get(name) != "failed":
            self.outcomes[name] = "skipped"
        elif report.when == "call":
            self.outcomes.setdefault(name, "passed")


def error_line(text: str) -> str:
    """The last ``SomethingError: ...`` line of a failure (a rank's exception comes last in
    torch's "Process N exited with error code 10 and exception: ..."), else its last line."""
    found: list[str] = re.findall(r"^E?\s*((?:[\w.]+(?:Error|Exception)|Failed|Timeout)\b.*)$", text, re.M)
    lines = found or [line for line in text.splitlines() if line.strip()] or [""]
    return lines[-1].strip()[:200]


def our_processes(marker: str) -> set[int]:
    """Living processes this run started: forked children, and any process whose environment
    carries ``marker`` (the rank processes' children, even those in sessions of their own);
    not multiprocessing's resource tracker (spawn's), which ends with us."""
    import multiprocessing
    from multiprocessing import resource_tracker

    pids = {p.pid for p in multiprocessing.active_children() if p.pid is not None}
    tracker = getattr(resource_tracker._resource_tracker, "_pid", None)
    needle = f"{RUN_VAR}={marker}".encode()
    with contextlib.suppress(OSError):
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) in (os.getpid(), tracker):
                continue
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if needle in f.read().split(b"\0"):
                        pids.add(int(entry))
            except OSError:
                continue
    return pids


def end_processes(marker: str, grace: float = 5.0) -> list[str]:
    """Wait ``grace`` s for this run's processes to end by themselves (arendez's server ends when
    its rank does), then kill the rest by id; returns those killed ("pid: command line")."""
    until = time.monotonic() + grace
    while (left := our_processes(marker)) and time.monotonic() < until:
        time.sleep(0.2)
    killed = []
    for pid in sorted(left):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/cmdline", "rb") as f:
            command = f.read().replace(b"\0", b" ").decode(errors="replace")
            killed.append(f"{pid}: {command[:150]}")
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    our_processes(marker)  # (reaps our killed children)
    return killed


def missing_requirements() -> str | None:
    """What to install before the suite can be imported, or None."""
    if importlib.util.find_spec("torch") is None:
        return "torch is not installed: pip install -e '.[torch]'"
    if importlib.util.find_spec("pytest_timeout") is None:
        return "pytest-timeout is not installed: pip install -e '.[test]'"
    if importlib.util.find_spec("expecttest") is None:
        return (
            "torch's test utilities import `expecttest`, which is not installed (it is not an\n"
            "arendez dependency). Install it:\n"
            "    pip install expecttest\n"
            "or, to keep it out of the environment:\n"
            "    pip install --target DIR expecttest   and run with PYTHONPATH=DIR"
        )
    return None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Run torch's distributed test suite (distributed_test.py) on a backend.",
        epilog="Arguments after -- go to pytest. See the module docstring for the alias mode.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--backend", choices=("arendez", "gloo"), default="arendez", help="BACKEND")
    parser.add_argument(
        "--as-gloo", action="store_true", help="BACKEND=gloo, every gloo group created as arendez"
    )
    parser.add_argument("--world-size", type=int, default=2, help="ranks per test")
    parser.add_argument("--start", choices=("fork", "spawn"), default="fork", help="how ranks start")
    parser.add_argument("--init", choices=("file", "env"), default="file", help="default group's init")
    parser.add_argument("-k", dest="expr", metavar="EXPR", help="pytest -k: the tests to run")
    parser.add_argument("--timeout", type=float, default=150.0, help="per test, seconds")
    parser.add_argument("--junit", metavar="PATH", help="write a JUnit XML report")
    parser.add_argument("pytest_args", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.as_gloo and args.backend != "arendez":
        parser.error("--as-gloo runs arendez under gloo's name: it needs --backend arendez")
    if args.world_size < 1 or args.timeout <= 0:
        parser.error("--world-size and --timeout must be positive")
    return args


def print_summary(title: str, tally: Tally) -> None:
    counts = {k: list(tally.outcomes.values()).count(k) for k in ("passed", "failed", "skipped")}
    print(f"\n{title}")
    for outcome, count in counts.items():
        print(f"  {outcome:<8}{count:>5}")
    print(f"  {'total':<8}{len(tally.outcomes):>5}")
    failed = sorted(name for name, outcome in tally.outcomes.items() if outcome == "failed")
    if failed:
        print("failed:")
        for name in failed:
            print(f"  {name}\n      {tally.errors.get(name, '')}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    problem = missing_requirements()
    if problem:
        print(problem, file=sys.stderr)
        return 2
    import pytest

    junit = os.path.abspath(args.junit) if args.junit else None
    run_dir = tempfile.mkdtemp(prefix="torch-suite-")
    for sub in ("barrier", "test_dir"):
        os.mkdir(os.path.join(run_dir, sub))
    env = {
        "BACKEND": "gloo" if args.as_gloo else args.backend,
        "WORLD_SIZE": str(args.world_size),
        "TEMP_DIR": run_dir,
        "INIT_METHOD": "env://" if args.init == "env" else f"file://{run_dir}/shared_init_file",
        "DISTRIBUTED_TESTS_DEFAULT_TIMEOUT": str(max(10, int(args.timeout) - 30)),
        "TMPDIR": run_dir,  # (the suite's per-test directories and store files)
        RUN_VAR: run_dir,
        START_VAR: args.start,
        INIT_VAR: args.init,
        AS_GLOO_VAR: "1" if args.as_gloo else "0",
    }
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    tempfile.tempdir = run_dir
    pytest_args = [os.path.abspath(__file__), "-p", "no:cacheprovider", "-v", "-rfE"]
    pytest_args += [f"--timeout={args.timeout}", *(["-k", args.expr] if args.expr else [])]
    pytest_args += [*([f"--junitxml={junit}"] if junit else []), *args.pytest_args]
    tally = Tally()
    try:
        status = int(pytest.main(pytest_args, plugins=[tally]))
    finally:
        killed = end_processes(run_dir)
        tempfile.tempdir = None
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        shutil.rmtree(run_dir, ignore_errors=True)
    mode = f"{args.backend} (as gloo)" if args.as_gloo else args.backend
    title = f"torch suite: {mode}, world size {args.world_size}, {args.start} start, {args.init} init"
    print_summary(title, tally)
    for line in killed:
        print(f"killed at the end, still running: {line}")
    return status


if __name__ == "__main__":
    sys.exit(main())
