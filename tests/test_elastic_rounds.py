"""Elastic rounds: the server's close rules and rank order, the arguments, ``min`` not reached,
and ``reform``/``share_state`` between ranks of one process against a real server."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Any

import numpy as np
import pytest
from arendez_server.limits import StateLimits
from arendez_server.state import Job

import arendez as dist
from arendez import elastic
from arendez.errors import RendezvousError
from tests.harness import ROOT, ServerProcess, popen, run_ranks
from tests.jobs import elastic as jobs


# -- the server's round logic (sans-I/O) ------------------------------------------------------
def test_an_elastic_round_closes_at_max_and_survivors_keep_their_order() -> None:
    job = Job("j", StateLimits())
    first = [job.join_elastic(2, 3, f"a{i}", 0.0)[1] for i in range(3)]  # closes at max
    assert job.forming is None and [m.rank for m in first] == [0, 1, 2]
    (round0,) = job.rounds.values()
    assert (round0.generation, round0.survivors, round0.world_size) == (0, 0, 3)
    # rank 1 dies; a newcomer (launcher slot 1) arrives before the survivors 2 and 0
    for rank in (0, 2):
        job.leave(round0, rank)
    newcomer = job.join_elastic(2, 3, "n", 1.0, hint=1)[1]
    _, old2, gone = job.join_elastic(2, 3, "b2", 1.0, came_from=0, hint=2, dead=[1])
    assert [(g.rank, g.failed) for g in gone] == [(1, True)]  # declared failed at once
    old0 = job.join_elastic(2, 3, "b0", 1.0, came_from=0, hint=0, dead=[1])[1]
    assert job.forming is None  # full again (3)
    assert (old0.rank, old2.rank, newcomer.rank) == (0, 1, 2)
    assert job.latest is not None and (job.latest.generation, job.latest.survivors) == (1, 2)


def test_at_min_the_round_waits_for_the_settle_time_unless_every_live_rank_is_in() -> None:
    job = Job("j", StateLimits())
    round_, _, _ = job.join_elastic(2, 4, "a", 0.0)
    assert job.settle(round_, 0.1) is None  # 1 < min
    job.join_elastic(2, 4, "b", 0.0)
    assert job.forming is round_  # 2 of 4, no round before: the settle time closes it
    assert job.settle(round_, 0.3) is round_ and job.forming is None and round_.world_size == 2
    # rank 1 dies; rank 0 reports it and re-forms: the one live rank is in, no settle time
    job.leave(round_, 0)
    r2, _, _ = job.join_elastic(1, 4, "a", 1.0, came_from=0, hint=0, dead=[1])
    assert job.forming is None and r2.world_size == 1 and r2.survivors == 1


def test_a_round_does_not_close_while_a_rank_of_the_running_round_is_active() -> None:
    """A rank that fell behind (stopped, then resumed) must not start a world of its own."""
    job = Job("j", StateLimits())
    for i in range(3):
        job.join_elastic(1, 4, f"a{i}", 0.0)
    running = job.settle(job.forming, 0.3)  # type: ignore[arg-type]
    assert running is not None and running.world_size == 3
    stale, _, _ = job.join_elastic(1, 4, "s", 1.0, came_from=-1)
    assert job.settle(stale, 1.3) is None and job.forming is stale  # the others still run
    for rank in range(3):  # they see "joiners waiting" and re-form
        job.leave(running, rank)
        assert job.close_ready(2.0) is None  # not all of them are in yet
        job.join_elastic(1, 4, f"b{rank}", 2.0, came_from=0, hint=rank)
    assert job.forming is None and job.latest is not running
    assert job.latest.world_size == 4 and job.latest.survivors == 3
    assert job.latest.members[3].address == "s"  # the stale rank comes after the survivors


def test_a_rank_of_an_older_round_counts_as_new() -> None:
    job = Job("j", StateLimits())
    job.generation = 5
    stale = job.join_elastic(1, 3, "s", 0.0, came_from=3, hint=0)[1]  # was stopped for 2 rounds
    fresh = job.join_elastic(1, 3, "f", 0.0, came_from=4, hint=2)[1]
    late = job.join_elastic(1, 3, "g", 0.0, came_from=4, hint=1)[1]
    assert (late.rank, fresh.rank, stale.rank) == (0, 1, 2)
    round_ = next(iter(job.rounds.values()))
    assert round_.survivors == 2


def test_elastic_and_fixed_joins_do_not_mix() -> None:
    job = Job("j", StateLimits())
    job.join_elastic(2, 4, "a", 0.0)
    with pytest.raises(RendezvousError, match=r"forming 2\.\.4 ranks, this rank asked for 3\.\.4"):
        job.join_elastic(3, 4, "b", 0.0)
    with pytest.raises(RendezvousError, match=r"elastic world of 2\.\.4 ranks, this rank asked for a fixed"):
        job.join(-1, 4, "c", 0.0)
    other = Job("k", StateLimits())
    other.join(-1, 4, "a", 0.0)
    with pytest.raises(RendezvousError, match="forming a fixed world of 4"):
        other.join_elastic(2, 4, "b", 0.0)
    for lo, hi, what in ((0, 2, "min world size"), (3, 2, "exceeds"), (1, True, "max world size")):
        with pytest.raises(RendezvousError, match=what):
            Job("x", StateLimits()).join_elastic(lo, hi, "a", 0.0)


# -- the arguments ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("world_size", "error", "words"),
    [
        ((0, 2), ValueError, "world_size min must be at least 1, got 0"),
        ((3, 2), ValueError, r"min <= max, got \(3, 2\)"),
        ((1.5, 2), TypeError, "world_size min must be an int"),
        ((1, 2, 3), ValueError, "needs two ints"),
    ],
)
def test_bad_elastic_sizes_are_refused_before_any_io(world_size: Any, error: type, words: str) -> None:
    with pytest.raises(error, match=words):
        asyncio.run(dist.init_process_group(init_method="arendez://127.0.0.1:1/j", world_size=world_size))


def test_elastic_needs_a_server_that_outlives_rank_0_and_leaves_ranks_to_it() -> None:
    for url in ("tcp://127.0.0.1:1", "file:///tmp/x", "inproc://j"):
        with pytest.raises(RendezvousError, match="needs a standalone arendez-server"):
            asyncio.run(dist.init_process_group(init_method=url, world_size=(1, 2)))
    with pytest.raises(ValueError, match="assigns ranks: leave rank=-1"):
        asyncio.run(dist.init_process_group(init_method="arendez://127.0.0.1:1/j", world_size=(1, 2), rank=1))
    with pytest.raises(RendezvousError, match="reform\\(\\) needs an elastic world"):
        asyncio.run(elastic.reform())


def test_env_min_world_size() -> None:
    env = {"ARENDEZ_MIN_WORLD_SIZE": "2", "WORLD_SIZE": "4"}
    assert elastic.bounds(-1, env) == elastic.Bounds(2, 4)
    assert elastic.bounds(3, env) is None  # an explicit size wins
    with pytest.raises(RendezvousError, match=r"ARENDEZ_MIN_WORLD_SIZE=5 must be in 1\.\.WORLD_SIZE=4"):
        elastic.bounds(-1, {**env, "ARENDEZ_MIN_WORLD_SIZE": "5"})
    with pytest.raises(RendezvousError, match="needs WORLD_SIZE"):
        elastic.bounds(-1, {"ARENDEZ_MIN_WORLD_SIZE": "2"})
    with pytest.raises(RendezvousError, match="ARENDEZ_ELASTIC_SETTLE"):
        elastic.settle_seconds({"ARENDEZ_ELASTIC_SETTLE": "-1"})


# -- against a real server --------------------------------------------------------------------
@pytest.mark.timeout(30)
def test_min_not_reachable_is_a_rendezvous_error_at_the_deadline(arendez_server: ServerProcess) -> None:
    async def main() -> float:
        started = time.monotonic()
        with pytest.raises(
            RendezvousError, match=r"only 1 rank\(s\) joined in time.*at least 3 \(missing: 2"
        ):
            await dist.init_process_group(
                init_method=f"{arendez_server.url}/short", world_size=(3, 4), timeout=1.5
            )
        return time.monotonic() - started

    waited = asyncio.run(main())
    assert 1.4 < waited < 6.0


@pytest.mark.timeout(60)
def test_share_state_and_a_reform_without_failure(arendez_server: ServerProcess) -> None:
    """Real rank processes: rank 0's state (arrays and values, never pickled) reaches every
    rank; a re-form with everyone alive keeps every rank where it was."""
    results = run_ranks(jobs.share, 3, f"{arendez_server.url}/state", timeout=50)
    for got in results:
        assert (got["step"], got["tag"], got["dtype"]) == (7, "x", "float32")
        assert got["w"] == np.arange(6, dtype=np.float32).reshape(2, 3).tolist()
        assert (got["generation"], got["survivors"]) == (0, 0)
        rank, size, before = got["reformed"]
        assert (rank, size) == (before, 3)
        assert (got["generation2"], got["survivors2"]) == (1, 3)
    with pytest.raises(TypeError, match="plain numeric dtype"):
        elastic._split({"o": np.array([object()])})


@pytest.mark.timeout(60)
def test_the_blocking_facade_reforms_too(arendez_server: ServerProcess) -> None:
    script = str(ROOT / "tests" / "scripts" / "elastic_sync.py")
    procs = [popen([sys.executable, script, f"{arendez_server.url}/sync"]) for _ in range(2)]
    outs = []
    for proc in procs:
        out, err = proc.communicate(timeout=50)
        assert proc.returncode == 0, err[-3000:]
        outs.append(json.loads(out.strip().splitlines()[-1]))
    for got in outs:
        assert got["after"] == [got["before"], 2] and got["w"] == [1.0, 1.0, 1.0] and got["waiting"] == 0


@pytest.mark.timeout(30)
async def test_ranks_waiting_to_join_are_news_to_the_running_round_by_its_nonce(
    arendez_server: ServerProcess,
) -> None:
    """The server names the round its ``joining`` news is for, and the client keeps it by round
    as it arrives (news that races a re-form is not dropped for want of a world to note it in)."""
    from arendez.store import Store

    host, port = arendez_server.url.removeprefix("arendez://").rsplit(":", 1)
    stores = [Store(host, int(port), "joining") for _ in range(3)]
    try:
        for store in stores:
            await store.connect(10)

        async def join(store: Store, i: int) -> Any:
            return await store.join(3, -1, f"a{i}", 10, peers=False, min_size=2, settle=0.05)

        first = await asyncio.gather(join(stores[0], 0), join(stores[1], 1))
        assert {m.world_size for m in first} == {2}
        nonce = first[0].nonce
        late = asyncio.create_task(join(stores[2], 2))  # waits in the next round (min 2)
        for _ in range(200):
            if all(s.joining.get(nonce) == 1 for s in stores[:2]):
                break
            await asyncio.sleep(0.01)
        assert [s.joining.get(nonce) for s in stores[:2]] == [1, 1]
        assert not stores[2].joining  # (it is the one waiting)
        late.cancel()
        with pytest.raises(asyncio.CancelledError):
            await late
    finally:
        for store in stores:
            await store.close()


@pytest.mark.timeout(60)
async def test_a_member_dead_before_its_peers_reach_it_sends_them_to_the_next_round(
    arendez_server: ServerProcess,
) -> None:
    """A rank of the round just formed that died before anyone connected (a second failure
    during a re-form: QA saw survivors crash with ``RendezvousError`` in 4 of 12 trials) does
    not end the job: the others join the next round, naming it dead, and form it without it."""
    import socket

    from arendez.registry import fresh_context
    from arendez.store import Store

    url = f"{arendez_server.url}/dead-member"
    host, port = arendez_server.url.removeprefix("arendez://").rsplit(":", 1)
    with socket.socket() as closed:  # an address where nothing listens: the member "died"
        closed.bind(("127.0.0.1", 0))
        dead_address = f"127.0.0.1:{closed.getsockname()[1]}"
    ghost = Store(host, int(port), "dead-member")
    await ghost.connect(10)

    async def rank() -> tuple[int, int, int]:
        await dist.init_process_group(init_method=url, world_size=(2, 3), timeout=20)
        x = np.ones(4, np.float32)
        await dist.all_reduce(x)
        got = (dist.get_world_size(), elastic.generation(), int(x[0]))
        await dist.destroy_process_group()
        return got

    try:
        loop = asyncio.get_running_loop()
        ranks = [loop.create_task(rank(), context=fresh_context()) for _ in range(2)]
        await asyncio.sleep(0.2)  # (the ghost joins last and completes the round of 3)
        await ghost.join(3, -1, dead_address, 10, peers=False, min_size=2)
        assert await asyncio.gather(*ranks) == [(2, 1, 2), (2, 1, 2)]
    finally:
        await ghost.close()
