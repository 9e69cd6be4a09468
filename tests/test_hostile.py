"""The server survives garbage from one client while a real job proceeds on it."""

from __future__ import annotations

import asyncio
import socket
import struct

import pytest

import arendez as dist
from tests.harness import collect, raw_frame, read_until_closed, rss_kib, server, spawn_rank
from tests.jobs import store as store_jobs


def _handshake(port: int, job: str = "evil") -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    sock.recv(65536)  # the challenge
    sock.sendall(raw_frame({"job": job, "nonce": b"0123456789abcdef"}))
    sock.recv(65536)  # welcome
    return sock


GARBAGE = [
    b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" * 3,
    struct.pack("<IQ", 1 << 30, 0),  # absurd header length
    struct.pack("<IQ", 4, 1 << 40) + b"abcd",  # absurd payload length
    struct.pack("<IQ", 5, 0) + b"\xc1\xc1\xc1\xc1\xc1",  # undecodable msgpack
    bytes(range(256)) * 8,
]


@pytest.mark.timeout(60)
def test_garbage_closes_only_that_connection(arendez_server):
    url = f"{arendez_server.url}/victim"
    procs = [spawn_rank(store_jobs.store_and_reduce, r, 2, url, 40) for r in range(2)]
    try:
        for junk in GARBAGE:
            with socket.create_connection(("127.0.0.1", arendez_server.port), timeout=5) as sock:
                sock.sendall(junk)
                read_until_closed(sock)  # the server hangs up on us ...
        for request in ([1, 2, 3], {"op": 7}, {"op": "no-such-op", "id": 1}):
            with _handshake(arendez_server.port) as sock:
                sock.sendall(raw_frame(request))
                reply = read_until_closed(sock)
                assert b"ProtocolError" in reply  # ... saying why, when it can
        half = raw_frame({"op": "set", "id": 1, "key": "k", "value": b"v" * 1000})[:-500]
        with _handshake(arendez_server.port) as sock:  # a truncated stream
            sock.sendall(half)
    finally:
        results = collect(procs, 50)
    for res in results:
        assert res.returncode == 0, res.stderr[-3000:]
        assert res.value == [3] * 40  # ranks add 1 and 2 each round
    assert arendez_server.proc.poll() is None  # the server is still up


@pytest.mark.timeout(30)
async def test_wrong_version_or_silent_client_does_not_block_others(arendez_server):
    idle = socket.create_connection(("127.0.0.1", arendez_server.port), timeout=5)  # says nothing
    try:
        store = await dist.Store("127.0.0.1", arendez_server.port, "fine", timeout=5).connect()
        await store.set("k", "v")
        assert await store.get("k") == b"v"
        await store.close()
    finally:
        idle.close()


@pytest.mark.timeout(60)
async def test_clients_that_never_read_their_replies_are_held_to_the_servers_total():
    """Each client leaves 4 MiB unread (under the 16 MiB of one client); 24 of them would make
    the server hold 96 MiB: with --max-unread-bytes 24 MiB it drops those past the total, frees
    what they left (not kept until they read) and serves the others."""
    with server("--max-unread-bytes", str(24 << 20)) as srv:
        store = await dist.Store("127.0.0.1", srv.port, "flood", timeout=10).connect()
        await store.set("big", b"x" * (1 << 20))
        before = rss_kib(srv.proc.pid)
        socks = []
        try:
            for _ in range(24):
                sock = _handshake(srv.port, job="flood")
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                sock.sendall(b"".join(raw_frame({"op": "get", "id": i, "key": "big"}) for i in range(4)))
                socks.append(sock)
            await asyncio.sleep(2)  # (dropped clients are cut 0.2 s after their last reply)
            held = rss_kib(srv.proc.pid) - before
            assert held < 60 * 1024, f"the server holds {held} KiB more"
            assert await store.get("big") == b"x" * (1 << 20)  # everyone else is fine
        finally:
            for sock in socks:
                sock.close()
            await store.close()
        assert "(the server's limit, --max-unread-bytes: 25165824)" in srv.stderr_text()


@pytest.mark.timeout(60)
async def test_client_that_never_reads_its_replies_is_dropped(arendez_server):
    store = await dist.Store("127.0.0.1", arendez_server.port, "flood", timeout=10).connect()
    await store.set("big", b"x" * (1 << 20))
    with _handshake(arendez_server.port, job="flood") as sock:
        sock.sendall(b"".join(raw_frame({"op": "get", "id": i, "key": "big"}) for i in range(200)))
        await asyncio.sleep(3)  # 200 MiB of replies asked for, none read yet
        assert rss_kib(arendez_server.proc.pid) < 150 * 1024  # the server did not hold them all
        received = len(await asyncio.to_thread(read_until_closed, sock, 10))
    assert received < 100 << 20  # dropped long before delivering all 200 replies
    assert await store.get("big") == b"x" * (1 << 20)  # everyone else is fine
    await store.close()
