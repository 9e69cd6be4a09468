"""The embedded server's lifetime (arendez/embedded.py) and how a store client reports losing it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket

import pytest

import arendez as dist
from arendez import embedded
from arendez.loop import run
from tests.harness import free_port, start_server


@pytest.fixture(autouse=True, params=["process", "loop"])
def server_mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test here holds for both ways of hosting: a child process and the event loop."""
    monkeypatch.setenv("ARENDEZ_EMBEDDED_SERVER", request.param)
    return str(request.param)


def _token(server: object) -> str | None:
    config = getattr(server, "config", None)
    return getattr(config if config is not None else server, "token", None)


def _port_is_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            s.listen()
        except OSError:
            return False
        return True


async def test_one_server_across_cycles_until_shutdown() -> None:
    port = free_port()
    first = await embedded.acquire("127.0.0.1", port, None, None)
    try:
        assert await embedded.acquire("127.0.0.1", port, None, None) is first
        store = await dist.Store("127.0.0.1", port, "job", timeout=5).connect(5)
        await store.set("k", b"v")
        await store.close()
        assert not _port_is_free(port)
    finally:
        await embedded.shutdown()
    assert _port_is_free(port)
    again = await embedded.acquire("127.0.0.1", port, None, None)
    try:
        assert again is not first and again.port == port
    finally:
        await embedded.shutdown()


async def test_another_token_replaces_the_server() -> None:
    port = free_port()
    plain = await embedded.acquire("127.0.0.1", port, None, None)
    try:
        secret = await embedded.acquire("127.0.0.1", port, "s3cret", None)
        assert secret is not plain and _token(secret) == "s3cret"
        with pytest.raises(dist.AuthenticationError):
            await dist.Store("127.0.0.1", port, "job", timeout=2).connect(2)
    finally:
        await embedded.shutdown()


def test_the_server_ends_with_its_event_loop_and_a_new_loop_gets_a_new_one() -> None:
    port = free_port()

    async def host() -> int:
        server = await embedded.acquire("127.0.0.1", port, None, None)
        return id(server)

    with asyncio.Runner() as runner:
        first = runner.run(host())
    assert _port_is_free(port)  # the loop's end closed it
    with asyncio.Runner() as runner:
        second = runner.run(host())
        assert not _port_is_free(port)
    assert second != first
    assert _port_is_free(port)


def test_a_server_left_on_a_stopped_loop_is_replaced() -> None:
    """A loop that stopped without cancelling its tasks must not keep the port."""
    port = free_port()
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(embedded.acquire("127.0.0.1", port, None, None))
    finally:
        loop.close()  # no task cancellation: the holder never ran its clean-up
    with asyncio.Runner() as runner:
        server = runner.run(embedded.acquire("127.0.0.1", port, None, None))
        assert server.port == port


async def test_a_server_that_shuts_down_is_no_alarm(caplog: pytest.LogCaptureFixture) -> None:
    port = free_port()
    await embedded.acquire("127.0.0.1", port, None, None)
    store = await dist.Store("127.0.0.1", port, "job", timeout=5).connect(5)
    try:
        with caplog.at_level(logging.INFO, logger="arendez"):
            await embedded.shutdown()
            for _ in range(200):
                if "lost the store" in caplog.text:
                    break
                await asyncio.sleep(0.01)
        lost = [r for r in caplog.records if "lost the store" in r.getMessage()]
        assert lost and all(r.levelno == logging.INFO for r in lost), caplog.text
        assert "it shut down" in lost[0].getMessage()
    finally:
        await store.close()


async def test_a_server_that_dies_is_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    srv = start_server()
    store = await dist.Store("127.0.0.1", srv.port, "job", timeout=5).connect(5)
    try:
        with caplog.at_level(logging.INFO, logger="arendez"):
            srv.proc.kill()
            srv.proc.wait(5)
            for _ in range(300):
                if "lost the store" in caplog.text:
                    break
                await asyncio.sleep(0.01)
        lost = [r for r in caplog.records if "lost the store" in r.getMessage()]
        assert lost and lost[0].levelno == logging.WARNING, caplog.text
    finally:
        await store.close()
        srv.stop()


async def _connect_then_close(spins: int) -> bool:
    """Connect a raw client, let the server's loop run ``spins`` steps, close the server; True if
    the client's connection ended (EOF or reset) within 2 s, as it must."""
    from arendez_server import Server, ServerConfig

    server = Server(ServerConfig(host="127.0.0.1", port=0))
    await server.start()
    client = socket.socket()
    client.setblocking(False)
    try:
        with contextlib.suppress(BlockingIOError):
            client.connect(("127.0.0.1", server.port))
        for _ in range(spins):
            await asyncio.sleep(0)
        await server.close(0.5)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 2.0
        while loop.time() < deadline:
            try:
                if not client.recv(65536):
                    return True
            except BlockingIOError:
                await asyncio.sleep(0.01)
            except ConnectionError:
                return True
        return False
    finally:
        client.close()


def test_a_connection_accepted_as_the_server_closes_is_dropped() -> None:
    """Issue 19's hang: a connection accepted in the loop step in which close() ran used to be
    served on by the closed server (a cancel lost in wait_for, or a task cancelled before it
    started), so a rank could join a round there that nobody else would ever join."""

    async def sweep() -> list[int]:
        return [spins for spins in list(range(8)) * 4 if not await _connect_then_close(spins)]

    assert run(sweep()) == []  # arendez's own loop (uvloop where installed)


async def test_no_store_process_falls_back_to_the_event_loop(
    server_mode: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """An interpreter that cannot be started (an embedded Python, a broken install) costs the
    child process, not the rendezvous: the store is hosted in the event loop, with a warning."""
    monkeypatch.setattr("sys.executable", "/nonexistent/python")
    port = free_port()
    with caplog.at_level(logging.WARNING, logger="arendez"):
        server = await embedded.acquire("127.0.0.1", port, None, None)
    try:
        assert server.port == port and hasattr(server, "config")  # the in-loop Server
        assert ("no store process" in caplog.text) == (server_mode == "process"), caplog.text
        store = await dist.Store("127.0.0.1", port, "job", timeout=5).connect(5)
        await store.set("k", b"v")
        await store.close()
    finally:
        await embedded.shutdown()


def test_the_store_process_starts_without_numpy() -> None:
    """The rank-hosted store's child process imports the server and the frame codec only: numpy
    (a third of its start-up, which every ``is_master`` store and every re-init waits for) is
    imported by the codec when a payload first needs a buffer, which a store never does."""
    import subprocess
    import sys

    from arendez.serverproc import _BOOT

    listing = "print(sorted(m for m in sys.modules if m.startswith('numpy')))"
    probe = _BOOT.replace("sys.exit(main())", listing)
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout


@pytest.mark.timeout(60)
def test_a_store_process_whose_parent_died_as_it_started_ends_quietly() -> None:
    """Rank 0 killed while its store process starts: the store finds the answer pipe closed and
    ends, with no traceback in the rank's output (QA20-F2: a BrokenPipeError traceback)."""
    import json
    import os
    import subprocess
    import sys

    from arendez.serverproc import _BOOT

    child = subprocess.Popen(
        [sys.executable, "-c", _BOOT],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert child.stdin is not None and child.stdout is not None and child.stderr is not None
    child.stdout.close()  # the parent is gone before the answer comes
    order = {"host": "127.0.0.1", "port": 0, "token": None, "wait": 1.0, "log_level": 30}
    child.stdin.write((json.dumps({**order, "parent": os.getpid(), "fd": None}) + "\n").encode())
    child.stdin.flush()
    try:
        code = child.wait(30)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    errors = child.stderr.read().decode()
    child.stdin.close()
    child.stderr.close()
    assert code == 0 and "Traceback" not in errors and "BrokenPipe" not in errors, errors
