"""The sans-I/O server state, without sockets."""

from __future__ import annotations

import pytest
from arendez_server.limits import StateLimits
from arendez_server.rounds import HOLD_MAX, Hearing, MemberState
from arendez_server.state import Job, ServerState

from arendez.errors import RendezvousError, StoreError


def test_byte_and_key_budgets_are_enforced_and_released():
    job = Job("j", StateLimits(max_keys_per_job=3, max_bytes_per_job=100))
    job.set("a", b"x" * 40)
    job.set("a", b"y" * 40)  # overwriting does not double-count
    assert job.nbytes == 41
    job.set("b", b"z" * 40)
    with pytest.raises(StoreError, match="more than 100 bytes"):
        job.set("c", b"w" * 40)
    job.delete("b")
    job.set("c", b"w" * 40)
    job.set("d", b"")
    with pytest.raises(StoreError, match="3 keys"):
        job.set("e", b"")


@pytest.mark.timeout(10)
def test_the_servers_byte_budget_bounds_every_job_together_and_is_released():
    """Many jobs each within their own limit cannot make the server hold more than
    ``--max-store-bytes`` (QA21: 256 MiB per job, times 10,000 jobs, was unbounded)."""
    state = ServerState(StateLimits(max_bytes_per_job=100, max_store_bytes=150))
    a, b = state.job("a"), state.job("b")
    a.set("k", b"x" * 79)  # 80 bytes
    b.queue_push("q", b"y" * 30)  # 31 + 32
    with pytest.raises(StoreError, match=r"more than 150 bytes .* --max-store-bytes"):
        b.set("k", b"z" * 20)
    assert (state.tally.nbytes, a.nbytes, b.nbytes) == (143, 80, 63)
    assert b.queue_pop("q") == b"y" * 30  # (the queue goes: its name's byte too)
    a.delete("k")
    assert state.tally.nbytes == 0
    b.set("k", b"z" * 99)
    assert state.tally.nbytes == 100


@pytest.mark.timeout(10)
def test_a_scoped_job_is_dropped_with_its_store_once_idle():
    state = ServerState(StateLimits(max_store_bytes=1000))
    state.job("kept").set("k", b"v")
    state.job("scoped").set("k", b"v" * 100)
    state.job("scoped").queue_push("q", b"x")
    state.drop_if_idle("kept", 0)
    state.drop_if_idle("scoped", 1, with_store=True)  # (a client still connected)
    assert sorted(state.jobs) == ["kept", "scoped"]
    state.drop_if_idle("scoped", 0, with_store=True)
    assert list(state.jobs) == ["kept"] and state.tally.nbytes == 2


def test_rounds_assign_ranks_and_a_rejoin_starts_a_new_round():
    job = Job("j", StateLimits())
    r1, a = job.join(-1, 2, "h:1", 0.0)
    _, b = job.join(-1, 2, "h:2", 0.0)
    assert (a, b) == (0, 1) and r1.complete and r1.peers() == ["h:1", "h:2"]
    assert job.leave(r1, 0) is not None
    r2, c = job.join(0, 2, "h:3", 1.0)  # rank 1 of round 1 is still active: a new round forms
    assert r2 is not r1 and not r2.complete and c == 0
    with pytest.raises(RendezvousError, match="already joined"):
        job.join(0, 2, "h:4", 1.0)
    with pytest.raises(RendezvousError, match="world of 2"):
        job.join(-1, 3, "h:4", 1.0)


def test_lease_expiry_declares_silent_members_failed_once():
    job = Job("j", StateLimits())
    r, _ = job.join(-1, 2, "a", 0.0)
    job.join(-1, 2, "b", 0.0)
    job.heartbeat(r, 0, 2.0)
    gone = job.expire(3.0, 2.5)
    assert [(d.rank, d.failed) for d in gone] == [(1, True)]
    assert r.members[1].state is MemberState.FAILED
    assert job.expire(3.1, 2.5) == []
    with pytest.raises(RendezvousError, match="declared failed"):
        job.attach(1, 2, r.nonce, "b", 4.0)


def test_leases_start_when_the_round_completes():
    job = Job("j", StateLimits())
    job.join(-1, 2, "a", 0.0)  # the first rank waits 10 s for the second
    r, _ = job.join(-1, 2, "b", 10.0)
    assert job.expire(10.1, 2.5) == []
    assert [d.rank for d in job.expire(13.0, 2.5)] == [0, 1]
    assert r.members[0].state is MemberState.FAILED


def test_a_server_that_hears_nobody_spares_open_leases_and_restarts_them_when_it_hears_again():
    lease_s = 2.5
    state = ServerState()
    job = state.job("j")
    hearing = Hearing(0.0, lease_s)
    alive, dead, killed = (state.lease(k * 16, 0.0) for k in (b"a", b"d", b"k"))
    alive.keepers = dead.keepers = killed.keepers = 1  # each with its keeper connection open
    r, _ = job.join(0, 3, "a", 0.0, alive)
    job.join(1, 3, "d", 0.0, dead)
    job.join(2, 3, "k", 0.0, killed)
    for now in (0.5, 1.0):  # all renew, then the server is cut off at 1.0
        for held in (alive, dead, killed):
            held.renew(now)
        hearing.hear(now)
    assert not hearing.deaf(2.0) and hearing.deaf(2.3)  # half a lease without any heartbeat
    killed.keepers = 0  # its process was killed: the connection closed (news from the network)
    assert state.spared(4.0, lease_s)  # leases ran out: some of them the server must not act on
    gone = state.expire(4.0, lease_s, deaf=True)
    assert [(d.rank, d.failed) for d in gone] == [(2, True)]
    assert state.expire(9.0, lease_s, deaf=True) == []  # the open ones are spared while deaf
    assert state.spared(1.0 + lease_s + HOLD_MAX, lease_s)  # for HOLD_MAX beyond their lease,
    assert not state.spared(1.1 + lease_s + HOLD_MAX, lease_s)  # not longer
    # back at 11.0: only ``alive`` renews (``dead`` died during the outage)
    assert hearing.hear(11.0) == pytest.approx(10.0) and not hearing.deaf(11.0)
    alive.renew(11.0)
    assert state.expire(11.1, lease_s, since=hearing.since) == []  # restarted: not overdue yet
    for now in (11.5, 12.0, 12.5, 13.0, 13.5, 14.0, 14.5, 15.0, 15.5, 16.0):
        alive.renew(now), hearing.hear(now)
        assert state.expire(now, lease_s, since=hearing.since) == []  # two leases to come back
    alive.renew(16.2), hearing.hear(16.2)
    gone = state.expire(16.2, lease_s, since=hearing.since)
    assert [(d.rank, d.failed) for d in gone] == [(1, True)]
    assert r.members[0].state is MemberState.ACTIVE


def test_no_silence_of_the_server_postpones_a_declaration_past_the_hold():
    """(Review: heartbeats that kept arriving just over a lease apart pushed every restart one
    lease further, and a stopped rank beside them was never declared.)"""
    lease_s = 2.5
    state = ServerState()
    job = state.job("j")
    hearing = Hearing(0.0, lease_s)
    lagging, stopped = state.lease(b"l" * 16, 0.0), state.lease(b"s" * 16, 0.0)
    lagging.keepers = stopped.keepers = 1
    job.join(0, 2, "l", 0.0, lagging)
    r, _ = job.join(1, 2, "s", 0.0, stopped)
    stopped.renew(0.0)
    now, gone = 0.0, []
    while not gone and now < 2 * HOLD_MAX:
        now += 2.6  # the lagging process beats a little over a lease apart: every beat restarts
        lagging.renew(now), hearing.hear(now)
        gone = state.expire(now, lease_s, since=hearing.since, deaf=hearing.deaf(now))
    assert [(d.rank, d.failed) for d in gone] == [(1, True)]
    assert lease_s + HOLD_MAX < now <= lease_s + HOLD_MAX + 2.6
    assert r.members[0].state is MemberState.ACTIVE


def test_a_lone_process_renewing_on_time_never_looks_like_silence():
    hearing = Hearing(0.0, 1.0)  # a short lease: deaf_after stays two heartbeat intervals
    for step in range(1, 20):
        assert hearing.hear(step * 0.5 + 0.4 * (step % 2)) is None
    assert hearing.since == float("-inf")
    hearing = Hearing(0.0, 2.5)  # a silence shorter than a lease (a loaded machine) restarts none
    assert hearing.hear(2.0) == pytest.approx(2.0) and hearing.since == float("-inf")


def test_add_stays_in_64_bit_range():
    job = Job("j", StateLimits())
    job.add("n", 2**63 - 1)
    with pytest.raises(StoreError, match="64-bit"):
        job.add("n", 1)
    assert job.get("n") == str(2**63 - 1).encode()


def test_a_process_lease_renews_all_its_members_and_arms_late():
    state = ServerState()
    job = state.job("j")
    lease = state.lease(b"k" * 16, 0.0)  # the process's keeper has not renewed it yet
    r, _ = job.join(-1, 2, "a", 0.0, lease)
    job.join(-1, 2, "b", 0.0, lease)
    assert job.expire(5.0, 2.5, arm_grace=10.0) == []  # unarmed: the grace applies
    lease.renew(6.0)
    assert job.expire(8.0, 2.5) == []  # one renewal covers both members
    gone = job.expire(8.6, 2.5)
    assert sorted(d.rank for d in gone) == [0, 1] and not r.in_use
    assert state.lease(b"k" * 16, 9.0) is lease  # held while a member refers to it


def test_free_ranks_are_handed_out_in_order_around_explicit_ones():
    job = Job("j", StateLimits())
    job.join(1, 4, "x", 0.0)
    ranks = [job.join(-1, 4, "y", 0.0)[1] for _ in range(3)]
    assert ranks == [0, 2, 3]


def test_a_round_is_on_one_machine_only_if_every_member_named_the_same_one():
    job = Job("j", StateLimits())
    same, _ = job.join(0, 2, "h:1", 0.0, machine="boot-a:1:2")
    job.join(1, 2, "h:2", 0.0, machine="boot-a:1:2")
    assert same.one_machine()
    mixed, _ = job.join(0, 2, "h:1", 1.0, machine="boot-a:1:2")
    job.join(1, 2, "h:2", 1.0, machine="boot-b:1:2")
    assert not mixed.one_machine()
    silent, _ = job.join(0, 2, "h:1", 2.0, machine="")  # (shared memory off on both)
    job.join(1, 2, "h:2", 2.0, machine="")
    assert not silent.one_machine()
