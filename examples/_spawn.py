"""Run ``worker(rank, world_size, init_method)`` on N local processes (for the examples)."""

from __future__ import annotations

import multiprocessing as mp
import socket
import sys
from collections.abc import Callable


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def spawn(worker: Callable[[int, int, str], None], world_size: int) -> None:
    """Start ``world_size`` processes joined by ``tcp://`` (rank 0 hosts the store); exit non-zero
    if any fails."""
    init_method = f"tcp://127.0.0.1:{free_port()}"
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=worker, args=(r, world_size, init_method)) for r in range(world_size)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    codes = [p.exitcode for p in procs]
    if any(code != 0 for code in codes):
        for p in procs:
            if p.is_alive():
                p.kill()
        sys.exit(f"ranks exited with {codes}")
