"""Cancellation is an event of the whole group (issue 20): a collective cancelled on one rank
ends on every rank with ``CollectiveCancelledError``, and the group stays usable."""

from __future__ import annotations

import asyncio
from typing import Any

import msgpack
import numpy as np
import pytest

import arendez as dist
from arendez import frames, wire
from arendez.testing import run_ranks
from tests.harness import run_ranks as run_processes
from tests.jobs import cancel as jobs

TCP = {"ARENDEZ_SHM": "0"}
SHM = {"ARENDEZ_SHM": "1"}


# -- the decoder's divert: the half-received payload's remaining bytes go nowhere ------------
def _frame(header: Any, payload: bytes) -> bytes:
    raw = msgpack.packb(header, use_bin_type=True)
    return wire.PREFIX.pack(len(raw), len(payload)) + raw + payload


def _feed(decoder: wire.Decoder, data: bytes, step: int) -> list[tuple[Any, memoryview | None]]:
    out = []
    view = memoryview(data)
    while view:
        buf = decoder.get_buffer()
        n = min(len(buf), len(view), step)
        buf[:n] = view[:n]
        view = view[n:]
        out.extend(decoder.feed(n))
    return out


def test_divert_keeps_the_stream_in_step_and_never_writes_the_buffer_again() -> None:
    user = np.zeros(300_000, np.uint8)
    decoder = wire.Decoder(sink=lambda h, n: memoryview(user) if h == "big" else None)
    big = _frame("big", (bytes(range(1, 256)) * 1200)[:300_000])
    after = _frame("next", b"abc")
    assert _feed(decoder, big[:100_000], 7000) == []
    written = user.copy()
    assert written.any()  # part of the payload landed in place (zero copy)
    landing = decoder.divert(lambda h, dest: h == "big" and dest.obj is user)
    assert landing is not None and landing.obj is user
    got = _feed(decoder, big[100_000:] + after, 7000)
    assert np.array_equal(user, written)  # not one byte more
    assert [h for h, _ in got] == ["big", "next"]
    assert got[0][1] is wire.DIVERTED and bytes(got[1][1] or b"") == b"abc"


def test_divert_keep_moves_the_payload_to_a_fresh_buffer() -> None:
    user = np.zeros(300_000, np.uint8)
    decoder = wire.Decoder(sink=lambda h, n: memoryview(user))
    payload = (bytes(range(1, 256)) * 1200)[:300_000]
    frame = _frame("p2p", payload)
    _feed(decoder, frame[:150_000], 5000)
    written = user.copy()
    assert decoder.divert(lambda h, dest: True, keep=True) is not None
    got = _feed(decoder, frame[150_000:], 5000)
    assert np.array_equal(user, written)
    assert got[0][0] == "p2p" and got[0][1] is not None and bytes(got[0][1]) == payload


def test_divert_leaves_other_payloads_alone() -> None:
    decoder = wire.Decoder()
    frame = _frame("other", bytes(200_000))
    _feed(decoder, frame[:50_000], 4096)
    assert decoder.divert(lambda h, dest: h == "big") is None
    got = _feed(decoder, frame[50_000:], 4096)
    assert got[0][0] == "other" and got[0][1] is not None and got[0][1].nbytes == 200_000


def test_cancel_frame_round_trips_and_is_checked() -> None:
    frame = frames.Cancel(0, 5, "all_reduce")
    assert frames.decode(frames.encode(frame)) == frame
    with pytest.raises(dist.ProtocolError, match="Cancel frame: bad seq"):
        frames.decode([int(frames.Kind.CANCEL), 0, "5", "all_reduce"])


def test_error_names_rank_and_collective() -> None:
    exc = dist.CollectiveCancelledError(3, "all_gather", 12)
    assert isinstance(exc, dist.ArendezError)
    assert str(exc) == "rank 3 cancelled all_gather (seq 12)"
    assert (exc.rank, exc.collective, exc.seq) == (3, "all_gather", 12)


# -- in-process ranks ------------------------------------------------------------------------
def _inproc(fn: Any, *args: Any) -> list[Any]:
    async def rank(r: int) -> Any:
        return await fn(r, 2, "", *args)

    return asyncio.run(run_ranks(2, rank, timeout=30))


@pytest.fixture
def inproc_join(monkeypatch: pytest.MonkeyPatch) -> None:
    """The jobs join themselves; in-process, ``run_ranks`` already did: make join a no-op and
    destroy leave the world to ``run_ranks``."""

    async def joined(url: str, ws: int, rank: int, timeout: float = 30.0) -> None:
        assert dist.is_initialized()

    monkeypatch.setattr(jobs, "join", joined)


def test_issue_scenario_inproc(inproc_join: None) -> None:
    r0, r1 = _inproc(jobs.issue_scenario)
    assert r0 == {"first": "timed out", "y": [30.0]}
    assert r1["first"] == "CollectiveCancelledError: rank 0 cancelled all_reduce (seq 0)"
    assert r1["cancelled_by"] == 0 and r1["y"] == [30.0]
    assert r1["seconds"] < 3.0


def test_the_api_calls_are_still_coroutine_functions_to_asyncio() -> None:
    # (they return a Call, which a cancel before the start still counts, not a bare coroutine)
    assert asyncio.iscoroutinefunction(dist.all_reduce) and asyncio.iscoroutinefunction(dist.barrier)
    assert asyncio.iscoroutinefunction(dist.send)


@pytest.mark.parametrize("mode", ["wait_for", "cancel", "task_group"])
def test_a_collective_cancelled_before_it_started_still_takes_its_place_inproc(
    inproc_join: None, mode: str
) -> None:
    r0, r1 = _inproc(jobs.cancel_before_start, mode)
    assert r0["first"] == {"wait_for": "TimeoutError", "cancel": "CancelledError"}.get(mode, "ExceptionGroup")
    assert r1["first"] == "CollectiveCancelledError: rank 0 cancelled all_reduce (seq 0)", r1
    assert r0["sums"] == r1["sums"] == [21.0, 41.0]  # (paired with the wrong step: 31, then a mismatch)


def test_a_timed_out_collective_ends_on_the_late_rank_too_inproc(inproc_join: None) -> None:
    r0, r1 = _inproc(jobs.late_after_a_timeout)
    assert r1["first"].startswith("CollectiveTimeoutError: all_reduce (seq 0) timed out after 2s"), r1
    assert r0["first"] == "CollectiveCancelledError: rank 1 timed out after 2s in all_reduce (seq 0)", r0
    assert r0["x"] == 1.0  # (not 3.0: rank 1's part, sent before its timeout, was not taken)
    assert r0["y"] == r1["y"] == 30.0


def test_cancel_one_of_eight_concurrent_inproc(inproc_join: None) -> None:
    r0, r1 = _inproc(jobs.cancel_one_of_eight)
    expected = ["ok"] * 8
    assert r0 == [*expected[:3], "CancelledError", *expected[4:]]
    assert r1 == [*expected[:3], "CollectiveCancelledError", *expected[4:]]


def test_cancel_at_random_points_inproc(inproc_join: None) -> None:
    outcomes = _inproc(jobs.cancel_at_random, 1 << 20, 6, 1)
    assert outcomes[0][0] == "cancelled", outcomes  # (rank 1 may have had all it needed)
    assert all(o in ("completed", "cancelled", "peer cancelled") for r in outcomes for o in r)


# -- real processes over TCP and shared memory ----------------------------------------------
def test_issue_scenario_over_tcp(arendez_server: Any) -> None:
    r0, r1 = run_processes(jobs.issue_scenario, 2, f"{arendez_server.url}/cancel-issue", env=TCP)
    assert r0 == {"first": "timed out", "y": [30.0]}
    assert r1["first"] == "CollectiveCancelledError: rank 0 cancelled all_reduce (seq 0)"
    assert r1["y"] == [30.0]
    assert r1["seconds"] < 3.0  # at once, not after the 30 s group timeout


@pytest.mark.parametrize("env", [TCP, SHM], ids=["tcp", "shm"])
@pytest.mark.parametrize(
    "collective,nbytes,rounds",
    [("all_reduce", 1 << 20, 4), ("all_reduce", 64 << 20, 2), ("broadcast", 64 << 20, 2)],
    ids=["all_reduce-1MiB", "all_reduce-64MiB", "broadcast-64MiB"],
)
def test_cancel_at_random_points(
    arendez_server: Any, env: dict[str, str], collective: str, nbytes: int, rounds: int
) -> None:
    url = f"{arendez_server.url}/cancel-{collective}-{nbytes}-{env['ARENDEZ_SHM']}"
    results = run_processes(jobs.cancel_at_random, 2, url, nbytes, rounds, 7, collective, env=env, timeout=90)
    canceller = 0 if collective == "all_reduce" else 1
    mine, theirs = results[canceller], results[1 - canceller]
    assert mine[0] == "cancelled", results  # (round 0 cancels at once)
    if nbytes > 8 << 20:  # too large to be over before the cancel: the peer was still in it
        assert "peer cancelled" in theirs, results
    for a, b in zip(mine, theirs, strict=True):  # a cancel that came too late changes nothing
        assert (a, b) in {
            ("completed", "completed"),
            ("cancelled", "peer cancelled"),
            ("cancelled", "completed"),  # the peer had done its part before the cancel
        }, results


def test_a_collective_cancelled_before_it_started_still_takes_its_place_over_tcp(arendez_server: Any) -> None:
    url = f"{arendez_server.url}/cancel-early"
    r0, r1 = run_processes(jobs.cancel_before_start, 2, url, "wait_for", env=TCP)
    assert r0["first"] == "TimeoutError", r0
    assert r1["first"].startswith("CollectiveCancelledError: rank 0"), r1
    assert r0["sums"] == r1["sums"] == [21.0, 41.0]


def test_a_timed_out_collective_ends_on_the_late_rank_too_over_tcp(arendez_server: Any) -> None:
    r0, r1 = run_processes(jobs.late_after_a_timeout, 2, f"{arendez_server.url}/late", env=TCP)
    assert r1["first"].startswith("CollectiveTimeoutError"), r1
    assert r0["first"] == "CollectiveCancelledError: rank 1 timed out after 2s in all_reduce (seq 0)", r0
    assert r0["y"] == r1["y"] == 30.0


def test_cancel_one_of_eight_concurrent_over_tcp(arendez_server: Any) -> None:
    r0, r1 = run_processes(jobs.cancel_one_of_eight, 2, f"{arendez_server.url}/cancel-8", env=TCP)
    assert r0 == ["ok"] * 3 + ["CancelledError"] + ["ok"] * 4
    assert r1 == ["ok"] * 3 + ["CollectiveCancelledError"] + ["ok"] * 4


def test_cancelled_init_leaves_nothing_half_joined(arendez_server: Any, tmp_path: Any) -> None:
    url = f"{arendez_server.url}/cancel-init"
    assert run_processes(jobs.cancel_init, 2, url, str(tmp_path)) == [3.0, 3.0]


def test_cancelled_destroy_still_closes_within_its_timeout(arendez_server: Any) -> None:
    r0, r1 = run_processes(jobs.cancel_destroy, 2, f"{arendez_server.url}/cancel-destroy")
    assert r0["destroy"] == "cancelled" and r0["initialized"] is False
    assert r0["pending"] == "GroupDestroyedError"
    assert r0["destroy_seconds"] < 4.0  # its own timeout is 1 s
    assert "destroyed its process group" in r1["reason"], r1


def test_cancelled_recv_mid_payload_over_tcp(arendez_server: Any) -> None:
    url = f"{arendez_server.url}/cancel-recv"
    _, seen = run_processes(jobs.cancel_recv, 2, url, 64 << 20, env=TCP)
    assert seen[0] == "gave up", seen  # 64 MiB do not cross loopback in 10 ms


@pytest.mark.timeout(60)
@pytest.mark.parametrize("env", [TCP, SHM], ids=["tcp", "shm"])
def test_a_peer_told_of_a_cancel_is_not_left_cancelling(arendez_server: Any, env: dict[str, str]) -> None:
    """(QA25: on Python 3.11 a collective running in lanes, told of a peer's cancel, left its
    caller's task with a cancel request counted, one more per such collective.)"""
    url = f"{arendez_server.url}/left-cancelling-{env['ARENDEZ_SHM']}"
    _, seen = run_processes(jobs.peers_task_not_left_cancelling, 2, url, env=env)
    assert [count for _, _, count in seen] == [0, 0, 0], seen
    assert any(outcome == "cancelled" for _, outcome, _ in seen), seen  # (the case was reached)
