"""The embedded server in a child process (``arendez_server.child``), as the rank that hosts it
sees it: started, its port, closed.

The child lives as long as this process: it exits when we close it, and by itself when we die
(its stdin, our pipe, reaches EOF) or stop being its parent. It runs in a session of its own, so
a signal for our process group (Ctrl-C, a job-control stop) is not one for the store; a stop of
this process alone leaves it serving, and its lease check declares us failed.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import subprocess
import sys
import time
from typing import Any

from . import loopcpu
from .transports import listen

#: The child's start-up (an interpreter, the server's imports) takes about 0.15 s; this bounds it.
START_TIMEOUT = 60.0

#: The child's program. ``arendez``'s ``__init__`` imports the whole API (collectives, numpy's
#: extras: two thirds of a server's start-up); the server needs a few of its submodules only,
#: so the package is entered as a bare namespace and they are imported from it as needed.
_BOOT = """
import importlib.util, sys, types
spec = importlib.util.find_spec("arendez")
bare = types.ModuleType("arendez")
bare.__path__, bare.__spec__ = list(spec.submodule_search_locations), spec
sys.modules["arendez"] = bare
from arendez_server.child import main
sys.exit(main())
"""


class ServerProcess:
    """An ``arendez-server`` child serving on ``port``."""

    def __init__(self, proc: subprocess.Popen[bytes], port: int, token: str | None) -> None:
        self.proc = proc
        self.port = port
        self.token = token

    @classmethod
    async def start(
        cls, host: str, port: int, token: str | None, wait: float, sock: socket.socket | None = None
    ) -> ServerProcess:
        """A child serving on ``host:port`` (0: a free port); ``OSError`` (with the child's
        errno) if it cannot listen there, a port in use retried for ``wait`` s;
        ``ChildProcessError`` if the child could not be started. ``sock``: a listening socket
        the child serves instead (ours is closed once the child has it)."""
        env = dict(os.environ)
        env.pop("ARENDEZ_TOKEN", None)  # (the token goes through the pipe, not the environment)
        for pool in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
            env[pool] = "1"  # (numpy comes with the server's imports: no math thread pools)
        try:
            proc = subprocess.Popen(
                [sys.executable, "-c", _BOOT],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                env=env,
                start_new_session=True,
                pass_fds=() if sock is None else (sock.fileno(),),
            )
        except OSError as exc:
            raise ChildProcessError(f"cannot start {sys.executable}: {exc}") from None
        loopcpu.release_child(proc.pid)  # (started from the loop thread, maybe pinned)
        fd = None if sock is None else sock.fileno()
        if sock is not None:  # (the child's copy listens now: ours would outlive the child)
            sock.close()
        assert proc.stdin is not None and proc.stdout is not None
        order = {
            "host": host,
            "port": port,
            "token": token,
            "wait": wait,
            "log_level": logging.getLogger("arendez.server").getEffectiveLevel(),
            "parent": os.getpid(),
            "fd": fd,
        }
        try:
            proc.stdin.write(json.dumps(order).encode() + b"\n")
            proc.stdin.flush()
            line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), START_TIMEOUT + wait)
        except BaseException:
            _kill(proc)
            raise
        if not line:
            _kill(proc)
            raise ChildProcessError(f"the store process exited at start (status {proc.returncode})")
        answer: dict[str, Any] = json.loads(line)
        if "port" not in answer:
            _kill(proc)
            raise OSError(int(answer.get("errno", 0)), f"the store process: {answer.get('error')}")
        return cls(proc, int(answer["port"]), token)

    async def close(self, timeout: float = 2.0) -> None:
        """Let the child close (it tells its clients), within ``timeout``; then kill it."""
        proc = self.proc
        if proc.stdin is not None and not proc.stdin.closed:
            proc.stdin.close()
        until = time.monotonic() + timeout + 1.0
        while proc.poll() is None and time.monotonic() < until:
            await asyncio.sleep(0.01)
        _kill(proc)

    def stop_now(self) -> None:
        """Close from outside any event loop: EOF to the child, which closes by itself."""
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.close()


def listening_socket(host: str, port: int, backlog: int = 4096) -> socket.socket | None:
    """``host:port`` bound and listening now, in the caller's thread, for a server about to
    start on it; ``None`` where the server had better bind by itself (a host name, which may
    stand for several addresses, or any error, which the server then reports).

    A master ``TCPStore``'s clients often start with it, thousands at once: with the port
    listening from the first instant they wait in its queue while the server starts, rather
    than being refused and retrying (a retry storm that, on a busy machine, starved the very
    start of the server: 6-10 s with 2,000 thread-ranks over 100 processes on 2 cores)."""
    try:
        return listen.listening_socket(host, port, backlog)
    except OSError:  # (in use, not an address of this host, ...: the server names it)
        return None


def _kill(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    for pipe in (proc.stdin, proc.stdout):
        if pipe is not None and not pipe.closed:
            pipe.close()
