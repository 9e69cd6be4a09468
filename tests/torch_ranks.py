"""Rank programs for the torch backend tests: ``python -m tests.torch_ranks NAME RANK WS INIT ARGS``.

Each rank reports its result last (``tests.harness.report_result``; read by ``RankResult.value``).
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import json
import os
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

import arendez.torch  # noqa: F401 - registers the backend
from tests.harness import report_result

SCENARIOS: dict[str, Callable[..., Any]] = {}


def scenario(fn: Callable[..., Any]) -> Callable[..., Any]:
    SCENARIOS[fn.__name__] = fn
    return fn


def _init(rank: int, ws: int, init: str) -> None:
    if init == "store":  # a torch TCPStore passed in; the backend derives its rendezvous through it
        port = int(os.environ["TEST_STORE_PORT"])
        store = dist.TCPStore("127.0.0.1", port, ws, rank == 0, timeout=datetime.timedelta(seconds=30))
        dist.init_process_group("arendez", store=store, rank=rank, world_size=ws)
    elif init == "env://":
        dist.init_process_group("arendez")  # RANK / WORLD_SIZE / MASTER_* from the environment
    else:
        dist.init_process_group(
            "arendez", init_method=init, rank=rank, world_size=ws, timeout=datetime.timedelta(seconds=30)
        )


def mlp(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(16, 64),
        torch.nn.Tanh(),
        torch.nn.Linear(64, 64),
        torch.nn.Tanh(),
        torch.nn.Linear(64, 4),
    )


def batch(step: int, rank: int, rows: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(rows, 16, generator=g), torch.randn(rows, 4, generator=g)


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> None:
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()


@scenario
def ddp(rank: int, ws: int, init: str, steps: int, bucket_mb: float) -> dict[str, Any]:
    _init(rank, ws, init)
    model = mlp()
    ddp_model = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=bucket_mb)
    opt = torch.optim.SGD(ddp_model.parameters(), lr=0.05, momentum=0.9)
    for step in range(steps):
        train_step(ddp_model, opt, *batch(step, rank))
    dist.destroy_process_group()
    return {"params": [p.detach().reshape(-1).tolist() for p in model.parameters()]}


@scenario
def reinit_with_one_store(rank: int, ws: int, init: str, rounds: int) -> list[float]:
    """The same torch store passed to init_process_group again after each destroy."""
    port = int(os.environ["TEST_STORE_PORT"])
    store = dist.TCPStore("127.0.0.1", port, ws, rank == 0, timeout=datetime.timedelta(seconds=30))
    sums = []
    for i in range(rounds):
        dist.init_process_group("arendez", store=store, rank=rank, world_size=ws)
        t = torch.full((3,), float(rank + i))
        dist.all_reduce(t)
        sums.append(float(t[0]))
        dist.destroy_process_group()
    return sums


@scenario
def ddp_until_failure(rank: int, ws: int, init: str, marks: str) -> dict[str, Any]:
    _init(rank, ws, init)
    ddp_model = torch.nn.parallel.DistributedDataParallel(mlp())
    opt = torch.optim.SGD(ddp_model.parameters(), lr=0.01)
    deadline = time.monotonic() + 30
    step = 0
    try:
        while time.monotonic() < deadline:
            train_step(ddp_model, opt, *batch(step, rank))
            step += 1
            if step == 3:
                Path(marks, f"ready-{rank}").touch()
            time.sleep(0.005)
    except Exception as exc:
        return {
            "at": time.time(),
            "type": type(exc).__name__,
            "runtime": isinstance(exc, RuntimeError),
            "message": str(exc),
        }
    return {"at": None, "type": None, "message": "training never failed"}


@scenario
def subgroup_until_failure(rank: int, ws: int, init: str, marks: str) -> dict[str, Any]:
    """Ranks 0 and 1 all_reduce over their subgroup until one fails; the others wait."""
    _init(rank, ws, init)
    group = dist.new_group([0, 1])
    if rank > 1:
        Path(marks, f"ready-{rank}").touch()
        time.sleep(8)
        return {"at": None, "message": "not in the subgroup"}
    t = torch.ones(4)
    deadline = time.monotonic() + 30
    step = 0
    try:
        while time.monotonic() < deadline:
            dist.all_reduce(t, group=group)
            step += 1
            if step == 3:
                Path(marks, f"ready-{rank}").touch()
            time.sleep(0.005)
    except Exception as exc:
        return {"at": time.time(), "type": type(exc).__name__, "message": str(exc)}
    return {"at": None, "message": "never failed"}


@scenario
def disjoint_subgroup_outlives_a_death(rank: int, ws: int, init: str, marks: str) -> dict[str, Any]:
    """Subgroups [0, 1] and [2, 3] all_reduce in a loop; rank 3 is killed once all are ready:
    rank 2 fails naming it, ranks 0 and 1 go on to the end (gloo's pairs are independent too)."""
    _init(rank, ws, init)
    groups = dist.new_group([0, 1]), dist.new_group([2, 3])
    group = groups[rank // 2]
    t = torch.ones(4)
    dist.all_reduce(t)  # (every pair of the world connected)
    try:
        for step in range(300):
            t = torch.ones(64)
            dist.all_reduce(t, group=group)
            assert t[0].item() == 2.0, t
            if step == 3:
                Path(marks, f"ready-{rank}").touch()
            time.sleep(0.01)
    except Exception as exc:
        return {"type": type(exc).__name__, "message": str(exc)}
    return {"type": None, "message": "finished"}


@scenario
def group_method_short_forms(rank: int, ws: int, init: str) -> dict[str, Any]:
    """torch's ProcessGroup overloads that libraries call on the group object itself
    (``pg.allgather(outs, t)``, ``pg.reduce(t, root, op)``...), without options objects."""
    _init(rank, ws, init)
    pg = dist.group.WORLD
    assert pg is not None
    got: dict[str, Any] = {}
    outs = [torch.zeros(2) for _ in range(ws)]
    pg.allgather(outs, torch.ones(2) * rank).wait()
    got["allgather"] = [o.tolist() for o in outs]
    out = torch.zeros(2)
    pg.reduce_scatter(out, [torch.ones(2) * (rank + p) for p in range(ws)], dist.ReduceOp.SUM).wait()
    got["reduce_scatter"] = out.tolist()
    t = torch.ones(2) * (rank + 1)
    pg.reduce(t, 0, dist.ReduceOp.MAX).wait()
    got["reduce"] = t.tolist()
    gathered = [torch.zeros(2) for _ in range(ws)] if rank == 0 else []
    pg.gather(gathered, torch.ones(2) * rank, 0).wait()
    got["gather"] = [g.tolist() for g in gathered]
    out = torch.zeros(2)
    pg.scatter(out, [torch.ones(2) * p for p in range(ws)] if rank == 0 else [], 0).wait()
    got["scatter"] = out.tolist()
    t = torch.ones(2) * rank
    pg.broadcast([t]).wait()  # (default options: root 0)
    got["broadcast"] = t.tolist()
    out = torch.zeros(2)
    pg._reduce_scatter_base(out, torch.arange(2.0 * ws) + rank).wait()
    got["reduce_scatter_base"] = out.tolist()
    pg.monitored_barrier(datetime.timedelta(seconds=10))  # (dist.monitored_barrier: gloo only)
    if rank == 1:
        time.sleep(1.5)
    try:
        pg.monitored_barrier(datetime.timedelta(seconds=0.5))
        got["late"] = "passed"
    except RuntimeError as exc:
        got["late"] = f"{type(exc).__name__}: {exc}"
    dist.destroy_process_group()
    return got


@scenario
def monitored_barrier_limits(rank: int, ws: int, init: str) -> dict[str, Any]:
    """``pg.monitored_barrier(timeout)`` that rank 1 reaches late: on a subgroup of a long timeout
    it is the call's own limit, and on the world 0 is "at once", as gloo's."""
    _init(rank, ws, init)
    sub = dist.new_group(list(range(ws)), timeout=datetime.timedelta(seconds=60))
    world = dist.group.WORLD
    assert world is not None
    got: dict[str, Any] = {}
    for name, pg, limit in (("sub", sub, 0.5), ("zero", world, 0.0)):
        world.monitored_barrier(datetime.timedelta(seconds=30))  # (together: then rank 1 is late)
        if rank == 1:
            time.sleep(4.0)
        started = time.monotonic()
        try:
            pg.monitored_barrier(datetime.timedelta(seconds=limit))
            got[name] = "passed"
        except RuntimeError as exc:
            got[name] = type(exc).__name__
        got[f"{name}_took"] = time.monotonic() - started
    dist.destroy_process_group()
    return got


@scenario
def refused_reductions(rank: int, ws: int, init: str) -> list[str]:
    """Reductions undefined for the dtype, on the default group and on a subgroup: every rank
    raises before any message goes, naming the op and the dtype it was given."""
    _init(rank, ws, init)
    sub = dist.new_group(list(range(ws)))
    said = []
    for group in (None, sub):
        for call, dtype, op in (
            (dist.all_reduce, torch.bfloat16, dist.ReduceOp.BAND),
            (functools.partial(dist.reduce, dst=0), torch.int64, dist.ReduceOp.AVG),
        ):
            try:
                call(torch.ones(2, dtype=dtype), op=op, group=group)
                said.append("no error")
            except RuntimeError as exc:
                said.append(f"{type(exc).__name__}: {exc}")
    t = torch.ones(2)
    dist.all_reduce(t, group=sub)  # (nothing was left in flight)
    said.append(f"sum {t[0].item():g}")
    dist.destroy_process_group()
    return said


def _np(t: torch.Tensor) -> np.ndarray[Any, Any]:
    return t.numpy().copy()


def contribution(rank: int, n: int, dtype: torch.dtype, salt: int = 0) -> torch.Tensor:
    values = (np.arange(n) * 7 + rank * 13 + salt) % 11 + 1
    return torch.from_numpy(values.astype(np.float64)).to(dtype)


def _same(got: torch.Tensor, want: np.ndarray[Any, Any], what: str) -> None:
    if not np.allclose(got.to(torch.float64).numpy(), want.astype(np.float64), rtol=1e-5):
        raise AssertionError(f"{what}: got {got.tolist()} want {want.tolist()}")


@scenario
def collectives(rank: int, ws: int, init: str) -> list[str]:
    """Every torch.distributed collective, checked against numpy on every rank."""
    _init(rank, ws, init)
    done = _every(rank, ws, list(range(ws)), None)
    sub_ranks = [0, ws - 1]
    sub = dist.new_group(sub_ranks, backend="arendez")
    if rank in sub_ranks:
        done += [f"sub:{name}" for name in _every(rank, ws, sub_ranks, sub)]
    dist.barrier()
    dist.destroy_process_group()
    return done


def _every(rank: int, ws: int, ranks: list[int], group: Any) -> list[str]:
    done: list[str] = []
    n = len(ranks)
    me = ranks.index(rank)
    parts = [_np(contribution(r, 10, torch.float32)) for r in ranks]
    # all_reduce, every op torch names (AVG too: gloo lacks it), sync and async
    for op, fn in [
        (dist.ReduceOp.SUM, np.sum),
        (dist.ReduceOp.PRODUCT, np.prod),
        (dist.ReduceOp.MIN, np.min),
        (dist.ReduceOp.MAX, np.max),
        (dist.ReduceOp.AVG, np.mean),
    ]:
        t = contribution(rank, 10, torch.float32)
        dist.all_reduce(t, op=op, group=group)
        _same(t, fn(np.stack(parts), axis=0), f"all_reduce {op}")
    ints = [_np(contribution(r, 10, torch.int64)).astype(np.int64) for r in ranks]
    for op, ufunc in [
        (dist.ReduceOp.BAND, np.bitwise_and),
        (dist.ReduceOp.BOR, np.bitwise_or),
        (dist.ReduceOp.BXOR, np.bitwise_xor),
    ]:
        t = contribution(rank, 10, torch.int64)
        dist.all_reduce(t, op=op, group=group)
        _same(t, ufunc.reduce(np.stack(ints), axis=0), f"all_reduce {op}")
    done.append("all_reduce")
    t = contribution(rank, 10, torch.float32)
    work = dist.all_reduce(t, group=group, async_op=True)
    assert work is not None
    assert work.wait(timeout=datetime.timedelta(seconds=20)) is True
    _same(t, np.sum(parts, axis=0), "async all_reduce")
    t2 = contribution(rank, 10, torch.float32)
    fut = dist.all_reduce(t2, group=group, async_op=True).get_future()
    value = fut.wait()
    _same(value[0], np.sum(parts, axis=0), "all_reduce future value")
    done.append("async_work_and_future")
    pair = [contribution(rank, 5, torch.float32), contribution(rank, 3, torch.float32, 1)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch plans to deprecate it; gloo has it
        dist.all_reduce_coalesced(pair, group=group)
    _same(pair[0], np.sum([_np(contribution(r, 5, torch.float32)) for r in ranks], axis=0), "coalesced 0")
    _same(pair[1], np.sum([_np(contribution(r, 3, torch.float32, 1)) for r in ranks], axis=0), "coalesced 1")
    done.append("all_reduce_coalesced")
    ins = [contribution(rank, 2 + i, torch.float32, i) for i in range(len(ranks))]  # as many as ranks
    outs = [[torch.zeros(2 + i) for i in range(len(ranks))] for _ in ranks]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        dist.all_gather_coalesced(outs, ins, group=group)
    for r, row in zip(ranks, outs, strict=True):  # torch's layout: [rank][tensor]
        for i, got in enumerate(row):
            _same(got, _np(contribution(r, 2 + i, torch.float32, i)), f"all_gather_coalesced [{r}][{i}]")
    done.append("all_gather_coalesced")
    root = ranks[-1]
    t = contribution(rank, 10, torch.float32)
    dist.broadcast(t, src=root, group=group)
    _same(t, parts[-1], "broadcast")
    b = torch.full((4,), float(rank), dtype=torch.bfloat16)
    dist.broadcast(b, src=root, group=group)
    assert b.tolist() == [float(root)] * 4, f"bfloat16 broadcast {b.tolist()}"
    done.append("broadcast")
    t = contribution(rank, 10, torch.float32)
    dist.reduce(t, dst=root, op=dist.ReduceOp.MAX, group=group)
    if rank == root:
        _same(t, np.max(parts, axis=0), "reduce")
    done.append("reduce")
    mine = contribution(rank, 10, torch.float32)
    outs = [torch.empty(10) for _ in ranks]
    held = dist.all_gather(outs, mine, group=group, async_op=True).get_future().wait()
    assert held == outs, "all_gather's future holds its output list, as gloo's"  # (by identity)
    for i in range(n):
        _same(outs[i], parts[i], f"all_gather {i}")
    flat = torch.empty(10 * n)
    held = dist.all_gather_into_tensor(flat, mine, group=group, async_op=True).get_future().wait()
    _same(flat, np.concatenate(parts), "all_gather_into_tensor")
    assert len(held) == n and all(h.data_ptr() == flat[10 * i].data_ptr() for i, h in enumerate(held)), (
        "all_gather_into_tensor's future holds the output's per-rank slices, as gloo's"
    )
    done += ["all_gather", "all_gather_into_tensor"]
    gathered = [torch.empty(10) for _ in ranks] if rank == root else None
    held = dist.gather(mine, gathered, dst=root, group=group, async_op=True).get_future().wait()
    assert held == (gathered or []), "gather's future: the gather list at the root, [] elsewhere"
    if gathered is not None:
        for i in range(n):
            _same(gathered[i], parts[i], f"gather {i}")
    done.append("gather")
    out = torch.empty(10)
    pieces = [contribution(r, 10, torch.float32, 5) for r in ranks] if rank == root else None
    dist.scatter(out, pieces, src=root, group=group)
    _same(out, _np(contribution(rank, 10, torch.float32, 5)), "scatter")
    done.append("scatter")
    blocks = [contribution(rank, 4, torch.float32, j) for j in range(n)]
    out = torch.empty(4)
    dist.reduce_scatter(out, blocks, group=group)
    _same(out, np.sum([_np(contribution(r, 4, torch.float32, me)) for r in ranks], axis=0), "reduce_scatter")
    big = torch.cat(blocks)
    out = torch.empty(4)
    dist.reduce_scatter_tensor(out, big, group=group)
    _same(out, np.sum([_np(contribution(r, 4, torch.float32, me)) for r in ranks], axis=0), "rs_tensor")
    done += ["reduce_scatter", "reduce_scatter_tensor"]
    ins = [contribution(rank, 3, torch.float32, j) for j in range(n)]
    outs = [torch.empty(3) for _ in ranks]
    dist.all_to_all(outs, ins, group=group)
    for i, r in enumerate(ranks):
        _same(outs[i], _np(contribution(r, 3, torch.float32, me)), f"all_to_all {i}")
    single_in = torch.cat(ins)
    single_out = torch.empty(3 * n)
    dist.all_to_all_single(single_out, single_in, group=group)
    _same(
        single_out, np.concatenate([_np(contribution(r, 3, torch.float32, me)) for r in ranks]), "a2a single"
    )
    # uneven splits: rank i sends i+1 rows to everyone
    rows_in = torch.full((n * (me + 1), 2), float(rank))
    rows_out = torch.empty(sum(i + 1 for i in range(n)), 2)
    dist.all_to_all_single(rows_out, rows_in, [i + 1 for i in range(n)], [me + 1] * n, group=group)
    want = np.concatenate([np.full((i + 1, 2), float(r)) for i, r in enumerate(ranks)])
    _same(rows_out, want, "a2a single uneven")
    done += ["all_to_all", "all_to_all_single"]
    assert dist.barrier(group=group, async_op=True).get_future().wait() == []  # (gloo's)
    done.append("barrier")
    # point to point: a ring of send/recv, isend/irecv, batch_isend_irecv, recv from any source
    right, left = ranks[(me + 1) % n], ranks[(me - 1) % n]
    if n > 1:
        got = torch.empty(6)
        ops = [
            dist.P2POp(dist.isend, contribution(rank, 6, torch.float32), right, group=group),
            dist.P2POp(dist.irecv, got, left, group=group),
        ]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        _same(got, _np(contribution(left, 6, torch.float32)), "batch_isend_irecv")
        got = torch.empty(6)
        send = dist.isend(contribution(rank, 6, torch.float32, 2), right, group=group)
        recv = dist.irecv(got, left, group=group)
        send.wait()
        recv.wait()
        _same(got, _np(contribution(left, 6, torch.float32, 2)), "isend/irecv")
        if me == 0:
            for _ in range(n - 1):
                got = torch.empty(2)
                sender = dist.recv(got, group=group)
                assert got.tolist() == [float(sender)] * 2, (sender, got.tolist())
        else:
            dist.send(torch.full((2,), float(rank)), ranks[0], group=group)
        done.append("send_recv")
    objs: list[Any] = [None] * n
    dist.all_gather_object(objs, {"rank": rank, "s": "x" * rank}, group=group)
    assert objs == [{"rank": r, "s": "x" * r} for r in ranks], objs
    lst: list[Any] = [rank, "from"] if rank == root else [None, None]
    dist.broadcast_object_list(lst, src=root, group=group)
    assert lst == [root, "from"], lst
    gl: list[Any] | None = [None] * n if rank == root else None
    dist.gather_object(("g", rank), gl, dst=root, group=group)
    if gl is not None:
        assert gl == [("g", r) for r in ranks], gl
    so: list[Any] = [None]
    dist.scatter_object_list(so, [("s", r) for r in ranks] if rank == root else None, src=root, group=group)
    assert so == [("s", rank)], so
    done.append("object_collectives")
    return done


@scenario
def device_mesh_dtensor(rank: int, ws: int, init: str) -> dict[str, Any]:
    """init_device_mesh, DTensor ops (a gather and a reduction) and group names."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    _init(rank, ws, init)
    mesh = init_device_mesh("cpu", (ws,))
    full = torch.arange(4.0 * ws * 3).reshape(4 * ws, 3)
    d = distribute_tensor(full, mesh, [Shard(0)])
    partial = DTensor.from_local(torch.full((3,), float(rank + 1)), mesh, [Partial()])
    sub = dist.new_group(list(range(ws)), backend="arendez")
    out = {
        "names": [dist.group.WORLD.group_name, mesh.get_group().group_name, sub.group_name],
        "desc": dist.group.WORLD.group_desc,
        "local": d.to_local().tolist(),
        "full": d.full_tensor().tolist(),
        "sum": d.sum().full_tensor().item(),
        "partial_to_replicate": partial.redistribute(mesh, [Replicate()]).to_local().tolist(),
    }
    dist.destroy_process_group()
    return out


@scenario
def fsdp2(rank: int, ws: int, init: str, steps: int) -> list[list[float]]:
    """FSDP2 ``fully_shard`` training on a CPU mesh; the full parameters after ``steps``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    _init(rank, ws, init)
    mesh = init_device_mesh("cpu", (ws,))
    model = mlp()
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(steps):
        train_step(model, opt, *batch(step, rank))
    params = [p.full_tensor().detach().reshape(-1).tolist() for p in model.parameters()]  # type: ignore[operator]
    dist.destroy_process_group()
    return params


@scenario
def bad_rank_args(rank: int, ws: int, init: str) -> dict[str, Any]:
    """Out-of-range dst/src in send, irecv, broadcast, reduce: the error each raises; then a collective."""
    _init(rank, ws, init)
    errors = {}
    for name, call in [
        ("send", lambda: dist.send(torch.ones(1), dst=ws + 3)),
        ("irecv", lambda: dist.irecv(torch.ones(1), src=ws + 7)),
        ("broadcast", lambda: dist.broadcast(torch.ones(1), src=ws)),
        ("reduce", lambda: dist.reduce(torch.ones(1), dst=ws + 5)),
    ]:
        try:
            call()
            errors[name] = "returned"
        except Exception as exc:  # (a ValueError as torch's own checks raise, a RuntimeError as gloo's)
            kinds = [k.__name__ for k in (ValueError, RuntimeError) if isinstance(exc, k)]
            errors[name] = f"{'+'.join(kinds)}: {exc}"
    wrong = {}  # arguments gloo refuses with a RuntimeError
    for name, call in [
        ("all_gather_into_tensor", lambda: dist.all_gather_into_tensor(torch.empty(3), torch.ones(2))),
        (
            "all_reduce AVG int64",
            lambda: dist.all_reduce(torch.ones(2, dtype=torch.int64), op=dist.ReduceOp.AVG),
        ),
    ]:
        try:
            call()
            wrong[name] = "returned"
        except Exception as exc:
            wrong[name] = f"{'RuntimeError' if isinstance(exc, RuntimeError) else 'not RuntimeError'}: {exc}"
    t = torch.ones(2)
    dist.all_reduce(t)
    dist.destroy_process_group()
    return {"errors": errors, "wrong": wrong, "after": t.tolist()}


def _strided_and_bf16_cases(rank: int, ws: int) -> dict[str, Callable[[Any], Any]]:
    """Calls on non-contiguous and bfloat16 tensors, each returning what the caller sees."""

    def nc(salt: int = 0) -> torch.Tensor:
        return (torch.arange(6.0).reshape(2, 3) + 10 * rank + salt).t()  # 3x2, non-contiguous

    def bf16(scale: float) -> torch.Tensor:
        return (torch.arange(4.0) * scale + 1.5 * (rank + 1)).to(torch.bfloat16)

    def broadcast(g: Any) -> Any:
        x = nc()
        dist.broadcast(x, src=ws - 1, group=g)
        return x.tolist()

    def all_reduce(g: Any) -> Any:
        x = nc()
        dist.all_reduce(x, group=g)
        return x.tolist()

    def all_reduce_async(g: Any) -> Any:
        x = nc()
        work = dist.all_reduce(x, op=dist.ReduceOp.MAX, group=g, async_op=True)
        work.wait()
        return x.tolist()

    def reduce(g: Any) -> Any:
        x = nc()
        dist.reduce(x, dst=0, group=g)
        return x.tolist() if rank == 0 else None  # torch leaves other ranks' tensors unspecified

    def all_gather(g: Any) -> Any:
        outs = [torch.zeros(2, 3).t() for _ in range(ws)]  # non-contiguous outputs and input
        dist.all_gather(outs, nc(), group=g)
        return [o.tolist() for o in outs]

    def gather(g: Any) -> Any:
        outs = [torch.zeros(2, 3).t() for _ in range(ws)] if rank == 0 else None
        dist.gather(nc(), outs, dst=0, group=g)
        return None if outs is None else [o.tolist() for o in outs]

    def scatter(g: Any) -> Any:
        out = torch.zeros(2, 3).t()
        dist.scatter(out, [nc(s) for s in range(ws)] if rank == 0 else None, src=0, group=g)
        return out.tolist()

    def send_recv(g: Any) -> Any:
        if rank == 0:
            dist.send(nc(), dst=1, group=g)
            return None
        x = torch.zeros(2, 3).t()
        if rank == 1:
            dist.recv(x, src=0, group=g)
        return x.tolist()

    def bf16_sum(g: Any) -> Any:
        x = bf16(0.25)
        dist.all_reduce(x, group=g)
        return [x.dtype == torch.bfloat16, x.tolist()]

    def bf16_max(g: Any) -> Any:
        x = bf16(1.0)
        dist.all_reduce(x, op=dist.ReduceOp.MAX, group=g)
        return x.tolist()

    def bf16_strided_sum(g: Any) -> Any:
        x = torch.stack([bf16(0.5), bf16(2.0)]).t()
        dist.all_reduce(x, group=g)
        return x.tolist()

    def bf16_reduce_scatter(g: Any) -> Any:
        out = torch.zeros(2, dtype=torch.bfloat16)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            x = (torch.arange(2.0 * ws) * 0.125 + 1.5 * (rank + 1)).to(torch.bfloat16)
            dist.reduce_scatter_tensor(out, x, group=g)
        return out.tolist()

    def fp16_sum(g: Any) -> Any:
        x = (torch.arange(4.0) * 0.25 + rank).to(torch.float16)
        dist.all_reduce(x, group=g)
        return x.tolist()

    return {
        "broadcast": broadcast, "all_reduce": all_reduce, "all_reduce_async": all_reduce_async,
        "reduce": reduce, "all_gather": all_gather, "gather": gather, "scatter": scatter,
        "send_recv": send_recv, "bf16_sum": bf16_sum, "bf16_max": bf16_max,
        "bf16_strided_sum": bf16_strided_sum, "bf16_reduce_scatter": bf16_reduce_scatter,
        "fp16_sum": fp16_sum,
    }  # fmt: skip


@scenario
def strided_and_bf16(rank: int, ws: int, init: str) -> dict[str, Any]:
    """Each case on the arendez default group, an arendez subgroup and a gloo group of the same ranks."""
    _init(rank, ws, init)
    sub = dist.new_group(list(range(ws)), backend="arendez")
    gloo = dist.new_group(list(range(ws)), backend="gloo")
    groups = [("arendez", None), ("arendez_sub", sub), ("gloo", gloo)]
    out = _each_case_on_each_group(_strided_and_bf16_cases(rank, ws), groups)
    dist.destroy_process_group()
    return out


def _each_case_on_each_group(
    cases: dict[str, Callable[[Any], Any]], groups: list[tuple[str, Any]]
) -> dict[str, Any]:
    """``"case/group"``: what each case returned on each group, or the error it raised."""
    out: dict[str, Any] = {}
    for name, case in cases.items():
        for label, group in groups:
            try:
                out[f"{name}/{label}"] = case(group)
            except Exception as exc:
                out[f"{name}/{label}"] = f"{type(exc).__name__}: {exc}"
            dist.barrier()
    return out


@scenario
def wait_timeout_then_result(rank: int, ws: int, init: str) -> dict[str, Any]:
    """Rank 0's ``wait(timeout)`` expires while rank 1 sleeps; the call goes on, a later wait returns."""
    from arendez.errors import WaitTimeoutError

    _init(rank, ws, init)
    t = torch.full((3,), float(rank + 1))
    raised = None
    if rank == 1:
        time.sleep(1.0)
    work = dist.all_reduce(t, async_op=True)
    if rank == 0:
        try:
            work.wait(timeout=datetime.timedelta(seconds=0.2))
        except WaitTimeoutError as exc:
            raised = {"runtime": isinstance(exc, RuntimeError), "timeout": isinstance(exc, TimeoutError)}
    assert work.wait() is True
    after = torch.ones(1)
    dist.all_reduce(after)
    dist.destroy_process_group()
    return {"raised": raised, "t": t.tolist(), "after": after.tolist()}


@scenario
def callbacks_that_call(rank: int, ws: int, init: str, backend: str) -> dict[str, Any]:
    """Future callbacks that make collectives (blocking, and async then waited: what PowerSGD's
    hook does), and DDP with the PowerSGD comm hook; ``backend`` "gloo" gives the reference."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

    if backend == "gloo":
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=ws)
    else:
        _init(rank, ws, init)

    def blocking(_: Any) -> list[float]:
        t = torch.full((2,), float(rank + 1))
        dist.all_reduce(t)
        return t.tolist()

    def nested(_: Any) -> list[float]:
        t = torch.full((2,), float(rank + 3))
        return list(dist.all_reduce(t, async_op=True).get_future().wait()[0].tolist())

    first = dist.all_reduce(torch.ones(1), async_op=True).get_future()
    out: dict[str, Any] = {"blocking": first.then(blocking).wait()}
    second = dist.all_reduce(torch.ones(1), async_op=True).get_future()
    out["nested"] = second.then(nested).wait()
    model = mlp()
    ddp_model = torch.nn.parallel.DistributedDataParallel(model)
    state = powerSGD_hook.PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=2)
    ddp_model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    opt = torch.optim.SGD(ddp_model.parameters(), lr=0.05)
    for step in range(5):
        train_step(ddp_model, opt, *batch(step, rank))
    out["params"] = [p.detach().reshape(-1).tolist() for p in model.parameters()]
    dist.destroy_process_group()
    return out


@scenario
def subgroup_timeout(rank: int, ws: int, init: str) -> dict[str, Any]:
    """A subgroup made with a 2 s timeout (the default group's is 60 s); rank 1 comes late."""
    dist.init_process_group(
        "arendez", init_method=init, rank=rank, world_size=ws, timeout=datetime.timedelta(60)
    )
    group = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=2))
    out: dict[str, Any] = {}
    if rank == 0:
        start = time.monotonic()
        try:
            dist.all_reduce(torch.ones(4), group=group)
        except Exception as exc:
            out = {"error": type(exc).__name__, "message": str(exc), "after": time.monotonic() - start}
        try:
            dist.all_reduce(torch.ones(4), group=group)
        except Exception as exc:
            out["again"] = type(exc).__name__
    else:
        time.sleep(8)
        late = torch.ones(4)
        dist.all_reduce(late, group=group)  # (rank 0's part had arrived: it may complete)
        out["late"] = late.tolist()
        try:
            dist.all_reduce(torch.ones(4), group=group)
        except Exception as exc:
            out["late again"] = f"{type(exc).__name__}: {exc}"
    dist.barrier()  # (the default group: rank 0 stays until rank 1 is done)
    dist.destroy_process_group()
    return out


@scenario
def ddp_join_uneven(rank: int, ws: int, init: str, backend: str) -> dict[str, Any]:
    """DDP's ``join()`` with uneven inputs and ``find_unused_parameters`` (its join hook calls the
    group's ``allreduce(tensor)`` overload directly), then the ``allreduce(tensor, op)`` and
    ``broadcast(tensor, root)`` overloads; ``backend`` "gloo" gives the reference."""
    if backend == "gloo":
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=ws)
    else:
        _init(rank, ws, init)
    model = mlp()
    ddp_model = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
    opt = torch.optim.SGD(ddp_model.parameters(), lr=0.05)
    with ddp_model.join():
        for step in range(3 + 2 * rank):  # rank r runs 3 + 2r steps
            train_step(ddp_model, opt, *batch(step, rank))
    pg = dist.group.WORLD
    assert pg is not None
    t = torch.full((3,), float(rank + 1))
    pg.allreduce(t, dist.ReduceOp.MAX).wait()
    b = torch.full((2,), float(rank))
    pg.broadcast(b, ws - 1).wait()
    out = {"params": [p.detach().reshape(-1).tolist() for p in model.parameters()]}
    out["overloads"] = [t.tolist(), b.tolist()]
    dist.destroy_process_group()
    return out


@scenario
def subgroup_edges(rank: int, ws: int, init: str) -> dict[str, Any]:
    """3 ranks: one-member subgroups, subgroup point-to-point beside the world's, a size
    mistake made by both members, and parameters written under no_grad (QA, gloo's results)."""
    _init(rank, ws, init)
    out: dict[str, Any] = {}
    singles, _ = dist.new_subgroups(group_size=1)
    t = torch.full((3,), float(rank + 1))
    dist.all_reduce(t, group=singles)
    dist.broadcast(t, src=rank, group=singles)
    gathered = [torch.zeros(3)]
    dist.all_gather(gathered, t, group=singles)
    dist.barrier(group=singles)
    out["single"] = gathered[0].tolist()
    pair = dist.new_group([0, 1])
    if rank == 0:
        dist.send(torch.full((2,), 1.0), 1)  # on the world, tag 0
        dist.send(torch.full((2,), 2.0), 1, group=pair)  # on the subgroup, tag 0
    elif rank == 1:
        on_pair, on_world = torch.zeros(2), torch.zeros(2)
        dist.recv(on_pair, 0, group=pair)
        dist.recv(on_world, 0)
        out["p2p"] = [on_pair.tolist(), on_world.tolist()]
    if rank == 2:
        dist.send(torch.full((2,), 9.0), 1)  # a non-member's message on the world
        dist.send(torch.full((2,), 5.0), 1, tag=3)
    elif rank == 0:
        dist.send(torch.full((2,), 7.0), 1, group=pair)
    if rank == 1:
        anyone, stranger, later = torch.zeros(2), torch.zeros(2), torch.zeros(2)
        src = dist.recv(anyone, None, group=pair)
        dist.recv(stranger, 2)
        work = dist.irecv(later, tag=3)  # from any source: the Work says whose it was
        work.wait()
        out["any"] = [src, anyone.tolist(), stranger.tolist(), work.source_rank()]
    if rank in (0, 1):
        try:  # both members make the same mistake: 11 elements cannot hold 2 x 5
            dist.all_gather_into_tensor(torch.zeros(11), torch.ones(5), group=pair)
            out["mistake"] = "no error"
        except Exception as exc:
            out["mistake"] = type(exc).__name__
        sums = []
        for value in (1.0, 10.0, 100.0):
            x = torch.full((5,), value)
            dist.all_reduce(x, group=pair)
            sums.append(x[0].item())
        out["after"] = sums
        me = dist.get_rank(pair)
        ts = [torch.full((1 << 16,), 10.0 * me + j) for j in range(2)]
        dist.all_to_all(ts, ts, group=pair)  # in place
        out["a2a"] = [t[0].item() for t in ts] + [t[-1].item() for t in ts]
        wrong = [torch.zeros(4), torch.zeros(5)] if rank == 0 else None  # (5: the root's mistake)
        try:
            dist.gather(torch.ones(4), wrong, dst=0, group=pair)
            out["gather"] = "no error"
        except Exception as exc:
            out["gather"] = type(exc).__name__
        x = torch.full((3,), 3.0)
        dist.all_reduce(x, group=pair)
        out["after gather"] = x.tolist()
        params = {
            "bf16": torch.nn.Parameter(torch.full((4,), 1.5, dtype=torch.bfloat16)),
            "fp32 on the pair": torch.nn.Parameter(torch.full((4,), 1.5)),
        }
        with torch.no_grad():
            dist.all_reduce(params["bf16"])
            dist.all_reduce(params["fp32 on the pair"], group=pair)
        out["no_grad"] = {k: p.float()[0].item() for k, p in params.items()}
    else:
        with torch.no_grad():
            dist.all_reduce(torch.nn.Parameter(torch.full((4,), 1.5, dtype=torch.bfloat16)))
    dist.destroy_process_group()
    return out


@scenario
def subgroup_mismatches(rank: int, ws: int, init: str) -> dict[str, str]:
    """3 ranks, subgroups of ranks 0 and 1 that disagree on a collective's dtype, op or kind
    (QA: silent garbage, where gloo under TORCH_DISTRIBUTED_DEBUG=DETAIL raises)."""
    _init(rank, ws, init)
    out: dict[str, str] = {}
    mine = torch.float32 if rank == 0 else torch.int32
    op = dist.ReduceOp.SUM if rank == 0 else dist.ReduceOp.MAX

    def kind(g: Any) -> None:
        if rank == 0:
            dist.broadcast(torch.ones(4), src=0, group=g)
        else:
            dist.all_reduce(torch.ones(4), group=g)

    cases: dict[str, Callable[[Any], None]] = {
        "dtype": lambda g: dist.all_reduce(torch.ones(4, dtype=mine), group=g),
        "op": lambda g: dist.all_reduce(torch.ones(4), op=op, group=g),
        "kind": kind,
    }
    for name, case in cases.items():
        pair = dist.new_group([0, 1])  # (a fresh subgroup each: one that saw a mismatch refuses more)
        if rank in (0, 1):
            try:
                case(pair)
                out[name] = "no error"
            except Exception as exc:
                out[name] = f"{type(exc).__name__}: {exc}"
            if out[name] != "no error":
                try:
                    dist.all_reduce(torch.ones(1), group=pair)
                    out[name + " then"] = "no error"
                except Exception as exc:
                    out[name + " then"] = type(exc).__name__
    dist.barrier()
    dist.destroy_process_group()
    return out


def _torch_feature_cases(rank: int, ws: int) -> dict[str, Callable[[Any], Any]]:
    """What torch features need of a group beyond the collectives (QA: each failed on arendez
    while gloo ran it); each case returns what the caller sees, compared with a gloo group's."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.nn.parallel import DistributedDataParallel

    def resize(group: Any) -> list[int]:  # (the tensor's storage was left not resizable)
        buf = torch.ones(4)
        dist.all_reduce(buf, group=group)
        buf.resize_(64)
        src = torch.arange(4.0)
        dist.broadcast(src, 0, group=group)
        src.untyped_storage().resize_(0)
        return [buf.numel(), src.untyped_storage().nbytes()]

    def fsdp1(group: Any) -> list[float]:  # (frees and regrows its flat parameters' storage)
        model = FullyShardedDataParallel(mlp(), process_group=group, device_id=torch.device("cpu"))
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        for step in range(2):
            train_step(model, opt, *batch(step, rank))
        with FullyShardedDataParallel.summon_full_params(model):
            return [round(float(p.sum()), 5) for p in model.parameters()]

    def devices(group: Any) -> list[str]:  # (a Python group had none: DCP's async save failed)
        g = group or dist.group.WORLD
        return [str(d) for d in g._device_types] + [str(dist.distributed_c10d._get_pg_default_device(g))]

    def from_rank0(group: Any) -> float:  # (broadcast_from_rank0 read the group's devices)
        model = DistributedDataParallel(mlp(), process_group=group)
        full = {k: torch.full_like(v, 3.0) for k, v in mlp().state_dict().items()} if rank == 0 else {}
        set_model_state_dict(
            model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        )
        return float(sum(p.sum() for p in model.parameters()))

    def sparse(group: Any) -> list[Any]:  # (sparse COO all_reduce; DDP of a sparse Embedding)
        s = torch.sparse_coo_tensor(torch.tensor([[0, rank + 1]]), torch.tensor([1.0, 2.0]), (ws + 2,))
        dist.all_reduce(s, group=group)
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Embedding(10, 4, sparse=True), torch.nn.Linear(4, 1))
        DistributedDataParallel(model, process_group=group)(torch.tensor([[rank, 3]])).sum().backward()
        grad = model[0].weight.grad
        assert grad is not None and grad.is_sparse
        return [s.to_dense().tolist(), grad.to_dense().tolist()]

    def inference(group: Any) -> list[list[float]]:  # (copy-backs into inference tensors)
        with torch.inference_mode():
            half = torch.full((2,), float(rank + 1), dtype=torch.bfloat16)
            dist.all_reduce(half, group=group)
            strided = torch.full((2, 2), float(rank + 1))[:, 0]
            dist.all_reduce(strided, group=group)
        return [half.float().tolist(), strided.tolist()]

    def float8(group: Any) -> list[float]:  # (sent as its bits; gloo broadcasts none)
        t = (torch.arange(4.0) * (rank + 1)).to(torch.float8_e4m3fn)
        if rank == 0:
            dist.send(t, 1, group=group)
        elif rank == 1:
            dist.recv(t, 0, group=group)
        return t.float().tolist()

    def compiled_ddp(group: Any) -> list[float]:  # (Dynamo traced into the group's broadcast)
        torch.manual_seed(0)
        model = DistributedDataParallel(mlp(), process_group=group)
        run = torch.compile(model, backend="eager")
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        for step in range(2):
            x, y = batch(step, rank)
            torch.nn.functional.mse_loss(run(x), y).backward()
            opt.step()
            opt.zero_grad()
        return [round(float(p.sum()), 5) for p in model.parameters()]

    return {
        "resize": resize,
        "fsdp1": fsdp1,
        "devices": devices,
        "from_rank0": from_rank0,
        "sparse": sparse,
        "inference": inference,
        "float8": float8,
        "compiled_ddp": compiled_ddp,
    }


@scenario
def torch_features(rank: int, ws: int, init: str) -> dict[str, Any]:
    """Each case on the arendez default group and on a gloo group of the same ranks."""
    _init(rank, ws, init)
    gloo = dist.new_group(list(range(ws)), backend="gloo")
    out = _each_case_on_each_group(_torch_feature_cases(rank, ws), [("arendez", None), ("gloo", gloo)])
    dist.destroy_process_group()
    return out


@scenario
def end_with_a_call_in_flight(rank: int, ws: int, init: str, how: str) -> dict[str, Any]:
    """Rank 0 starts an all_reduce the others never join, then ends the group (``how``:
    torch's ``destroy_process_group``, or its ``_abort_process_group``); the others wait for
    its end. The group's timeout is 5 s."""
    dist.init_process_group(
        "arendez", init_method=init, rank=rank, world_size=ws, timeout=datetime.timedelta(seconds=5)
    )
    dist.barrier()
    out: dict[str, Any] = {}
    if rank == 0:
        work = dist.all_reduce(torch.ones(2), async_op=True)
        started = time.monotonic()
        if how == "abort":
            dist.distributed_c10d._abort_process_group()
        else:
            dist.destroy_process_group()
        out["seconds"] = time.monotonic() - started
        try:
            work.wait()
            out["work"] = "completed"
        except Exception as exc:
            out["work"] = type(exc).__name__
        Path(os.environ["TEST_DONE_FILE"]).write_text("done")
    else:
        deadline = time.monotonic() + 30
        while not Path(os.environ["TEST_DONE_FILE"]).exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        with contextlib.suppress(Exception):  # (its peer's end may have failed this world)
            dist.destroy_process_group()
    return out


def main() -> None:
    name, rank, ws, init, args = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
    torch.set_num_threads(1)
    result = SCENARIOS[name](rank, ws, init, *json.loads(args))
    report_result(result)


if __name__ == "__main__":
    main()
