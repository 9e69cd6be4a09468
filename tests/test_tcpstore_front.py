"""torch's own TCPStore client on ``arendez-server --tcpstore-port``: every operation answers as
torch's server does, its keys are those of ``arendez.sync.TCPStore``, torchrun's ``c10d``
rendezvous and gloo run on it, and a client that breaks the protocol or a limit is closed, named
in the log, without the server holding what it announced."""

from __future__ import annotations

import asyncio
import re
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
from arendez_server import tcpstore_wire as tw  # noqa: E402
from arendez_server.app import Server, ServerConfig  # noqa: E402
from arendez_server.tcpstore_front import client_key, store_key  # noqa: E402
from torch.distributed import TCPStore  # noqa: E402

import arendez.sync  # noqa: E402
from arendez.errors import LimitError, ProtocolError, StoreTimeoutError  # noqa: E402
from tests.harness import PY, ServerProcess, start_server  # noqa: E402

SCRIPTS = Path(__file__).parent / "scripts"


@pytest.fixture
def tcpstore_server() -> Iterator[tuple[ServerProcess, int]]:
    """A real ``arendez-server`` with a TCPStore port: (the server, that port)."""
    srv = start_server("--tcpstore-port", "0")
    try:
        assert srv.proc.stdout is not None
        line = srv.proc.stdout.readline()
        assert "TCPStore clients on" in line, line
        yield srv, int(line.rsplit(":", 1)[1])
    finally:
        srv.stop()


def _client(port: int, timeout: float = 5.0) -> Any:
    limit = timedelta(seconds=timeout)
    return TCPStore("127.0.0.1", port, is_master=False, timeout=limit, wait_for_workers=False)


def _outcomes(store: Any) -> list[tuple[str, Any]]:
    """Every TCPStore operation, as a user calls them: each result, or the exception's type."""
    steps: list[tuple[str, Callable[[], Any]]] = [
        ("set", lambda: store.set("k", b"v")),
        ("get", lambda: store.get("k")),
        ("add", lambda: store.add("c", 5)),
        ("add again", lambda: store.add("c", -2)),
        ("compare_set hit", lambda: store.compare_set("k", b"v", b"w")),
        ("compare_set miss", lambda: store.compare_set("k", b"v", b"x")),
        ("compare_set absent", lambda: store.compare_set("m", b"x", b"y")),
        ("compare_set absent, empty expected", lambda: store.compare_set("n", b"", b"z")),
        ("check", lambda: (store.check(["k", "c"]), store.check(["k", "absent"]), store.check([]))),
        ("wait present", lambda: store.wait(["k", "c"])),
        ("wait timeout", lambda: store.wait(["absent"], timedelta(milliseconds=200))),
        ("usable after the timeout", lambda: store.get("n")),
        ("num_keys", lambda: store.num_keys()),
        ("delete", lambda: (store.delete_key("n"), store.delete_key("n"))),
        ("append", lambda: (store.append("a", b"12"), store.append("a", b"34"), store.get("a"))),
        ("multi_set", lambda: store.multi_set(["x", "y"], [b"1", b""])),
        ("multi_get", lambda: store.multi_get(["a", "c", "x", "y"])),
        ("multi_get none", lambda: store.multi_get([])),
        ("queue", lambda: (store.queue_push("q", b"1"), store.queue_push("q", b"2"), store.queue_len("q"))),
        ("queue_pop", lambda: (store.queue_pop("q"), store.queue_pop("q"), store.queue_len("q"))),
        ("queue_pop empty", lambda: store.queue_pop("q", block=False)),
        ("list_keys", lambda: sorted(store.list_keys())),
        ("binary value", lambda: (store.set("bin", bytes(range(256))), store.get("bin"))),
        ("unicode key", lambda: (store.set("ключ", b"u"), store.get("ключ"))),
        ("barrier of one", lambda: (store.barrier("b", 1), store.barrier("b", 1), store.get("b"))),
        ("barrier timeout", lambda: store.barrier("bt", 2, timedelta(milliseconds=200))),
        ("usable after a barrier timeout", lambda: (store.get("bt"), store.add("bt", 0))),
        ("barrier on a value", lambda: (store.set("bv", b"x"), store.barrier("bv", 1))),
        ("get absent", lambda: (store.set_timeout(timedelta(milliseconds=200)), store.get("never"))),
    ]
    out: list[tuple[str, Any]] = []
    for name, step in steps:
        try:
            out.append((name, step()))
        except Exception as exc:
            out.append((name, type(exc).__name__))
    return out


@pytest.mark.timeout(60)
def test_torch_client_gets_the_answers_of_torch_server(tcpstore_server: tuple[ServerProcess, int]) -> None:
    _, port = tcpstore_server
    master = TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=5), wait_for_workers=False)
    want = _outcomes(_client(master.port))
    got = _outcomes(_client(port))
    assert got == want
    assert dict(got)["wait timeout"] == "DistStoreError"  # (the run did reach the failures)
    assert dict(got)["queue_pop empty"] == "QueueEmptyError"


def _barrier_outcomes(
    port: int, client: Callable[[int], Any] = _client, run: str = ""
) -> list[tuple[str, list[str]]]:
    """torch's ``barrier`` across clients (``client(port)``, torch's by default), each case in a
    fresh key (prefixed by ``run``: runs on one server share its keys until their clients are
    gone): who goes on and who times out. A later arrival starts once the earlier ones are
    counted (the key's counter)."""
    watcher = client(port)

    def counted(key: str, arrivals: int) -> None:
        while not (watcher.check([key]) and int(watcher.get(key)) >= arrivals):
            time.sleep(0.01)

    def case(key: str, counts: list[int], then: Callable[[str], Any] | None = None) -> list[str]:
        key, outcomes = run + key, [""] * len(counts)

        def arrive(i: int, store: Any) -> None:
            try:
                store.barrier(key, counts[i], timedelta(seconds=1))
                outcomes[i] = "passed"
            except Exception as exc:
                outcomes[i] = _timeout_named(exc)

        threads = []
        for i in range(len(counts)):
            threads.append(threading.Thread(target=arrive, args=(i, client(port))))
            threads[-1].start()
            counted(key, i + 1)
        if then is not None:
            then(key)
        for thread in threads:
            thread.join()
        return outcomes

    def plain_wait_then_short_arrival() -> list[str]:
        waiter, seen = client(port), []

        def wait() -> None:
            try:
                waiter.wait([run + "plain"], timedelta(seconds=1))
                seen.append("woken")
            except Exception as exc:
                seen.append(_timeout_named(exc))

        thread = threading.Thread(target=wait)
        thread.start()
        time.sleep(0.2)  # (the wait is on: a get of the key would not return)
        outcome = case("plain", [2])
        thread.join()
        return [*outcome, *seen]

    return [
        ("a plain wait on the key, an arrival short of its count", plain_wait_then_short_arrival()),
        ("all of two", case("two", [2, 2])),
        ("a later call of a larger count frees no one", case("larger", [2, 3])),
        ("a later call of a smaller count frees all", case("smaller", [3, 2])),
        ("freed by an add below the count", case("add", [5], lambda key: watcher.add(key, 1))),
        ("freed by a set", case("set", [5], lambda key: watcher.set(key, b"x"))),
        ("not by a delete", case("delete", [5], watcher.delete_key)),
    ]


def _timeout_named(exc: Exception) -> str:
    """One name for a timeout of either client (torch's ``DistStoreError``, arendez's
    ``StoreTimeoutError``); any other error by its type."""
    timed_out = isinstance(exc, torch.distributed.DistStoreError | StoreTimeoutError)
    return "timeout" if timed_out else type(exc).__name__


def _arendez_client(port: int) -> Any:
    return arendez.sync.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=5))


@pytest.mark.timeout(90)
def test_barrier_goes_as_on_torch_server(tcpstore_server: tuple[ServerProcess, int]) -> None:
    """torch's clients on the TCPStore port, and ``arendez.sync.TCPStore`` on the server's own
    protocol (the ``barrier`` request), go through each case as torch's clients on torch's server."""
    srv, port = tcpstore_server
    master = TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=5), wait_for_workers=False)
    want = _barrier_outcomes(master.port)
    assert _barrier_outcomes(port, run="torch-client/") == want
    assert _barrier_outcomes(srv.port, _arendez_client, run="arendez-client/") == want
    assert dict(want)["a later call of a larger count frees no one"] == ["timeout"] * 2


@pytest.mark.timeout(60)
def test_torch_client_names_a_key_per_rank_of_a_large_world_in_one_request(
    tcpstore_server: tuple[ServerProcess, int],
) -> None:
    """More keys in one request than arendez's own clients send (they split at 10,000): torch's
    client cannot split, and a rank 0 of a job of the server's largest world (65,536 ranks)
    waits on every rank's key, named as torch names them."""
    _, port = tcpstore_server
    store, n = _client(port), 65_536
    keys = [f"default_pg/0//rank_{r}" for r in range(n)]
    store.multi_set(keys, [str(r).encode() for r in range(n)])
    store.wait(keys, timedelta(seconds=20))
    assert store.check(keys)
    assert store.multi_get(keys) == [str(r).encode() for r in range(n)]
    assert store.get("default_pg/0//rank_65535") == b"65535"  # (the connection is still up)


@pytest.mark.timeout(60)
def test_torch_and_arendez_clients_meet_in_one_barrier(tcpstore_server: tuple[ServerProcess, int]) -> None:
    """A barrier of four: two torch clients and two ``arendez.sync.TCPStore`` ones; none goes
    on before the last arrives, and the key's counter is torch's (4)."""
    srv, port = tcpstore_server
    clients = [_client(port), _arendez_client(srv.port), _client(port), _arendez_client(srv.port)]
    counts: list[int] = []

    def meet(i: int) -> None:
        time.sleep(0.1 * i)  # (the first waits for the last)
        clients[i].barrier("mixed", 4, timedelta(seconds=10))
        counts.append(int(clients[i].get("mixed")))

    threads = [threading.Thread(target=meet, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert counts == [4, 4, 4, 4]


@pytest.mark.timeout(60)
def test_torch_and_arendez_clients_share_keys(tcpstore_server: tuple[ServerProcess, int]) -> None:
    """One key space for both clients: a value either sets the other reads, a torch ``wait``
    woken by an arendez ``set``, and torch's worker count (``init/``) is arendez's."""
    srv, port = tcpstore_server
    theirs = TCPStore("127.0.0.1", port, 2, False, timeout=timedelta(seconds=5))
    ours = arendez.sync.TCPStore("127.0.0.1", srv.port, 2, False, timeout=timedelta(seconds=5))
    theirs.set("from_torch", b"t")
    ours.set("from_arendez", b"a")
    assert ours.get("from_torch") == b"t"
    assert theirs.get("from_arendez") == b"a"
    assert sorted(theirs.list_keys()) == sorted(ours.list_keys()) == ["from_arendez", "from_torch"]
    assert ours._store.add("__arendez_tcpstore/workers", 0) == 2  # one each

    def later() -> None:
        time.sleep(0.3)
        ours.set("late", b"L")

    setter = threading.Thread(target=later)
    setter.start()
    started = time.monotonic()
    assert theirs.get("late") == b"L"
    assert time.monotonic() - started >= 0.25  # it waited for the set
    setter.join()


@pytest.mark.timeout(150)
def test_torchrun_c10d_and_gloo_run_on_the_server_run_after_run(
    tcpstore_server: tuple[ServerProcess, int],
) -> None:
    """``torchrun --rdzv-backend c10d --rdzv-endpoint`` this server, twice with torch's default
    run id: the rendezvous and the store torch's workers share for gloo live on it (the agent
    cannot bind the port, so it connects), and its keys go with the run's last client, so the
    next run starts afresh (it met the last run's closed rendezvous: RendezvousClosedError)."""
    srv, port = tcpstore_server
    argv = [PY, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2"]
    argv += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}"]
    argv += [str(SCRIPTS / "gloo_sum.py")]
    for run in range(2):
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
        assert done.returncode == 0, f"run {run}: {done.stderr[-3000:]}"
        # (the workers share torchrun's stdout: their lines may run together)
        assert sorted(re.findall(r"RANK \d SUM [\d.]+", done.stdout)) == ["RANK 0 SUM 3.0", "RANK 1 SUM 3.0"]
    ours = arendez.sync.TCPStore("127.0.0.1", srv.port, timeout=timedelta(seconds=5))
    assert ours.list_keys() == []


@pytest.mark.timeout(10)
def test_key_mapping() -> None:
    assert store_key(b"/a/b") == "a/b"
    assert client_key("a/b") == "/a/b"
    assert store_key(b"init/") == "__arendez_tcpstore/workers"
    assert client_key("__arendez_tcpstore/workers") == "init/"
    with pytest.raises(ProtocolError, match="lacks the '/'"):
        store_key(b"plain")
    with pytest.raises(ProtocolError, match="not UTF-8"):
        store_key(b"/\xff")


@pytest.mark.timeout(10)
def test_a_key_list_has_a_bound_of_its_own() -> None:
    """A request naming keys may be longer than one with a value (``max_list_request``), and
    past its own bound it is refused by its length, naming the bound."""
    reader = tw.RequestReader(100, 10, 500)
    keys = [b"/" + bytes([97 + i]) * 30 for i in range(8)]  # 8 keys, 8 x 39 bytes with lengths
    reader.feed(bytes([tw.Query.WAIT]) + struct.pack("<Q", 8) + b"".join(tw.blob(k) for k in keys))
    assert reader.next() == (tw.Query.WAIT, keys)  # (over 100 bytes, within 500)
    reader.feed(bytes([tw.Query.SET]) + tw.blob(b"/k") + tw.blob(b"v" * 200))
    with pytest.raises(
        LimitError, match=r"more than 100 bytes \(the server's limit: its largest value and key"
    ):
        reader.next()
    reader = tw.RequestReader(100, 10, 500)
    reader.feed(bytes([tw.Query.WAIT]) + struct.pack("<Q", 2) + tw.blob(b"/a") + struct.pack("<Q", 600))
    with pytest.raises(
        LimitError, match=r"more than 500 bytes \(the server's limit: 10 keys of 42 bytes or less"
    ):
        reader.next()


def test_reader_takes_requests_split_anywhere() -> None:
    """Requests that arrive a byte at a time, and several in one read, parse the same."""
    wire = bytes([tw.Query.VALIDATE]) + struct.pack("<I", tw.VALIDATION_MAGIC)
    wire += bytes([tw.Query.SET]) + tw.blob(b"/k") + tw.blob(b"value")
    wire += bytes([tw.Query.MULTI_GET]) + struct.pack("<Q", 2) + tw.blob(b"/a") + tw.blob(b"/b")
    wire += bytes([tw.Query.ADD]) + tw.blob(b"/n") + struct.pack("<q", -3)
    wire += bytes([tw.Query.GET]) + tw.blob(b"/n") + bytes([tw.Query.SET]) + tw.blob(b"/e") + tw.blob(b"")
    want = [
        (tw.Query.VALIDATE, tw.VALIDATION_MAGIC),
        (tw.Query.SET, b"/k", b"value"),
        (tw.Query.MULTI_GET, [b"/a", b"/b"]),
        (tw.Query.ADD, b"/n", -3),
        (tw.Query.GET, b"/n"),
        (tw.Query.SET, b"/e", b""),
    ]
    for chunk in (1, 3, 7, 8, 9, 10, 17, len(wire)):
        reader = tw.RequestReader(1 << 20, 10)
        got = []
        for i in range(0, len(wire), chunk):
            reader.feed(wire[i : i + chunk])
            while (request := reader.next()) is not None:
                got.append(request)
        assert got == want
        assert reader.buffered() == 0


def _raw(port: int, data: bytes, wait: float = 3.0) -> tuple[bytes, float]:
    """Send ``data``; what the server answered before closing, and how long it took to close."""
    with socket.create_connection(("127.0.0.1", port), timeout=wait) as sock:
        sock.sendall(data)
        started, got = time.monotonic(), b""
        try:
            while chunk := sock.recv(4096):
                got += chunk
        except TimeoutError:
            return got, float("inf")
        return got, time.monotonic() - started


VALIDATE = bytes([tw.Query.VALIDATE]) + struct.pack("<I", tw.VALIDATION_MAGIC)


@pytest.mark.timeout(60)
def test_bad_clients_are_closed_and_named_in_the_log(tcpstore_server: tuple[ServerProcess, int]) -> None:
    srv, port = tcpstore_server
    set_k, wait = VALIDATE + bytes([tw.Query.SET]) + tw.blob(b"/k"), VALIDATE + bytes([tw.Query.WAIT])
    cases = {
        "garbage": (b"GET / HTTP/1.1\r\n\r\n", "not a TCPStore client"),
        "wrong magic": (bytes([0]) + struct.pack("<I", 1234), "not a TCPStore client"),
        "unknown query": (VALIDATE + bytes([200]), "unknown TCPStore query type 200"),
        # a value of 1 TiB announced: refused at its length, nothing of it buffered
        "huge value": (set_k + struct.pack("<Q", 1 << 40), "limit"),
        "too many keys": (wait + struct.pack("<Q", 10**9), "65536 keys per request"),
        "non-integer add": (
            VALIDATE
            + bytes([tw.Query.SET])
            + tw.blob(b"/t")
            + tw.blob(b"abc")
            + bytes([tw.Query.ADD])
            + tw.blob(b"/t")
            + struct.pack("<q", 1),
            "does not hold an integer",
        ),
    }
    for name, (data, words) in cases.items():
        got, took = _raw(port, data)
        assert got == b"", name
        assert took < 2.0, f"{name}: not closed"
        deadline = time.monotonic() + 5  # (the first line of a burst is logged at once)
        while words not in (log := srv.stderr_text()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert words in log, f"{name}: {words!r} not in the log:\n{log}"
        time.sleep(1.1)  # (the next case starts a burst of its own: its line is not summarised)
    # and the server still serves
    store = _client(port)
    store.set("after", b"ok")
    assert store.get("after") == b"ok"


@pytest.mark.timeout(30)
def test_a_closed_waiter_and_a_silent_client_leave_nothing_behind() -> None:
    """A client that closes while its ``wait`` is parked leaves no waiter behind; one that never
    validates is closed at the handshake timeout; both free their connection slot."""

    async def main() -> None:
        server = Server(ServerConfig(tcpstore_port=0, handshake_timeout=0.3))
        await server.start()
        try:
            port = server.tcpstore_port
            assert port is not None
            loop = asyncio.get_running_loop()
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(VALIDATE + bytes([tw.Query.WAIT]) + struct.pack("<Q", 1) + tw.blob(b"/never"))
            await writer.drain()
            for _ in range(100):
                if server.waits.waiters:
                    break
                await asyncio.sleep(0.01)
            assert list(server.waits.waiters) == [("tcpstore", "never")]
            writer.close()
            silent_reader, silent = await asyncio.open_connection("127.0.0.1", port)
            started = loop.time()
            assert await asyncio.wait_for(silent_reader.read(), 5) == b""  # closed by the server
            assert 0.2 < loop.time() - started < 3.0
            silent.close()
            for _ in range(100):
                if not server.waits.waiters and not server.admission.conns:
                    break
                await asyncio.sleep(0.01)
            assert server.waits.waiters == {}
            assert not server.admission.conns
        finally:
            await server.close()

    asyncio.run(main())


@pytest.mark.timeout(30)
def test_the_port_refuses_to_open_with_a_token(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("secret")
    argv = [PY, "-m", "arendez_server", "--port", "0", "--tcpstore-port", "0", "--token-file", str(token)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=20, check=False)
    assert done.returncode == 2
    assert "cannot authenticate" in done.stderr


def _set(key: bytes, value: bytes) -> bytes:
    return bytes([tw.Query.SET]) + tw.blob(key) + tw.blob(value)


def _wait(*keys: bytes) -> bytes:
    return bytes([tw.Query.WAIT]) + struct.pack("<Q", len(keys)) + b"".join(tw.blob(k) for k in keys)


async def _front(**config: Any) -> Server:
    server = Server(ServerConfig(tcpstore_port=0, **config))
    await server.start()
    return server


async def _raw_client(server: Server) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    assert server.tcpstore_port is not None
    reader, writer = await asyncio.open_connection("127.0.0.1", server.tcpstore_port)
    writer.write(VALIDATE)
    return reader, writer


async def _ping(server: Server, timeout: float = 2.0) -> None:
    reader, writer = await _raw_client(server)
    writer.write(bytes([tw.Query.PING]) + struct.pack("<I", 77))
    assert await asyncio.wait_for(reader.readexactly(4), timeout) == struct.pack("<I", 77)
    writer.close()


@pytest.mark.timeout(60)
def test_a_client_that_does_not_read_its_replies_cannot_make_the_server_hold_them() -> None:
    """Requests whose replies are many times their size (a GET of a 256 KiB value, 4,000 times
    in 52 KB) are answered only as the client reads: the server held hundreds of MiB and more
    for a few KB sent (review). The server keeps answering others meanwhile."""

    async def main() -> None:
        server = await _front()
        try:
            reader, writer = await _raw_client(server)
            writer.write(_set(b"/big", bytes(256 << 10)))
            writer.write((bytes([tw.Query.GET]) + tw.blob(b"/big")) * 4000)
            multi = bytes([tw.Query.MULTI_GET]) + struct.pack("<Q", 1000) + tw.blob(b"/big") * 1000
            writer.write(multi)
            for _ in range(20):
                await asyncio.sleep(0.05)
                held = sum(c.buffered() + c.reader.buffered() for c in server.admission.conns)  # type: ignore[attr-defined]
                assert held < 4 << 20, f"the server holds {held} bytes for one client"
            await _ping(server)
            # reading them lets the server go on: the replies arrive, in order
            for _ in range(10):
                size = struct.unpack("<Q", await asyncio.wait_for(reader.readexactly(8), 5))[0]
                assert size == 256 << 10
                await reader.readexactly(size)
            writer.close()
        finally:
            await server.close()

    asyncio.run(main())


@pytest.mark.timeout(60)
def test_a_chain_of_waiters_each_woken_by_the_last_ones_set_all_wake() -> None:
    """Client i waits on ``c{i}`` and has queued ``set c{i+1}`` behind it: one set of ``c0``
    wakes them all, in turn (answered inside the setter's change, the wakes nested until a
    RecursionError at about 200 clients and the rest were lost: review)."""

    async def main() -> None:
        server = await _front()
        try:
            n = 400
            clients = []
            for i in range(n):
                reader, writer = await _raw_client(server)
                writer.write(_wait(f"/c{i}".encode()) + _set(f"/c{i + 1}".encode(), b"x"))
                clients.append((reader, writer))
            last_reader, last = await _raw_client(server)
            last.write(_wait(f"/c{n}".encode()))
            await asyncio.sleep(0.3)
            _, setter = await _raw_client(server)
            setter.write(_set(b"/c0", b"go"))
            assert await asyncio.wait_for(last_reader.readexactly(1), 10) == tw.STOP_WAITING
            for reader, writer in clients:
                assert await asyncio.wait_for(reader.readexactly(1), 5) == tw.STOP_WAITING
                writer.close()
            last.close()
            setter.close()
        finally:
            await server.close()

    asyncio.run(main())


@pytest.mark.timeout(10)
def test_a_request_that_arrives_in_pieces_is_parsed_once() -> None:
    """A ``multi_get`` of 2,000 keys fed a key at a time reads each key once (it was parsed again
    from its start at every piece: quadratic, 7.6 s of CPU for 10,000 keys: review)."""
    keys = [f"/k{i}".encode() for i in range(2000)]
    wire = bytes([tw.Query.MULTI_GET]) + struct.pack("<Q", len(keys)) + b"".join(tw.blob(k) for k in keys)
    reader = tw.RequestReader(1 << 20, 10_000)
    calls = 0
    original = reader._bytes

    def counted(buf: bytearray, pos: int) -> tuple[bytes, int]:
        nonlocal calls
        calls += 1
        return original(buf, pos)

    reader._bytes = counted  # type: ignore[method-assign]
    step = len(tw.blob(keys[0]))
    pieces = [wire[:9]] + [wire[i : i + step] for i in range(9, len(wire), step)]
    got = None
    for piece in pieces:
        reader.feed(piece)
        got = reader.next() or got
    assert got == (tw.Query.MULTI_GET, keys)
    assert calls < 3 * len(keys), calls


_PORTED_RUN = """
import sys
from datetime import timedelta
from arendez.sync import TCPStore
store = TCPStore("127.0.0.1", int(sys.argv[1]), None, False, timedelta(seconds=10))
print(store.add("arrived", 1), store.check(["done"]), flush=True)
store.set("done", "1")
"""


@pytest.mark.timeout(60)
def test_a_ported_scripts_next_run_meets_a_fresh_store_on_a_standalone_server(
    tcpstore_server: tuple[ServerProcess, int],
) -> None:
    """``arendez.sync.TCPStore`` on the server's own port shares the TCPStore job with torch's
    clients, and its keys go with the run's last client as theirs do (QA26: the second run of a
    ported script read the first run's counter and keys, and its ranks never waited)."""
    srv, _ = tcpstore_server
    runs = []
    for _ in range(2):
        done = subprocess.run(
            [PY, "-c", _PORTED_RUN, str(srv.port)], capture_output=True, text=True, timeout=30
        )
        assert done.returncode == 0, done.stderr
        runs.append(done.stdout.split())
        time.sleep(0.5)  # (the server hears the run's connection close)
    assert runs == [["1", "False"], ["1", "False"]]


@pytest.mark.timeout(30)
def test_the_keys_go_with_their_last_client_unless_a_grace_keeps_them() -> None:
    """A torch store goes with the run that hosts it: the TCPStore port's keys go once its last
    client has gone (``--tcpstore-grace``, default 0), so the next run meets no stale keys."""

    async def main(grace: float) -> list[str]:
        server = await _front(tcpstore_grace=grace)
        try:
            reader, writer = await _raw_client(server)
            writer.write(_set(b"/left", b"behind") + _wait(b"/left"))
            assert await asyncio.wait_for(reader.readexactly(1), 5) == tw.STOP_WAITING
            writer.close()
            await asyncio.sleep(0.3)
            job = server.state.jobs.get("tcpstore")
            return [] if job is None else list(job.kv)
        finally:
            await server.close()

    assert asyncio.run(main(0.0)) == []
    assert asyncio.run(main(5.0)) == ["left"]


@pytest.mark.timeout(30)
def test_a_key_deleted_after_a_clients_wait_reads_empty_as_on_torch_server(
    tcpstore_server: tuple[ServerProcess, int],
) -> None:
    """torch's client waits for a key, then gets it; deleted in between, torch's server answers
    an empty value (this server closed the connection, which the client cannot survive)."""
    _, port = tcpstore_server
    master = TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=5), wait_for_workers=False)
    for where in (master.port, port):
        with socket.create_connection(("127.0.0.1", where), timeout=5) as sock:
            sock.sendall(VALIDATE + _set(b"/gone", b"x") + bytes([tw.Query.DELETE_KEY]) + tw.blob(b"/gone"))
            sock.sendall(bytes([tw.Query.GET]) + tw.blob(b"/gone"))
            sock.sendall(bytes([tw.Query.MULTI_GET]) + struct.pack("<Q", 1) + tw.blob(b"/gone"))
            want = struct.pack("<q", 1) + tw.blob(b"") + tw.blob(b"")
            got = b""
            while len(got) < len(want):
                got += sock.recv(64)
            assert got == want, where


@pytest.mark.timeout(10)
def test_a_burst_of_closings_is_summed_up_by_reason() -> None:
    """(QA25-F6: the summary kept only the last reason: a client closed by a limit during a flood
    of garbage was lost from the log.)"""
    from arendez_server.tcpstore_front import _closings

    items = [(f"10.0.0.{i}:1", "not a TCPStore client") for i in range(40)]
    items.insert(7, ("10.0.0.99:1", "a TCPStore request of more than 1052672 bytes"))
    summary = _closings(items)
    assert summary.startswith(
        "41 more TCPStore client(s) closed in the last 1 s: 40 x not a TCPStore client; "
    )
    assert "1 x a TCPStore request of more than 1052672 bytes" in summary
    assert summary.endswith("the last: 10.0.0.39:1: not a TCPStore client")
