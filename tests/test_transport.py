"""A connection's close: bounded by its timeout, the linger included."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest

from arendez.transport import Connection


@pytest.mark.timeout(20)
async def test_a_close_that_lingers_on_a_silent_peer_keeps_its_timeout() -> None:
    """``wait_closed(timeout, linger=...)`` on a peer that never closes its end (a black-holed
    link) ends within ``timeout`` all told: the linger used to run out and the close then waited
    the whole ``timeout`` again (QA: destroy_process_group(timeout=2) took 3 s)."""
    listener = socket.socket()  # the kernel accepts into its queue; nobody reads or closes
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    loop = asyncio.get_running_loop()
    transport, conn = await loop.create_connection(Connection, *listener.getsockname())
    transport.write(bytes(32 << 20))  # more than the socket buffers hold: it waits for the peer
    started = time.monotonic()
    await conn.wait_closed(0.6, linger=0.4)
    took = time.monotonic() - started
    assert 0.35 < took < 0.9, took
    listener.close()
