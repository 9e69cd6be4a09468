"""The store's fast path: the async client's corked batches and shared expiry timer, the compact
request form (batched, checked, versioned in the welcome) and multi_get/multi_set."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import struct
import time

import msgpack
import pytest

import arendez as dist
from arendez import handshake
from arendez.blocking_store import BlockingStore
from arendez.errors import StoreError, StoreTimeoutError
from arendez.store_wire import STORE_PROTOCOL, HeaderReader
from tests.harness import raw_frame, read_until_closed, server, start_server


@pytest.mark.timeout(30)
async def test_pipelined_calls_all_answered_in_order(arendez_server):
    """Many calls in flight on one async client: corked batches lose and reorder nothing."""
    st = await dist.Store("127.0.0.1", arendez_server.port, "pipe", timeout=10).connect()
    try:

        async def lane(i: int) -> list[int]:
            got = []
            for j in range(50):
                await st.set(f"k{i}", str(j))
                assert await st.get(f"k{i}") == str(j).encode()
                got.append(await st.add("total", 1))
            return got

        results = await asyncio.gather(*(lane(i) for i in range(32)))
        totals = sorted(t for r in results for t in r)
        assert totals == list(range(1, 32 * 50 + 1))  # every add applied exactly once
        assert all(r == sorted(r) for r in results)
        with pytest.raises(StoreTimeoutError):
            await st.get("never", timeout=0.2)  # per-call expiry still works with the shared timer
    finally:
        await st.close()


@pytest.mark.timeout(30)
async def test_short_call_expires_on_time_behind_a_long_one():
    """One timer serves all calls: a later call with an earlier deadline re-arms it."""
    srv = start_server()
    st = await dist.Store("127.0.0.1", srv.port, "expiry", timeout=10).connect()
    try:
        await st.set("a", "1")
        os.killpg(srv.proc.pid, signal.SIGSTOP)  # the server stops answering, the socket stays up
        long_call = asyncio.ensure_future(st.add("n", 1, timeout=20))
        await asyncio.sleep(0.05)
        t0 = time.monotonic()
        with pytest.raises(StoreTimeoutError):
            await st.add("n", 1, timeout=0.3)
        assert time.monotonic() - t0 < 3.0
        assert not long_call.done()  # its own deadline is still ahead
        os.killpg(srv.proc.pid, signal.SIGCONT)
        assert await asyncio.wait_for(long_call, 10) >= 1  # answered once the server resumes
    finally:
        os.killpg(srv.proc.pid, signal.SIGCONT)
        await st.close()
        srv.stop()


def _session(port: int, job: str) -> socket.socket:
    """A raw connection past the handshake; returns it with the welcome checked."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    sock.recv(65536)  # the challenge
    sock.sendall(raw_frame({"job": job, "nonce": b"0123456789abcdef"}))
    hlen, _ = struct.unpack("<IQ", sock.recv(12))
    welcome = msgpack.unpackb(sock.recv(hlen))
    assert welcome["store"] == STORE_PROTOCOL  # the server announces the compact form
    return sock


def _replies(sock: socket.socket, count: int) -> list[object]:
    reader, out = HeaderReader(1 << 20), []
    while len(out) < count:
        buf = reader.get_buffer()
        n = sock.recv_into(buf)
        assert n, f"the server closed after {out}"
        out.extend(reader.feed(n))
    return out


@pytest.mark.timeout(30)
def test_compact_requests_batched_in_one_write_answered_in_order(arendez_server):
    """Compact requests sent in one write get compact replies, in order; a bad one gets an
    error naming what was wrong and the connection keeps serving; the map form still works."""
    with _session(arendez_server.port, "compact") as sock:
        requests = [
            ["set", 1, "a", b"1"],
            ["add", 2, "n", 5],
            ["get", 3, "a", 5.0],
            ["set", 4, "a"],  # one argument short
            ["set", 5, "k" * 5000, b"v"],  # key over the server's limit
            ["multi_set", 6, ["x", "y"], [b"X", b"Y"]],
            ["multi_get", 7, ["x", "y", "a"], 5.0],
            ["compare_set", 8, "a", b"1", b"2"],
            ["check", 9, ["a", "x", "nope"]],
            ["num_keys", 10],
            ["delete", 11, "x"],
        ]
        sock.sendall(b"".join(raw_frame(r) for r in requests))
        sock.sendall(raw_frame({"op": "get", "id": 12, "key": "y", "timeout": 1.0}))
        got = _replies(sock, len(requests) + 1)
    assert got[:3] == [[1, None], [2, 5], [3, b"1"]]
    assert got[3]["id"] == 4 and got[3]["error"] == "StoreError"
    assert "set takes 2 argument(s) (key, value), got 1" in got[3]["message"]
    assert got[4]["id"] == 5 and "limit of 4096 bytes" in got[4]["message"]
    assert got[5:11] == [[6, None], [7, [b"X", b"Y", b"1"]], [8, b"2"], [9, False], [10, 4], [11, True]]
    assert got[11] == {"id": 12, "ok": b"Y"}  # map form, map reply


@pytest.mark.timeout(30)
def test_unknown_compact_op_and_oversized_frame_close_with_a_protocol_error(arendez_server):
    """(An oversized frame is the size limit's ``LimitError``, as the clients raise it.)"""
    for request, error, words in (
        (raw_frame(["nope", 1]), b"ProtocolError", b"unknown request 'nope'"),
        (raw_frame([7, 1, "k"]), b"ProtocolError", b"unknown request 7"),
        (struct.pack("<IQ", (1 << 20) + 9000, 0), b"LimitError", b"exceeds the server's limit of"),
        (
            raw_frame(["get", 1, "k", 1.0], payload=3) + b"abc",
            b"ProtocolError",
            b"payload of 3 bytes exceeds 0",
        ),
    ):
        with _session(arendez_server.port, "bad") as sock:
            sock.sendall(request)
            reply = read_until_closed(sock)
        assert error in reply and words in reply, (request[:40], reply)


@pytest.mark.timeout(30)
async def test_waiting_compact_get_and_multi_get_are_woken_by_a_set(arendez_server):
    st = await dist.Store("127.0.0.1", arendez_server.port, "wake", timeout=10).connect()
    other = BlockingStore("127.0.0.1", arendez_server.port, "wake", timeout=10)
    try:
        waiting = asyncio.ensure_future(st.multi_get(["p", "q"], timeout=10))
        one = asyncio.ensure_future(st.get("q", timeout=10))
        await asyncio.sleep(0.2)
        assert not waiting.done() and not one.done()
        await asyncio.to_thread(other.multi_set, ["p", "q"], ["P", b"Q"])
        assert await asyncio.wait_for(waiting, 5) == [b"P", b"Q"]
        assert await asyncio.wait_for(one, 5) == b"Q"
        assert await asyncio.to_thread(other.multi_get, ["q", "p"]) == [b"Q", b"P"]
        with pytest.raises(StoreTimeoutError):
            await st.multi_get(["p", "never"], timeout=0.3)
        with pytest.raises(ValueError, match="2 keys but 1 values"):
            await st.multi_set(["a", "b"], ["1"])
    finally:
        other.close()
        await st.close()


@pytest.mark.timeout(30)
async def test_a_server_without_the_compact_form_is_named():
    """A server whose welcome does not announce store protocol 2 is refused by both clients."""

    async def old_server(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        challenge, _ = handshake.make_challenge(None)
        writer.write(raw_frame(challenge))
        hlen, _ = struct.unpack("<IQ", await reader.readexactly(12))
        hello = msgpack.unpackb(await reader.readexactly(hlen))
        writer.write(raw_frame(handshake.answer_hello(hello, None, challenge["nonce"])))
        await reader.read()

    listener = await asyncio.start_server(old_server, "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    try:
        blocking = BlockingStore("127.0.0.1", port, "old", timeout=5)
        with pytest.raises(dist.ProtocolError, match="store protocol 1, this client needs 2"):
            await asyncio.to_thread(blocking.connect)
        with pytest.raises(dist.StoreError, match="store protocol 1, this client needs 2"):
            await dist.Store("127.0.0.1", port, "old", timeout=1).connect()
    finally:
        listener.close()


def _frames(sock: socket.socket, count: int) -> list:
    reader, got = HeaderReader(2 << 20), []
    while len(got) < count:
        n = sock.recv_into(reader.get_buffer())
        assert n, f"closed after {got}"
        got.extend(reader.feed(n))
    return got


@pytest.mark.timeout(30)
def test_early_welcome_lets_requests_ride_behind_the_hello(arendez_server):
    """No token: the challenge carries the welcome; a client that takes it sends its hello and a
    request (larger than a hello may be) in one write and gets the reply with no welcome first."""
    with socket.create_connection(("127.0.0.1", arendez_server.port), timeout=10) as sock:
        (challenge,) = _frames(sock, 1)
        early = handshake.early_welcome(challenge, None)
        assert early is not None and early["store"] == STORE_PROTOCOL
        hello, _ = handshake.answer_challenge(challenge, None, {"job": "early"}, "server")
        hello["early"] = True
        big = b"v" * 20_000  # 20 times what a frame before the hello may hold
        sock.sendall(raw_frame(hello) + raw_frame(["set", 1, "k", big]) + raw_frame(["get", 2, "k", 5.0]))
        assert _frames(sock, 2) == [[1, None], [2, big]]


@pytest.mark.timeout(30)
def test_no_early_welcome_with_a_token_and_for_clients_that_wait(tmp_path):
    """With a token the server proves itself in its welcome: none comes early. A client that
    does not take the early welcome (older ones) gets the welcome as before."""
    (tmp_path / "token").write_text("s3cret\n")
    with (
        server("--token-file", str(tmp_path / "token")) as srv,
        socket.create_connection(("127.0.0.1", srv.port), timeout=10) as sock,
    ):
        (challenge,) = _frames(sock, 1)
        assert "early" not in challenge and handshake.early_welcome(challenge, "s3cret") is None
    srv = start_server()
    try:
        with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as sock:
            (challenge,) = _frames(sock, 1)
            hello, nonce = handshake.answer_challenge(challenge, None, {"job": "old"}, "server")
            sock.sendall(raw_frame(hello))
            (welcome,) = _frames(sock, 1)
            assert handshake.check_welcome(welcome, None, nonce, "server")["store"] == STORE_PROTOCOL
            sock.sendall(raw_frame(["add", 1, "n", 2]))
            assert _frames(sock, 1) == [[1, 2]]
    finally:
        srv.stop()


@pytest.mark.timeout(60)
async def test_thousands_of_waits_on_one_key_take_no_task_and_leave_nothing_behind():
    """torch's barrier idiom: every rank waits on one key. Each waiting request is parked on
    its key (no server task); one that times out, or whose connection goes, leaves no waiter."""
    from arendez_server.app import Server, ServerConfig

    srv = Server(ServerConfig(port=0))
    await srv.start()
    st = await dist.Store("127.0.0.1", srv.port, "w", timeout=30).connect()
    other = await dist.Store("127.0.0.1", srv.port, "w", timeout=30).connect()
    try:
        waits = [asyncio.ensure_future(st.get("go")) for _ in range(2000)]
        gone = asyncio.ensure_future(other.multi_get(["go", "never"]))
        for _ in range(200):
            await asyncio.sleep(0.02)
            if len(srv.waits.waiters.get(("w", "go"), ())) == 2001:
                break
        assert len(srv.waits.waiters[("w", "go")]) == 2001
        assert not [t for t in asyncio.all_tasks() if t.get_coro().__qualname__ == "Server._blocking"]
        with pytest.raises(StoreTimeoutError, match="wait"):
            await st.wait(["never"], timeout=0.2)
        await other.close()  # its multi_get is withdrawn with its connection
        for _ in range(200):
            await asyncio.sleep(0.02)
            if len(srv.waits.waiters.get(("w", "go"), ())) == 2000:
                break
        assert len(srv.waits.waiters[("w", "go")]) == 2000
        assert gone.done() and isinstance(gone.exception(), StoreError)
        await st.set("go", "1")
        assert await asyncio.gather(*waits) == [b"1"] * 2000
        assert srv.waits.waiters == {}
    finally:
        for fut in waits:
            fut.cancel()
        await st.close()
        await srv.close()


@pytest.mark.timeout(60)
async def test_barrier_callers_wait_without_a_task_and_leave_nothing_behind():
    """``Store.barrier`` (torch's ``TCPStore.barrier``): a thousand callers wait on the key
    with no server task; one that times out or whose connection goes stays counted and
    leaves no waiter; the last arrival lets them all go on, and the server holds nothing."""
    from arendez_server.app import Server, ServerConfig

    srv = Server(ServerConfig(port=0))
    await srv.start()
    st = await dist.Store("127.0.0.1", srv.port, "b", timeout=30).connect()
    other = await dist.Store("127.0.0.1", srv.port, "b", timeout=30).connect()
    waits: list[asyncio.Future[None]] = []
    try:
        waits = [asyncio.ensure_future(st.barrier("meet", 1003)) for _ in range(1000)]
        gone = asyncio.ensure_future(other.barrier("meet", 1003))
        for _ in range(200):
            await asyncio.sleep(0.02)
            if len(srv.barriers[("b", "meet")].waiting) == 1001:
                break
        assert len(srv.barriers[("b", "meet")].waiting) == 1001
        assert not [t for t in asyncio.all_tasks() if t.get_coro().__qualname__ == "Server._blocking"]
        with pytest.raises(StoreTimeoutError, match=r"barrier\('meet', 1003\) timed out"):
            await st.barrier("meet", 1003, timeout=0.2)
        await other.close()  # its barrier is withdrawn with its connection
        for _ in range(200):
            await asyncio.sleep(0.02)
            if len(srv.barriers[("b", "meet")].waiting) == 1000:
                break
        assert len(srv.barriers[("b", "meet")].waiting) == 1000
        assert gone.done() and isinstance(gone.exception(), StoreError)
        assert await st.get("meet") == b"1002"  # (both that gave up are counted)
        await st.barrier("meet", 1003)  # the last arrival goes on at once, and frees them all
        await asyncio.gather(*waits)
        assert await st.get("meet") == b"1003"
        assert srv.barriers == {} and srv.waits.waiters == {}
        with pytest.raises(StoreError, match="barrier count must be a 64-bit integer, got 'x'"):
            await st._ask("barrier", 5, True, "meet", "x")
        with pytest.raises(StoreError, match=r"store key must be a string, got \['meet'\]"):
            await st._ask("barrier", 5, True, ["meet"], 2)  # (QA25-F5: it closed the connection)
        assert await st.get("meet") == b"1003"  # (the connection goes on)
    finally:
        for fut in waits:
            fut.cancel()
        await st.close()
        await srv.close()
