"""Server limits: options of ``arendez-server``; a refused client is told which limit, by name."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from typing import Any

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


def _burst_in_log(srv: Any, word: str, summary: str) -> tuple[list[str], int]:
    """The server's log lines holding ``word`` once the burst's summary is out: a first line and
    one summary (checked), and how many the summary counts (its ``summary`` pattern's group)."""
    time.sleep(1.5)  # (the summary closes a second after the first line)
    lines = [ln for ln in srv.stderr_text().splitlines() if word in ln]
    assert 2 <= len(lines) <= 4, lines
    found = re.search(summary, "\n".join(lines))
    assert found is not None, lines
    return lines, int(found.group(1))


@pytest.mark.timeout(30)
def test_a_flood_of_refused_connections_is_a_line_and_a_summary_in_the_servers_log():
    """200 connections past the limit are not 200 warnings: the first is logged, the rest of
    its second summed up in one line naming how many and the limit."""
    srv = start_server("--max-connections", "1")
    try:
        with socket.create_connection(("127.0.0.1", srv.port)):
            for _ in range(200):
                with socket.create_connection(("127.0.0.1", srv.port)) as extra:
                    extra.recv(4096)  # (the refusal, sent in place of the challenge)
            lines, summed = _burst_in_log(srv, "refused", r"(\d+) more connection\(s\) refused")
        assert 190 <= summed <= 199, lines
        assert "--max-connections" in lines[-1], lines
    finally:
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


@pytest.mark.timeout(60)
async def test_state_limits_are_limit_errors_naming_their_option_and_fail_at_once():
    """A full job count, a full key count and a too-large world size each name the option that
    sets them; a rank joining a server that holds its most jobs fails at once, not at its timeout."""
    srv = start_server("--max-jobs", "1", "--max-keys-per-job", "2", "--max-world-size", "4")
    try:
        first = await dist.Store("127.0.0.1", srv.port, "first", timeout=5).connect()
        await first.set("a", "1")
        await first.set("b", "2")
        with pytest.raises(dist.LimitError, match="--max-keys-per-job"):
            await first.set("c", "3")
        with pytest.raises(dist.RendezvousError, match="--max-world-size"):
            await first.join(5, 0, "127.0.0.1:1", timeout=2)
        started = time.monotonic()
        with pytest.raises(dist.LimitError, match="--max-jobs"):
            await dist.init_process_group(init_method=f"{srv.url}/second", world_size=2, rank=0, timeout=20)
        assert time.monotonic() - started < 5  # (the timeout is 20 s)
        assert not dist.is_initialized()
        await first.close()
    finally:
        srv.stop()


@pytest.mark.timeout(30)
async def test_a_value_past_the_servers_limit_is_refused_by_name_and_the_client_goes_on():
    """A 2 MiB value would end the connection as a protocol error at the server; every client
    refuses to send it, naming the limit, and its connection stays usable. "" is a key (as in torch)."""
    srv = start_server()
    try:
        store = await dist.Store("127.0.0.1", srv.port, "big", timeout=5).connect()
        with pytest.raises(dist.LimitError, match=r"exceeds the server's limit of \d+ bytes per request"):
            await store.set("k", b"x" * (2 << 20))
        await store.set("", b"empty key")
        assert await store.get("") == b"empty key"
        await store.close()
        blocking = dist.BlockingStore("127.0.0.1", srv.port, "big")
        with pytest.raises(dist.LimitError, match="a value may hold up to 1048576 bytes"):
            blocking.set("k", b"x" * (2 << 20))
        blocking.set("k", b"x" * 1000)
        assert blocking.get("k") == b"x" * 1000
        blocking.close()
    finally:
        srv.stop()


_CRASHING_RANK = (
    "import os, sys, time, arendez.sync as d; "
    "d.init_process_group(init_method=sys.argv[1], world_size=2, rank=int(sys.argv[2])); "
    "print('joined', flush=True); time.sleep(2); os._exit(1)"
)


@pytest.mark.timeout(60)
async def test_a_job_whose_ranks_all_crashed_gives_its_slot_back_once_their_leases_run_out():
    """(Review: a job whose connections had all gone before its leases ran out was never
    forgotten, so crashed jobs used up --max-jobs for good.)"""
    srv = start_server("--lease", "1", "--max-jobs", "2")
    try:
        ranks = [
            subprocess.Popen(
                [sys.executable, "-c", _CRASHING_RANK, f"{srv.url}/crashed", str(r)],
                stdout=subprocess.PIPE,
                text=True,
            )
            for r in range(2)
        ]
        assert [p.communicate(timeout=40)[0].strip() for p in ranks] == ["joined", "joined"]
        deadline = time.monotonic() + 15  # (the leases: 1 s, once their keepers are gone)
        while True:
            try:
                async with (
                    dist.Store("127.0.0.1", srv.port, "one", timeout=5) as one,
                    dist.Store("127.0.0.1", srv.port, "two", timeout=5) as two,
                ):
                    await one.set("k", "v")
                    await two.set("k", "v")  # (both slots: the crashed job's is free again)
                break
            except dist.LimitError:
                assert time.monotonic() < deadline, "the crashed job still holds its --max-jobs slot"
                await asyncio.sleep(0.3)
    finally:
        srv.stop()


@pytest.mark.timeout(60)
async def test_a_multi_get_whose_answer_would_pass_the_limit_is_refused_by_name():
    """(QA25-F1: one 4 KB request naming a 1 MiB key a thousand times made the server build a
    3 GiB answer, stall its other clients for seconds and keep a gigabyte after.) The answer's
    size is checked before it is built, at once and for a multi_get that waited for its keys;
    the connection and the other clients go on."""
    srv = start_server()
    try:
        store = await dist.Store("127.0.0.1", srv.port, "amp", timeout=10).connect()
        await store.set("big", b"x" * (1 << 20))
        with pytest.raises(
            dist.LimitError, match=r"multi_get of 40 keys would answer 41943040 bytes.*33554432"
        ):
            await store.multi_get(["big"] * 40)
        waiting = asyncio.ensure_future(store.multi_get(["big"] * 39 + ["later"]))
        await asyncio.sleep(0.2)
        other = await dist.Store("127.0.0.1", srv.port, "amp", timeout=10).connect()
        await other.set("later", b"y" * (1 << 20))
        with pytest.raises(dist.LimitError, match="multi_get of 40 keys would answer"):
            await waiting
        assert await store.multi_get(["big"] * 8) == [b"x" * (1 << 20)] * 8  # (within the limit)
        await other.close()
        await store.close()
    finally:
        srv.stop()


@pytest.mark.timeout(30)
def test_wrong_tokens_in_a_loop_are_a_line_and_a_summary_in_the_servers_log():
    """(QA25-F2: each failed handshake was a log line: 13,000 lines in 5 s from one client.)"""
    srv = start_server("--log-level", "INFO", env={"ARENDEZ_TOKEN": "secret"})
    try:
        for _ in range(100):
            with pytest.raises(dist.AuthenticationError, match="wrong or missing token"):
                dist.BlockingStore("127.0.0.1", srv.port, "j", token="wrong", timeout=5).connect()
        lines, summed = _burst_in_log(srv, "token", r"(\d+) more client\(s\) closed for a bad handshake")
        assert 90 <= summed <= 99, lines
        assert "wrong or missing token" in lines[-1], lines
    finally:
        srv.stop()


_WAITING_RANK = (
    "import sys, time, numpy as np, arendez.sync as d; "
    "d.init_process_group(init_method=sys.argv[1], world_size=2, rank=0, timeout=60); "
    "t = time.monotonic()\n"
    "try:\n    d.all_reduce(np.ones(2)); print('completed', flush=True)\n"
    "except Exception as e:\n    print(type(e).__name__, round(time.monotonic() - t, 1), flush=True)\n"
)
_STOPPING_RANK = (
    "import os, signal, sys, arendez.sync as d; "
    "d.init_process_group(init_method=sys.argv[1], world_size=2, rank=1, timeout=60); "
    "print('joined', flush=True); os.kill(os.getpid(), signal.SIGSTOP)"
)


@pytest.mark.timeout(60)
def test_a_full_max_jobs_leaves_the_leases_working() -> None:
    """(QA25: a process's lease connection asked for a job of its own, so a server holding
    --max-jobs jobs refused every lease, silently, and a stopped rank was never declared failed:
    its peers waited for the collective's timeout.)"""
    srv = start_server("--lease", "1", "--max-jobs", "1")
    ranks = []
    try:
        for script in (_WAITING_RANK, _STOPPING_RANK):
            argv = [sys.executable, "-c", script, f"{srv.url}/only"]
            ranks.append(subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, start_new_session=True))
        waiting = ranks[0].communicate(timeout=40)[0].split()
        assert waiting[0] == "RankFailedError", waiting
        assert float(waiting[1]) < 20, waiting  # (the lease, not the 60 s timeout)
    finally:
        for proc in ranks:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        srv.stop()
