"""The lease sidecar: a small process that sends its parent's heartbeats.

A heartbeat thread needs the GIL, and one C call that keeps it for longer than the lease (a
96 MB ``json.loads``, a long garbage collection) would get a healthy process declared failed.
So on Linux the lease keeper (``lease.py``) opens and authenticates the lease connection, then
hands its socket to this process, which writes a ready-made heartbeat frame every interval as
long as its parent lives and is not stopped:

- parent running or sleeping (``/proc/PID/stat`` state R, S, D): heartbeat;
- parent stopped (SIGSTOP, a debugger: state T or t): no heartbeat, so the lease runs out as
  it would for a frozen process;
- parent gone (it is no longer our parent, or a zombie): exit, closing the connection.

It ignores SIGINT (a Ctrl-C in the terminal reaches the whole process group; it is the parent's
to handle). It exits 0 when its stdin reaches EOF, 1 when the server closes the connection (the
keeper then reconnects). The keeper stops it in order by writing ``STOP`` first: then it sends
the lease's end frame, and the server counts the members still on the lease as left, not failed
(their leaves may not have arrived). A parent that dies closes the pipe without it: its lease
runs out. Run by path with ``python -I -S`` and only the standard library, so it starts in tens
of milliseconds and holds no copy of the application::

    python -I -S leaseproc.py FD PARENT_PID INTERVAL HEARTBEAT_HEX END_HEX
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import socket
import sys
import time

#: Parent states (``/proc/PID/stat``) in which it cannot answer, so no heartbeat is sent.
STOPPED = (b"T", b"t")
#: Parent states of a process that is gone.
GONE = (b"Z", b"X", b"x")
#: What the keeper writes to the sidecar's stdin to stop it in order (the lease ends).
STOP = b"E"


def parent_state(pid: int) -> bytes:
    """The one-letter state of process ``pid`` (``b"X"`` if it is gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return b"X"
    return stat[stat.rindex(b")") + 2 :][:1]


def run(sock: socket.socket, parent: int, interval: float, beat: bytes, end: bytes = b"") -> int:
    """Send ``beat`` every ``interval`` s while ``parent`` runs, and ``end`` when stopped in
    order; the exit code (see above)."""
    stdin = sys.stdin.fileno()
    # poll, not select: the socket keeps its number from the parent, which may be past 1023
    # (a process holding a thousand connections), where select() refuses it
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLIN)
    poller.register(stdin, select.POLLIN)
    due = time.monotonic()
    while True:
        if os.getppid() != parent:
            return 0
        now = time.monotonic()
        if now >= due:
            state = parent_state(parent)
            if state in GONE:
                return 0
            if state not in STOPPED:
                try:
                    sock.sendall(beat)
                except OSError:
                    return 1
            due = now + interval
        wait_ms = max(0.0, due - time.monotonic()) * 1000.0
        readable = {fd for fd, _ in poller.poll(wait_ms)}
        if stdin in readable:  # the keeper asks us to stop (STOP), or its process is gone (EOF)
            if end and os.read(stdin, 1) == STOP and parent_state(parent) not in GONE:
                with contextlib.suppress(OSError):
                    sock.sendall(end)
            return 0
        if sock.fileno() in readable:
            try:
                data = sock.recv(1 << 16)  # the server's pushed events: the parent has them too
            except OSError:
                return 1
            if not data:
                return 1


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the parent, whose exit ends us
    fd, parent, interval, beat = int(argv[1]), int(argv[2]), float(argv[3]), bytes.fromhex(argv[4])
    end = bytes.fromhex(argv[5]) if len(argv) > 5 else b""
    sock = socket.socket(fileno=fd)
    sock.setblocking(True)
    sock.settimeout(max(5.0, 4 * interval))  # (a send the kernel cannot take for that long fails)
    try:
        return run(sock, parent, interval, beat, end)
    finally:
        sock.close()


if __name__ == "__main__":
    sys.exit(main(sys.argv))
