"""The blocking hop into arendez's loop thread (``arendez.loop.LoopThread``), without a network."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator

import pytest

from arendez.errors import RankFailedError
from arendez.loop import LoopThread


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
