"""A rank's peer listener: limits on connections that have not authenticated, a hello-sized
budget before the handshake, and failed connections freed at once (no reference cycles)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import socket
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from arendez import handshake, transport
from arendez.errors import LimitError
from arendez.transports import tcp
from tests.harness import (
    collect,
    peer_bombs,
    raw_frame,
    read_until_closed,
    rss_kib,
    spawn_rank,
    wait_for_files,
)
from tests.jobs import listener


@contextmanager
def _no_cycle_collection() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


async def _recv_all(reader: asyncio.StreamReader, seconds: float = 5.0) -> bytes:
    async with asyncio.timeout(seconds):
        return await reader.read()


async def _client(port: int, data: bytes, host: str = "127.0.0.1") -> bytes:
    """Connect (from ``host``), read the challenge, send ``data``, read until the listener hangs up."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(host, 0))
    try:
        if data:
            writer.write(data)
        return await _recv_all(reader)
    finally:
        writer.close()


@pytest.mark.timeout(60)
async def test_a_storm_of_bad_clients_leaves_no_connection_alive() -> None:
    mesh = tcp.Mesh(token="secret", limits=tcp.ListenerLimits(handshake_seconds=1.0))
    made: list[weakref.ref[transport.Connection]] = []
    accepted = mesh._accepted

    def tracking(conn: transport.Connection) -> transport.Connection:
        made.append(weakref.ref(conn))
        return accepted(conn)

    mesh._accepted = tracking  # type: ignore[method-assign]
    port = await mesh.listen("127.0.0.1", 0)
    try:
        with _no_cycle_collection():
            bombs = peer_bombs()
            for _ in range(10):
                replies = await asyncio.gather(*(_client(port, b) for b in bombs))
                for reply in replies:
                    assert b"arendez" in reply  # the challenge, then the hang-up
            async with asyncio.timeout(5):
                while mesh._tasks:
                    await asyncio.sleep(0.01)
            await asyncio.sleep(0.05)  # the transports' last callbacks
            alive = [r for r in made if r() is not None]
            assert len(made) == 10 * len(bombs)
            assert not alive, f"{len(alive)} of {len(made)} connections still alive without a gc pass"
            assert not mesh._pending
    finally:
        await mesh.close(1.0)


@pytest.mark.timeout(30)
async def test_connections_past_the_limits_are_refused_naming_the_limit() -> None:
    limits = tcp.ListenerLimits(per_host=3, total=5, handshake_seconds=1.0)
    mesh = tcp.Mesh(token=None, limits=limits)
    port = await mesh.listen("127.0.0.1", 0)
    silent: list[socket.socket] = []
    try:
        for host in ["127.0.0.1"] * 3 + ["127.0.0.2"] * 2:  # these wait for their handshake
            sock = socket.socket()
            sock.bind((host, 0))
            sock.connect(("127.0.0.1", port))
            silent.append(sock)
        await asyncio.sleep(0.2)
        assert mesh._pending.total() == 5
        per_host = await _client(port, b"", "127.0.0.1")
        assert b"LimitError" in per_host and b"ARENDEZ_PEER_MAX_PENDING_PER_HOST" in per_host
        total = await _client(port, b"", "127.0.0.3")
        assert b"LimitError" in total and b"ARENDEZ_PEER_MAX_PENDING)" in total
        # a dialer sees the refusal as an error naming the limit
        conn = await transport.open_connection("127.0.0.1", port)
        with pytest.raises(LimitError, match="ARENDEZ_PEER_MAX_PENDING_PER_HOST"):
            await handshake.client_handshake(conn, None, {"rank": 1, "round": b""}, 2.0)
        conn.abort()
        # the silent ones are dropped after the pre-handshake time, and the slots free up
        loop = asyncio.get_running_loop()
        started = loop.time()
        for sock in silent:
            sock.setblocking(False)
            while True:
                try:
                    chunk = await loop.sock_recv(sock, 4096)
                except ConnectionResetError:
                    break
                if not chunk:
                    break
        assert loop.time() - started < 3.0
        async with asyncio.timeout(2):
            while mesh._pending:
                await asyncio.sleep(0.01)
        accepted = await _client(port, raw_frame({"nonce": b"n" * 16}), "127.0.0.1")
        assert b"LimitError" not in accepted
    finally:
        for sock in silent:
            sock.close()
        await mesh.close(1.0)


def test_limits_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ARENDEZ_PEER_MAX_PENDING_PER_HOST", "7")
    monkeypatch.setenv("ARENDEZ_PEER_MAX_PENDING", "70")
    monkeypatch.setenv("ARENDEZ_PEER_HANDSHAKE_MS", "1500")
    assert tcp.ListenerLimits.from_env() == tcp.ListenerLimits(7, 70, 1.5)
    monkeypatch.setenv("ARENDEZ_PEER_MAX_PENDING", "0")
    with pytest.raises(ValueError, match="ARENDEZ_PEER_MAX_PENDING must be at least 1, got 0"):
        tcp.ListenerLimits.from_env()


def _attack_silently(port: int, count: int, hosts: int) -> tuple[list[socket.socket], int]:
    """Open ``count`` connections from ``hosts`` loopback addresses that never say a word;
    return them and how many the listener refused at once naming a limit."""
    socks, refused = [], 0
    for i in range(count):
        sock = socket.socket()
        sock.bind((f"127.0.0.{2 + i % hosts}", 0))
        sock.settimeout(30)  # (a loaded machine accepts slowly)
        sock.connect(("127.0.0.1", port))
        socks.append(sock)
    time.sleep(0.5)  # refusals are immediate: an error frame, then the close
    for sock in socks:
        data = b""
        with contextlib.suppress(BlockingIOError, ConnectionError):
            while chunk := sock.recv(4096, socket.MSG_DONTWAIT):
                data += chunk
        refused += b"LimitError" in data
    return socks, refused


@pytest.mark.timeout(150)
def test_hostile_clients_at_a_ranks_listener_while_a_job_runs(arendez_server, tmp_path):
    """Pre-auth bombs, 400 silent connections from 8 addresses (past the total limit), then
    400 more once the first were dropped: the job's results stay exact and rank 0's RSS grows by < 64 MiB."""
    env = {"ARENDEZ_PEER_HANDSHAKE_MS": "3000"}
    url = f"{arendez_server.url}/peer-attack-{tmp_path.name}"
    procs = [spawn_rank(listener.reduce_under_attack, r, 2, url, str(tmp_path), env=env) for r in range(2)]
    peak = 0
    try:
        wait_for_files(tmp_path, "ready-*", 2)
        info = json.loads((tmp_path / "rank-0.json").read_text())
        pid, port = info["pid"], tcp.split_address(info["address"])[1]
        before = rss_kib(pid)
        for _ in range(10):
            for bomb in peer_bombs():
                with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
                    sock.sendall(bomb)
                    sock.shutdown(socket.SHUT_WR)  # (the silent one hangs up at once)
                    with contextlib.suppress(ConnectionError):
                        read_until_closed(sock)  # (maybe the challenge), then closed
        peak = max(peak, rss_kib(pid))
        for _ in range(2):  # the second wave retries once the first was dropped
            socks, refused = _attack_silently(port, 400, 8)
            peak = max(peak, rss_kib(pid))
            assert refused > 0  # (how many depends on how fast the held ones time out)
            for sock in socks:
                sock.close()
            time.sleep(3.1)  # past the pre-handshake time: the held ones were dropped
        after = rss_kib(pid)
        (tmp_path / "stop").write_text("1")
    finally:
        results = collect(procs, 110)
    for res in results:
        assert res.returncode == 0, res.stderr[-3000:]
    zero, one = (res.value for res in results)
    assert zero == one and zero["wrong"] == 0 and zero["steps"] > 20, (zero, one)
    grew = (max(peak, after) - before) / 1024
    assert grew < 64, f"rank 0 grew by {grew:.1f} MiB (before {before} KiB, peak {peak}, after {after})"
    print(f"rank 0 RSS: before {before} KiB, peak {peak} KiB, after {after} KiB; steps {zero['steps']}")
