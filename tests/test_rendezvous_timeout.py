"""A rendezvous that times out counts the ranks that joined (the caller included) and names the
missing ones."""

from __future__ import annotations

import asyncio

import pytest

import arendez as dist
from tests.harness import free_port


@pytest.mark.timeout(30)
async def test_a_rank_alone_counts_itself_and_names_the_missing() -> None:
    url = f"tcp://127.0.0.1:{free_port()}"
    with pytest.raises(  # (a timeout: a StoreTimeoutError too, torch's DistStoreError)
        dist.RendezvousTimeoutError, match=r"only 1 of 3 ranks joined in time \(missing: 2 rank\(s\): 1, 2\)"
    ):
        await dist.init_process_group(init_method=url, world_size=3, rank=0, timeout=1.0)
    assert not dist.is_initialized()


@pytest.mark.timeout(30)
async def test_a_round_that_times_out_names_the_joins_it_refused(arendez_server) -> None:
    """A rank with the wrong world size, or a second rank 0, is refused at once; the rank left
    waiting hears of both when its round times out, not only that a rank is missing."""
    stores = [
        await dist.Store("127.0.0.1", arendez_server.port, "refusals", timeout=10).connect() for _ in range(3)
    ]
    try:
        waiting = asyncio.ensure_future(stores[0].join(2, 0, "127.0.0.1:1", timeout=2.0))
        await asyncio.sleep(0.3)
        with pytest.raises(dist.RendezvousError, match=r"forming a world of 2, rank 1 asked for 3"):
            await stores[1].join(3, 1, "127.0.0.1:2", timeout=2.0)
        with pytest.raises(dist.RendezvousError, match=r"rank 0 of job 'refusals' has already joined"):
            await stores[2].join(2, 0, "127.0.0.1:3", timeout=2.0)
        with pytest.raises(dist.RendezvousError) as timed_out:
            await waiting
        message = str(timed_out.value)
        assert "only 1 of 2 ranks joined in time (missing: 1 rank(s): 1)" in message, message
        assert "joins refused meanwhile: " in message, message
        assert "rank 1 asked for 3" in message and "rank 0 of job 'refusals' has already joined" in message, (
            message
        )
    finally:
        for store in stores:
            await store.close()


@pytest.mark.timeout(30)
async def test_ranks_that_gave_up_first_are_not_named_missing(arendez_server) -> None:
    """Ranks whose deadlines pass a moment apart: the later ones still count the earlier ones as
    joined. Before, rank 2 said "only 1 of 4 joined (missing: 0, 1, 3)" when only 3 never came."""
    stores = [
        await dist.Store("127.0.0.1", arendez_server.port, "gave-up", timeout=10).connect() for _ in range(3)
    ]
    try:
        joins = [
            asyncio.ensure_future(store.join(4, rank, f"127.0.0.1:{rank + 1}", timeout=1.0 + 0.3 * rank))
            for rank, store in enumerate(stores)
        ]
        outcomes = await asyncio.gather(*joins, return_exceptions=True)
        for outcome in outcomes:
            assert isinstance(outcome, dist.RendezvousError), outcome
            assert "only 3 of 4 ranks joined in time (missing: 1 rank(s): 3)" in str(outcome), outcome
    finally:
        for store in stores:
            await store.close()


@pytest.mark.timeout(30)
async def test_a_rank_whose_rank_0_never_answers_is_told_rank_0_hosts_the_store() -> None:
    """Under tcp:// rank 0 hosts the store: a store that never answers (rank 0 not started, or
    killed while the others start) is named as rank 0's (QA20-F2: only "unreachable")."""
    url = f"tcp://127.0.0.1:{free_port()}"
    with pytest.raises(dist.StoreConnectTimeoutError, match="rank 0 hosts the store: did rank 0 start"):
        await dist.init_process_group(init_method=url, world_size=2, rank=1, timeout=2.0)
    assert not dist.is_initialized()
