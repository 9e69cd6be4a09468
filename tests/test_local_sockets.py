"""Same-host peers talk over abstract Unix sockets (``arendez.transports.local``), with TCP as
the fallback: off by ``ARENDEZ_LOCAL_SOCKETS=0``, and whenever the name is not reachable (a peer
in another network namespace: ``test_multihost`` runs ranks in separate namespaces)."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import pytest

from arendez.transports import local
from tests.harness import run_function
from tests.jobs import local as local_jobs


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("setting", "expect_local"), [("1", True), ("0", False)])
def test_ranks_of_one_host_connect_over_unix_sockets_unless_turned_off(
    arendez_server: Any, setting: str, expect_local: bool
) -> None:
    out = run_function(
        local_jobs.links_after_all_reduce,
        2,
        f"{arendez_server.url}/local{setting}",
        env={"ARENDEZ_LOCAL_SOCKETS": setting},
    )
    for res in out:
        assert res["sum"] == [3.0, 3.0, 3.0]
        assert res["connections"] == 1
        assert res["local"] == (1 if expect_local else 0)
        assert res["advertised_local"] is expect_local


def test_messages_name_a_local_peer_readably() -> None:
    """QA: a RankFailedError said 'connection to b'\\x00arendez-26270-b244…' is closed'."""
    from arendez.transport import describe_peer

    assert describe_peer(b"\0arendez-26270-b244966b") == "local socket arendez-26270-b244966b"
    assert describe_peer("") == "a local socket"  # (an unnamed client end)
    assert describe_peer(("10.0.0.2", 29400)) == "10.0.0.2:29400"
    assert describe_peer(("fe80::1", 29400, 0, 0)) == "[fe80::1]:29400"


def test_advertised_addresses_parse_back() -> None:
    assert local.parse(local.advertise("10.0.0.1:4567", "arendez-1-ab")) == ("10.0.0.1:4567", "arendez-1-ab")
    assert local.parse(local.advertise("[::1]:80", None)) == ("[::1]:80", None)


@pytest.mark.timeout(10)
async def test_a_name_nobody_listens_on_is_an_os_error_at_once() -> None:
    """What the mesh falls back to TCP on: connecting to an unknown name fails, not hangs."""
    with pytest.raises(OSError):
        await local.connect(local.new_name(), timeout=5)


@pytest.mark.timeout(10)
async def test_a_listener_accepts_and_its_name_dies_with_it() -> None:
    name = local.new_name()
    accepted: list[Any] = []

    class Recorder(asyncio.Protocol):
        def connection_made(self, transport: Any) -> None:
            accepted.append(transport)

    server = await local.listen(name, Recorder)
    conn = await local.connect(name, timeout=5)
    for _ in range(100):
        if accepted:
            break
        await asyncio.sleep(0.01)
    assert len(accepted) == 1
    conn.close()
    server.close()
    await server.wait_closed()
    with pytest.raises(OSError):
        await local.connect(name, timeout=5)


def test_store_clients_try_the_server_name_only_for_addresses_of_this_machine(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert local.server_name("0.0.0.0", 29400) == "arendez-server/*:29400"
    assert local.server_name("localhost", 29400) == "arendez-server/127.0.0.1:29400"
    assert local.server_name("store.example", 29400) is None  # (clients could not match a name)
    assert local.server_candidates("127.0.0.1", 1) == ["arendez-server/127.0.0.1:1", "arendez-server/*:1"]
    assert local.server_candidates("192.0.2.7", 1) == []  # (TEST-NET-1: not ours)
    assert local.server_candidates("store.example", 1) == []
    monkeypatch.setenv("ARENDEZ_LOCAL_SOCKETS", "0")
    assert local.server_candidates("127.0.0.1", 1) == []


@pytest.mark.timeout(30)
@pytest.mark.parametrize("setting", ["1", "0"])
async def test_blocking_store_clients_on_the_servers_host_use_its_local_socket(
    monkeypatch: pytest.MonkeyPatch, setting: str
) -> None:
    """The blocking client (and so ``TCPStore`` and the lease keeper) reaches a server on this
    host over its Unix socket, which the server counts as host ``localhost (Unix socket)``; the
    event-loop ``Store`` keeps TCP (see ``Store._open_stream``)."""
    from arendez_server import Server, ServerConfig

    from arendez.blocking_store import BlockingStore
    from arendez.store import Store

    monkeypatch.setenv("ARENDEZ_LOCAL_SOCKETS", setting)
    server = Server(ServerConfig(host="127.0.0.1", port=0))
    await server.start()
    store = Store("127.0.0.1", server.port, "j")
    try:
        await store.connect(10)
        await store.set("k", "v")
        assert set(server.admission.per_host) == {"127.0.0.1"}

        def blocking() -> tuple[bytes, int, set[str]]:
            with BlockingStore("127.0.0.1", server.port, "j") as client:
                assert client._sock is not None
                return client.get("k", timeout=5), client._sock.family, set(server.admission.per_host)

        value, family, hosts = await asyncio.get_running_loop().run_in_executor(None, blocking)
        assert value == b"v"
        assert (family == socket.AF_UNIX) is (setting == "1")
        local_host = "localhost (Unix socket)"
        assert hosts == ({"127.0.0.1", local_host} if setting == "1" else {"127.0.0.1"})
    finally:
        await store.close()
        await server.close()


@pytest.mark.timeout(30)
async def test_local_clients_past_the_per_host_limit_are_refused_by_its_name() -> None:
    from arendez_server import Server, ServerConfig

    from arendez.blocking_store import BlockingStore
    from arendez.errors import LimitError

    server = Server(ServerConfig(host="127.0.0.1", port=0, max_connections_per_host=1))
    await server.start()

    def two_clients() -> str:
        with BlockingStore("127.0.0.1", server.port, "j"), pytest.raises(LimitError) as refused:
            BlockingStore("127.0.0.1", server.port, "j", connect_timeout=5).connect()
        return str(refused.value)

    try:
        message = await asyncio.get_running_loop().run_in_executor(None, two_clients)
        assert "localhost (Unix socket) already has 1 connections" in message
        assert "--max-connections-per-host" in message
    finally:
        await server.close()
