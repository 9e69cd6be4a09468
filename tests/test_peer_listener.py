"""A rank's peer listener: limits on connections that have not authenticated, a hello-sized
budget before the handshake, and failed connections freed at once (no reference cycles)."""

from __future__ import annotations

import asyncio
import gc
import socket
import struct
import weakref
from collections.abc import Iterator
from contextlib import contextmanager

import msgpack
import pytest

from arendez import transport
from arendez.errors import LimitError
from arendez.transports import tcp
from tests.harness import raw_frame


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


# what strangers send before (instead of) a hello: each must close the connection
def _bombs() -> list[bytes]:
    wide = msgpack.packb([{}] * 1000)  # 1 KiB of empty maps: a thousand dicts once decoded
    deep = b"\x91" * 900 + b"\xc0"  # arrays nested 900 deep
    return [
        b"",  # says nothing and hangs up
        b"GET / HTTP/1.1\r\n\r\n",
        struct.pack("<IQ", 1 << 30, 0),  # a 1 GiB header announced
        struct.pack("<IQ", 8, 1 << 20) + msgpack.packb({"rank": 1}).ljust(8, b"\xc0"),  # a payload
        struct.pack("<IQ", len(wide), 0) + wide,
        struct.pack("<IQ", len(deep), 0) + deep,
        raw_frame({"rank": 1, "round": b"x" * 16, "nonce": b"n" * 16, "proof": b"p" * 32}),  # wrong proof
        raw_frame({"nonce": b"n" * 16}) * 5,  # more frames than a handshake needs
        struct.pack("<IQ", 5, 0) + b"\xc1\xc1\xc1\xc1\xc1",  # not msgpack
    ]


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
            bombs = _bombs()
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
            await transport.client_handshake(conn, None, {"rank": 1, "round": b""}, 2.0)
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
