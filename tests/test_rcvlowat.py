"""SO_RCVLOWAT on plain TCP connections: the kernel wakes the reader only once enough of a large
payload is queued, and never waits for bytes the peer has not committed to send."""

from __future__ import annotations

import asyncio
import resource
import socket
from typing import Any

import numpy as np
import pytest

from arendez import loop as arendez_loop
from arendez import transport, wire
from arendez.errors import ProtocolError

pytestmark = pytest.mark.skipif(not hasattr(socket, "SO_RCVLOWAT"), reason="no SO_RCVLOWAT here")

# sizes around the thresholds: below the smallest mark, between it and the cap, above the cap
SIZES = [300_000, 0, 70_000, 5, 2_000_123, 65_535, 65_536, 262_144, 262_145, 0, 1_000_000, 3]


def _payload(i: int, n: int) -> bytes:
    return (np.arange(n, dtype=np.uint32) * (i + 1)).astype(np.uint8).tobytes()


async def _serve(
    got: list[tuple[Any, bytes | None]], done: asyncio.Event, want: int
) -> tuple[Any, list[Any]]:
    conns: list[transport.Connection] = []

    def made() -> transport.Connection:
        conn = transport.Connection()

        def on_frame(header: Any, payload: memoryview | None) -> None:
            got.append((header, None if payload is None else bytes(payload)))
            if len(got) == want:
                done.set()

        conn.set_handlers(on_frame, lambda exc: None)
        conns.append(conn)
        return conn

    server = await asyncio.get_running_loop().create_server(made, "127.0.0.1", 0)
    return server, conns


async def _trickle(port: int, pieces: list[bytes], pause: float, done: asyncio.Event) -> None:
    """Send ``pieces`` from a raw socket, pausing between them (a slow link's partial arrivals),
    and keep it open until everything arrived (an end of stream would wake the reader anyway)."""
    loop = asyncio.get_running_loop()
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setblocking(False)
    try:
        for piece in pieces:
            await loop.sock_sendall(sock, piece)
            await asyncio.sleep(pause)
        await done.wait()
    finally:
        sock.close()


def _stream() -> bytes:
    out = bytearray()
    for i, n in enumerate(SIZES):
        for part in wire.encode({"i": i}, _payload(i, n) if n else None):
            out += part
    return bytes(out)


async def _check(pieces: list[bytes], pause: float) -> list[Any]:
    got: list[tuple[Any, bytes | None]] = []
    done = asyncio.Event()
    server, conns = await _serve(got, done, len(SIZES))
    port = server.sockets[0].getsockname()[1]
    try:
        sender = asyncio.create_task(_trickle(port, pieces, pause, done))
        try:
            async with asyncio.timeout(10):  # a mark above what is still to come would hang here
                await done.wait()
        finally:
            done.set()
        marks = [
            c._transport.get_extra_info("socket").getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT)
            for c in conns
            if c._transport is not None
        ]
        await sender
    finally:
        server.close()
        for c in conns:
            c.abort()
    assert [h for h, _ in got] == [{"i": i} for i in range(len(SIZES))]
    for i, (n, (_, payload)) in enumerate(zip(SIZES, got, strict=True)):
        assert payload == (_payload(i, n) if n else None), f"frame {i} ({n} bytes) corrupted"
    return marks


@pytest.mark.parametrize("cut", [1_000, 37_111, 150_000])
def test_every_frame_arrives_when_a_large_payload_trickles_in(cut: int) -> None:
    """Pieces of odd sizes with pauses: reads end mid-payload, so the mark must follow what is
    left of it after every read, down to a small frame right behind a large payload."""
    data = _stream()
    pieces = [data[i : i + cut] for i in range(0, len(data), cut)]
    marks = arendez_loop.run(_check(pieces, 0.002 if cut > 10_000 else 0.0))
    assert marks == [1]  # between frames the reader wakes for any byte again


def test_frames_arrive_whole_in_one_burst() -> None:
    marks = arendez_loop.run(_check([_stream()], 0.0))
    assert marks == [1]


class _Fake:
    def __init__(self, extra: dict[str, Any]) -> None:
        self.extra = extra

    def get_extra_info(self, name: str) -> Any:
        return self.extra.get(name)


def test_only_plain_tcp_sockets_get_a_mark() -> None:
    """Under TLS the kernel counts ciphertext and the TLS layer may already hold what we wait for;
    a unix socket does not honour the mark in poll."""
    with socket.socket() as tcp, socket.socket(socket.AF_UNIX) as unix:
        assert transport._lowat_socket(_Fake({"socket": unix})) is None  # type: ignore[arg-type]
        tls = _Fake({"socket": tcp, "ssl_object": object()})
        assert transport._lowat_socket(tls) is None  # type: ignore[arg-type]
        assert transport._lowat_socket(_Fake({"socket": tcp})) is tcp  # type: ignore[arg-type]


def test_a_bad_header_length_closes_at_once_without_a_huge_buffer() -> None:
    """After a frame fails its limits, the mark is not followed: the decoder's state is garbage
    then (asking it for a buffer would size one by the bogus header length: gigabytes)."""

    async def go() -> int:
        got: list[tuple[Any, bytes | None]] = []
        server, conns = await _serve(got, asyncio.Event(), 1)
        port = server.sockets[0].getsockname()[1]
        loop = asyncio.get_running_loop()
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        sock = socket.create_connection(("127.0.0.1", port))
        sock.setblocking(False)
        try:
            await loop.sock_sendall(sock, wire.PREFIX.pack((1 << 31) + 5, 0) + b"x" * 100)
            async with asyncio.timeout(5):
                while not conns:
                    await asyncio.sleep(0.01)
                await conns[0].closed
            assert isinstance(conns[0].error, ProtocolError)
        finally:
            sock.close()
            server.close()
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak

    grown_kib = arendez_loop.run(go())
    assert grown_kib < 256 * 1024
