"""The async store client's write path: corked batches and the shared expiry timer."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

import arendez as dist
from arendez.errors import StoreTimeoutError
from tests.harness import start_server


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
