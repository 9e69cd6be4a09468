"""Torch rank processes forked from one that has imported torch already (tests only).

``import torch`` costs about 2.7 s of CPU, and the suite starts a hundred torch rank processes:
on 2 cores that was a quarter of its time. A zygote process (``python -m tests.zygote``, one
per pytest worker, started on first use) imports torch once, without the plugin entry points
(``TORCH_DEVICE_BACKEND_AUTOLOAD=0``: arendez reads some settings from the environment when it
is imported, and must be imported by each rank under that rank's environment), then forks a
child for each request. The child becomes what ``python -m MODULE ARGS...`` would have been:
its own session, the requested environment, working directory and argv, stdout and stderr on
the requester's pipes, and the module run as ``__main__``; it exits as the interpreter does
(atexit handlers, a traceback and status 1 on an exception).

What stays a plain ``python`` process: anything about how torch finds the backend (the entry
point at ``import torch``), torchrun and its agents, and every non-torch rank. (The children
share the zygote's string hash seed, where separate processes each have their own: the core's
rank tests stay plain processes, so an order that differs between ranks still shows there.)

The requester talks to the zygote over a Unix socket, one connection per child: the request
(argv, environment, working directory) with the pipes' write ends passed as descriptors; the
answer is the child's pid, and later its exit status (``subprocess``'s ``returncode``).
"""

from __future__ import annotations

import array
import atexit
import contextlib
import ctypes
import json
import os
import runpy
import selectors
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

PRELOAD = ("numpy", "torch", "torch.distributed", "torch.nn.parallel")
_STATUS = struct.Struct("<qq")  # (pid, returncode) on the request's connection
_PR_SET_PDEATHSIG = 1


# -- the zygote --------------------------------------------------------------------------------


def _recv_request(conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
    fds = array.array("i")
    data, ancdata, _, _ = conn.recvmsg(1 << 20, socket.CMSG_LEN(2 * fds.itemsize))
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
    return json.loads(data), list(fds)


def _serve(listener: socket.socket) -> tuple[dict[str, Any], list[int]]:
    """Fork children on request until the requester goes away; returns only in a child."""
    chld_r, chld_w = os.pipe()
    os.set_blocking(chld_w, False)
    signal.set_wakeup_fd(chld_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ)
    sel.register(sys.stdin, selectors.EVENT_READ)  # EOF: the requester is gone
    sel.register(chld_r, selectors.EVENT_READ)
    children: dict[int, socket.socket] = {}
    while True:
        for key, _ in sel.select():
            if key.fileobj is sys.stdin:
                if not os.read(sys.stdin.fileno(), 4096):
                    for pid in children:  # (the session is over: none may outlive it)
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(pid, signal.SIGKILL)
                    sys.exit(0)
            elif key.fileobj is listener:
                conn, _ = listener.accept()
                try:
                    request, fds = _recv_request(conn)
                except (OSError, ValueError):  # (a requester interrupted mid-request)
                    conn.close()
                    continue
                pid = os.fork()
                if pid == 0:
                    sel.close()
                    for other in children.values():
                        other.close()
                    listener.close()
                    conn.close()
                    signal.set_wakeup_fd(-1)
                    os.close(chld_r)
                    os.close(chld_w)
                    return request, fds
                for fd in fds:
                    os.close(fd)
                try:
                    conn.sendall(_STATUS.pack(pid, 0))
                except OSError:  # (its requester is gone: so is the child)
                    os.kill(pid, signal.SIGKILL)
                children[pid] = conn
            else:
                with contextlib.suppress(BlockingIOError):
                    os.read(chld_r, 4096)
                while children:
                    pid, status = os.waitpid(-1, os.WNOHANG)
                    if pid == 0:
                        break
                    conn = children.pop(pid, None)  # type: ignore[assignment]
                    if conn is not None:
                        with contextlib.suppress(OSError):
                            conn.sendall(_STATUS.pack(pid, os.waitstatus_to_exitcode(status)))
                        conn.close()


def _become(request: dict[str, Any], fds: list[int]) -> None:
    """In the forked child: turn into ``python -m MODULE ARGS`` as the request describes."""
    os.setsid()
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)  # (dies with the zygote)
    if os.getppid() == 1:
        os._exit(137)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.dup2(fds[0], 1)
    os.dup2(fds[1], 2)
    for fd in fds:
        os.close(fd)
    for signum in (signal.SIGCHLD, signal.SIGTERM, signal.SIGPIPE):
        signal.signal(signum, signal.SIG_IGN if signum == signal.SIGPIPE else signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    sys.argv = [request["module"], *request["args"]]


def main() -> None:
    path = sys.argv[1]
    os.environ["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"  # (see the module docstring)
    for name in PRELOAD:
        __import__(name)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    print("ready", flush=True)
    request, fds = _serve(listener)
    _become(request, fds)
    runpy.run_module(request["module"], run_name="__main__", alter_sys=True)


# -- the requester -----------------------------------------------------------------------------


class Child:
    """A forked rank, with the part of ``subprocess.Popen``'s interface the tests use. If the
    zygote goes, its children are killed (``PR_SET_PDEATHSIG``), and report ``-SIGKILL``."""

    def __init__(self, argv: Sequence[str], conn: socket.socket, out: int, err: int) -> None:
        self.args = list(argv)
        self.returncode: int | None = None
        self._conn: socket.socket | None = conn
        self._open = {out: "stdout", err: "stderr"}  # the pipes not read to their end yet
        self._read = {"stdout": bytearray(), "stderr": bytearray()}
        try:
            self.pid = self._read_status(30.0)[0]
        except BaseException:
            self._close()
            raise

    def _read_status(self, timeout: float | None) -> tuple[int, int]:
        assert self._conn is not None
        self._conn.settimeout(timeout)
        data = b""
        while len(data) < _STATUS.size:
            chunk = self._conn.recv(_STATUS.size - len(data))
            if not chunk:
                raise ChildProcessError(f"the zygote went away: {self.args}")
            data += chunk
        pid, code = _STATUS.unpack(data)
        return int(pid), int(code)

    def _exited(self, timeout: float | None) -> None:
        """Take the exit status if it comes within ``timeout`` (0: only if it is there)."""
        if self.returncode is not None:
            return
        try:
            self.returncode = self._read_status(timeout)[1]
        except ChildProcessError:  # the zygote died: so did its children (PR_SET_PDEATHSIG)
            self.returncode = -signal.SIGKILL
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def poll(self) -> int | None:
        with contextlib.suppress(TimeoutError, BlockingIOError):
            self._exited(0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        try:
            self._exited(timeout)
        except TimeoutError:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0) from None
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:  # (not once reaped: the pid may be another process's now)
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """Read stdout and stderr to their end, then wait; as ``Popen.communicate`` (text)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with selectors.DefaultSelector() as sel:
            for fd in self._open:
                sel.register(fd, selectors.EVENT_READ)
            while self._open:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
                for key, _ in sel.select(left):
                    fd = int(key.fd)
                    chunk = os.read(fd, 1 << 16)
                    if chunk:
                        self._read[self._open[fd]] += chunk
                    else:
                        sel.unregister(fd)
                        os.close(fd)
                        del self._open[fd]
        try:
            self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0) from None
        out, err = (bytes(self._read[name]).decode(errors="replace") for name in ("stdout", "stderr"))
        return out, err

    def _close(self) -> None:
        for fd in self._open:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._open.clear()
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def __del__(self) -> None:
        self._close()


class _Zygote:
    def __init__(self, env: dict[str, str], cwd: Path) -> None:
        self._dir = tempfile.mkdtemp(prefix="arendez-zygote-")
        self.path = os.path.join(self._dir, "sock")
        self._log = tempfile.TemporaryFile()  # noqa: SIM115 - its own errors, as long as it lives
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.zygote", self.path],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            cwd=cwd,
            env=env,
            start_new_session=True,
        )
        assert self.proc.stdout is not None
        if self.proc.stdout.readline() != b"ready\n":
            self.close()
            self._log.seek(0)
            raise RuntimeError(f"the torch zygote did not start:\n{self._log.read().decode()[-3000:]}")

    def spawn(self, module: str, args: Sequence[str], env: dict[str, str], cwd: Path) -> Child:
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(self.path)
            request = json.dumps({"module": module, "args": list(args), "env": env, "cwd": str(cwd)})
            fds = array.array("i", [out_w, err_w])
            conn.sendmsg([request.encode()], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds.tobytes())])
        except BaseException:
            conn.close()
            os.close(out_r)
            os.close(err_r)
            raise
        finally:
            os.close(out_w)
            os.close(err_w)
        return Child([sys.executable, "-m", module, *args], conn, out_r, err_r)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            assert self.proc.stdin is not None
            self.proc.stdin.close()  # (EOF: it exits)
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        with contextlib.suppress(OSError):
            os.unlink(self.path)
            os.rmdir(self._dir)


_zygote: _Zygote | None = None
_lock = threading.Lock()


def spawn(module: str, args: Sequence[str], env: dict[str, str], cwd: Path, base: dict[str, str]) -> Child:
    """``python -m module args`` with ``env`` (complete) in ``cwd``, forked from the zygote
    (started, if there is none, with environment ``base`` in ``cwd``)."""
    global _zygote
    with _lock:
        if _zygote is None or _zygote.proc.poll() is not None:
            _zygote = _Zygote(base, cwd)
            atexit.register(_zygote.close)
        zygote = _zygote
    return zygote.spawn(module, args, env, cwd)


if __name__ == "__main__":
    main()
