"""``arendez-run``'s child processes: each in its own session with its output on pipes we read,
copied out line by line with a prefix, and stopped as a process group (signal, grace, SIGKILL).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, BinaryIO

CHUNK = 1 << 16
MAX_LINE = 1 << 16  # a longer line is passed on in pieces, each prefixed


async def pump_lines(stream: asyncio.StreamReader, prefix: bytes, out: BinaryIO) -> None:
    """Copy ``stream`` to ``out`` line by line, each line prefixed.

    If ``out`` breaks (``arendez-run ... | head``) the stream is still drained, so that no rank
    blocks on a full pipe.
    """
    broken = False

    def emit(lines: list[bytes]) -> None:
        nonlocal broken
        if lines and not broken:
            try:
                out.write(b"".join(prefix + line + b"\n" for line in lines))
                out.flush()
            except (OSError, ValueError):
                broken = True

    pending = b""
    while chunk := await stream.read(CHUNK):
        pending += chunk
        *lines, pending = pending.split(b"\n")
        while len(pending) > MAX_LINE:
            lines.append(pending[:MAX_LINE])
            pending = pending[MAX_LINE:]
        emit(lines)
    emit([pending] if pending else [])


def group_alive(pgid: int) -> bool:
    """Whether process group ``pgid`` has a member that is not a zombie.

    Zombies count as gone: orphans are reaped by init, which may take its time. Without a
    Linux ``/proc``, any member counts.
    """
    try:
        pids = [name for name in os.listdir("/proc") if name.isdigit()]
    except OSError:
        pids = []
    if not pids:
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return False
        return True
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        state, _ppid, pgrp = stat[stat.rfind(b")") + 2 :].split()[:3]  # after "pid (comm) "
        if int(pgrp) == pgid and state not in (b"Z", b"X"):
            return True
    return False


@dataclass
class Child:
    """One child process (a rank or the embedded server), leading its own session.

    Its stdout and stderr are our own pipes rather than asyncio's: on Python 3.11 ``Process.wait``
    only returns once the pipes close, which a grandchild holding them open would delay forever.
    """

    name: str
    proc: asyncio.subprocess.Process
    stdout: asyncio.StreamReader
    stderr: asyncio.StreamReader
    pipes: list[asyncio.BaseTransport]
    pumps: list[asyncio.Task[None]] = field(default_factory=list)
    #: Wall-clock time at which the process ended (None while it runs), noted by a thread
    #: blocked on it: an exit is timed as it happens, not when our loop gets to it.
    ended: float | None = None

    def _time_exit(self) -> None:
        with contextlib.suppress(OSError):  # (already reaped by asyncio: it ended just now)
            os.waitid(os.P_PID, self.proc.pid, os.WEXITED | os.WNOWAIT)  # leaves it to asyncio
        self.ended = time.time()

    def signal(self, sig: int) -> bool:
        """Send ``sig`` to the child's whole process group; False when the group is gone."""
        try:
            os.killpg(self.proc.pid, sig)  # start_new_session: pgid == pid
        except (ProcessLookupError, PermissionError):
            return False
        return True

    def alive(self) -> bool:
        """The child, or anything it left in its process group, still runs."""
        return self.proc.returncode is None or group_alive(self.proc.pid)

    def pump(self, prefix: bytes) -> None:
        self.pumps = [
            asyncio.create_task(pump_lines(self.stdout, prefix, sys.stdout.buffer)),
            asyncio.create_task(pump_lines(self.stderr, prefix, sys.stderr.buffer)),
        ]

    def close(self) -> None:
        for pipe in self.pipes:
            pipe.close()


async def spawn(name: str, argv: Sequence[str], env: dict[str, str]) -> Child:
    """Start ``argv`` in a new session with its output on pipes we read."""
    loop = asyncio.get_running_loop()
    readers: list[asyncio.StreamReader] = []
    pipes: list[asyncio.BaseTransport] = []
    ends: list[int] = []
    try:
        for _ in range(2):
            r, w = os.pipe()
            ends.append(w)
            reader = asyncio.StreamReader(limit=2 * MAX_LINE)
            protocol = functools.partial(asyncio.StreamReaderProtocol, reader)
            source = open(r, "rb", buffering=0)  # noqa: SIM115 -- the transport owns and closes it
            transport, _ = await loop.connect_read_pipe(protocol, source)
            readers.append(reader)
            pipes.append(transport)
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=ends[0],
            stderr=ends[1],
            env=env,
            start_new_session=True,
        )
    except BaseException:
        for opened in pipes:
            opened.close()
        raise
    finally:
        for w in ends:
            os.close(w)
    child = Child(name, proc, readers[0], readers[1], pipes)
    threading.Thread(target=child._time_exit, name=f"exit of {name}", daemon=True).start()
    return child


async def until(event: asyncio.Event, timeout: float) -> None:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(event.wait(), timeout)


async def stop(children: Sequence[Child], sig: int, grace: float, kill_now: asyncio.Event) -> None:
    """Signal every child's process group; SIGKILL what is left after ``grace`` seconds."""
    targets = [c for c in children if c.alive()]
    if not targets:
        return
    for c in targets:
        c.signal(sig)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + grace
    leaders = asyncio.gather(*(c.proc.wait() for c in targets))
    killed = asyncio.ensure_future(kill_now.wait())
    try:
        either: list[asyncio.Future[Any]] = [leaders, killed]
        await asyncio.wait(either, timeout=grace, return_when=asyncio.FIRST_COMPLETED)
        # Processes the leaders left in their groups are no children of ours: nothing to wait
        # on but their group, so look again until it is empty or the grace period is over.
        while not kill_now.is_set() and any(c.alive() for c in targets) and loop.time() < deadline:
            await until(kill_now, 0.05)
    finally:
        killed.cancel()
        for c in targets:
            c.signal(signal.SIGKILL)
        await leaders


async def drain(children: Sequence[Child], timeout: float = 5.0) -> None:
    """Let the output pumps reach end of file (every writer of the pipes is gone by now)."""
    pumps = [t for c in children for t in c.pumps]
    if pumps:
        _, late = await asyncio.wait(pumps, timeout=timeout)
        for t in late:
            t.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)
    for c in children:
        c.close()
