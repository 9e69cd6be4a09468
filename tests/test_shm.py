"""Shared-memory payloads: the ring allocator, segments, and real ranks on one host."""

from __future__ import annotations

import os
import signal
import socket
import time
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from arendez import shm
from tests.harness import collect, run_ranks, spawn_rank, wait_for_files
from tests.jobs import failures as failures_jobs
from tests.jobs import shm as shm_jobs


# -- RingSpace -----------------------------------------------------------------------------
@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 5000), st.integers(0, 10**6)), max_size=200))
def test_ring_space_hands_out_disjoint_aligned_ranges(steps):
    ring = shm.RingSpace(16 * 1024)
    live: dict[int, int] = {}  # offset -> requested bytes
    for allocate, nbytes, pick in steps:
        if allocate or not live:
            offset = ring.alloc(nbytes)
            if offset is None:
                assert live, "an empty ring refused a request that fits"
                continue
            assert offset % shm.ALIGN == 0 and offset >= 0 and offset + nbytes <= ring.size
            for other, size in live.items():
                assert offset + nbytes <= other or other + size <= offset, "ranges overlap"
            live[offset] = nbytes
        else:
            offset = sorted(live)[pick % len(live)]  # frees come in any order
            ring.free(offset)
            del live[offset]
        assert (ring.used == 0) == (not live)
    for offset in list(live):
        ring.free(offset)
    assert ring.alloc(ring.size) == 0  # everything came back


def test_ring_space_reclaims_from_the_oldest_range_forward():
    ring = shm.RingSpace(1024)
    a, b, c = ring.alloc(256), ring.alloc(256), ring.alloc(256)
    assert (a, b, c) == (0, 256, 512)
    assert ring.alloc(512) is None  # 256 left at the end
    ring.free(b)
    assert ring.alloc(512) is None  # b is free but a, older, still holds the front
    ring.free(a)
    assert ring.alloc(512) == 0  # wrapped into what a and b gave back
    assert ring.alloc(1) is None  # the head met c's range: full, and says so at once


def test_ring_space_refuses_what_can_never_fit_and_unknown_frees():
    ring = shm.RingSpace(1024)
    assert ring.alloc(2048) is None
    with pytest.raises(KeyError):
        ring.free(64)


# -- Segment -------------------------------------------------------------------------------
@pytest.fixture
def shm_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("ARENDEZ_SHM_DIR", str(tmp_path))
    return tmp_path


def test_segment_is_shared_and_leaves_no_file(shm_dir):
    mine = shm.Segment.create(1 << 16)
    theirs = shm.Segment.attach(mine.path, mine.size, mine.cookie)
    mine.view(100, 5)[:] = b"hello"
    assert bytes(theirs.view(100, 5)) == b"hello"
    theirs.unlink()
    mine.unlink()
    assert list(shm_dir.iterdir()) == []
    mine.view(0, 3)[:] = b"abc"  # the mapping outlives the file
    assert bytes(theirs.view(0, 3)) == b"abc"
    with pytest.raises(TypeError):  # the receiver's mapping is read-only: the sender's to write
        theirs.view(0, 3)[:] = b"xyz"
    with pytest.raises(ValueError, match="outside"):
        theirs.view(1 << 16, 1)
    mine.close()
    theirs.close()


def test_attach_refuses_what_is_not_the_offered_segment(shm_dir, tmp_path_factory):
    mine = shm.Segment.create(4096)
    try:
        with pytest.raises(shm.ShmUnavailable, match="someone else"):
            shm.Segment.attach(mine.path, mine.size, b"x" * shm.COOKIE_BYTES)
        with pytest.raises(shm.ShmUnavailable, match="not 8192 bytes"):
            shm.Segment.attach(mine.path, 8192, mine.cookie)
        elsewhere = tmp_path_factory.mktemp("other") / os.path.basename(mine.path)
        with pytest.raises(shm.ShmUnavailable, match="not a segment"):
            shm.Segment.attach(str(elsewhere), mine.size, mine.cookie)  # another host's path
        with pytest.raises(shm.ShmUnavailable, match="not a segment"):
            shm.Segment.attach(str(shm_dir / "passwd"), mine.size, mine.cookie)
        with pytest.raises(shm.ShmUnavailable, match="cannot open"):
            shm.Segment.attach(str(shm_dir / "arendez-gone"), mine.size, mine.cookie)
    finally:
        mine.close()
    assert list(shm_dir.iterdir()) == []


def test_create_fails_cleanly_without_a_directory(monkeypatch, tmp_path):
    monkeypatch.setenv("ARENDEZ_SHM_DIR", str(tmp_path / "missing"))
    with pytest.raises(shm.ShmUnavailable, match="cannot create"):
        shm.Segment.create(4096)
    assert not shm.enabled()


def test_a_process_holds_segments_up_to_its_budget(shm_dir, monkeypatch):
    """Segments are real memory: past ARENDEZ_SHM_PROCESS_BYTES a pair is refused (it then uses
    sockets), and closing a segment gives its bytes back."""
    size = 1 << 16
    monkeypatch.setattr(shm, "PROCESS_BYTES", shm._held + 2 * (size + shm.COOKIE_BYTES))
    first, second = shm.Segment.create(size), shm.Segment.create(size)
    with pytest.raises(shm.ShmUnavailable, match="ARENDEZ_SHM_PROCESS_BYTES"):
        shm.Segment.create(size)
    first.close()
    third = shm.Segment.create(size)
    for segment in (second, third):
        segment.close()


def test_a_nearly_full_directory_is_left_alone(shm_dir, monkeypatch):
    """A segment that would leave the directory (a tmpfs: the host's memory) with less than a
    quarter, or DIRECTORY_RESERVE, free is refused."""
    real = os.statvfs(shm_dir)
    size = 1 << 30

    def with_free(free: int) -> None:
        fake = mock.Mock(f_frsize=1, f_blocks=size, f_bavail=free)
        monkeypatch.setattr(shm.os, "statvfs", lambda path: fake if path == str(shm_dir) else real)

    with_free(size // 4 + (1 << 20))
    shm.Segment.create(4096).close()
    with_free(size // 4 + 4096)
    with pytest.raises(shm.ShmUnavailable, match="1024 MiB free; arendez leaves 256 MiB"):
        shm.Segment.create(1 << 16)
    assert list(shm_dir.iterdir()) == []


# -- Channels: the handshake between two ranks, without sockets ----------------------------
def _pair(size: int = 1 << 16) -> tuple[shm.Channels, shm.Channels]:
    return shm.Channels(allowed=True, size=size), shm.Channels(allowed=True, size=size)


def test_channels_handshake_carries_payloads_and_frees(shm_dir):
    a, b = _pair()
    offer = a.on_hello(1, b.host)  # b said hello: same host key, so a offers
    assert offer is not None and not a.carries(1, 1 << 16)
    assert b.on_offer(0, *offer) == (True, "")
    assert a.on_answer(1, True) and a.carries(1, 1 << 16) and 1 in a.settled
    assert list(shm_dir.iterdir()) == []  # both unlinked: nothing to leak
    assert not a.carries(1, shm.MIN_PAYLOAD - 1)  # small payloads stay inline
    offset, dest = a.reserve(1, 40_000)
    dest[:] = b"\x07" * 40_000
    assert bytes(b.payload(0, offset, 40_000)) == b"\x07" * 40_000
    assert b.free(0, offset)
    [(peer, offsets)] = b.take_frees()
    assert peer == 0 and offsets == [offset] and b.take_frees() == []
    a.on_free(1, offsets)
    with pytest.raises(ValueError, match="does not hold"):
        a.on_free(1, offsets)  # a second free of the same range is the peer's bug, not ours
    with pytest.raises(ValueError, match="outside"):
        b.payload(0, 1 << 16, 1)
    a.close()
    b.close()


def test_channels_other_host_or_refusal_stays_on_tcp(shm_dir):
    a, b = _pair()
    assert a.on_hello(1, "another-boot:1:2") is None and 1 in a.settled
    assert not list(shm_dir.iterdir())  # nothing created for a peer elsewhere
    offer = a.on_hello(2, b.host)
    assert offer is not None
    assert not a.on_answer(2, False) and not a.carries(2, 1 << 20)
    assert list(shm_dir.iterdir()) == []
    off = shm.Channels(allowed=False)
    assert off.on_offer(0, *_pair()[0].on_hello(0, b.host))[0] is False


def test_channels_refuse_malformed_and_repeated_offers(shm_dir):
    a, b = _pair()
    path, size, cookie = a.on_hello(1, b.host)
    assert b.on_offer(0, path, size, 12345) == (False, "malformed offer")
    assert b.on_offer(0, path, -1, cookie) == (False, "malformed offer")
    assert b.on_offer(0, 7, size, cookie) == (False, "malformed offer")
    assert b.on_offer(0, path, size, cookie)[0] is True
    assert b.on_offer(0, path, size, cookie) == (False, "this link already has a segment")
    with pytest.raises(ValueError, match="without a segment"):
        a.payload(5, 0, 10)
    with pytest.raises(ValueError, match="never given"):
        b.on_free(0, [0])  # b never sent anything through shared memory
    a.close()
    b.close()


def test_abandoned_offers_and_stale_files_are_removed(shm_dir):
    a, b = _pair()
    assert a.on_hello(1, b.host) is not None
    a.abandon_unanswered()  # init stopped waiting for the answer
    assert list(shm_dir.iterdir()) == []
    stale = shm_dir / "arendez-999999999-left"  # a pid that cannot exist, an hour old
    stale.write_bytes(b"x")
    os.utime(stale, (time.time() - 3600, time.time() - 3600))
    fresh = shm_dir / "arendez-999999999-handshaking"
    fresh.write_bytes(b"x")
    alive = shm_dir / f"arendez-{os.getpid()}-mine"
    alive.write_bytes(b"x")
    os.utime(alive, (time.time() - 3600, time.time() - 3600))
    assert shm.sweep_stale() == 1
    assert sorted(p.name for p in shm_dir.iterdir()) == sorted([fresh.name, alive.name])


# -- real ranks ----------------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_large_payloads_go_through_shared_memory_and_no_file_stays(arendez_server, shm_dir):
    results = run_ranks(shm_jobs.shm_job, 3, f"{arendez_server.url}/shm", 300_001, 3, env={})
    for res in results:
        assert res["shm"] > 0.8 * res["received"], res
        assert res["copied"] == 0, res
        assert res["during"] == [] and res["after"] == [], res  # unlinked once mapped


@pytest.mark.timeout(60)
def test_a_full_ring_falls_back_to_tcp(arendez_server, shm_dir):
    """A ring far smaller than what is in flight, and no waiting for room: part of the bytes
    take TCP, none are lost."""
    env = {"ARENDEZ_SHM_BYTES": str(1536 * 1024), "ARENDEZ_SHM_ROOM_WAIT_MS": "0"}
    results = run_ranks(shm_jobs.shm_job, 4, f"{arendez_server.url}/shm-small", 1_000_003, 2, env=env)
    for res in results:
        assert 0 < res["shm"] < res["received"] and res["full"] > 0, res  # (how much: timing)


@pytest.mark.timeout(60)
def test_a_full_ring_is_waited_for(arendez_server, shm_dir):
    """The same small ring, and sends wait for the receiver to hand back room (as they do by
    default, for up to 100 ms): every large payload goes through shared memory."""
    env = {"ARENDEZ_SHM_BYTES": str(1536 * 1024), "ARENDEZ_SHM_ROOM_WAIT_MS": "30000"}
    results = run_ranks(shm_jobs.shm_job, 4, f"{arendez_server.url}/shm-wait", 1_000_003, 2, env=env)
    for res in results:
        assert res["full"] == 0 and res["waits"] > 0, res
        assert res["shm"] > 0.95 * res["received"], res


@pytest.mark.timeout(60)
def test_ranks_that_cannot_share_memory_use_tcp(arendez_server, tmp_path):
    """Separate shm directories stand for separate hosts (or containers): every offer fails."""
    dirs = [tmp_path / f"host{r}" for r in range(2)]
    procs = []
    for rank, folder in enumerate(dirs):
        folder.mkdir()
        env = {"ARENDEZ_SHM_DIR": str(folder)}
        procs.append(
            spawn_rank(shm_jobs.shm_job, rank, 2, f"{arendez_server.url}/shm-apart", 300_001, 2, env=env)
        )
    for res in collect(procs, 50):
        assert res.returncode == 0, res.stderr[-3000:]
        assert res.value["shm"] == 0 and res.value["received"] > 0, res.value


@pytest.mark.timeout(60)
def test_ranks_past_their_shared_memory_budget_use_sockets(arendez_server, shm_dir):
    env = {"ARENDEZ_SHM_PROCESS_BYTES": "0"}
    results = run_ranks(shm_jobs.shm_job, 3, f"{arendez_server.url}/shm-budget", 300_001, 2, env=env)
    for res in results:  # (shm_job checks every result against numpy)
        assert res["shm"] == 0 and res["received"] > 0, res
        assert list(shm_dir.iterdir()) == []


@pytest.mark.timeout(90)
def test_kill_9_while_payloads_sit_in_shared_memory(arendez_server, tmp_path, monkeypatch):
    shm_dir = tmp_path / "shm"
    shm_dir.mkdir()
    monkeypatch.setenv("ARENDEZ_SHM_DIR", str(shm_dir))
    url = f"{arendez_server.url}/shm-kill"
    procs = [
        spawn_rank(failures_jobs.reduce_until_failure, r, 3, url, str(tmp_path), 500_000, 40.0)
        for r in range(3)
    ]
    try:
        wait_for_files(tmp_path, "ready-*", 3)
        os.kill(procs[1].pid, signal.SIGKILL)
        killed_at = time.time()
        results = collect([procs[0], procs[2]], 20)
    finally:
        procs[1].kill()
        procs[1].wait()
    for res in results:
        assert res.returncode == 0, res.stderr[-3000:]
        assert res.value["error"] == "RankFailedError" and res.value["rank_named"] == 1, res.value
        assert res.value["at"] - killed_at < 3.0
    assert list(shm_dir.iterdir()) == []


@pytest.mark.timeout(30)
def test_forged_shared_memory_reference_closes_only_that_link(arendez_server):
    """A peer that points outside its segment (or has none) gets its connection closed; the rank
    raises RankFailedError instead of reading out of bounds, and the server is unharmed."""
    results = run_ranks(failures_jobs.forged_shm_reference, 2, f"{arendez_server.url}/shm-forged", timeout=25)
    assert "RankFailedError" in results[0] and "rank 1" in results[0], results[0]
    assert results[1] == "sent"
    with socket.create_connection(("127.0.0.1", arendez_server.port), timeout=5):
        pass  # still accepting
