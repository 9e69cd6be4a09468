"""The error hierarchy: errors cross process boundaries intact, and stay readable at scale."""

from __future__ import annotations

import pickle
from concurrent.futures import ProcessPoolExecutor

import pytest

import arendez as dist


def _raise_rank_failed() -> None:
    exc = dist.RankFailedError(3, "all_reduce", "declared failed by the server (no heartbeat for 2.5s)")
    exc.add(5, "connection lost")
    raise exc


@pytest.mark.parametrize(
    "exc",
    [
        dist.CollectiveCancelledError(1, "barrier", 4),
        dist.WaitTimeoutError("all_reduce", 2.0),
        dist.CollectiveTimeoutError("broadcast", 1.5, iter([2, 1]), iter([3])),
        dist.StoreTimeoutError("get('k') not satisfied within 1s"),
        dist.InvalidArgumentError("output_tensor must be float32 x 8, got float32 x 6"),
    ],
    ids=lambda e: type(e).__name__,
)
def test_errors_pickle_with_their_fields(exc: dist.ArendezError) -> None:
    copy = pickle.loads(pickle.dumps(exc))
    assert type(copy) is type(exc) and str(copy) == str(exc) and copy.__dict__ == exc.__dict__


def test_a_rank_failure_raised_in_another_process_arrives_whole() -> None:
    with ProcessPoolExecutor(1) as pool, pytest.raises(dist.RankFailedError) as caught:
        pool.submit(_raise_rank_failed).result(timeout=60)
    assert caught.value.ranks == [3, 5] and caught.value.collective == "all_reduce"
    assert str(caught.value).endswith("; then rank 5: connection lost")


def test_a_failure_at_scale_names_a_few_ranks_with_reasons_and_counts_the_rest() -> None:
    exc = dist.RankFailedError(0, "all_reduce", "declared failed by the server")
    for rank in range(1, 1001):
        exc.add(rank, "declared failed by the server")
    exc.add(7, "named twice")
    message = str(exc)
    assert exc.ranks == list(range(1001))
    assert message.count("declared failed by the server") == 1 + dist.RankFailedError.TOLD
    assert f"and {1000 - dist.RankFailedError.TOLD} more rank(s): 9, 10, 11," in message
    assert len(message) < 1000, len(message)
