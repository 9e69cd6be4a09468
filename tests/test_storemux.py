"""Many ``TCPStore`` clients of one process share a few connections (``arendez.storemux``):
the server sees a handful of connections for hundreds of thread-ranks, a lost server fails the
calls in flight and the next ones reconnect, and a forked child gets connections of its own."""

from __future__ import annotations

import contextlib
import datetime
import itertools
import math
import os
import subprocess
import textwrap
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

import arendez.storemux as storemux
import arendez.sync as sync
from arendez.errors import LimitError, StoreConnectionError, StoreError, StoreTimeoutError
from arendez.storemux import CLIENTS_PER_CONNECTION
from tests.harness import PY, ROOT, _env, server, start_server

TIMEOUT = datetime.timedelta(seconds=20)


def _sockets(pid: int) -> int:
    """How many sockets process ``pid`` holds open."""
    fds = os.listdir(f"/proc/{pid}/fd")
    count = 0
    for fd in fds:
        with contextlib.suppress(OSError):  # (closed meanwhile)
            count += os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:")
    return count


@pytest.mark.timeout(90)
def test_hundreds_of_thread_ranks_share_a_few_connections() -> None:
    """600 thread-ranks run torch's rendezvous idiom (add, set, the last one sets ``done``,
    wait, multi_get of the neighbours): all finish with the right values while the server holds
    16 connections of their own plus one per 128 shared clients, not 600."""
    n, own = 600, 16
    with server() as srv:
        before = _sockets(srv.proc.pid)
        stores: list[sync.TCPStore] = []
        guard = threading.Lock()
        start = threading.Barrier(n)

        def rank(i: int) -> list[bytes]:
            store = sync.TCPStore("127.0.0.1", srv.port, None, False, TIMEOUT)
            with guard:
                stores.append(store)
            start.wait()
            r = store.add("count", 1) - 1
            store.set(f"addr/{r}", f"host{r}")
            if r == n - 1:
                store.set("done", "1")
            store.wait(["done"])
            keys = [f"addr/{(r - 1) % n}", f"addr/{(r + 1) % n}"]
            got = store.multi_get(keys)
            assert got == [f"host{(r - 1) % n}".encode(), f"host{(r + 1) % n}".encode()]
            return got

        with ThreadPoolExecutor(n) as pool:
            results = list(pool.map(rank, range(n)))
        assert len(results) == n
        held = _sockets(srv.proc.pid) - before
        shared = math.ceil((n - own) / CLIENTS_PER_CONNECTION)
        # each connection is one socket (TCP, or the server's local socket for the own ones)
        assert held <= own + shared + 2, (held, own, shared)
        for store in stores:
            store.close()


@pytest.mark.timeout(60)
def test_a_lost_server_fails_the_waiting_calls_and_the_next_calls_reconnect(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("ARENDEZ_TCPSTORE_OWN_CONNECTIONS", "0")
    srv = start_server()
    try:
        stores = [sync.TCPStore("127.0.0.1", srv.port, None, False, TIMEOUT) for _ in range(3)]
        stores[0].set("k", "v")
        with ThreadPoolExecutor(3) as pool:
            waits = [pool.submit(s.wait, ["never"]) for s in stores]
            with pytest.raises(TimeoutError):
                waits[0].result(timeout=0.3)  # they wait on the server
            srv.proc.kill()
            srv.proc.wait()
            for w in waits:  # in flight when the server died: failed, not left hanging
                with pytest.raises(StoreConnectionError, match="lost the connection to the store"):
                    w.result(timeout=10)
        port = srv.port
        srv = start_server(port=port)  # the same address again: the loop thread reconnects
        stores[1].set("k2", "v2")  # (a new server: the old keys are gone)
        assert stores[2].get("k2") == b"v2"
        stores[0].set_timeout(datetime.timedelta(seconds=0.3))
        with pytest.raises(StoreTimeoutError, match=r"not satisfied within 0\.3s"):
            stores[0].get("missing")
        for s in stores:
            s.close()
    finally:
        srv.stop()


@pytest.mark.timeout(60)
def test_an_oversized_value_is_refused_naming_the_limit_and_the_client_goes_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("ARENDEZ_TCPSTORE_OWN_CONNECTIONS", "0")
    with server() as srv:
        store = sync.TCPStore("127.0.0.1", srv.port, None, False, TIMEOUT)
        with pytest.raises(StoreError, match=r"exceeds the server's limit of \d+ bytes per request"):
            store.set("big", b"x" * (2 << 20))
        store.set("small", "ok")
        assert store.get("small") == b"ok"
        store.close()


@pytest.mark.timeout(60)
def test_a_forked_child_gets_shared_connections_of_its_own() -> None:
    """A fork copies no loop thread: the child's shared clients connect again from its own."""
    with server() as srv:
        code = textwrap.dedent(
            f"""
            import datetime, os, sys
            os.environ["ARENDEZ_TCPSTORE_OWN_CONNECTIONS"] = "0"
            import arendez.sync as sync
            t = datetime.timedelta(seconds=20)
            store = sync.TCPStore("127.0.0.1", {srv.port}, None, False, t)
            store.set("parent", "1")
            pid = os.fork()
            if pid == 0:
                store.set("child", "2")
                other = sync.TCPStore("127.0.0.1", {srv.port}, None, False, t)
                print("child", other.get("parent").decode(), flush=True)
                os._exit(0)
            os.waitpid(pid, 0)
            print("parent", store.get("child").decode(), flush=True)
            """
        )
        out = subprocess.run(
            [PY, "-c", code], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=45
        )
        assert out.returncode == 0, out.stderr[-3000:]
        assert "child 1" in out.stdout and "parent 2" in out.stdout, out.stdout


@pytest.mark.timeout(120)
def test_1000_thread_ranks_of_the_plain_tcpstore_idiom_all_meet() -> None:
    """The short version of ``benchmarks/tcpstore_threads.py``: a master ``TCPStore`` in its own
    process, 1,000 thread-ranks over 2 processes started in a loop; every rank adds, sets, waits
    for the last one's ``done`` and reads its neighbour's address, none fails."""
    proc = subprocess.run(
        [PY, str(ROOT / "benchmarks" / "tcpstore_threads.py"), "--backends", "arendez",
         "--worlds", "1000", "--procs", "2", "--repeat", "1", "--timeout", "60"],
        capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=110,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| 1000 | 1 | — |" in proc.stdout and "| — / 0 |" in proc.stdout, proc.stdout + proc.stderr


def _promotable(monkeypatch: pytest.MonkeyPatch, after: int, most: int) -> None:
    monkeypatch.setenv("ARENDEZ_TCPSTORE_OWN_CONNECTIONS", "0")
    monkeypatch.setattr(storemux, "PROMOTE_AFTER", after)
    monkeypatch.setattr(storemux, "MAX_PROMOTED", most)
    monkeypatch.setattr(storemux, "_promotions", True)
    monkeypatch.setattr(storemux, "_promoted", itertools.count())


@pytest.mark.timeout(60)
def test_a_busy_client_gets_a_connection_of_its_own_up_to_the_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    """A shared client that keeps calling opens its own connection (the direct path) after
    ``PROMOTE_AFTER`` calls; past ``MAX_PROMOTED`` of them the others stay shared."""
    _promotable(monkeypatch, after=5, most=1)
    with server() as srv:
        before = _sockets(srv.proc.pid)
        busy, other = (sync.TCPStore("127.0.0.1", srv.port, None, False, TIMEOUT) for _ in range(2))
        busy.set("a", "0")
        assert _sockets(srv.proc.pid) - before == 1  # both on one shared connection
        for i in range(10):
            busy.set("a", str(i))
            assert busy.add("n", 1) == i + 1
        assert _sockets(srv.proc.pid) - before == 2  # the busy one on its own now
        for i in range(10):
            other.set("b", str(i))
        assert _sockets(srv.proc.pid) - before == 2  # the cap: the other stays shared
        assert other.get("a") == b"9" and busy.get("b") == b"9" and other.add("n", 0) == 10
        busy.close()
        other.close()


@pytest.mark.timeout(60)
def test_a_client_refused_its_own_connection_stays_on_the_shared_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """The server's connection limit refuses the promotion: the calls go on over the shared
    connection, nothing fails, and the process stops asking."""
    _promotable(monkeypatch, after=3, most=100)
    with server("--max-connections", "1") as srv:
        store = sync.TCPStore("127.0.0.1", srv.port, None, False, TIMEOUT)
        for i in range(8):
            store.set("k", str(i))
        assert store.get("k") == b"7"
        assert storemux._promotions is False
        store.close()


def test_answered_callers_are_woken_one_at_a_time_in_order() -> None:
    """The loop thread wakes the first caller whose answer came; each woken caller wakes the
    next (woken all at once, hundreds of threads waited for the GIL together: most of the
    clients' CPU at 10,000 thread-ranks). A caller that gave up is skipped; one whose turn came
    as it gave up passes it on."""
    wakeups = storemux._Wakeups()
    replies = [storemux._Reply() for _ in range(4)]

    def woken() -> list[bool]:
        state = []
        for reply in replies:
            got = reply.lock.acquire(blocking=False)
            if got:
                reply.lock.release()
            state.append(got)
        return state

    for reply in replies:
        wakeups.finished(reply)
    assert woken() == [True, False, False, False]
    assert not wakeups.withdraw(replies[2])  # (queued, never woken: it leaves the queue)
    replies[0].lock.acquire()
    wakeups.pass_on()
    assert woken() == [False, True, False, False]
    replies[1].lock.acquire()
    wakeups.pass_on()  # (skips the withdrawn one)
    assert woken() == [False, False, False, True]
    assert wakeups.withdraw(replies[3])  # its turn came as it gave up: it must pass it on
    wakeups.pass_on()
    late = storemux._Reply()
    wakeups.finished(late)  # nobody running: woken at once
    assert late.lock.acquire(blocking=False)


@pytest.mark.timeout(90)
def test_callers_that_time_out_do_not_stall_the_others() -> None:
    """Callers waiting on a missing key time out while others' answers keep coming: no turn is
    left with a caller that has gone."""
    with server() as srv:
        short = datetime.timedelta(seconds=0.3)
        clients = [
            sync.TCPStore("127.0.0.1", srv.port, None, False, short if i % 4 == 0 else TIMEOUT)
            for i in range(40)
        ]

        def work(i: int) -> str:
            store = clients[i]
            if i % 4 == 0:
                try:
                    store.get(f"missing-{i}")
                except StoreTimeoutError:
                    return "timed out"
                return "found"
            for k in range(30):
                store.set(f"k{i}", str(k))
                assert store.get(f"k{i}") == str(k).encode()
            return "ok"

        with ThreadPoolExecutor(40) as pool:
            outcomes = list(pool.map(work, range(40)))
        assert outcomes == ["timed out" if i % 4 == 0 else "ok" for i in range(40)]


@pytest.mark.timeout(60)
def test_a_shared_clients_set_does_not_wait_and_its_error_reaches_its_next_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A ``set`` over a shared connection returns once handed on (torch's waits for no answer);
    the client's later calls see the value, and a refused set is raised by a later call."""
    _promotable(monkeypatch, after=10**6, most=0)  # (it stays on the shared connection)
    with server("--max-keys-per-job", "100") as srv:
        client = sync.TCPStore("127.0.0.1", srv.port, None, False, TIMEOUT)
        assert isinstance(client._store, storemux.SharedStoreClient)
        room = 100 - client.num_keys()
        for i in range(room):  # (fills the job)
            client.set(f"k{i}", str(i))
        assert client.get(f"k{room - 1}") == str(room - 1).encode()
        client.set("one too many", "x")
        outcomes = []
        for _ in range(3):  # (the first call that starts once the answer came raises it, once)
            try:
                outcomes.append(client.get("k0"))
            except LimitError as exc:  # (the refusal's own class)
                outcomes.append(str(exc))
        refused = [o for o in outcomes if isinstance(o, str)]
        assert len(refused) == 1 and "an earlier set of 'one too many' failed" in refused[0], outcomes
        assert "max-keys-per-job" in refused[0] and outcomes[-1] == b"0", outcomes
        client.close()


@pytest.mark.timeout(60)
def test_a_shared_client_fails_at_once_while_the_server_is_away_and_works_once_it_is_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """QA: after the server died, each call of a shared client (the 17th+ TCPStore of a
    process) waited its whole timeout; torch's TCPStore and the own-connection client fail at
    once. A call made while the connection is down fails now; one after the server is back
    (the loop thread reconnects in the background) succeeds."""
    _promotable(monkeypatch, after=10**6, most=0)  # (it stays on the shared connection)
    srv = start_server()
    port = srv.port
    client = sync.TCPStore("127.0.0.1", port, None, False, TIMEOUT)
    try:
        assert isinstance(client._store, storemux.SharedStoreClient)
        client.set("k", "v")
        assert client.get("k") == b"v"
        srv.stop()
        for _ in range(2):
            started = time.monotonic()
            with pytest.raises(StoreConnectionError, match="lost the connection to the store"):
                client.get("k")
            assert time.monotonic() - started < 5.0  # (not the store's 20 s timeout)
        srv = start_server(port=port)  # the same address again
        for _ in range(100):  # (the reconnection runs in the background: at most 10 s)
            try:
                client.set("back", "yes")
                assert client.get("back") == b"yes"
                break
            except StoreConnectionError:
                time.sleep(0.1)
        else:
            raise AssertionError("the shared client did not reconnect to the restarted server")
    finally:
        client.close()
        srv.stop()


@pytest.mark.timeout(60)
def test_a_shared_clients_wait_for_the_key_of_a_refused_set_raises_the_refusal_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """QA: 200 threads whose sets hit the key limit got 20 s StoreTimeoutErrors from their next
    ``get`` of those keys and not one LimitError."""
    _promotable(monkeypatch, after=10**6, most=0)  # (it stays on the shared connection)
    with server("--max-keys-per-job", "3") as srv:
        client = sync.TCPStore("127.0.0.1", srv.port, None, False, TIMEOUT)
        assert isinstance(client._store, storemux.SharedStoreClient)
        room = 3 - client.num_keys()
        for i in range(room):
            client.set(f"k{i}", str(i))
        client.set("refused", "x")
        started = time.monotonic()
        with pytest.raises(LimitError, match=r"an earlier set of 'refused' failed: .*max-keys-per-job"):
            client.get("refused")
        assert time.monotonic() - started < 5.0  # (not the store's 20 s timeout)
        assert client.get("k0") == b"0"  # (the abandoned get's late answer is ignored)
        client.close()


_EXIT_RIGHT_AFTER_SET = """
import datetime, os, sys
import arendez.sync as sync
port, key = int(sys.argv[1]), sys.argv[2]
clients = [sync.TCPStore("127.0.0.1", port, None, False, datetime.timedelta(seconds=20)) for _ in range(20)]
assert type(clients[-1]._store).__name__ == "SharedStoreClient"
clients[-1].set(key, "kept")
os._exit(0)  # (no exit hooks: what is not yet written is lost)
"""


@pytest.mark.timeout(90)
def test_a_shared_clients_set_is_written_before_it_returns_so_an_exit_right_after_keeps_it() -> None:
    """QA20: a process whose 17th+ client set a key and exited at once (``os._exit``, a kill)
    lost the set in 10 of 10 trials, and the job waited for the key until its timeout; torch's
    ``set`` returns once its bytes are the kernel's, and so does this one now."""
    with server() as srv:
        reader = sync.TCPStore("127.0.0.1", srv.port, None, False, datetime.timedelta(seconds=5))
        for trial in range(5):
            child = subprocess.run(
                [PY, "-c", _EXIT_RIGHT_AFTER_SET, str(srv.port), f"key{trial}"],
                env=_env(None),
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert child.returncode == 0, child.stderr
            assert reader.get(f"key{trial}") == b"kept", trial
        reader.close()


@pytest.mark.timeout(60)
def test_a_new_shared_client_waits_for_a_server_that_is_away_as_torchs_constructor_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """QA20: with the server down, a new client on a shared connection returned at once and its
    first call failed; torch's constructor retries until the server is back (or its timeout)."""
    monkeypatch.setenv("ARENDEZ_TCPSTORE_OWN_CONNECTIONS", "0")
    srv = start_server()
    port = srv.port
    holders = [sync.TCPStore("127.0.0.1", port, None, False, TIMEOUT) for _ in range(3)]
    restarted: list[object] = []
    try:
        assert isinstance(holders[0]._store, storemux.SharedStoreClient)
        holders[0].set("before", "1")
        srv.stop()
        time.sleep(0.5)  # (the loop thread sees the connection close)
        back = threading.Timer(1.5, lambda: restarted.append(start_server(port=port)))
        back.start()
        started = time.monotonic()
        late = sync.TCPStore("127.0.0.1", port, None, False, TIMEOUT)
        waited = time.monotonic() - started
        back.join()
        assert waited >= 1.0, f"the constructor returned after {waited:.2f}s, before the server was back"
        late.set("after", "2")
        assert late.get("after") == b"2"
        restarted.pop().stop()  # type: ignore[attr-defined]
        time.sleep(0.5)
        started = time.monotonic()
        with pytest.raises(StoreError, match="unreachable until the deadline"):
            sync.TCPStore("127.0.0.1", port, None, False, datetime.timedelta(seconds=1))
        assert time.monotonic() - started >= 0.9  # (its own timeout, as torch's)
    finally:
        for s in holders:
            s.close()
        for other in restarted:
            other.stop()  # type: ignore[attr-defined]
