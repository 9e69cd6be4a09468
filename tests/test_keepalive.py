"""TCP keepalive on store and peer connections: gentle enough that an overloaded host (loopback
dropping packets from its full backlog) does not cut healthy idle connections."""

from __future__ import annotations

import asyncio
import re
import socket
import subprocess

import pytest

from arendez.store import Store
from tests.harness import server


def _keepalive_timers(port: int) -> list[float]:
    """Seconds left on the keepalive timer of each end of the TCP connections to ``port``."""
    out = subprocess.run(
        ["ss", "-tnoH", "state", "established", f"( sport = :{port} or dport = :{port} )"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    unit = {"ms": 0.001, "sec": 1, "min": 60}
    found = re.findall(r"timer:\(keepalive,(?:(\d+)min)?(?:(\d+)(ms|sec))?", out)
    return [int(m or 0) * 60 + int(n or 0) * unit.get(u, 0) for m, n, u in found]


@pytest.mark.timeout(30)
async def test_both_ends_of_a_store_connection_probe_only_after_a_minute_of_silence(monkeypatch) -> None:
    monkeypatch.setenv("ARENDEZ_LOCAL_SOCKETS", "0")  # loopback TCP, as between hosts
    with server() as srv:
        store = await Store("127.0.0.1", srv.port, "ka").connect()
        try:
            await store.set("k", b"v")
            assert await store.get("k") == b"v"
            timers: list[float] = []
            for _ in range(100):  # until no reply is in flight (then the keepalive timer runs)
                timers = _keepalive_timers(srv.port)
                if len(timers) >= 2:
                    break
                await asyncio.sleep(0.02)
        finally:
            await store.close()
    # the client's end and the server's accepted end (which inherits the listener's options)
    assert len(timers) == 2, timers
    assert all(t >= 50 for t in timers), f"keepalive would probe within {min(timers)} s: {timers}"


def test_dialled_sockets_give_up_only_after_minutes_of_unanswered_probes() -> None:
    from arendez import transport

    with socket.socket() as sock:
        transport.tune_tcp_socket(sock)
        idle = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE)
        interval = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL)
        probes = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT)
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
    # three lost probes in a row must not end a connection: loss comes in bursts under load
    assert probes >= 5 and idle + interval * probes >= 120, (idle, interval, probes)
