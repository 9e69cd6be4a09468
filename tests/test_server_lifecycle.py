"""The server: SIGTERM exits cleanly; a job survives the server being killed and restarted."""

from __future__ import annotations

import asyncio
import signal

import pytest

import arendez as dist
from tests.harness import collect, spawn_rank, start_server, wait_for_files
from tests.jobs import store as store_jobs


@pytest.mark.timeout(30)
async def test_sigterm_stops_accepting_tells_clients_and_exits_zero():
    srv = start_server()
    events: list[dict] = []
    store = await dist.Store("127.0.0.1", srv.port, "bye", timeout=5).connect()
    store.on_event = events.append
    srv.proc.send_signal(signal.SIGTERM)
    assert await asyncio.to_thread(srv.proc.wait, 10) == 0
    for _ in range(100):
        if events:
            break
        await asyncio.sleep(0.02)
    assert events and events[0]["event"] == "server_shutdown"
    with pytest.raises(dist.StoreError):
        await store.set("k", "v", timeout=0.5)
    await store.close()


def _server_killed_under_a_job(tmp_path, job, name: str):
    """A server, two ranks of ``job`` on it (each writes ``ready-<rank>``), the server killed
    once both are ready (``killed`` tells them); returns the killed server and the ranks."""
    srv = start_server()
    procs = [spawn_rank(job, r, 2, f"{srv.url}/{name}", str(tmp_path)) for r in range(2)]
    try:
        wait_for_files(tmp_path, "ready-*", 2)
    except BaseException:
        srv.stop()
        for p in procs:
            p.kill()
            p.wait()
        raise
    srv.proc.kill()
    srv.proc.wait()
    (tmp_path / "killed").write_text("1")
    return srv, procs


@pytest.mark.timeout(60)
def test_destroy_does_not_wait_out_its_timeout_for_a_dead_server(tmp_path):
    """The server is killed for good: the ranks' collectives go on, and destroy (30 s group
    timeout) gives up its goodbye to the server after about a second."""
    srv, procs = _server_killed_under_a_job(tmp_path, store_jobs.destroy_after_server_died, "gone")
    try:
        results = collect(procs, 40)
    finally:
        srv.stop()
    for res in results:
        assert res.returncode == 0, res.stderr[-3000:]
        assert res.value["sum"] == 2.0
        assert res.value["destroy_seconds"] < 5.0, res.value  # (was the whole 30 s)


@pytest.mark.timeout(90)
def test_job_survives_server_kill_and_restart(tmp_path):
    srv, procs = _server_killed_under_a_job(tmp_path, store_jobs.server_outage, "outage")
    port = srv.port
    try:
        wait_for_files(tmp_path, "checked-*", 2)
        srv = start_server(port=port)  # same port: the ranks reconnect and re-attach
        (tmp_path / "back").write_text("1")
        results = collect(procs, 60)
    finally:
        srv.stop()
        for p in procs:
            if p.poll() is None:
                p.kill()
    for res in results:
        assert res.returncode == 0, res.stderr[-3000:]
        out = res.value
        assert out["sums"] == [2.0] * 20  # collectives kept working while the server was down
        assert out["during"].startswith("StoreConnectTimeoutError"), out  # (the server is gone)
        assert float(out["during"].split("after ")[1][:-1]) <= 2.5
        assert out["after"] == 2.0
