"""Real processes for tests: a standalone server, and N ranks running a rank function.

Rank functions are passed as objects (``tests/jobs``, ``tests/conformance.py``); each rank
process (``tests/rank.py``) imports it by module and name and prints its JSON result last.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago, picked below the kernel's ephemeral
    range: an outgoing connection of another test takes its port from that range, and once took
    one a test had picked there before binding it (EADDRINUSE)."""
    low = _ephemeral_low()
    for _ in range(100):
        port = random.randint(max(1024, low - 12000), low - 1)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # (no luck below it: any free port)
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONUNBUFFERED"] = "1"
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "ARENDEZ_URL"):
        env.pop(name, None)
    env.update(extra or {})
    return env


@dataclass
class ServerProcess:
    proc: subprocess.Popen[str]
    url: str
    port: int
    log: Any = None  # the file its stderr goes to (a pipe nobody reads could block it)

    def stderr_text(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return str(self.log.read())

    def stop(self, timeout: float = 10.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def start_server(*args: str, port: int = 0, env: dict[str, str] | None = None) -> ServerProcess:
    """Start ``python -m arendez_server`` and wait for the URL it prints."""
    log = tempfile.TemporaryFile("w+")  # noqa: SIM115 - it lives as long as the server
    proc = subprocess.Popen(
        [PY, "-m", "arendez_server", "--port", str(port), "--log-level", "WARNING", *args],
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
        env=_env(env),
        start_new_session=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    srv = ServerProcess(proc, line.strip().rsplit(" ", 1)[-1], 0, log)
    if "listening on" not in line:
        proc.kill()
        proc.wait(5)
        raise RuntimeError(f"server did not start: {line!r} {srv.stderr_text()}")
    srv.port = int(srv.url.rsplit(":", 1)[1])
    return srv


@contextmanager
def server(*args: str, port: int = 0) -> Iterator[ServerProcess]:
    srv = start_server(*args, port=port)
    try:
        yield srv
    finally:
        srv.stop()


@dataclass
class RankResult:
    rank: int
    returncode: int
    stdout: str
    stderr: str

    @property
    def value(self) -> Any:
        files = [ln for ln in self.stdout.splitlines() if ln.startswith("RESULT-FILE ")]
        if files:  # a large result, written to a file (``report_result``)
            path = Path(files[-1][len("RESULT-FILE ") :])
            try:
                return json.loads(path.read_text())
            finally:
                path.unlink(missing_ok=True)
        lines = [ln for ln in self.stdout.splitlines() if ln.startswith("RESULT ")]
        if not lines:
            raise AssertionError(
                f"rank {self.rank} printed no result (rc={self.returncode}):\n{self.stderr[-3000:]}"
            )
        text = lines[-1][len("RESULT ") :]
        try:
            return json.loads(text)
        except ValueError as exc:  # (say what came instead: a cut or an interleaved line)
            where = exc.pos if isinstance(exc, json.JSONDecodeError) else 0
            raise AssertionError(
                f"rank {self.rank}: RESULT line of {len(text)} chars unreadable at {where}: "
                f"...{text[max(0, where - 200) : where + 200]!r}...; stdout {len(self.stdout)} chars, "
                f"{self.stdout.count(chr(10))} lines, rc={self.returncode}; "
                f"stderr tail:\n{self.stderr[-1500:]}"
            ) from None


def report_result(result: Any) -> None:
    """A rank's last word: ``RESULT <json>``, or for a large result (over a pipe's atomic write)
    ``RESULT-FILE <path>`` (a 119 KB RESULT line of a torch rank came back cut or interleaved,
    twice in some hundred runs under load; a short line is written in one piece)."""
    text = json.dumps(result)
    if len(text) < 3000:
        print("RESULT " + text, flush=True)
        return
    fd, path = tempfile.mkstemp(prefix="arendez-result-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    print(f"RESULT-FILE {path}", flush=True)


def raw_frame(obj: object, payload: int = 0) -> bytes:
    """One frame's prefix and msgpack header, built by hand (for tests that forge frames)."""
    raw = msgpack.packb(obj, use_bin_type=True)
    return struct.pack("<IQ", len(raw), payload) + raw


def peer_bombs() -> list[bytes]:
    """What strangers send a rank's peer listener before (instead of) a hello: each must get
    the connection closed, and cost the listener nothing once it is."""
    wide = msgpack.packb([{}] * 1000)  # 1 KiB of empty maps: a thousand dicts once decoded
    deep = b"\x91" * 900 + b"\xc0"  # arrays nested 900 deep
    return [
        b"",  # says nothing and hangs up
        b"GET / HTTP/1.1\r\n\r\n",
        struct.pack("<IQ", 1 << 30, 0),  # a 1 GiB header announced
        struct.pack("<IQ", 8, 1 << 20) + msgpack.packb({"rank": 1}).ljust(8, b"\xc0"),  # a payload
        struct.pack("<IQ", len(wide), 0) + wide,
        struct.pack("<IQ", len(deep), 0) + deep,
        raw_frame({"rank": 1, "round": b"x" * 16, "nonce": b"n" * 16, "proof": b"p" * 32}),  # bad proof
        raw_frame({"nonce": b"n" * 16}) * 5,  # more frames than a handshake needs
        struct.pack("<IQ", 5, 0) + b"\xc1\xc1\xc1\xc1\xc1",  # not msgpack
    ]


def read_until_closed(sock: socket.socket, timeout: float = 5.0) -> bytes:
    """Read until EOF; return everything the other side sent before closing."""
    sock.settimeout(timeout)
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def rss_kib(pid: int) -> int:
    """Resident memory of process ``pid`` in KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmRSS for pid {pid}")


def wait_for_files(folder: Path, pattern: str, count: int, timeout: float = 30.0) -> None:
    """Wait until ``count`` files matching ``pattern`` exist in ``folder`` (ranks' progress marks)."""
    deadline = time.monotonic() + timeout
    while len(list(folder.glob(pattern))) < count:
        if time.monotonic() > deadline:
            raise AssertionError(f"fewer than {count} {pattern} files in {folder} after {timeout}s")
        time.sleep(0.02)


def popen(argv: Sequence[str], env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """Start ``argv`` from the repo root in its own session, output captured as text."""
    return subprocess.Popen(
        list(argv),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(env),
        cwd=ROOT,
        start_new_session=True,
    )


def popen_torch(argv: Sequence[str], env: dict[str, str] | None = None) -> Any:
    """``popen`` for a ``python -m`` rank that imports torch: forked from a process that has
    imported it once (``tests/zygote.py``; ``ARENDEZ_TEST_ZYGOTE=0``: a plain process)."""
    if os.environ.get("ARENDEZ_TEST_ZYGOTE", "1") == "0" or list(argv[:2]) != [PY, "-m"]:
        return popen(argv, env)
    from tests import zygote

    return zygote.spawn(argv[2], argv[3:], _env(env), ROOT, base=_env())


def _target(fn: Callable[..., Awaitable[Any]]) -> str:
    return f"{fn.__module__}:{fn.__qualname__}"


def spawn_rank(
    fn: Callable[..., Awaitable[Any]],
    rank: int,
    world_size: int,
    url: str,
    *args: Any,
    env: dict[str, str] | None = None,
    join: bool = False,
) -> subprocess.Popen[str]:
    """Start one rank process running ``fn`` (``tests/rank.py``); with ``join`` the runner
    joins ``url`` for it."""
    argv = [PY, "-m", "tests.rank", *(["--join"] if join else []), _target(fn)]
    return popen([*argv, str(rank), str(world_size), url, json.dumps(list(args))], env)


def collect(procs: Sequence[subprocess.Popen[str]], timeout: float) -> list[RankResult]:
    """Wait for every rank (killing all on timeout) and return their outputs."""
    deadline = time.monotonic() + timeout
    results = []
    try:
        for rank, proc in enumerate(procs):
            try:
                out, err = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                for p in procs:
                    p.kill()
                out, err = proc.communicate()
                raise AssertionError(f"rank {rank} hung past {timeout}s:\n{err[-3000:]}") from None
            results.append(RankResult(rank, proc.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return results


def run_ranks(
    fn: Callable[..., Awaitable[Any]],
    world_size: int,
    url: str,
    *args: Any,
    timeout: float = 60.0,
    env: dict[str, str] | None = None,
    join: bool = False,
) -> list[Any]:
    """Run ``fn`` on ``world_size`` rank processes; every rank must succeed; return their values.

    ``fn(rank, world_size, url, *args)`` joins by itself (``tests/jobs``); with ``join``,
    ``fn(rank, world_size, *args)`` runs with the default group joined at ``url`` for it.
    """
    procs = [spawn_rank(fn, r, world_size, url, *args, env=env, join=join) for r in range(world_size)]
    results = collect(procs, timeout)
    for res in results:
        assert res.returncode == 0, f"rank {res.rank} exited {res.returncode}:\n{res.stderr[-4000:]}"
    return [res.value for res in results]


def run_function(
    fn: Callable[..., Awaitable[Any]], world_size: int, url: str, *args: Any, **kw: Any
) -> list[Any]:
    """``run_ranks(..., join=True)``: rank code that expects the default group joined."""
    return run_ranks(fn, world_size, url, *args, join=True, **kw)


@contextmanager
def emulated_hosts(prefix: str, count: int) -> Iterator[Any]:
    """``count`` emulated hosts (network namespaces on one bridge, ``benchmarks/netns.py``),
    deleted after, none left behind; skips the test without root."""
    import pytest

    if os.geteuid() != 0:
        pytest.skip("network namespaces need root (CI runs as root)")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from netns import Hosts

    topo = Hosts(f"{prefix}{os.getpid()}", count)
    try:
        yield topo
    finally:
        topo.close()
        left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert topo.prefix not in left, f"namespaces left behind: {left}"


class Lines:
    """Every line a process writes to ``stream``, read by a thread, waited for by substring."""

    def __init__(self, stream: object) -> None:
        self.lines: list[str] = []
        self._changed = threading.Condition()
        threading.Thread(target=self._read, args=(stream,), daemon=True).start()

    def _read(self, stream: object) -> None:
        for line in stream:  # type: ignore[attr-defined]
            with self._changed:
                self.lines.append(line)
                self._changed.notify_all()

    def wait_for(self, text: str, timeout: float) -> bool:
        with self._changed:
            return self._changed.wait_for(lambda: any(text in line for line in self.lines), timeout)

    def __str__(self) -> str:
        with self._changed:
            return "".join(self.lines)[-4000:]


def start_cut_job(
    hosts: Any, ranks: int, job: str, port: int, lease: float, link_timeout: float
) -> tuple[Lines, list[subprocess.Popen[str]], list[Lines], list[Lines]]:
    """On emulated ``hosts``: the server on host 0 (``--lease``) and ``ranks`` ranks of
    ``tests/cut_rank.py`` on hosts 1..ranks (``ARENDEZ_LINK_TIMEOUT``), all reducing; the
    server's log and the ranks' processes, outputs and errors."""
    argv = ["-m", "arendez_server", "--host", "0.0.0.0", "--port", str(port), "--lease", str(lease)]
    server = hosts.run(0, [PY, *argv])
    server_log, server_out = Lines(server.stderr), Lines(server.stdout)
    assert server_out.wait_for("listening on", 20), server_log
    url = f"arendez://{hosts.address(0)}:{port}/{job}"
    env = {"PYTHONPATH": str(ROOT), "ARENDEZ_LINK_TIMEOUT": str(link_timeout)}
    procs = [
        hosts.run(host, [PY, "-m", "tests.cut_rank", url, str(ranks), str(host - 1)], env)
        for host in range(1, ranks + 1)
    ]
    outs, errs = [Lines(p.stdout) for p in procs], [Lines(p.stderr) for p in procs]
    for rank, out in enumerate(outs):
        assert out.wait_for("READY", 30), f"rank {rank} never joined:\n{errs[rank]}"
    time.sleep(0.5)  # (collectives running)
    return server_log, procs, outs, errs


def failed_after(out: Lines, err: Lines, cut_at: float, within: float) -> tuple[float, str]:
    """Seconds from ``cut_at`` (wall time) to a cut_rank's ``FAILED`` line, and its error."""
    assert out.wait_for("FAILED", within), f"no error {within}s after the cut:\n{out}\n{err}"
    line = next(line for line in str(out).splitlines() if line.startswith("FAILED"))
    _, when, error = line.split(" ", 2)
    return float(when) - cut_at, error
