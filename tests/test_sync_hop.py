"""The blocking hop into arendez's loop thread (``arendez.loop.LoopThread``), without a network."""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from arendez.errors import RankFailedError
from arendez.loop import LoopThread
from arendez.loopcpu import SPIN_MICROS, Spin, cpu_quota
from tests.harness import PY, collect, popen, run_function
from tests.jobs import local as local_jobs


@pytest.fixture
def hop() -> Iterator[LoopThread]:
    thread = LoopThread()
    yield thread
    loop = thread.loop()
    loop.call_soon_threadsafe(loop.stop)


async def _echo(value: int, delay: float = 0.0) -> int:
    if delay:
        await asyncio.sleep(delay)
    return value


async def _fail() -> None:
    await asyncio.sleep(0)
    raise RankFailedError(3, "all_reduce", "connection lost")


def test_call_returns_the_value_and_reraises_the_same_error(hop: LoopThread) -> None:
    assert hop.call(_echo, 7) == 7
    with pytest.raises(RankFailedError) as info:
        hop.call(_fail)
    assert info.value.rank == 3


def test_bad_arguments_raise_in_the_caller(hop: LoopThread) -> None:
    with pytest.raises(TypeError):
        hop.call(_echo)  # missing argument: the coroutine cannot even be built


def test_calls_start_in_call_order(hop: LoopThread) -> None:
    seen: list[int] = []

    async def note(i: int) -> None:
        seen.append(i)
        await asyncio.sleep(0.001 * (5 - i % 5))

    pending = [hop.start(note, (i,)) for i in range(50)]
    for p in pending:
        p.result(10)
    assert seen == list(range(50))


def test_many_threads_each_get_their_own_result(hop: LoopThread) -> None:
    results: dict[int, list[int]] = {}

    def worker(t: int) -> None:
        results[t] = [hop.call(_echo, t * 1000 + i) for i in range(200)]

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    assert all(results[t] == [t * 1000 + i for i in range(200)] for t in range(8))


def test_wait_with_timeout_and_done_callback_on_the_loop_thread(hop: LoopThread) -> None:
    where: list[str] = []
    done = hop.start(_echo, (5, 0.3), None, lambda d: where.append(threading.current_thread().name))
    t0 = time.monotonic()
    assert done.wait(0.05) is False and not done.done()
    assert time.monotonic() - t0 < 0.25
    with pytest.raises(TimeoutError):
        done.result(0.01)
    assert done.result(5) == 5
    assert done.wait() and done.wait(0)  # every later wait passes straight through
    assert where == ["arendez-loop"]


def test_a_blocking_call_from_the_loop_thread_is_refused(hop: LoopThread) -> None:
    async def nested() -> int:
        return hop.call(_echo, 1)

    with pytest.raises(RuntimeError, match="loop thread itself"):
        hop.call(nested)


def test_the_hop_does_not_hold_the_gil_while_waiting(hop: LoopThread) -> None:
    """A Python thread keeps running while another waits on a slow call."""
    ticks = 0
    stop = threading.Event()

    def count() -> None:
        nonlocal ticks
        while not stop.is_set():
            ticks += 1

    counter = threading.Thread(target=count)
    counter.start()
    try:
        before = ticks
        hop.call(_echo, 1, 0.3)
        assert ticks - before > 1000
    finally:
        stop.set()
        counter.join(5)


async def _affinity() -> list[int]:
    return sorted(os.sched_getaffinity(0))


@pytest.mark.timeout(10)
def test_the_loop_thread_keeps_to_one_cpu_and_the_caller_keeps_its_own(
    hop: LoopThread, monkeypatch: pytest.MonkeyPatch
) -> None:
    allowed = sorted(os.sched_getaffinity(0))
    assert hop.keep_on_one_cpu(1) is None  # (not on the loop thread: nothing changes)
    assert hop.call(_affinity) == allowed
    monkeypatch.setenv("ARENDEZ_PIN_LOOP", "0")
    assert hop.call(_pin, hop, 1) is None
    assert hop.call(_affinity) == allowed
    monkeypatch.delenv("ARENDEZ_PIN_LOOP")
    pinned = hop.call(_pin, hop, len(allowed) + 1)  # (cyclically: the second allowed CPU)
    if len(allowed) < 2:  # (one CPU: nothing to choose)
        assert pinned is None
        return
    assert pinned == allowed[1]
    assert hop.call(_affinity) == [allowed[1]]
    assert sorted(os.sched_getaffinity(0)) == allowed


async def _pin(hop: LoopThread, index: int) -> int | None:
    return hop.keep_on_one_cpu(index)


_RANK = """
import json, os, sys, threading
import numpy as np
import arendez.sync as dist
from arendez.loop import shared
async def affinity():
    return sorted(os.sched_getaffinity(0))
seen = []
for round_ in range(2):  # (a second init in the same process, on the loop thread pinned before)
    dist.init_process_group("arendez", init_method=sys.argv[1] + str(round_), rank=int(sys.argv[2]),
                            world_size=2)
    x = np.ones(2)
    later = dist.all_reduce(x, async_op=True).get_future().then(lambda _: sorted(os.sched_getaffinity(0)))
    seen.append({"loop": shared.call(affinity), "main": sorted(os.sched_getaffinity(0)),
                 "spin": shared.spin.seconds, "callback": later.wait(), "sum": x.tolist()})
    dist.destroy_process_group()
print(json.dumps(seen))
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("pin", ["1", "0"])
def test_the_loop_threads_of_a_hosts_ranks_keep_to_cpus_of_their_own(arendez_server: Any, pin: str) -> None:
    """Blocking ranks on one host: each loop thread on the CPU of its ``LOCAL_RANK`` (unless
    ``ARENDEZ_PIN_LOOP=0``), the main threads and the threads the loop thread starts (a
    future's callback) on every CPU they had; the loops poll for a blocking call's answer (1 ms,
    ``ARENDEZ_SPIN_US``) while the host has a CPU per rank. All of it again on a second init."""
    env = {"ARENDEZ_PIN_LOOP": pin, "ARENDEZ_SPIN_US": "1000" if pin == "1" else "0"}
    url = f"{arendez_server.url}/pin{pin}-"
    procs = [popen([PY, "-c", _RANK, url, str(r)], env={**env, "LOCAL_RANK": str(r)}) for r in range(2)]
    results = collect(procs, 50)
    for res in results:
        assert res.returncode == 0, res.stderr[-3000:]
    allowed = sorted(os.sched_getaffinity(0))
    pinned = pin == "1" and len(allowed) >= 2
    spin = 0.001 if pinned else 0.0
    for rank, res in enumerate(results):
        for seen in json.loads(res.stdout.strip().splitlines()[-1]):
            assert seen["loop"] == ([allowed[rank]] if pinned else allowed), seen
            assert seen["main"] == seen["callback"] == allowed, seen
            assert seen["spin"] == spin and seen["sum"] == [2.0, 2.0], seen


@pytest.mark.timeout(10)
def test_polling_is_for_a_host_with_a_cpu_per_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    spin = Spin()
    assert spin.configure(local_ranks=2, cpus=2) == SPIN_MICROS / 1e6
    assert spin.configure(local_ranks=4, cpus=2) == 0.0
    monkeypatch.setenv("ARENDEZ_SPIN_US", "250")
    assert spin.configure(local_ranks=1, cpus=2) == 250e-6
    monkeypatch.setenv("ARENDEZ_SPIN_US", "0")
    assert spin.configure(local_ranks=1, cpus=2) == 0.0 and spin.budget() == 0.0


@pytest.mark.timeout(20)
def test_polls_that_run_out_back_off_and_an_answer_in_time_resets_them(
    hop: LoopThread, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A call answered while the loop polls keeps the polling on; one that outlasts the poll
    makes the next call skip it, then two, four... calls after each further miss. (A 100 ms
    poll here, so that a loaded machine still answers the quick calls within it.)"""
    monkeypatch.setenv("ARENDEZ_SPIN_US", "100000")
    hop.spin.configure(local_ranks=1, cpus=2)
    assert hop.call(_echo, 1) == 1
    assert hop.spin.budget() == 0.1  # (answered in time: the next call polls)
    skipped = []
    for _ in range(3):
        hop.call(_echo, 1, 0.3)  # (outlasts the poll)
        calls = 0
        while hop.spin.budget() == 0.0:
            calls += 1
        skipped.append(calls)
    assert skipped == [1, 2, 4]
    hop.call(_echo, 1)
    hop.call(_echo, 1, 0.3)
    assert hop.spin.budget() == 0.0 and hop.spin.budget() == 0.1  # (back to one skipped)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("spin_us", "crowded"), [("", False), ("0", False), ("", True)])
def test_an_awaited_collective_polls_while_the_hosts_ranks_have_a_cpu_each(
    arendez_server: Any, spin_us: str, crowded: bool
) -> None:
    """The async API in the caller's own loop: its world polls for a collective's messages (1
    ms) when the host's ranks (``LOCAL_WORLD_SIZE``) fit on the CPUs the process may use; not
    with ``ARENDEZ_SPIN_US=0``, nor when they are more than the CPUs."""
    cpus = len(os.sched_getaffinity(0))
    env = {"LOCAL_WORLD_SIZE": str(cpus + 1 if crowded else 2)}
    if spin_us:
        env["ARENDEZ_SPIN_US"] = spin_us
    url = f"{arendez_server.url}/poll-{spin_us or 'default'}-{crowded}"
    seen = run_function(local_jobs.polling_after_all_reduce, 2, url, env=env)
    want = 0.001 if not spin_us and not crowded and cpus >= 2 else 0.0
    assert [s["spin"] for s in seen] == [want, want]
    assert [s["sum"] for s in seen] == [[3.0] * 3] * 2


@pytest.mark.timeout(10)
def test_a_containers_cpu_limit_counts(tmp_path: Path) -> None:
    """The CFS quota of the process's cgroup (v2 ``cpu.max``, or v1) caps the CPUs to poll on."""
    own = tmp_path / "self-cgroup"
    own.write_text("0::/job/rank0\n")
    v2 = tmp_path / "job" / "rank0"
    v2.mkdir(parents=True)
    (v2 / "cpu.max").write_text("150000 100000\n")
    assert cpu_quota(tmp_path, own) == 1.5
    (v2 / "cpu.max").write_text("max 100000\n")
    assert cpu_quota(tmp_path, own) is None
    (v2 / "cpu.max").unlink()
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("200000\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert cpu_quota(tmp_path, own) == 2.0
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert cpu_quota(tmp_path, own) is None


@pytest.mark.timeout(10)
def test_calls_waited_on_at_once_share_one_poll(monkeypatch: pytest.MonkeyPatch) -> None:
    """50 collectives in flight keep one callback ready per loop turn, not 50; each is let go
    as it ends, and one answered in time keeps the polling on. (A 10 s poll here: the 20 turns
    fit in it on a loaded machine.)"""
    monkeypatch.setenv("ARENDEZ_SPIN_US", "10000000")

    async def main() -> tuple[int, int, float]:
        spin = Spin()
        spin.configure(local_ranks=1, cpus=2)
        polls = 0
        poll = spin._poll

        def counted(loop: asyncio.AbstractEventLoop) -> None:
            nonlocal polls
            polls += 1
            poll(loop)

        spin._poll = counted  # type: ignore[method-assign]
        ended = [False] * 50
        for i in range(50):
            spin.poll_until(lambda i=i: ended[i])  # type: ignore[misc]
        for _ in range(20):
            await asyncio.sleep(0)
        turns = polls
        ended[:] = [True] * 50
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        return turns, len(spin._waiting), spin.budget()

    turns, left, budget = asyncio.run(main())
    assert 19 <= turns <= 22  # (about one poll per loop turn)
    assert left == 0 and budget == 10.0


@pytest.mark.timeout(10)
def test_a_burst_of_calls_that_run_out_backs_off_once() -> None:
    async def main() -> tuple[float, float]:
        spin = Spin()
        spin.configure(local_ranks=1, cpus=2)
        for _ in range(50):
            spin.poll_until(lambda: False)
        await asyncio.sleep(0.01)  # (all 50 ran out, in the same turn)
        return spin.budget(), spin.budget()

    assert asyncio.run(main()) == (0.0, 0.001)  # one call skipped, not 256
