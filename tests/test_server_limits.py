"""Server limits: options of ``arendez-server``; a refused client is told which limit, by name."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import pytest

import arendez as dist
from tests.harness import start_server


@pytest.mark.timeout(30)
async def test_connection_refused_by_per_host_limit_names_the_limit():
    """(Clients over the server's local socket: ``test_local_sockets``.)"""
    srv = start_server("--max-connections-per-host", "2")
    stores = []
    try:
        for _ in range(2):
            stores.append(await dist.Store("127.0.0.1", srv.port, "lim", timeout=5).connect())
        started = time.monotonic()
        with pytest.raises(dist.LimitError, match="--max-connections-per-host") as info:
            await dist.Store("127.0.0.1", srv.port, "lim", timeout=5).connect()
        assert "127.0.0.1 already has 2 connections" in str(info.value)
        assert time.monotonic() - started < 3  # at once, not after retrying until the deadline
        await stores[0].set("k", "v")  # the admitted clients are unaffected
        assert await stores[1].get("k") == b"v"
    finally:
        for store in stores:
            await store.close()
        srv.stop()


@pytest.mark.timeout(30)
async def test_connection_refused_by_total_limit_names_the_limit():
    srv = start_server("--max-connections", "1")
    first = await dist.Store("127.0.0.1", srv.port, "lim", timeout=5).connect()
    try:
        with pytest.raises(dist.LimitError, match=r"--max-connections,"):
            await dist.Store("127.0.0.1", srv.port, "lim", timeout=5).connect()
        await first.close()
        for _ in range(50):  # the slot frees once the server has seen the close
            try:
                again = await dist.Store("127.0.0.1", srv.port, "lim", timeout=5).connect()
                break
            except dist.LimitError:
                await asyncio.sleep(0.05)
        else:
            raise AssertionError("the connection slot was never freed")
        await again.close()
    finally:
        await first.close()
        srv.stop()


@pytest.mark.timeout(30)
async def test_pending_request_limit_fails_the_request_not_the_connection():
    srv = start_server("--max-pending-per-connection", "3")
    store = await dist.Store("127.0.0.1", srv.port, "lim", timeout=5).connect()
    try:
        waits = [asyncio.ensure_future(store.get(f"never-{i}", timeout=10)) for i in range(3)]
        await asyncio.sleep(0.2)
        with pytest.raises(dist.LimitError, match="--max-pending-per-connection"):
            await store.get("one-too-many", timeout=10)
        await store.set("never-0", "now")
        assert await waits[0] == b"now"  # the connection survived the refusal
        for w in waits[1:]:
            w.cancel()
    finally:
        await store.close()
        srv.stop()


def test_limit_options_must_be_positive():
    res = subprocess.run(
        [sys.executable, "-m", "arendez_server", "--port", "0", "--max-connections", "0"],
        capture_output=True,
        text=True,
        timeout=20,
    )
    assert res.returncode == 2 and "--max-connections must be at least 1" in res.stderr
