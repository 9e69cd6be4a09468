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
from arendez.errors import ProtocolError  # noqa: E402
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


@pytest.mark.timeout(120)
def test_torchrun_c10d_and_gloo_run_on_the_server(tcpstore_server: tuple[ServerProcess, int]) -> None:
    """``torchrun --rdzv-backend c10d --rdzv-endpoint`` this server: the rendezvous, and the store
    torch's workers share for gloo, live on it (the agent cannot bind the port, so it connects)."""
    srv, port = tcpstore_server
    argv = [PY, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2"]
    argv += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "front"]
    argv += [str(SCRIPTS / "gloo_sum.py")]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=100, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    # (the workers share torchrun's stdout: their lines may run together)
    assert sorted(re.findall(r"RANK \d SUM [\d.]+", done.stdout)) == ["RANK 0 SUM 3.0", "RANK 1 SUM 3.0"]
    ours = arendez.sync.TCPStore("127.0.0.1", srv.port, timeout=timedelta(seconds=5))
    assert any(key.startswith("torch.rendezvous.front") for key in ours.list_keys())


def test_key_mapping() -> None:
    assert store_key(b"/a/b") == "a/b"
    assert client_key("a/b") == "/a/b"
    assert store_key(b"init/") == "__arendez_tcpstore/workers"
    assert client_key("__arendez_tcpstore/workers") == "init/"
    with pytest.raises(ProtocolError, match="lacks the '/'"):
        store_key(b"plain")
    with pytest.raises(ProtocolError, match="not UTF-8"):
        store_key(b"/\xff")


def test_reader_takes_requests_split_anywhere() -> None:
    """Requests that arrive a byte at a time, and several in one read, parse the same."""
    wire = bytes([tw.Query.VALIDATE]) + struct.pack("<I", tw.VALIDATION_MAGIC)
    wire += bytes([tw.Query.SET]) + tw.blob(b"/k") + tw.blob(b"value")
    wire += bytes([tw.Query.MULTI_GET]) + struct.pack("<Q", 2) + tw.blob(b"/a") + tw.blob(b"/b")
    want = [
        (tw.Query.VALIDATE, tw.VALIDATION_MAGIC),
        (tw.Query.SET, b"/k", b"value"),
        (tw.Query.MULTI_GET, [b"/a", b"/b"]),
    ]
    for chunk in (1, 3, len(wire)):
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
        "too many keys": (wait + struct.pack("<Q", 10**9), "10000 keys per request"),
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
