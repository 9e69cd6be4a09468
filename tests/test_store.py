"""Store semantics against a real arendez-server process."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest

import arendez as dist
from arendez import lease, testing
from arendez.registry import fresh_context
from arendez.store import Store
from tests.harness import run_ranks, start_server
from tests.jobs import store as store_jobs


async def _client(srv, job: str = "store") -> dist.Store:
    return await dist.Store("127.0.0.1", srv.port, job, timeout=10).connect()


@pytest.mark.timeout(30)
async def test_set_get_delete_num_keys(arendez_server):
    store = await _client(arendez_server)
    try:
        await store.set("a", "1")
        await store.set("b", b"\x00\xff")
        assert await store.get("a") == b"1"
        assert await store.get("b") == b"\x00\xff"
        assert await store.num_keys() == 2
        assert await store.check(["a", "b"]) is True
        assert await store.delete("a") is True
        assert await store.delete("a") is False
        assert await store.check(["a"]) is False
        assert await store.num_keys() == 1
    finally:
        await store.close()


@pytest.mark.timeout(30)
async def test_add_and_compare_set(arendez_server):
    store = await _client(arendez_server)
    try:
        assert await store.add("n", 5) == 5
        assert await store.add("n", -2) == 3
        assert await store.get("n") == b"3"
        assert await store.compare_set("cas", "", "first") == b"first"  # missing + empty expected
        assert await store.compare_set("cas", "wrong", "second") == b"first"
        assert await store.compare_set("cas", "first", "second") == b"second"
        await store.set("text", "x")
        with pytest.raises(dist.StoreError, match="integer"):
            await store.add("text", 1)
    finally:
        await store.close()


@pytest.mark.timeout(30)
async def test_jobs_are_separate_namespaces(arendez_server):
    a, b = await _client(arendez_server, "job-a"), await _client(arendez_server, "job-b")
    try:
        await a.set("k", "from a")
        assert await b.check(["k"]) is False
        await b.set("k", "from b")
        assert await a.get("k") == b"from a"
    finally:
        await a.close()
        await b.close()


@pytest.mark.timeout(30)
async def test_wait_blocks_until_set_and_times_out(arendez_server):
    store, other = await _client(arendez_server), await _client(arendez_server)
    try:
        waiter = asyncio.create_task(store.wait(["late"], timeout=5))
        await asyncio.sleep(0.2)
        assert not waiter.done()
        await other.set("late", "now")
        await asyncio.wait_for(waiter, 2)
        started = time.monotonic()
        with pytest.raises(dist.StoreTimeoutError):
            await store.wait(["never"], timeout=0.5)
        assert 0.4 <= time.monotonic() - started < 2.5
        with pytest.raises(TimeoutError):  # also a builtin TimeoutError
            await store.get("never", timeout=0.2)
    finally:
        await store.close()
        await other.close()


@pytest.mark.timeout(30)
async def test_limits_give_clear_errors(arendez_server):
    store = await _client(arendez_server)
    try:
        with pytest.raises(
            dist.LimitError, match="store key of 5000 bytes exceeds the server's limit of 4096"
        ):
            await store.set("k" * 5000, "v")
        with pytest.raises(dist.StoreError, match="store key must be a string"):
            await store._ask("set", None, False, 7, b"v")  # (the typed API cannot send one)
        await store.set("still", "works")  # the connection survived the bad requests
        assert await store.get("still") == b"works"
    finally:
        await store.close()


@pytest.mark.timeout(30)
async def test_store_unreachable_is_a_store_error():
    store = dist.Store("127.0.0.1", 9, "x", timeout=0.5)
    started = time.monotonic()
    with pytest.raises(dist.StoreError, match="unreachable") as caught:
        await store.connect()
    assert time.monotonic() - started < 3
    assert isinstance(caught.value, dist.NetworkError) and isinstance(caught.value, TimeoutError)


@pytest.mark.timeout(30)
async def test_queues_wake_one_waiting_popper_per_value(arendez_server):
    a, b = await _client(arendez_server, "queues"), await _client(arendez_server, "queues")
    try:
        pops = [asyncio.ensure_future(b.queue_pop("jobs", timeout=10)) for _ in range(3)]
        await asyncio.sleep(0.1)
        assert not any(p.done() for p in pops)
        for i in range(3):
            await a.queue_push("jobs", f"task-{i}")
        assert sorted(await asyncio.gather(*pops)) == [b"task-0", b"task-1", b"task-2"]
        waiting = asyncio.ensure_future(b.wait(["more"], timeout=10))
        await asyncio.sleep(0.1)
        assert not waiting.done()
        await a.queue_push("more", "x")
        await waiting  # a non-empty queue is a present key
        assert await b.queue_pop("more") == b"x"
        assert await a.queue_len("jobs") == 0 and await a.list_keys() == []
        with pytest.raises(dist.QueueEmptyError):
            await a.queue_pop("jobs", block=False)
        with pytest.raises(dist.StoreTimeoutError, match="queue_pop"):
            await a.queue_pop("jobs", timeout=0.2)
        await a.set("k", "v")
        assert await b.list_keys() == ["k"] and await b.num_keys() == 1
    finally:
        await a.close()
        await b.close()


@pytest.mark.timeout(60)
def test_concurrent_add_from_processes(arendez_server):
    totals = run_ranks(store_jobs.store_add, 4, f"{arendez_server.url}/adders", 200)
    assert totals == [800] * 4


@pytest.mark.timeout(30)
async def test_a_second_init_of_one_context_while_the_first_forms_fails_at_once(arendez_server):
    """Two tasks of one context initialising together: the second fails naming the way out (a
    context per rank), the first forms its world, and ranks in their own contexts work."""
    url = f"arendez://127.0.0.1:{arendez_server.port}/twice"

    async def rank_main() -> int:
        await dist.init_process_group(init_method=url, world_size=2, rank=-1, timeout=20)
        try:
            return dist.get_rank()
        finally:
            await dist.destroy_process_group()

    async def both_in_one_context() -> list[Any]:
        first = asyncio.ensure_future(
            dist.init_process_group(init_method=url, world_size=2, rank=-1, timeout=20)
        )
        await asyncio.sleep(0)
        with pytest.raises(dist.RendezvousError, match="fresh_context"):
            await dist.init_process_group(init_method=url, world_size=2, rank=-1, timeout=20)
        other = asyncio.get_running_loop().create_task(rank_main(), context=fresh_context())
        await first
        ranks = [dist.get_rank(), await other]
        await dist.destroy_process_group()
        return ranks

    loop = asyncio.get_running_loop()
    ranks = await loop.create_task(both_in_one_context(), context=fresh_context())
    assert sorted(ranks) == [0, 1]


@pytest.mark.timeout(60)
async def test_run_ranks_simulates_ranks_against_a_real_server(arendez_server):
    async def rank_main(rank: int) -> float:
        x = np.full(3, rank + 1.0)
        await dist.all_reduce(x)
        return float(x[0])

    url = f"arendez://127.0.0.1:{arendez_server.port}/simulated"
    assert await testing.run_ranks(16, rank_main, init_method=url, timeout=40) == [136.0] * 16


@pytest.mark.timeout(30)
async def test_prefix_store_maps_every_operation_under_its_prefix(arendez_server):
    store = await _client(arendez_server, "prefixed")
    try:
        outer = dist.PrefixStore("a", store)
        inner = dist.PrefixStore("b", outer)
        await inner.set("k", "v")
        await inner.multi_set(["x", "y"], ["1", "2"])
        assert await store.get("a/b/k") == b"v" and await inner.multi_get(["y", "x"]) == [b"2", b"1"]
        assert await inner.add("n", 5) == 5 and await store.get("a/b/n") == b"5"
        await inner.queue_push("q", "item")
        assert await store.queue_len("a/b/q") == 1 and await inner.queue_pop("q") == b"item"
        waiting = asyncio.ensure_future(store.wait(["a/b/log"], timeout=10))
        await asyncio.gather(*(inner.append("log", f"{i};") for i in range(20)))
        await waiting  # (an append wakes the waiters of its key)
        parts = (await store.get("a/b/log")).split(b";")[:-1]
        assert sorted(parts) == sorted(str(i).encode() for i in range(20))  # none lost
        await store.set("other", "z")
        assert sorted(await inner.list_keys()) == ["k", "log", "n", "x", "y"]
        assert sorted(await outer.list_keys()) == ["b/k", "b/log", "b/n", "b/x", "b/y"]
        assert await inner.check(["k", "x"]) and await inner.delete("k") and not await inner.check(["k"])
        with pytest.raises(dist.StoreTimeoutError):
            await inner.wait(["never"], timeout=0.2)
    finally:
        await store.close()


@pytest.mark.timeout(60)
async def test_key_lists_longer_than_one_request_go_as_several(arendez_server):
    """torch's stores take any number of keys; the server takes 10,000 per request (a waiting
    request holds its keys), so the client splits longer lists. A raw request over the bound is
    a ``LimitError`` naming it, and the connection lives on."""
    from arendez.store_wire import MAX_KEYS

    store = await _client(arendez_server, "many-keys")
    try:
        keys = [f"k{i}" for i in range(2 * MAX_KEYS + 500)]
        values = [f"{i}".encode() * 40 for i in range(len(keys))]  # (over one request frame too)
        await store.multi_set(keys, values)
        assert await store.multi_get(keys) == values
        assert await store.check(keys) and not await store.check([*keys, "absent"])
        await store.wait(keys)
        with pytest.raises(dist.StoreTimeoutError):
            await store.wait([*keys, "absent"], timeout=0.3)
        with pytest.raises(
            dist.LimitError, match=rf"names {MAX_KEYS + 1} keys, over the server's limit of {MAX_KEYS}"
        ):
            await store._ask("check", None, False, keys[: MAX_KEYS + 1])
        assert await store.get("k7") == values[7]
    finally:
        await store.close()


@pytest.mark.timeout(30)
async def test_a_multi_get_sees_a_key_deleted_after_it_looked_as_missing(arendez_server):
    """The server looks at a waiting request's keys from where it last stopped; a multi_get whose
    earlier key was deleted meanwhile waits for it again rather than answering without it."""
    a, b = await _client(arendez_server, "relook"), await _client(arendez_server, "relook")
    try:
        await a.set("first", "1")
        pending = asyncio.ensure_future(b.multi_get(["first", "second"], timeout=10))
        await asyncio.sleep(0.2)
        await a.delete("first")
        await a.set("second", "2")
        await asyncio.sleep(0.2)
        assert not pending.done()  # "first" went missing: it waits on
        await a.set("first", "again")
        assert await asyncio.wait_for(pending, 5) == [b"again", b"2"]
    finally:
        await a.close()
        await b.close()


@contextlib.asynccontextmanager
async def _a_rank_beside_a_rank_of_another_process(job: str) -> AsyncIterator[tuple[Store, int, list[dict]]]:
    """Two ranks joined through a server with a 2 s lease, each its lease keeper's only user
    (the stores name the server by two addresses: two keepers, as two processes would have);
    yields the first store, its rank, and the events the other one hears."""
    srv = start_server("--lease", "2")
    leaving = await Store("127.0.0.1", srv.port, job, timeout=10).connect()
    staying = await Store("localhost", srv.port, job, timeout=10).connect()
    events: list[dict] = []
    staying.on_event = events.append
    try:
        first, _ = await asyncio.gather(leaving.join(2, -1, "a:1"), staying.join(2, -1, "b:1"))
        await asyncio.sleep(2.5)  # (the lease is renewed: longer than it)
        yield leaving, first.rank, events
    finally:
        await leaving.close()
        await staying.close()
        srv.stop()


@pytest.mark.timeout(30)
async def test_a_slow_leave_of_the_last_rank_of_a_process_is_a_leave_not_a_failure(monkeypatch):
    """The process's lease is released after the leave, not before: with 5,000 ranks on 2
    cores, the last rank of a process released it, its leave (from a starved event loop) came
    after the lease had run out, and ranks that were leaving in good order were declared failed,
    failing the collectives of hundreds of others."""
    async with _a_rank_beside_a_rank_of_another_process("slowleave") as (leaving, rank, events):
        ask = leaving._call

        async def starved(op: str, *args: Any, **kwargs: Any) -> Any:
            if op == "leave":
                await asyncio.sleep(4.5)  # (an event loop that did not run for longer than the lease)
            return await ask(op, *args, **kwargs)

        monkeypatch.setattr(leaving, "_call", starved)
        await leaving.leave(timeout=10)
        await asyncio.sleep(3.0)  # (a failure would have been declared by now)
        news = [(e["event"], e["rank"]) for e in events]
        assert news == [("rank_left", rank)], news


@pytest.mark.timeout(30)
async def test_close_ends_a_call_waiting_for_a_reconnect_attempt():
    """(review) A call of a client that fails while the server is away waits for one reconnect
    attempt; ``close()`` during that attempt ends it at once, saying so."""
    import socket

    srv = start_server()
    port = srv.port
    store = await Store("127.0.0.1", port, "closing", timeout=10).connect()
    store.fail_while_away = True
    mute = socket.socket()
    try:
        await store.set("k", b"v")
        srv.stop()
        mute.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        mute.bind(("127.0.0.1", port))
        mute.listen(16)  # (connections complete, and no handshake ever comes: the attempt hangs)
        for _ in range(200):
            if store._conn is None:
                break
            await asyncio.sleep(0.01)
        call = asyncio.ensure_future(store.get("k", timeout=8))
        await asyncio.sleep(0.3)
        assert not call.done()
        started = time.monotonic()
        await store.close()
        with pytest.raises(dist.StoreError, match="closed"):
            await asyncio.wait_for(call, 3)
        assert time.monotonic() - started < 3.0
    finally:
        mute.close()
        await store.close()


@pytest.mark.timeout(30)
async def test_a_process_that_ends_its_lease_in_order_has_its_unleft_ranks_leave(monkeypatch):
    """5,000-rank swarm: a rank's leave could fail to take effect on the server (given up under
    a starved loop); once every rank of the process had released the lease, its end let the
    server declare those ranks failed 2.5 s later, failing the collectives of hundreds of
    others. A lease ended in order (the keeper stops its sidecar) now makes them leave."""
    async with _a_rank_beside_a_rank_of_another_process("leaseend") as (leaving, rank, events):
        ask = leaving._call

        async def lost(op: str, *args: Any, **kwargs: Any) -> Any:
            if op == "leave":  # (a leave that never takes effect on the server)
                raise dist.StoreError("gave up")
            return await ask(op, *args, **kwargs)

        monkeypatch.setattr(leaving, "_call", lost)
        await leaving.leave(timeout=10)  # (then its process's lease keeper stops, in order)
        await asyncio.sleep(3.0)  # (a failure would have been declared by now)
        news = [(e["event"], e["rank"]) for e in events]
        assert news == [("rank_left", rank)], news


@pytest.mark.timeout(30)
async def test_a_process_that_joins_again_keeps_its_lease_keeper_until_it_lingers_out(
    monkeypatch, arendez_server
):
    """Re-initialising (elastic recovery, init/destroy cycles) reuses the process's lease
    connection and sidecar, whose start cost more than the rest of a cycle; a keeper whose
    ranks all left in good order ends after ``LINGER`` s, its sidecar with it."""
    monkeypatch.setattr(lease, "LINGER", 1.0)
    keepers, sidecars = [], []
    for cycle in range(2):
        store = await Store("127.0.0.1", arendez_server.port, f"linger-{cycle}", timeout=10).connect()
        try:
            await store.join(1, 0, "a:1")
            keeper = store._lease
            assert keeper is not None
            for _ in range(100):  # (the keeper's thread hands the connection over)
                if keeper._sidecar is not None:
                    break
                await asyncio.sleep(0.05)
            keepers.append(keeper)
            sidecars.append(keeper._sidecar)
            await store.leave()
            assert keeper in lease._keepers.values()  # (lingering)
        finally:
            await store.close()
    assert keepers[0] is keepers[1]
    assert sidecars[0] is not None and sidecars[0] is sidecars[1]
    for _ in range(100):
        if sidecars[0].poll() is not None and keepers[0] not in lease._keepers.values():
            break
        await asyncio.sleep(0.05)
    assert keepers[0] not in lease._keepers.values()
    assert sidecars[0].poll() == 0  # (stopped in order: it sent the lease's end)


@pytest.mark.timeout(30)
async def test_a_failed_leave_ends_the_lease_when_its_process_lets_go_though_a_rank_beside_left_well(
    monkeypatch,
):
    """Two ranks of one process share its lease; one's leave fails, the other's succeeds: the
    lease must not linger (review of the linger: the failed rank stayed active on the server for
    as long as the process kept re-using its keeper), so the server counts that rank as left."""
    monkeypatch.setattr(lease, "LINGER", 30.0)
    srv = start_server("--lease", "2")
    stores = [
        await Store(host, srv.port, "dirty", timeout=10).connect()
        for host in ("127.0.0.1", "127.0.0.1", "localhost")  # (the third: another process's keeper)
    ]
    failing, good, observer = stores
    events: list[dict] = []
    observer.on_event = events.append
    try:
        joined = await asyncio.gather(*(st.join(3, -1, f"h:{i}") for i, st in enumerate(stores)))
        ask = failing._call

        async def lost(op: str, *args: Any, **kwargs: Any) -> Any:
            if op == "leave":
                raise dist.StoreError("gave up")
            return await ask(op, *args, **kwargs)

        monkeypatch.setattr(failing, "_call", lost)
        await failing.leave(timeout=10)
        await good.leave()
        for _ in range(50):
            if ("rank_left", joined[0].rank) in [(e["event"], e["rank"]) for e in events]:
                break
            await asyncio.sleep(0.05)
        news = sorted((e["event"], e["rank"]) for e in events)
        assert news == sorted([("rank_left", joined[0].rank), ("rank_left", joined[1].rank)]), news
    finally:
        for st in stores:
            await st.close()
        srv.stop()


@pytest.mark.timeout(30)
async def test_a_store_never_connected_connects_on_its_first_call(arendez_server):
    """(QA21: it waited out its timeout, 30 s, then said the running server was unreachable.)"""
    store = dist.Store("127.0.0.1", arendez_server.port, "lazy", timeout=10)
    try:
        started = time.monotonic()
        await asyncio.gather(store.set("a", "1"), store.set("b", "2"))  # (two first calls at once)
        assert await store.multi_get(["a", "b"]) == [b"1", b"2"]
        assert time.monotonic() - started < 5
    finally:
        await store.close()
    async with dist.Store("127.0.0.1", arendez_server.port, "lazy", timeout=10) as again:
        assert await again.get("a") == b"1"


@pytest.mark.timeout(30)
async def test_a_first_call_that_cannot_reach_the_server_leaves_the_store_retrying():
    """A call's own deadline bounds its wait for the first connection; the store keeps trying,
    so a sibling call with a longer deadline, or a later call, reaches a server that started
    late, and ``connect()`` then only waits for that connection (review of QA21's fix: one
    failed first call closed the store for every caller)."""
    from tests.harness import free_port

    port = free_port()
    store = dist.Store("127.0.0.1", port, "late", timeout=10)
    srv = None
    try:
        short = asyncio.ensure_future(store.check(["k"], timeout=0.5))
        long = asyncio.ensure_future(store.get("k", timeout=20))
        with pytest.raises(dist.StoreConnectTimeoutError, match="unreachable"):
            await short
        srv = start_server(port=port)
        await store.connect(10)  # (the connection the calls started: not a second one)
        await store.set("k", "v")
        assert await long == b"v"
        assert await store.check(["k"]) is True
        assert len(store._tasks) == 1
    finally:
        await store.close()
        if srv is not None:
            srv.stop()


@pytest.mark.timeout(30)
async def test_a_scoped_store_goes_with_its_last_client_after_a_grace():
    """(torchrun's rendezvous: its keys live as long as its agents' connections, as a TCPStore
    master's live with it; QA21: finished runs held their job slots and keys for good. Review:
    without a grace, a network blip that cut every client at once wiped a running job's keys.)"""
    srv = start_server("--scoped-grace", "1")
    try:
        port = srv.port
        first = await dist.Store("127.0.0.1", port, "scoped", timeout=10, scoped=True).connect()
        await first.set("k", "v")
        await first.close()
        await asyncio.sleep(0.3)  # (every client gone for a moment: a blip)
        second = await dist.Store("127.0.0.1", port, "scoped", timeout=10, scoped=True).connect()
        await asyncio.sleep(1.2)  # (past the grace, counted from the first one leaving)
        assert await second.get("k") == b"v"  # (a client came back within the grace)
        await second.close()
        deadline = time.monotonic() + 5
        while True:  # (the server drops it once the grace after the last client has passed)
            async with dist.Store("127.0.0.1", port, "scoped", timeout=10) as probe:
                if await probe.num_keys() == 0:
                    break
            assert time.monotonic() < deadline, "the scoped job's keys outlived its clients"
            await asyncio.sleep(0.2)
    finally:
        srv.stop()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("state", ["connected", "closed, loss not yet handled", "gone", "server leaving"])
def test_leave_waits_long_only_for_a_connected_server(state: str) -> None:
    """A leave gives a connected server ``LEAVE_SECONDS`` to answer, and a server that is gone
    ``LEAVE_OFFLINE_SECONDS``, including a connection whose close is not yet handled (the
    server process died a moment ago: a survivor's destroy took 5 s, not 1, in 4 of 16 trials)."""
    from arendez import store_membership
    from arendez.store_membership import Membership

    class Conn:
        is_open = state != "closed, loss not yet handled"

    budgets: list[float] = []
    store = Store("127.0.0.1", 1, "job")

    async def call(op: str, timeout: float | None = None, wait: bool = False, **fields: Any) -> Any:
        budgets.append(float(timeout or 0))

    store._call = call  # type: ignore[method-assign]
    store._membership = Membership(0, 1, [], b"n")
    store._conn = None if state == "gone" else Conn()
    store._server_leaving = state == "server leaving"
    asyncio.run(store.leave(timeout=20))
    want = store_membership.LEAVE_SECONDS if state == "connected" else store_membership.LEAVE_OFFLINE_SECONDS
    assert budgets == [want]


@pytest.mark.timeout(30)
async def test_a_port_that_accepts_but_is_no_arendez_server_is_named_as_such():
    """(QA25: an arendez:// URL naming the server's --http-port, or etcd's, waited out its
    timeout and then said "unreachable" with no last error.)"""
    import socket

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    try:
        port = listener.getsockname()[1]
        with pytest.raises(dist.StoreError) as info:
            await dist.Store("127.0.0.1", port, "j", timeout=2).connect()
    finally:
        listener.close()
    assert f"127.0.0.1:{port} accepted the connection but sent no arendez greeting" in str(info.value)
    assert "not an arendez-server's store port" in str(info.value)
