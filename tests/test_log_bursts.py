"""A failure at scale is a few log lines per process, not one per rank and lost peer (QA3-F9)."""

from __future__ import annotations

import asyncio
import logging
import re
import signal
import time

import numpy as np
import pytest

import arendez as dist
from arendez.testing import fresh_context
from tests.harness import spawn_rank
from tests.jobs import failures as failures_jobs

LOCAL, REMOTE = 16, 6  # ranks as tasks of this process; rank processes killed at once


async def _survivor(url: str, world_size: int, rank: int) -> str:
    await dist.init_process_group(init_method=url, world_size=world_size, rank=rank, timeout=60)
    x = np.ones(1000, np.float32)
    try:
        for _ in range(100_000):  # (bounded: the kill ends it within seconds)
            await dist.all_reduce(x)
        return "no error"
    except dist.RankFailedError as exc:
        # stay in the group past the lease (2.5 s): a killed rank this one had no link to is
        # the server's news then (a rank that destroys at once hears of no more losses)
        await asyncio.sleep(4)
        return type(exc).__name__
    finally:
        await dist.destroy_process_group(timeout=5)


async def _files(folder, pattern: str, count: int, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while len(list(folder.glob(pattern))) < count:
        assert time.monotonic() < deadline, f"fewer than {count} {pattern} in {folder}"
        await asyncio.sleep(0.05)


@pytest.mark.timeout(120)
async def test_a_failure_at_scale_is_a_few_lines_per_process(arendez_server, tmp_path, monkeypatch, caplog):
    """16 ranks here, 6 rank processes killed at once: 16 x 6 losses and 16 flight-recorder
    dumps come out as a first line and a summary each, naming every lost rank; each rank's
    dump is one file."""
    dumps = tmp_path / "dumps"
    monkeypatch.setenv("ARENDEZ_FLIGHT_RECORDER_DIR", str(dumps))
    caplog.set_level(logging.INFO, logger="arendez")
    world_size = LOCAL + REMOTE
    url = f"{arendez_server.url}/burst-{tmp_path.name}"
    procs = [
        spawn_rank(failures_jobs.reduce_until_failure, r, world_size, url, str(tmp_path), 1000, 60.0)
        for r in range(LOCAL, world_size)
    ]
    loop = asyncio.get_running_loop()
    tasks = [loop.create_task(_survivor(url, world_size, r), context=fresh_context()) for r in range(LOCAL)]
    try:
        await _files(tmp_path, "ready-*", REMOTE, 60)
        for proc in procs:  # stopped first, so that none sees another's death and ends itself,
            proc.send_signal(signal.SIGSTOP)  # in good order, before its own kill (a CI flake
        for proc in procs:  # under load: two ranks left with a goodbye rather than being lost)
            proc.kill()
        outcomes = await asyncio.wait_for(asyncio.gather(*tasks), 30)
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
        for task in tasks:
            task.cancel()
    assert outcomes == ["RankFailedError"] * LOCAL

    def losses() -> list[str]:
        warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        return [m for m in warned if re.search(r"peer rank \d+:|more peer\(s\) lost", m)]

    def named() -> set[int]:
        found: set[int] = set()
        for line in losses():
            if "more peer(s) lost" in line:
                found.update(int(n) for n in line.split("): ranks ", 1)[1].split(";")[0].split(", "))
            else:
                found.add(int(re.search(r"peer rank (\d+):", line).group(1)))  # type: ignore[union-attr]
        return found

    # a killed rank no survivor was connected to is news from the server, once its lease runs
    # out (2.5 s); a summary closes a second after its burst's first line
    for _ in range(100):
        if named() == set(range(LOCAL, world_size)):
            break
        await asyncio.sleep(0.1)
    await asyncio.sleep(1.5)
    lines = [r.getMessage() for r in caplog.records]
    assert named() == set(range(LOCAL, world_size)), "\n".join(losses())
    assert 2 <= len(losses()) <= 6, "\n".join(losses())  # (16 x 6 = 96 lines, one per rank and peer)

    told = [m for m in lines if "flight recorder dump" in m]
    assert 2 <= len(told) <= 4, "\n".join(told)  # (one per rank and dump: 16-32)
    assert any("more flight recorder dump(s) written by rank(s)" in m for m in told), told
    # (a killed rank may see another's death, and dump, before its own SIGKILL lands)
    written = {p.name for p in dumps.glob("arendez-flightrec-*.json")}
    expected = {f"arendez-flightrec-burst-{tmp_path.name}-rank{r}.json" for r in range(world_size)}
    assert written <= expected, written - expected
    assert {f"arendez-flightrec-burst-{tmp_path.name}-rank{r}.json" for r in range(LOCAL)} <= written


async def test_ranks_of_one_process_declared_failed_are_one_burst(caplog: pytest.LogCaptureFixture) -> None:
    """(QA26: a process of 500 simulated ranks that the server declared failed printed a line per
    rank.) The first expulsion is a line at once, the rest of its burst one summary."""
    from arendez import burstlog
    from arendez.world import World

    why = "this rank was declared failed by the server (no heartbeat for 2.5s)"
    with caplog.at_level(logging.WARNING, logger="arendez.world"):
        for rank in range(40):
            World(rank, 40, 5.0).expelled(why)
        await asyncio.sleep(burstlog.WINDOW + 0.3)
    lines = [r.getMessage() for r in caplog.records if r.name == "arendez.world"]
    assert lines == [
        f"rank 0: {why}",
        f"39 more rank(s) of this process declared failed: ranks 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, "
        f"13, 14, 15, 16, ... and 23 more; the first: {why}",
    ]
