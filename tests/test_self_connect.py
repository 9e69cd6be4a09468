"""TCP self-connect: a client dialling a free port of its own host from the ephemeral range may be
given that very port as its source, and its socket connects to itself. Held, it takes the port
the master is about to listen on (the master then fails: address in use).

Each case runs in a network namespace of its own whose ephemeral range is the store's port and
the next one, so the self-connect happens on the first dials rather than once in thousands."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

PORT = 40311

_CASE = textwrap.dedent(
    """
    import asyncio, datetime, sys, threading, time
    import arendez, arendez.sync as sync
    port, which = int(sys.argv[1]), sys.argv[2]
    if which == "async":  # a client retrying alone: then the port must be free for a master
        async def dial():
            try:
                await arendez.Store("127.0.0.1", port, "j", timeout=1.5).connect()
            except arendez.StoreError as exc:
                print("client gave up:", type(exc).__name__)
        asyncio.run(dial())
    got = {}
    def client():
        store = sync.TCPStore("127.0.0.1", port, None, False, datetime.timedelta(seconds=20))
        got["value"] = store.get("k")
    thread = threading.Thread(target=client)
    thread.start()
    time.sleep(1.0)  # (the client dials a port nothing listens on yet)
    master = sync.TCPStore("127.0.0.1", port, None, True, datetime.timedelta(seconds=20))
    master.set("k", b"v")
    thread.join(30)
    print("client got", got.get("value"))
    """
)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("which", ["blocking", "async"])
def test_a_client_that_connects_to_itself_lets_the_port_go_for_its_master(which: str) -> None:
    setup = (
        f"ip link set lo up && sysctl -qw net.ipv4.ip_local_port_range='{PORT} {PORT + 1}' && "
        f'exec "{sys.executable}" -c "$0" {PORT} {which}'
    )
    done = subprocess.run(
        ["unshare", "-n", "sh", "-c", setup, _CASE], capture_output=True, text=True, timeout=80
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "client got b'v'" in done.stdout, done.stdout + done.stderr[-3000:]
