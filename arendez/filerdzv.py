"""``file:///path`` rendezvous (torch's semantics): a file every rank can open is the meeting point.

The first rank to take the file's lock (``fcntl.flock``) and find it empty hosts an embedded
arendez server and writes its address there; the others read the address and join it over TCP.
What the file needs: every rank can open it read-write, and ``flock`` locks are honoured among
them (any local filesystem; on NFS, a client that maps ``flock`` to NFS locks, as Linux does since
2.6.12). Like torch's, the file must be new or empty when the job starts: the rank that wrote it
empties it when its process exits.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import fcntl
import os
import socket
from dataclasses import replace

from . import embedded
from .errors import RendezvousError
from .rendezvous import DEFAULT_JOB, Plan

#: How often a rank retries a lock another rank holds.
LOCK_POLL_SECONDS = 0.02


async def resolve(where: Plan, timeout: float) -> Plan:
    """The tcp ``Plan`` that the file at ``where.job`` names (written by this rank if first)."""
    path = where.job
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as exc:
        raise RendezvousError(f"file:// rendezvous cannot open {path!r}: {exc}") from None
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if loop.time() >= deadline:
                    raise RendezvousError(
                        f"file:// rendezvous: {path!r} stayed locked for {timeout:g}s"
                    ) from None
                await asyncio.sleep(LOCK_POLL_SECONDS)
        try:
            text = os.pread(fd, 4096, 0).decode(errors="replace").strip()
            if text:
                host, _, written = text.rpartition(":")
                if not host or not written.isdigit():
                    raise RendezvousError(f"file:// rendezvous: {path!r} holds {text[:80]!r}, not host:port")
                host = host.strip("[]")
                return replace(where, host=host, port=int(written), transport="tcp", job=DEFAULT_JOB)
            host = os.environ.get("ARENDEZ_ADVERTISE_ADDR") or "127.0.0.1"
            port = _free_port(host)
            await embedded.acquire(host, port, where.token, None)
            address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
            os.pwrite(fd, address.encode(), 0)
            os.fsync(fd)
            atexit.register(_empty, path, address)
            return replace(where, host=host, port=port, transport="tcp", job=DEFAULT_JOB, host_server=True)
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _free_port(host: str) -> int:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _empty(path: str, address: str) -> None:
    """Empty the file if it still names this process's server (the job is over)."""
    with contextlib.suppress(OSError), open(path, "r+b") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        if f.read().decode(errors="replace").strip() == address:
            f.truncate(0)
