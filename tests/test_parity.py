"""torch.distributed parity (issue 17): every public name is provided or deliberately refused,
and tutorial scripts print the same under torch/gloo and ``arendez.sync`` with only the import
changed."""

from __future__ import annotations

import asyncio
import datetime
import inspect
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import arendez
import arendez.sync as sync
from arendez import queries, synccall
from arendez.errors import ArendezError, CollectiveTimeoutError, StoreTimeoutError
from arendez.testing import run_ranks
from tests.harness import PY, collect, free_port, popen, popen_torch

#: names only the blocking module has (they block by nature, or are torch's blocking shapes)
SYNC_ONLY = {"breakpoint", "FileStore", "Future", "HashStore", "TCPStore"}


# -- names ------------------------------------------------------------------------------------
def test_every_torch_distributed_name_is_provided_or_refused_with_a_reason() -> None:
    dist = pytest.importorskip("torch.distributed")
    public = sorted(n for n in dir(dist) if not n.startswith("_"))
    # (a submodule some code imported - torch.distributed.tensor, fsdp, nn - is no API of ours)
    missing = [
        n
        for n in public
        if not hasattr(sync, n) and n not in queries.UNSUPPORTED and not inspect.ismodule(getattr(dist, n))
    ]
    assert not missing, f"torch.distributed names arendez.sync neither provides nor refuses: {missing}"
    both = [n for n in queries.UNSUPPORTED if hasattr(sync, n)]
    assert not both, f"listed as unsupported but provided: {both}"
    stale = [n for n in queries.UNSUPPORTED if n not in public]
    assert not stale, f"listed as unsupported but torch.distributed has no such name: {stale}"
    assert all(len(reason) > 20 for reason in queries.UNSUPPORTED.values())


def test_async_api_has_the_blocking_names() -> None:
    absent = [n for n in sync.__all__ if n not in SYNC_ONLY and not hasattr(arendez, n)]
    assert not absent, f"in arendez.sync but not in arendez: {absent}"
    assert all(hasattr(sync, n) for n in sync.__all__)


def test_what_cannot_apply_says_so() -> None:
    with pytest.raises(ValueError, match="NCCL"):
        sync.Backend("nccl")
    assert sync.Backend("tcp") == sync.Backend("arendez") == sync.Backend.GLOO == "gloo"
    # a ported script's check of the backend it asked for holds, as under torch with gloo (QA20)
    sync.init_process_group("gloo")
    try:
        backend = sync.get_backend()
        assert backend == "gloo" and backend == sync.Backend.GLOO and backend != "nccl"
        assert backend in {"gloo", "nccl"} and {"gloo": 1}[backend] == 1  # (equal, and hashed alike)
    finally:
        sync.destroy_process_group()
    assert not sync.is_nccl_available() and sync.is_gloo_available()
    with pytest.raises(ArendezError, match="FileStore is not supported"):
        sync.FileStore("/tmp/x", 2)
    with pytest.raises(ValueError, match="group_size"):
        sync.init_process_group()
        try:
            sync.new_subgroups()
        finally:
            sync.destroy_process_group()
    with pytest.warns(FutureWarning, match="reduce_op is deprecated"):
        assert sync.reduce_op.SUM is sync.ReduceOp.SUM
    assert sync.supports_complex(sync.ReduceOp.SUM) and not sync.supports_complex(sync.ReduceOp.MAX)


@pytest.mark.timeout(10)
def test_a_rank_outside_a_group_is_told_so_by_torchs_marker() -> None:
    """``NON_GROUP_MEMBER`` is torch's -100, and a call given it (or a literal -100) does
    nothing, as torch's."""
    assert sync.GroupMember.NON_GROUP_MEMBER == sync.group.NON_GROUP_MEMBER == -100
    assert sync.isend(np.zeros(1), 0, group=int("-100")) is None  # (not the marker object itself)


def test_env_queries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    with pytest.raises(ArendezError, match="LOCAL_RANK"):
        sync.get_node_local_rank()
    assert sync.get_node_local_rank(fallback_rank=3) == 3
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert sync.get_node_local_rank() == 1
    assert not sync.is_torchelastic_launched()
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    assert sync.is_torchelastic_launched()


# -- blocking p2p handles ----------------------------------------------------------------------
def test_irecv_wait_that_times_out_goes_on_until_cancelled() -> None:
    sync.init_process_group()  # a world of one rank: an irecv from any rank never completes
    try:
        assert sync.group.WORLD is not None and sync.get_pg_count() == 1
        work = sync.irecv(np.zeros(2))
        assert work is not None
        start = time.monotonic()
        with pytest.raises(TimeoutError, match="goes on"):
            work.wait(timeout=0.2)
        assert time.monotonic() - start < 3
        assert not work.is_completed()  # still posted, as with gloo
        assert work.cancel(grace=3)
        assert work.is_completed() and not work.is_success()  # withdrawn, as an asyncio cancel
        assert isinstance(work.exception(), sync.CallCancelledError)
    finally:
        sync.destroy_process_group()
    assert sync.group.WORLD is None


def test_work_futures_hold_the_outputs_and_chain_as_torchs() -> None:
    """``get_future().wait()`` gives the call's tensors (``[tensor]``, as torch's), and
    ``then`` chains: a DDP comm hook's ``fut.then(lambda f: f.value()[0] / n)`` works."""
    sync.init_process_group()
    try:
        x = np.full(3, 4.0)
        work = sync.all_reduce(x, async_op=True)
        fut = work.get_future()
        halved = fut.then(lambda f: f.value()[0] / 2)
        assert fut.wait() == [x] and fut.wait()[0] is x
        assert halved.wait().tolist() == [2.0] * 3 and halved.done()
        late = fut.then(lambda f: len(f.value()))  # chained after it is done: runs at once
        assert late.done() and late.wait() == 1

        def broken(f: sync.Future) -> None:
            raise RuntimeError("hook failed")

        with pytest.raises(RuntimeError, match="hook failed"):
            fut.then(broken).wait()
        listed = [np.zeros(2)]
        assert sync.all_gather(listed, np.ones(2), async_op=True).get_future().wait() is listed  # as gloo's
        recv = sync.irecv(np.zeros(1))  # (never completes in a world of one: its future waits)
        assert recv is not None and not recv.get_future().done()
        assert recv.cancel(grace=3)
    finally:
        sync.destroy_process_group()


def test_torch_signatures_bind_as_torchs() -> None:
    """``async_op`` by position, torch's CPU-neutral keywords accepted, the rest refused by name;
    ``Work.result()`` and futures hold what gloo's hold; misuse errors are ``ValueError`` as torch's."""
    with pytest.raises(ValueError, match="no default process group"):
        sync.get_rank()
    sync.init_process_group()
    try:
        x = np.full(2, 3.0)
        work = sync.all_reduce(x, sync.ReduceOp.SUM, None, True)  # (tensor, op, group, async_op)
        assert isinstance(work, sync.Work) and work.result() == [x]
        assert sync.barrier(None, True).result() == []
        assert sync.broadcast(x, 0, None, True, None).result() == [x]
        listed = [np.zeros(2)]
        assert sync.gather(np.ones(2), listed, 0, None, True).result() == listed
        assert sync.gather(np.ones(2), listed, 0, async_op=True).get_future().wait() == listed
        objs: list[Any] = [{"a": 1}]
        sync.broadcast_object_list(objs, 0, None, "cpu")
        sync.broadcast_object_list(objs, src=0, device=None)
        with pytest.raises(ValueError, match="device='cuda:0' is not supported"):
            sync.broadcast_object_list(objs, src=0, device="cuda:0")
        sync.barrier(device_ids=[0])
        group = sync.new_group([0], group_desc="mine", use_local_synchronization=False)
        assert sync.get_world_size(group) == 1
        with pytest.raises(ValueError, match="use_local_synchronization=True"):
            sync.new_group([0], use_local_synchronization=True)
        with pytest.raises(TypeError, match="at most 4 positional"):
            sync.all_reduce(x, sync.ReduceOp.SUM, None, False, 5)
        with pytest.raises(TypeError, match="multiple values for argument 'async_op'"):
            sync.all_reduce(x, sync.ReduceOp.SUM, None, False, async_op=True)
        with pytest.raises(ValueError, match="already initialized"):
            sync.init_process_group()
    finally:
        sync.destroy_process_group()


def test_source_rank_of_a_work_that_is_no_receive_is_torchs_runtime_error() -> None:
    """(QA26: it was a ``TypeError`` from ``int(None)``.)"""
    sync.init_process_group()
    try:
        work = sync.all_reduce(np.ones(2), async_op=True)
        work.wait()
        with pytest.raises(RuntimeError, match="only be called on work objects that correspond to a recv"):
            work.source_rank()
    finally:
        sync.destroy_process_group()


def test_the_torch_signatures_arendez_sync_binds_by_are_torchs() -> None:
    """... and what ``help()`` shows of each is torch's order, this API's extras after it as
    keywords (QA26: it showed the async API's, ``algorithm`` where torch has ``async_op``)."""
    dist = pytest.importorskip("torch.distributed")
    for name, params in [*synccall._TORCH_PARAMS.items(), ("init_process_group", None)]:
        torchs = tuple(p for p in inspect.signature(getattr(dist, name)).parameters if not p.startswith("_"))
        assert params is None or torchs == params, name
        shown = inspect.signature(getattr(sync, name)).parameters.values()
        assert tuple(p.name for p in shown)[: len(torchs)] == torchs, name
        assert all(p.kind is p.KEYWORD_ONLY for p in list(shown)[len(torchs) :]), name
    assert inspect.signature(sync.new_group).parameters["use_local_synchronization"].default is False
    assert inspect.signature(sync.init_process_group).parameters["timeout"].default is None


def test_a_then_callback_may_make_blocking_calls_as_on_gloo() -> None:
    """A callback chained to a pending future runs off the loop thread once it completes, so it
    may call and wait on arendez (a PowerSGD hook does; on the loop thread it would deadlock)."""
    sync.init_process_group()
    try:
        seen: list[str] = []

        def reduce_more(f: sync.Future) -> Any:
            seen.append(threading.current_thread().name)
            assert isinstance(f._done.error, sync.CallCancelledError)
            y = np.full(2, 3.0)
            sync.all_reduce(y)  # blocking
            z = sync.all_reduce(np.full(2, 5.0), async_op=True).get_future().wait()[0]
            return (y + z).tolist()

        recv = sync.irecv(np.zeros(1))  # pending in a world of one, until cancelled
        assert recv is not None
        chained = recv.get_future().then(reduce_more)
        assert recv.cancel(grace=3)  # completes the future on the loop thread
        assert chained.wait() == [8.0, 8.0]
        assert seen == ["arendez-callback"]
    finally:
        sync.destroy_process_group()


def test_work_futures_hold_the_callers_tensors() -> None:
    """A bfloat16 or non-contiguous tensor travels as a stand-in; the future holds the caller's
    tensor itself (with the result), and a tensor passed by keyword too (QA6-F4)."""
    torch = pytest.importorskip("torch")
    sync.init_process_group()
    try:
        b = torch.full((4,), 3.03125, dtype=torch.bfloat16)
        (held,) = sync.all_reduce(b, async_op=True).get_future().wait()
        assert held is b and held.dtype == torch.bfloat16 and b.tolist() == [3.03125] * 4
        strided = torch.ones(4, 2)[:, 0]
        assert not strided.is_contiguous()
        (held,) = sync.all_reduce(strided, async_op=True).get_future().wait()
        assert held is strided
        t = torch.ones(3)
        assert sync.broadcast(src=0, tensor=t, async_op=True).get_future().wait()[0] is t
    finally:
        sync.destroy_process_group()


@pytest.mark.timeout(30)
def test_futures_of_tensor_calls_are_torch_futures_that_torch_can_wait_on() -> None:
    """A port-by-import script hands ``get_future()`` to ``torch.futures.wait_all`` and
    ``collect_all`` (C++ functions that take torch's futures only), as on gloo (QA20-2)."""
    torch = pytest.importorskip("torch")
    sync.init_process_group()
    try:
        ts = [torch.full((2,), float(i)) for i in range(3)]
        futures = [sync.all_reduce(t, async_op=True).get_future() for t in ts]
        assert all(isinstance(f, torch.futures.Future) for f in futures)
        assert [v[0] is t for v, t in zip(torch.futures.wait_all(futures), ts, strict=True)] == [True] * 3
        both = torch.futures.collect_all([futures[0], futures[1]]).wait()
        assert [f.value()[0] is t for f, t in zip(both, ts[:2], strict=True)] == [True, True]
        listed = [torch.zeros(2)]
        assert sync.all_gather(listed, torch.ones(2), async_op=True).get_future().wait() is listed
        future = sync.all_reduce(torch.full((2,), 4.0), async_op=True).get_future()
        halved = future.then(lambda f: f.value()[0] / 2)
        assert halved.wait().tolist() == [2.0, 2.0]
        pending = sync.irecv(torch.zeros(1))  # (a world of one: pending until cancelled)
        assert pending is not None
        future = pending.get_future()
        assert isinstance(future, torch.futures.Future) and not future.done()
        assert pending.cancel(grace=3)
        with pytest.raises(sync.CallCancelledError):
            future.wait()
    finally:
        sync.destroy_process_group()


def test_an_expanded_broadcast_source_is_only_read() -> None:
    """An ``expand``ed tensor (stride 0) cannot be written: as a broadcast's source it is only
    read, so it is no error (QA6-F7); torch's own backend path too."""
    torch = pytest.importorskip("torch")
    sync.init_process_group()
    try:
        t = torch.arange(4.0).expand(3, 4)
        sync.broadcast(t, src=0)
        assert t.tolist() == [[0.0, 1.0, 2.0, 3.0]] * 3
    finally:
        sync.destroy_process_group()
    import torch.distributed as tdist

    import arendez.torch  # noqa: F401  (registers the backend)

    tdist.init_process_group("arendez", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        tdist.broadcast(t, src=0)
        assert t.tolist() == [[0.0, 1.0, 2.0, 3.0]] * 3
    finally:
        tdist.destroy_process_group()


def test_a_bitwise_reduction_of_bfloat16_names_bfloat16() -> None:
    """bfloat16 reduces as a float32 copy; a bitwise op on it names the caller's dtype."""
    torch = pytest.importorskip("torch")
    sync.init_process_group()
    try:
        t = torch.ones(4, dtype=torch.bfloat16)
        with pytest.raises(
            sync.InvalidArgumentError, match=r"ReduceOp.BAND needs an integer or bool array, got bfloat16$"
        ):
            sync.all_reduce(t, op=sync.ReduceOp.BAND)
        sync.all_reduce(t)  # (the group goes on)
        assert t.tolist() == [1.0] * 4
    finally:
        sync.destroy_process_group()


# -- async API ---------------------------------------------------------------------------------
async def test_async_isend_irecv_batch_and_objects() -> None:
    async def rank(r: int) -> Any:
        peer = 1 - r
        out = np.zeros(3, np.float32)
        # isend then a blocking send to the same peer: matched in call order
        first = arendez.isend(np.full(3, r + 1.0, np.float32), peer)
        second = arendez.irecv(out, peer)
        assert first is not None and second is not None
        late = np.zeros(3, np.float32)
        done = asyncio.ensure_future(arendez.recv(late, peer))
        await arendez.send(np.full(3, 10.0 * (r + 1), np.float32), peer)
        await first.wait()
        await second.wait(timeout=10)
        await done
        ops = [arendez.P2POp(arendez.irecv, np.zeros(1), group_peer=peer)]
        ops.insert(0, arendez.P2POp(arendez.isend, np.array([7.0 + r]), peer))
        works = arendez.batch_isend_irecv(ops)
        for w in works:
            await w.wait()
        got = works[1].get_future().result()
        objs: list[Any] = [None]
        if r == 0:
            await arendez.send_object_list([{"a": [1, "b"]}], dst=1)
        else:
            assert await arendez.recv_object_list(objs) == 0
        return out.tolist(), late.tolist(), float(ops[1].tensor[0]), got, objs

    a, b = await run_ranks(2, rank)
    assert a == ([2.0] * 3, [20.0] * 3, 8.0, 1, [None])
    assert b == ([1.0] * 3, [10.0] * 3, 7.0, 0, [{"a": [1, "b"]}])


async def test_async_work_wait_timeout_is_a_wait_timeout_and_the_call_goes_on() -> None:
    async def rank(r: int) -> Any:
        out = np.zeros(2, np.float32)
        if r == 0:
            work = arendez.irecv(out, 1)
            assert work is not None
            with pytest.raises(arendez.WaitTimeoutError, match=r"did not finish within 0\.2s"):
                await work.wait(timeout=0.2)  # (rank 1 sends only after the barrier below)
            assert not work.is_completed()
            await arendez.barrier()
            assert await work.wait(timeout=10)
        else:
            await arendez.barrier()
            await arendez.send(np.full(2, 5.0, np.float32), 0)
        return out.tolist()

    assert (await run_ranks(2, rank))[0] == [5.0, 5.0]


@pytest.mark.timeout(30)
async def test_async_object_p2p_refuses_what_the_codec_cannot_carry() -> None:
    """An object the codec cannot carry fails the send and the receive alike, naming the sender
    (the receiver does not wait out its timeout); the pair goes on with the next objects."""

    async def rank(r: int) -> Any:
        objs: list[Any] = [None, None]
        if r == 0:
            with pytest.raises(arendez.ObjectSerializationError, match=r"rank 0 .*builtins\.object"):
                await arendez.send_object_list([1, object()], dst=1)
            with pytest.raises(ArendezError, match="CPU"):
                await arendez.send_object_list([1], dst=1, device="cuda:0")
            await arendez.send_object_list([(1, "a"), {2, 3}], dst=1)
            return None
        with pytest.raises(arendez.ObjectSerializationError, match="send_object_list: rank 0") as caught:
            await arendez.recv_object_list(objs, src=0)
        assert caught.value.rank == 0 and isinstance(caught.value, TypeError)
        assert await arendez.recv_object_list(objs, src=0) == 0
        return objs

    assert (await run_ranks(2, rank))[1] == [(1, "a"), {2, 3}]


async def test_async_subgroups_and_rank_maps() -> None:
    async def rank(r: int) -> Any:
        mine, subgroups = await arendez.new_subgroups(group_size=2)
        split = await arendez.split_group(split_ranks=[[0, 3], [1, 2]])
        x = np.full(2, float(r))
        await arendez.all_reduce_coalesced([x, np.array([r], np.int64)], group=split)
        return (
            len(subgroups),
            arendez.get_process_group_ranks(mine),
            arendez.get_global_rank(split, 1),
            arendez.get_group_rank(split, r),
            x.tolist(),
        )

    got = await run_ranks(4, rank)
    assert got[0] == (2, [0, 1], 3, 0, [3.0, 3.0])
    assert got[1] == (2, [0, 1], 2, 0, [3.0, 3.0])
    assert got[3] == (2, [2, 3], 3, 1, [3.0, 3.0])


async def test_monitored_barrier_names_the_rank_that_did_not_arrive() -> None:
    async def rank(r: int) -> Any:
        if r == 1:
            await asyncio.sleep(2.5)  # never enters the barrier
            return None
        start = time.monotonic()
        with pytest.raises(CollectiveTimeoutError) as info:
            await arendez.monitored_barrier(timeout=datetime.timedelta(seconds=0.5))
        return info.value.missing + info.value.unresponsive, time.monotonic() - start, str(info.value)

    ranks, took, text = (await run_ranks(3, rank, timeout=20))[0]
    assert ranks == [1] and "never arrived: [1]" in text and took < 5


# -- stores --------------------------------------------------------------------------------------
def test_hash_store_across_threads() -> None:
    store = sync.HashStore()
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(store.get("k")))
    reader.start()
    store.set("k", "v")
    reader.join(5)
    assert got == [b"v"]
    assert store.add("n", 2) == 2 and store.add("n", 3) == 5
    assert store.compare_set("c", "", "x") == b"x" and store.compare_set("c", "y", "z") == b"x"
    prefixed = sync.PrefixStore("p", store)
    prefixed.set("a", b"1")
    assert store.get("p/a") == b"1" and prefixed.check(["a"]) and not prefixed.check(["b"])
    assert prefixed.delete_key("a") and not store.check(["p/a"])
    store.set_timeout(datetime.timedelta(seconds=0.2))
    with pytest.raises(StoreTimeoutError):
        store.wait(["never"])


def test_tcp_store_master_and_client() -> None:
    port = free_port()
    out: dict[str, Any] = {}

    def client() -> None:
        store = sync.TCPStore("127.0.0.1", port, 2, False, datetime.timedelta(seconds=20))
        out["value"] = store.get("from-master")
        store.set("from-client", b"hi")
        store.close()

    master_done: list[sync.TCPStore] = []

    def master() -> None:
        master_done.append(sync.TCPStore("127.0.0.1", port, 2, True, datetime.timedelta(seconds=20)))

    threads = [threading.Thread(target=master), threading.Thread(target=client)]
    threads[0].start()
    time.sleep(0.2)  # (the client retries until the master's server is up either way)
    threads[1].start()
    threads[0].join(20)
    assert master_done, "the master TCPStore did not come up"
    store = master_done[0]
    store.set("from-master", "x")
    threads[1].join(20)
    assert out["value"] == b"x"
    store.wait(["from-client"], datetime.timedelta(seconds=5))
    assert store.get("from-client") == b"hi" and store.add("cnt", 4) == 4
    store.close()


# -- tutorial scripts under torch/gloo and arendez.sync -------------------------------------------
#: scenario -> world size, and whether it meets through a shared file (file://) instead of env://
SCENARIOS = {"everything": (2, False), "ring": (3, True)}  # (every two-rank script in one world)


def _run_script(module: str, scenario: str, size: int, init: list[str]) -> list[Any]:
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    argv = [PY, "-m", "tests.tutorial_ranks", module, scenario]
    return [popen_torch([*argv, str(r), str(size), *init], env) for r in range(size)]


@pytest.mark.timeout(150)
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_tutorial_script_prints_the_same_under_torch_and_arendez(scenario: str, tmp_path: Path) -> None:
    pytest.importorskip("torch")
    size, by_file = SCENARIOS[scenario]
    modules = ("torch.distributed", "arendez.sync")
    inits = {m: [f"file://{tmp_path / m}"] if by_file else [] for m in modules}  # a fresh file each
    started = {m: _run_script(m, scenario, size, inits[m]) for m in modules}  # side by side
    outputs = {}
    try:
        for module in modules:
            results = collect(started[module], 120)
            for res in results:
                assert res.returncode == 0, f"{module} rank {res.rank} exited:\n{res.stderr[-3000:]}"
            outputs[module] = [res.stdout for res in results]
    finally:  # (collect kills its own ranks on a timeout; these are the other module's)
        for proc in (p for procs in started.values() for p in procs):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert all(outputs["arendez.sync"]), "arendez ranks printed nothing"
    assert outputs["arendez.sync"] == outputs["torch.distributed"]
    if by_file:  # the rank that wrote the server's address emptied the file when it exited
        assert (tmp_path / "arendez.sync").read_bytes() == b""


def test_file_init_refuses_a_file_that_names_no_server(tmp_path: Path) -> None:
    path = tmp_path / "rdzv"
    path.write_text("not an address")
    with pytest.raises(arendez.RendezvousError, match="not host:port"):
        sync.init_process_group(init_method=f"file://{path}", world_size=2, rank=1, timeout=5)
    with pytest.raises(arendez.RendezvousError, match="world_size and rank"):
        sync.init_process_group(init_method=f"file://{path}", world_size=2)


# -- a script that never calls destroy -----------------------------------------------------------
EXIT_SCRIPT = """
import sys, time
import numpy as np
import arendez.sync as dist

rank = int(sys.argv[1])
dist.init_process_group("gloo", rank=rank, world_size=2)
x = np.ones(2)
dist.all_reduce(x)
print("sum", x.tolist(), flush=True)
if rank == 0:
    time.sleep(1.0)  # rank 1 leaves first: rank 0 must not call that a failure
"""


@pytest.mark.timeout(90)
def test_exit_without_destroy_warns_once_and_peers_raise_no_alarm() -> None:
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    start = time.monotonic()
    results = collect([popen([PY, "-c", EXIT_SCRIPT, str(r)], env) for r in range(2)], 60)
    took = time.monotonic() - start
    for res in results:
        assert res.returncode == 0, res.stderr[-3000:]
        assert res.stdout.strip() == "sum [2.0, 2.0]"
        assert res.stderr.count("destroy_process_group() was not called") == 1, res.stderr
        for alarm in ("connection lost", "reconnecting", "lost the store", "failed"):
            assert alarm not in res.stderr, f"rank {res.rank} raised an alarm: {res.stderr}"
    assert took < 45  # bounded: the exit hook gives destroy at most EXIT_DESTROY_SECONDS


@pytest.mark.timeout(60)
def test_sync_objects_keep_their_tensors_dtype_and_torch_list_conventions() -> None:
    """A bfloat16 tensor given as the object itself arrives as bfloat16 (the facade's stand-ins,
    bit views for the data collectives, were handed to the object collectives too: it arrived as
    int16); an output list longer than the group keeps its extra entries, as torch's does; an
    ``irecv`` from this rank itself fails at once (it waited out the group timeout)."""
    torch = pytest.importorskip("torch")
    sync.init_process_group(timeout=datetime.timedelta(seconds=30))
    try:
        t = torch.tensor([1.5, -2.0], dtype=torch.bfloat16)
        out: list[Any] = [None, "extra"]
        sync.all_gather_object(out, t)
        assert out[0].dtype == torch.bfloat16 and out[0].tolist() == [1.5, -2.0] and out[1] == "extra"
        gathered: list[Any] = [None, None]
        sync.gather_object(torch.zeros(2, dtype=torch.complex32), gathered, dst=0)
        assert gathered[0].dtype == torch.complex32
        started = time.monotonic()
        with pytest.raises(ValueError, match="this rank itself"):  # (at wait, as gloo's)
            sync.irecv(torch.zeros(2), src=0).wait()
        assert time.monotonic() - started < 5
    finally:
        sync.destroy_process_group()


@pytest.mark.timeout(60)
def test_sync_init_takes_torch_signature_and_defaults() -> None:
    """torch's positional order, its backend spellings, ``pg_options``/``device_id`` of None, and
    its 30-minute default timeout (a ported script's long step on one rank must not time out at
    the async API's 300 s)."""
    from arendez import registry
    from arendez.loop import shared

    async def group_timeout() -> float:
        group = registry.default_group()
        assert group is not None
        return group.timeout

    sync.init_process_group("cpu:gloo,cuda:nccl", None, None, 1, 0, pg_options=None, device_id=None)
    try:
        assert shared.call(group_timeout) == 1800.0
        assert sync.default_pg_timeout == datetime.timedelta(minutes=30)
    finally:
        sync.destroy_process_group()
    sync.init_process_group("GLOO", timeout=datetime.timedelta(seconds=42))
    try:
        assert shared.call(group_timeout) == 42.0
    finally:
        sync.destroy_process_group()
    with pytest.raises(ValueError, match="no backend for the cpu device"):
        sync.init_process_group("cuda:nccl")
    with pytest.raises(ValueError, match="cannot apply"):
        sync.init_process_group("nccl")
    with pytest.raises(ValueError, match="device_id"):
        sync.init_process_group(device_id="cuda:0")
    assert not sync.is_initialized()


@pytest.mark.timeout(90)
def test_sync_init_meets_through_torch_own_tcpstore() -> None:
    """``init_process_group(store=torch.distributed.TCPStore(...))``, the store of a script
    ported by its import line: the ranks meet through it (it was a TypeError)."""
    pytest.importorskip("torch")
    port = free_port()
    script = Path(__file__).parent / "scripts" / "sync_torch_store.py"
    results = collect([popen([PY, str(script), str(r), "2", str(port)]) for r in range(2)], 60)
    for res in results:
        assert res.returncode == 0, res.stderr[-3000:]
    assert [res.stdout.strip() for res in results] == ["RANK 0 SUM 3.0", "RANK 1 SUM 3.0"]


@pytest.mark.timeout(90)
def test_messages_sent_before_the_sender_failed_are_still_received() -> None:
    """As with gloo: a rank that sends and then dies of an uncaught exception has sent; its
    messages already here are received after its failure is known (they were a
    ``RankFailedError``), and the next recv from it is the failure."""
    port = free_port()
    script = Path(__file__).parent / "scripts" / "send_then_fail.py"
    results = collect([popen([PY, str(script), str(r), str(port)]) for r in range(2)], 60)
    assert results[0].returncode != 0 and "rank 0 fails after sending" in results[0].stderr
    assert results[1].returncode == 0, results[1].stderr[-3000:]
    assert results[1].stdout.splitlines() == ["GOT [0.0, 1.0, 2.0, 3.0] [7.0, 7.0]", "THEN RankFailedError"]
