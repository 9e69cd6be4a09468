"""``arendez-server``'s arguments: a bad one is a one-line usage error naming it (exit status 2),
never a traceback, a wrapped port or a silent start."""

from __future__ import annotations

import contextlib
import io
import socket
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from server import cli
from tests.harness import ROOT, _env


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "arendez_server", *argv],
        capture_output=True,
        text=True,
        timeout=20,
        env=_env(),
        cwd=ROOT,
    )


@pytest.fixture
def files(tmp_path: Path) -> dict[str, str]:
    empty = tmp_path / "empty"
    empty.write_text("  \n")
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    return {"empty": str(empty), "junk": str(junk), "dir": str(tmp_path)}


CASES = [
    (["--port", "99999"], "--port", "must be in 0-65535, got 99999"),
    (["--port", "-1"], "--port", "got -1"),
    (["--port", "http"], "--port", "must be an integer"),
    (["--token-file", "/nonexistent/token"], "--token-file", "does not exist"),
    (["--token-file", "{empty}"], "--token-file", "is empty"),
    (["--token-file", "{dir}"], "--token-file", "is not a regular file"),
    (["--tls-cert", "/nonexistent", "--tls-key", "/x"], "--tls-cert", "does not exist"),
    (["--tls-cert", "{junk}", "--tls-key", "{junk}"], "--tls-cert", "does not load"),
    (["--tls-cert", "{junk}"], "--tls-cert", "go together"),
    (["--log-level", "LOUD"], "--log-level", "got 'LOUD'"),
    (["--lease", "0"], "--lease", "finite and > 0"),
]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("argv,option,words", CASES, ids=[" ".join(c[0]) for c in CASES])
def test_bad_option_is_a_one_line_usage_error(files, argv, option, words):
    proc = _run(*(a.format(**files) for a in argv))
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == "", proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("arendez-server: error:") and option in last and words in last, last


def _refused(argv: list[str]) -> str:
    """Parse ``argv`` in this process with socket creation forbidden; return the usage error."""
    err = io.StringIO()
    with (
        mock.patch.object(socket, "socket", side_effect=AssertionError("a socket was opened")),
        contextlib.redirect_stderr(err),
        pytest.raises(SystemExit) as exit_,
    ):
        cli.main(argv)
    assert exit_.value.code == 2, err.getvalue()
    return err.getvalue().strip().splitlines()[-1]


@settings(max_examples=60, deadline=None)
@given(st.one_of(st.integers(max_value=-1), st.integers(min_value=65536)))
def test_any_port_out_of_range_is_refused_before_listening(port: int) -> None:
    line = _refused(["--port", str(port)])
    assert "--port" in line and str(port) in line and "0-65535" in line, line


@settings(max_examples=40, deadline=None)
@given(st.text(st.characters(codec="ascii", categories=["L"]), min_size=1, max_size=10))
def test_any_unknown_log_level_is_refused(level: str) -> None:
    if level.upper() in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
        return
    line = _refused(["--log-level", level])
    assert "--log-level" in line and repr(level) in line, line


def _start_and_stop(*argv: str) -> str:
    """Start the server with ``argv``, stop it once it listens; its log."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "arendez_server", "--port", "0", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=_env(),
        cwd=ROOT,
    )
    try:
        assert proc.stdout is not None
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("arendez-server listening on"):
                break
        proc.terminate()
        out, _ = proc.communicate(timeout=10)
        return "".join(lines) + out
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.timeout(30)
def test_the_default_connection_limit_fits_the_open_file_limit_quietly() -> None:
    """The default asks for nothing the operator chose: no warning where the open-file limit
    admits fewer connections; a value given that the limit cannot hold is named in a warning."""
    import resource

    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert "WARNING" not in _start_and_stop(), "a default start warned"
    too_many = str((hard if hard != resource.RLIM_INFINITY else 1 << 20) + 1000)
    log = _start_and_stop("--max-connections", too_many)
    assert "WARNING" in log and f"not --max-connections {too_many}" in log, log


@pytest.mark.timeout(60)
@pytest.mark.parametrize("option", ["--port", "--tcpstore-port", "--http-port"])
def test_a_port_in_use_is_one_line_naming_the_address(option: str) -> None:
    """(QA26: a full uvloop traceback.)"""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        argv = ["--port", "0", option, str(port)] if option != "--port" else ["--port", str(port)]
        done = subprocess.run(
            [sys.executable, "-m", "arendez_server", *argv],
            capture_output=True,
            text=True,
            timeout=30,
            env=_env(),
        )
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        f"arendez-server: cannot listen: [Errno 98] error while attempting to bind on address "
        f"('127.0.0.1', {port}): address already in use"
    ]
