"""The embedded server as a child process of the rank that hosts it (``arendez.serverproc``).

Run as ``python -m arendez_server.child``. The parent writes one JSON line to our stdin::

    {"host": ..., "port": ..., "token": ... or null, "wait": seconds, "log_level": 30, "parent": pid,
     "fd": n or null}

(``fd``: a socket the parent already bound and listens on, passed down to us: then clients that
come while we start wait in its queue instead of being refused and retrying.)

and we answer one JSON line on stdout: ``{"port": N}`` once listening, or ``{"error": text,
"errno": n}`` (a port in use is retried for ``wait`` seconds first: the last host may be
leaving). Then we serve until our stdin reaches EOF (the parent closed it, or died: its end of
the pipe closes with it, kill -9 included), our parent changes, or SIGTERM; then we close the
server, telling every client. SIGINT is ignored: Ctrl-C is for the ranks, which close us.

Why a process: the store outlives a stopped or busy host. With the server in rank 0's event
loop, a SIGSTOPped rank 0 stopped the lease check too (nobody was declared failed, survivors
waited for their collective timeout), and a rank 0 busy in a long synchronous step, or holding
the GIL, stalled every other rank's store calls and rendezvous.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
import sys
from typing import Any

from arendez import loop as _loop

from .admission import raise_fd_limit
from .hosted import start_server

#: How often the parent is looked for (besides the EOF of stdin, which is immediate).
PARENT_CHECK = 1.0


def _say(answer: dict[str, Any]) -> bool:
    """Answer the parent; False if it is gone (killed while we started: its end of the pipe
    closed), which ends us quietly rather than with a traceback in the rank's output."""
    try:
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # (so the exit's own flush is quiet)
        os.close(devnull)
        return False
    return True


async def _serve(order: dict[str, Any]) -> int:
    loop = asyncio.get_running_loop()
    try:
        fd = order.get("fd")
        server = await start_server(
            str(order["host"]),
            int(order["port"]),
            order.get("token"),
            None,
            float(order["wait"]),
            sock=None if fd is None else socket.socket(fileno=int(fd)),
        )
    except OSError as exc:
        _say({"error": exc.strerror or str(exc), "errno": exc.errno or 0})  # (errno apart)
        return 1
    if not _say({"port": server.port}):
        await server.close(1.0)
        return 0
    stop = asyncio.Event()
    stdin = sys.stdin.fileno()

    def parent_spoke() -> None:
        if not os.read(stdin, 4096):  # EOF: the parent closed us, or is gone
            loop.remove_reader(stdin)
            stop.set()

    loop.add_reader(stdin, parent_spoke)
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    parent = int(order["parent"])
    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), PARENT_CHECK)
        except TimeoutError:
            if os.getppid() != parent:  # (stdin may be held open by a child the parent forked)
                break
    await server.close(1.0)
    return 0


def main() -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    order = json.loads(sys.stdin.readline())
    logging.basicConfig(
        level=int(order.get("log_level", logging.WARNING)),
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    raise_fd_limit()  # (then the server fits it quietly, as an embedded server does)
    return _loop.run(_serve(order))


if __name__ == "__main__":
    sys.exit(main())
