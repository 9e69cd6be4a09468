"""Peer connections opened on first use (issue 11): init connects each rank to its O(log W)
neighbours only, collectives and point-to-point open what else they need, a simultaneous dial
yields one connection, and the death of a rank nobody connected to is still seen.

W=16 here (16 real processes fit the suite's time on 2 cores); W=64 is in
``benchmarks/lazy_mesh.py``.
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import numpy as np
import pytest

import arendez as dist
from arendez import frames, testing
from arendez.errors import RendezvousError
from arendez.lifecycle import neighbour_offsets
from arendez.transports.tcp import Mesh
from tests.harness import run_ranks
from tests.jobs import lazy as lazy_jobs


def _neighbours(rank: int, ws: int) -> list[int]:
    return sorted({(rank + k) % ws for k in neighbour_offsets(ws)} - {rank})


def _pairs(peers: list[list[int]]) -> set[tuple[int, int]]:
    return {(min(r, p), max(r, p)) for r, mine in enumerate(peers) for p in mine}


def test_neighbour_offsets_are_plus_minus_powers_of_two():
    assert neighbour_offsets(1) == []
    assert neighbour_offsets(2) == [-1, 1]
    assert neighbour_offsets(16) == [-8, -4, -2, -1, 1, 2, 4, 8]
    assert len(neighbour_offsets(10_000)) == 28  # +-2^0 .. +-2^13: within the server's 64


async def test_simultaneous_dials_leave_one_connection_the_lower_ranks():
    meshes = [Mesh(token="t"), Mesh(token="t")]
    ports = [await m.listen("127.0.0.1") for m in meshes]
    addresses = {r: f"127.0.0.1:{p}" for r, p in enumerate(ports)}
    got: dict[int, list[int]] = {0: [], 1: []}
    lost: list[str] = []
    try:
        for rank, mesh in enumerate(meshes):

            def route(peer: int, frame: Any, payload: Any, rank: int = rank) -> None:
                got[rank].append(frame.qid)

            mesh.start(rank, 2, b"n" * 16, addresses, route, lambda *_: None, lambda p, why: lost.append(why))
        links = [meshes[0].link(1), meshes[1].link(0)]  # both dial in the same loop turn
        for qid in range(5):  # queued while the dials run, in order
            for link in links:
                assert link is not None
                link.send(frames.encode(frames.Query(0, qid)))
        async with asyncio.timeout(10):
            while len(got[0]) < 5 or len(got[1]) < 5:
                await asyncio.sleep(0.01)
        for link in links:  # sent on the connection once it is up
            assert link is not None
            link.send(frames.encode(frames.Query(0, 5)))
        async with asyncio.timeout(10):
            while len(got[0]) < 6 or len(got[1]) < 6:
                await asyncio.sleep(0.01)
        assert got == {0: list(range(6)), 1: list(range(6))}
        assert [m.opened for m in meshes] == [1, 1] and not lost
        assert meshes[0].conns[1].peer[1] == ports[1]  # rank 0 dialed it: rank 0's dial won
        assert meshes[1].conns[0].peer[1] != ports[0]
    finally:
        for mesh in meshes:
            await mesh.close(2)


@pytest.mark.timeout(10)
async def test_preconnect_with_no_time_left_blames_the_time_not_the_addresses():
    """QA: 'peer connections not made in 0s … check the advertised addresses' when a slow
    rendezvous had used all of init's timeout; the addresses were fine."""
    meshes = [Mesh(token="t"), Mesh(token="t")]
    ports = [await m.listen("127.0.0.1") for m in meshes]
    addresses = {r: f"127.0.0.1:{p}" for r, p in enumerate(ports)}
    try:
        meshes[0].start(0, 2, b"n" * 16, addresses, lambda *_: None, lambda *_: None, lambda *_: None)
        with pytest.raises(RendezvousError, match=r"not made in 0s.*timeout left only 0s") as info:
            await meshes[0].preconnect([1], 0.0)
        assert "ARENDEZ_ADVERTISE_ADDR" not in str(info.value)
    finally:
        for mesh in meshes:
            await mesh.close(2)


@pytest.mark.timeout(20)
async def test_init_failed_by_a_peer_that_left_names_the_failure_it_left_on():
    """QA (kill -9 during init, 2 of 14 trials): survivors blamed rank 0, which had left on the
    news of the dead rank, because its departure reached them first. A neighbour that left
    makes init wait a moment for the news of a failure, and the error names that failure."""
    with socket.socket() as idle:  # (listening, never accepting: dials to it wait for an answer)
        idle.bind(("127.0.0.1", 0))
        idle.listen(16)
        nowhere = f"127.0.0.1:{idle.getsockname()[1]}"
        for failure_follows in (True, False):
            mesh = Mesh(token="t")
            await mesh.listen("127.0.0.1")
            try:
                addresses = {r: nowhere for r in range(4)}
                mesh.start(1, 4, b"n" * 16, addresses, lambda *_: None, lambda *_: None, lambda *_: None)
                joining = asyncio.ensure_future(mesh.preconnect([0, 2], 10.0))
                await asyncio.sleep(0.1)
                mesh.forget(0, "it left the job (the server says)", left=True)
                await asyncio.sleep(0.3)
                assert not joining.done()  # (waiting for the news of why it left)
                if failure_follows:
                    mesh.forget(3, "declared failed by the server (no heartbeat for 2.5s)")
                with pytest.raises(RendezvousError) as info:
                    await joining
                if failure_follows:
                    assert info.value.rank == 3 and info.value.unreachable == (3, 0)
                    assert str(info.value).startswith("could not connect to rank 0 at")
                    assert "; the job also lost rank 3 (declared failed by the server" in str(info.value)
                else:
                    assert info.value.rank == 0 and info.value.unreachable == (0,)
                    assert "it left the job" in str(info.value) and "also lost" not in str(info.value)
            finally:
                await mesh.close(2)


@pytest.mark.timeout(20)
async def test_init_that_hears_bad_news_dials_the_neighbours_that_should_dial_it():
    """QA (kill -9 of rank 1 during init under tcp://): rank 0, rank 1's dialer, failed at once
    and exited with the store; ranks 2 and 3, waiting for rank 1 to dial them, heard nothing
    more and timed out, or blamed rank 0. News that the job is failing (rank 0 left here) makes
    init dial those neighbours itself: a refused dial names the dead rank at once."""
    with socket.socket() as idle, socket.socket() as dead:
        idle.bind(("127.0.0.1", 0))
        idle.listen(16)  # rank 3: alive but slow (never answers)
        dead.bind(("127.0.0.1", 0))  # rank 1: nothing listens (connections are refused)
        addresses = {r: f"127.0.0.1:{idle.getsockname()[1]}" for r in range(4)}
        addresses[1] = f"127.0.0.1:{dead.getsockname()[1]}"
        mesh = Mesh(token="t")
        await mesh.listen("127.0.0.1")
        try:
            mesh.start(2, 4, b"n" * 16, addresses, lambda *_: None, lambda *_: None, lambda *_: None)
            joining = asyncio.ensure_future(mesh.preconnect([0, 1, 3], 10.0))
            await asyncio.sleep(0.3)
            assert not joining.done()  # (ranks 0 and 1 are to dial it; it dials rank 3)
            mesh.forget(0, "it left the job (the server says)", left=True)
            with pytest.raises(RendezvousError) as info:
                await asyncio.wait_for(joining, 0.9)  # (before the 1 s wait for news would end)
            assert info.value.rank == 1 and info.value.unreachable == (1, 0), info.value
            assert "could not connect to rank 1 at" in str(info.value) and "Refused" in str(info.value)
        finally:
            await mesh.close(2)


@pytest.mark.timeout(120)
def test_init_connects_neighbours_only_and_first_use_dials_once(arendez_server, tmp_path):
    ws, a, b = 16, 0, 5  # 5 is no +-2^k from 0 (mod 16): not connected at init
    url = f"{arendez_server.url}/lazy-{tmp_path.name}"
    out = run_ranks(lazy_jobs.connection_counts, ws, url, a, b, timeout=100)
    for rank, res in enumerate(out):
        assert res["init"] == _neighbours(rank, ws), (rank, res["init"])
    init = _pairs([res["init"] for res in out])
    assert len(init) < ws * (ws - 1) // 2
    assert (a, b) not in init
    after = _pairs([res["all_reduce"] for res in out])
    assert init <= after < _pairs([list(range(ws))] * ws), sorted(after - init)
    # both sent to each other at once: each has one connection to the other, and counted one
    final = [res["p2p"] for res in out]
    assert b in final[a] and a in final[b]
    assert _pairs(final) == after | {(a, b)}
    for rank, res in enumerate(out):
        assert res["opened"] == len(res["p2p"]), (rank, res)


@pytest.mark.timeout(90)
def test_death_of_a_rank_never_connected_to_is_seen(arendez_server, tmp_path):
    ws, victim = 8, 3  # rank 0's neighbours (8): 1, 2, 4, 6, 7 - not 3
    url = f"{arendez_server.url}/lazy-dead-{tmp_path.name}"
    from tests.harness import collect, spawn_rank

    procs = [spawn_rank(lazy_jobs.unconnected_failure, r, ws, url, victim, str(tmp_path)) for r in range(ws)]
    results = collect(procs, 80)
    for res in results:
        if res.rank != victim:
            assert res.returncode == 0, res.stderr[-3000:]
    survivors = {res.rank: res.value for res in results if res.rank != victim}
    # rank 0 dials the dead rank on first use: the refused dial names it at once
    zero = survivors.pop(0)
    assert not zero["connected"]
    assert zero["error"].startswith(f"{victim}: "), zero
    assert "could not connect to rank 3" in zero["error"], zero
    assert zero["seconds"] < 2.0, zero
    unconnected = [r for r, s in survivors.items() if not s["connected"]]
    assert unconnected, survivors  # (the scenario needs some)
    for rank, seen in survivors.items():
        assert seen["error"] != "never seen", (rank, seen)
        if seen["connected"]:  # its connection broke
            assert "connection lost" in seen["error"], (rank, seen)
        else:  # the server's declaration: within the lease (2.5 s) and its sweep
            assert "declared failed by the server" in seen["error"], (rank, seen)
        assert seen["seconds"] < 5.0, (rank, seen)


@pytest.mark.timeout(90)
async def test_small_collectives_of_a_group_of_no_power_of_two_connect_few_pairs(arendez_server, monkeypatch):
    """24 ranks over TCP: a barrier, a small all_reduce, all_gather and broadcast, and the
    object collectives leave each rank with its O(log W) neighbours and the fold partners, not
    all 23 peers (QA: a 72-rank job dialed every pair on its first barrier and timed out; 256
    ranks in one process ran out of fds on all_gather_object)."""
    monkeypatch.setenv("ARENDEZ_SHM", "0")
    ws = 24

    async def rank_main(rank: int) -> list[int]:
        await dist.barrier()
        x = np.full(4, float(rank))
        await dist.all_reduce(x)
        assert x[0] == sum(range(ws))
        blocks = [np.zeros(2) for _ in range(ws)]
        await dist.all_gather(blocks, np.full(2, float(rank)))
        assert [b[0] for b in blocks] == [float(r) for r in range(ws)]
        y = np.full(4, float(rank))
        await dist.broadcast(y, src=7)
        assert y.tolist() == [7.0] * 4
        objects: list[object] = [None] * ws
        await dist.all_gather_object(objects, {"rank": rank, "pad": "x" * rank})
        assert objects == [{"rank": r, "pad": "x" * r} for r in range(ws)]
        chosen = [rank, "from 5"] if rank == 5 else [None, None]
        await dist.broadcast_object_list(chosen, src=5)
        assert chosen == [5, "from 5"]
        squares = [None] * ws if rank == 3 else None
        await dist.gather_object(rank * rank, squares, dst=3)
        assert rank != 3 or squares == [r * r for r in range(ws)]
        return lazy_jobs._peers()

    url = f"arendez://127.0.0.1:{arendez_server.port}/few-pairs"
    peers = await testing.run_ranks(ws, rank_main, init_method=url, timeout=80)
    for rank, mine in enumerate(peers):
        fold = {rank + 16, rank - 16} & set(range(ws))
        assert set(mine) <= set(_neighbours(rank, ws)) | fold, (rank, mine)


@pytest.mark.timeout(90)
async def test_dials_refused_by_a_busy_local_listener_are_retried(arendez_server, monkeypatch):
    """Every rank dials every other at once over the same-host Unix sockets, against listeners
    that admit one pending handshake per host: the refused dials are retried until they get
    through (QA: those over the local socket failed for good, the collective with them)."""
    monkeypatch.setenv("ARENDEZ_SHM", "0")
    monkeypatch.setenv("ARENDEZ_PEER_MAX_PENDING_PER_HOST", "1")
    ws = 12

    async def rank_main(rank: int) -> list[float]:
        out = np.zeros(ws)
        await dist.all_to_all_single(out, np.full(ws, float(rank)))
        assert dist.transport_stats().local_connections > 0  # (the local sockets were used)
        return out.tolist()

    url = f"arendez://127.0.0.1:{arendez_server.port}/busy-listeners"
    got = await testing.run_ranks(ws, rank_main, init_method=url, timeout=60)
    assert got == [[float(r) for r in range(ws)]] * ws


def test_a_send_on_a_failed_dial_names_the_rank_it_was_for() -> None:
    """The collective that hits it then names that rank (it used to say "rank -1")."""
    from arendez.transports.pending import PendingLink

    link = PendingLink(5)
    link.fail(TimeoutError("no connection within 1s"))
    with pytest.raises(ConnectionResetError, match="could not connect to rank 5: no connection") as caught:
        link.send({"op": "x"})
    assert getattr(caught.value, "peer", None) == 5


@pytest.mark.timeout(90)
@pytest.mark.parametrize("shared_memory", ["1", "0"])
async def test_every_rank_sees_the_same_link_kind_whichever_links_it_has_opened(
    arendez_server, monkeypatch, shared_memory
):
    """The link kind picks lane sizes and algorithms, so all ranks must agree on it from the
    start. It was "shm" once every member had said hello over a link: with links opened
    lazily, ranks switched at different moments, and identical large all_reduces failed with
    CollectiveMismatchError (QA: 5 of 10 trials at W=6 after a barrier)."""
    monkeypatch.setenv("ARENDEZ_SHM", shared_memory)
    ws = 12

    async def rank_main(rank: int) -> tuple[str, str]:
        group = dist.current_world().groups[0]
        before = group.link_kind()  # (only the neighbours' links are open)
        await dist.barrier()
        x = np.full(1 << 18, float(rank), np.float32)
        await dist.all_reduce(x)
        assert x[0] == sum(range(ws))
        return before, group.link_kind()

    url = f"arendez://127.0.0.1:{arendez_server.port}/link-kind-{shared_memory}"
    kinds = await testing.run_ranks(ws, rank_main, init_method=url, timeout=80)
    expected = "shm" if shared_memory == "1" else "tcp"
    assert kinds == [(expected, expected)] * ws
