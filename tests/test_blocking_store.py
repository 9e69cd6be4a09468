"""The blocking store client against a real arendez-server process."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import pytest

import arendez as dist
from arendez.blocking_store import BlockingStore
from arendez.errors import AuthenticationError, LimitError, StoreError, StoreTimeoutError
from tests.harness import server, start_server


@pytest.mark.timeout(30)
def test_ops_and_errors(arendez_server):
    with BlockingStore("127.0.0.1", arendez_server.port, "bjob", timeout=10) as st:
        st.set("a", "1")
        assert st.get("a") == b"1"
        assert st.add("n", 5) == 5
        assert st.add("n", -2) == 3
        assert st.compare_set("c", "", "x") == b"x"
        assert st.compare_set("c", "nope", "y") == b"x"
        assert st.check(["a", "c"]) is True
        assert st.num_keys() == 3
        assert st.delete("a") is True
        assert st.check(["a"]) is False
        with pytest.raises(StoreError, match="does not hold an integer"):
            st.add("c", 1)  # the server's error reaches the caller
        assert st.get("c") == b"x"  # and the connection is still usable


@pytest.mark.timeout(30)
def test_get_and_wait_time_out_then_succeed_across_clients(arendez_server):
    with BlockingStore("127.0.0.1", arendez_server.port, "bjob2") as st:
        t0 = time.monotonic()
        with pytest.raises(StoreTimeoutError):
            st.get("late", timeout=0.3)
        with pytest.raises(StoreTimeoutError):
            st.wait(["late"], timeout=0.3)
        assert time.monotonic() - t0 < 3.0

        def later() -> None:
            time.sleep(0.2)
            with BlockingStore("127.0.0.1", arendez_server.port, "bjob2") as other:
                other.set("late", "here")

        t = threading.Thread(target=later)
        t.start()
        assert st.get("late", timeout=10) == b"here"  # blocks until another client sets it
        t.join()


@pytest.mark.timeout(30)
async def test_shares_keys_with_the_async_client(arendez_server):
    a = await dist.Store("127.0.0.1", arendez_server.port, "mixed", timeout=10).connect()
    try:
        b = BlockingStore("127.0.0.1", arendez_server.port, "mixed", timeout=10)
        await asyncio.to_thread(b.set, "k", b"v")
        assert await a.get("k") == b"v"
        assert await a.add("ctr", 2) == 2
        assert await asyncio.to_thread(b.add, "ctr", 1) == 3
        b.close()
    finally:
        await a.close()


@pytest.mark.timeout(30)
def test_server_loss_fails_the_call_and_the_next_call_reconnects():
    srv = start_server()
    port = srv.port
    st = BlockingStore("127.0.0.1", port, "lost", timeout=10).connect()
    try:
        st.set("x", "1")
        os.killpg(srv.proc.pid, signal.SIGKILL)
        srv.proc.wait(5)
        t0 = time.monotonic()
        with pytest.raises(StoreError, match=r"lost the connection|unreachable"):
            st.get("x", timeout=5)
        assert time.monotonic() - t0 < 3.0
        with pytest.raises(StoreError, match="unreachable"):
            st.set("x", "2")
        srv = start_server(port=port)
        st.set("x", "3")  # reopened on the next call
        assert st.get("x") == b"3"
    finally:
        st.close()
        srv.stop()


@pytest.mark.timeout(30)
def test_a_wait_the_server_never_answers_names_the_callers_timeout():
    """A stalled server (SIGSTOP: the connection stays up) cannot answer even that the wait
    timed out: the client gives it 1 s more, then names the caller's timeout (QA4-F7)."""
    srv = start_server()
    st = BlockingStore("127.0.0.1", srv.port, "stalled", timeout=10).connect()
    try:
        os.killpg(srv.proc.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(
            StoreTimeoutError, match=r"store wait timed out: not satisfied within 0.5s, and no answer"
        ) as caught:
            st.wait(["never"], timeout=0.5)
        assert f"127.0.0.1:{srv.port} 1s past that" in str(caught.value)
        assert 0.5 <= time.monotonic() - t0 < 5.0
    finally:
        os.killpg(srv.proc.pid, signal.SIGCONT)
        st.close()
        srv.stop()


@pytest.mark.timeout(30)
def test_token_is_checked(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("tok-1\n")
    with server("--token-file", str(token_file)) as srv:
        with BlockingStore("127.0.0.1", srv.port, "t", token="tok-1") as st:
            st.set("a", "b")
            assert st.get("a") == b"b"
        with pytest.raises(AuthenticationError):
            BlockingStore("127.0.0.1", srv.port, "t", token="wrong").connect()
        with pytest.raises(AuthenticationError, match=rf"127\.0\.0\.1:{srv.port} requires a token and none"):
            BlockingStore("127.0.0.1", srv.port, "t").connect()
    with server() as srv:  # a token given to a server that checks none
        refused = rf"127\.0\.0\.1:{srv.port} runs without a token"
        with pytest.raises(AuthenticationError, match=refused):
            BlockingStore("127.0.0.1", srv.port, "t", token="tok-1").connect()


@pytest.mark.timeout(30)
def test_a_connection_closed_during_the_handshake_is_a_store_connection_error():
    """A server that closes a connection mid-handshake (it gave up on a late hello) is a
    ``StoreConnectionError`` naming the handshake: what ``TCPStore`` retries, not a raw OSError."""
    import socket

    from arendez.errors import StoreConnectionError

    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def close_each() -> None:
        conn, _ = listener.accept()
        conn.close()

    closer = threading.Thread(target=close_each, daemon=True)
    closer.start()
    try:
        st = BlockingStore("127.0.0.1", port, "j", connect_timeout=5)
        with pytest.raises(StoreConnectionError, match="closed the connection during the handshake"):
            st.connect()
    finally:
        listener.close()
        closer.join(5)


@pytest.mark.timeout(30)
def test_the_connect_timeout_bounds_the_whole_handshake(tmp_path):
    """A server whose every frame comes late (here through a relay that holds each for 0.7 s)
    gets one deadline for the connect and both handshake frames: a 1 s connect gives up after
    about 1 s. Before, each frame had the whole budget, and this connect took 1.4 s and
    succeeded."""
    import socket

    from arendez.errors import StoreConnectionError

    token_file = tmp_path / "token"
    token_file.write_text("tok\n")
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    stop = threading.Event()

    def pump(src: socket.socket, dst: socket.socket, delay: float) -> None:
        try:
            while not stop.is_set() and (data := src.recv(65536)):
                time.sleep(delay)
                dst.sendall(data)
        except OSError:
            pass

    def relay(srv_port: int) -> None:
        client, _ = listener.accept()
        upstream = socket.create_connection(("127.0.0.1", srv_port))
        threading.Thread(target=pump, args=(client, upstream, 0.0), daemon=True).start()
        pump(upstream, client, 0.7)
        client.close()
        upstream.close()

    with server("--token-file", str(token_file)) as srv:
        relayer = threading.Thread(target=relay, args=(srv.port,), daemon=True)
        relayer.start()
        st = BlockingStore("127.0.0.1", port, "slow", token="tok", connect_timeout=1.0)
        started = time.monotonic()
        try:
            with pytest.raises(StoreConnectionError, match="did not answer the handshake"):
                st.connect()
            assert time.monotonic() - started < 1.3
        finally:
            stop.set()
            st.close()
            listener.close()
            relayer.join(5)


@pytest.mark.timeout(30)
def test_set_does_not_wait_for_its_answer_and_its_error_reaches_the_next_call():
    """``set`` returns once sent (as torch's, which waits for no answer): a later call reads the
    answers, and each refused set's error is raised once, in order, by the next calls, naming
    its key (none is lost)."""
    with (
        server("--max-keys-per-job", "300") as srv,
        BlockingStore("127.0.0.1", srv.port, "unacked", timeout=10) as st,
    ):
        for i in range(290):  # (more than may go unanswered: one then waits for all)
            st.set(f"k{i}", str(i))
        assert st.get("k289") == b"289" and st.num_keys() == 290  # read your own writes
        for i in range(290, 305):
            st.set(f"k{i}", "x")  # the 301st key is refused by the server
        assert st.check(["k299"])  # (this call reads the refusals; its answer stands)
        for i in range(300, 305):  # (the refusals' own class: code catching LimitError sees it)
            with pytest.raises(LimitError, match=rf"an earlier set of 'k{i}' failed: .*max-keys-per-job"):
                st.get("k0")
        assert st.get("k0") == b"0"  # each raised once; the connection goes on


@pytest.mark.timeout(30)
def test_a_set_of_a_large_value_waits_so_its_refusal_is_raised_by_that_set():
    with (
        server("--max-bytes-per-job", str(100 << 10)) as srv,
        BlockingStore("127.0.0.1", srv.port, "large", timeout=10) as st,
    ):
        st.set("fits", b"x" * (64 << 10))  # (up to 64 KiB: returns once sent)
        with pytest.raises(LimitError, match=r"max-bytes-per-job"):
            st.set("too large", b"x" * (128 << 10))
        assert st.get("fits") == b"x" * (64 << 10) and st.num_keys() == 1


@pytest.mark.timeout(30)
def test_the_servers_store_bytes_bound_all_jobs_together():
    """Two jobs, each well within ``--max-bytes-per-job``, together past ``--max-store-bytes``."""
    with (
        server("--max-store-bytes", str(200 << 10)) as srv,
        BlockingStore("127.0.0.1", srv.port, "one", timeout=10) as one,
        BlockingStore("127.0.0.1", srv.port, "two", timeout=10) as two,
    ):
        one.set("a", b"x" * (150 << 10))
        with pytest.raises(LimitError, match=r"more than 204800 bytes .* --max-store-bytes"):
            two.set("b", b"y" * (100 << 10))
        assert one.delete("a") is True
        two.set("b", b"y" * (100 << 10))
        assert two.get("b") == b"y" * (100 << 10)


@pytest.mark.timeout(30)
def test_a_wait_for_the_key_of_a_refused_set_raises_the_refusal_at_once():
    """QA: ``get`` of a key whose ``set`` the server refused waited the whole timeout and
    raised a StoreTimeoutError that named no limit; a call that only waits for keys raises the
    refusal as soon as it reads it."""
    with (
        server("--max-keys-per-job", "2") as srv,
        BlockingStore("127.0.0.1", srv.port, "refused", timeout=20) as st,
    ):
        st.set("a", b"1")
        st.set("b", b"2")
        st.set("c", b"3")  # (the third key: refused)
        started = time.monotonic()
        with pytest.raises(LimitError, match=r"an earlier set of 'c' failed: .*max-keys-per-job"):
            st.get("c")
        assert time.monotonic() - started < 5.0  # (not the 20 s timeout)
        assert st.get("b") == b"2" and st.num_keys() == 2  # (the abandoned get's answer is skipped)
