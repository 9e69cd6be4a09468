"""Scripts in the style of PyTorch's "Writing Distributed Applications with PyTorch" tutorial.

``python -m tests.tutorial_ranks MODULE SCENARIO RANK SIZE [INIT_METHOD]`` runs one rank with
``import MODULE as dist`` (``torch.distributed`` or ``arendez.sync``) and nothing else changed
(SCENARIO ``everything`` runs every two-rank one in one world);
MASTER_ADDR/MASTER_PORT come from the environment. Each rank prints what it saw.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

import torch

dist: Any = None


def p2p_blocking(rank: int, size: int) -> None:
    tensor = torch.zeros(1)
    if rank == 0:
        tensor += 1
        dist.send(tensor=tensor, dst=1)
    else:
        dist.recv(tensor=tensor, src=0)
    print("Rank ", rank, " has data ", tensor[0].item())


def p2p_nonblocking(rank: int, size: int) -> None:
    tensor = torch.zeros(1)
    req = None
    if rank == 0:
        tensor += 1
        req = dist.isend(tensor=tensor, dst=1)
        print("Rank 0 started sending")
    else:
        req = dist.irecv(tensor=tensor, src=0)
        print("Rank 1 started receiving")
    req.wait()
    print("Rank ", rank, " has data ", tensor[0].item(), req.is_completed())


def group_all_reduce(rank: int, size: int) -> None:
    group = dist.new_group([0, 1])
    tensor = torch.ones(1)
    dist.all_reduce(tensor, op=dist.reduce_op.SUM, group=group)
    print("Rank ", rank, " has data ", tensor[0].item())


def _ring_allreduce(send: Any, recv: Any) -> None:
    rank = dist.get_rank()
    size = dist.get_world_size()
    send_buff = send.clone()
    recv_buff = send.clone()
    accum = send.clone()
    left = ((rank - 1) + size) % size
    right = (rank + 1) % size
    for i in range(size - 1):
        if i % 2 == 0:
            send_req = dist.isend(send_buff, right)
            dist.recv(recv_buff, left)
            accum[:] += recv_buff[:]
        else:
            send_req = dist.isend(recv_buff, right)
            dist.recv(send_buff, left)
            accum[:] += send_buff[:]
        send_req.wait()
    recv[:] = accum[:]


def ring(rank: int, size: int) -> None:
    send = torch.arange(4, dtype=torch.float32) * (rank + 1)
    recv = torch.zeros(4)
    _ring_allreduce(send, recv)
    print("Rank ", rank, " ring sum ", recv.tolist())


def _average_gradients(model: Any) -> None:
    size = float(dist.get_world_size())
    for param in model.parameters():
        dist.all_reduce(param.grad.data, op=dist.reduce_op.SUM)
        param.grad.data /= size


def training(rank: int, size: int) -> None:
    torch.manual_seed(1234)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
    gen = torch.Generator().manual_seed(rank)
    data, target = torch.randn(16, 4, generator=gen), torch.randn(16, 1, generator=gen)
    for epoch in range(5):
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(data), target)
        loss.backward()
        _average_gradients(model)
        optimizer.step()
        print("Rank ", rank, ", epoch ", epoch, ": ", round(loss.item(), 6))
    print("Rank ", rank, " weights ", [round(v, 6) for v in model[0].weight.reshape(-1).tolist()])


def extras(rank: int, size: int) -> None:
    """The rest of the API a CPU script uses (documentation examples)."""
    peer = 1 - rank
    print("available", dist.is_available(), "initialized", dist.is_initialized())
    print("world", dist.get_rank(dist.group.WORLD), dist.get_world_size(group=dist.group.WORLD))
    # batch_isend_irecv: a simultaneous exchange
    send_t, recv_t = torch.full((3,), float(rank + 1)), torch.zeros(3)
    ops = [dist.P2POp(dist.isend, send_t, peer), dist.P2POp(dist.irecv, recv_t, peer)]
    for req in dist.batch_isend_irecv(ops):
        req.wait()
    print("batch got", recv_t.tolist())
    # irecv from any source, then source_rank-free check of what came
    if rank == 0:
        dist.send_object_list([{"step": 3, "name": "ok"}, [1, 2.5, "x"]], dst=1)
    else:
        objs: list[Any] = [None, None]
        dist.recv_object_list(objs, src=0)
        print("objects", objs)
    # async_op collectives and their futures
    t = torch.tensor([rank + 1.0, 10.0])
    work = dist.all_reduce(t, op=dist.ReduceOp.MAX, async_op=True)
    work.wait()
    print("async max", t.tolist(), work.is_completed())
    # all_reduce_coalesced on a list of tensors
    a, b = torch.ones(2) * (rank + 1), torch.ones(3) * (rank + 2)
    dist.all_reduce_coalesced([a, b])
    print("coalesced", a.tolist(), b.tolist())
    # all_gather_coalesced: output_tensor_lists[rank][i] (as many tensors as ranks: a transposed
    # layout would pass unnoticed)
    mine = [torch.full((2,), 10.0 * rank + i) for i in range(size)]
    lists = [[torch.zeros(2) for _ in range(size)] for _ in range(size)]
    dist.all_gather_coalesced(lists, mine)
    print("gathered coalesced", [[t.tolist() for t in row] for row in lists])
    # subgroups
    mine, subgroups = dist.new_subgroups(group_size=1)
    print("subgroups", len(subgroups), dist.get_process_group_ranks(mine))
    print("global of group rank 0", dist.get_global_rank(mine, 0), dist.get_group_rank(mine, rank))
    dist.monitored_barrier(timeout=__import__("datetime").timedelta(seconds=30))
    print("monitored barrier passed")


def dtypes_and_layouts(rank: int, size: int) -> None:
    """bfloat16 (mixed-precision code) and non-contiguous tensors, as gloo takes them."""
    t = torch.full((3,), rank + 1.5, dtype=torch.bfloat16)
    dist.all_reduce(t)
    print("bf16 all_reduce", t.dtype, t.tolist())
    b = torch.full((2,), rank + 5.25, dtype=torch.bfloat16)
    dist.broadcast(b, src=1)
    print("bf16 broadcast", b.tolist())
    outs = [torch.zeros(2, dtype=torch.bfloat16) for _ in range(size)]
    dist.all_gather(outs, torch.full((2,), rank + 0.5, dtype=torch.bfloat16))
    print("bf16 all_gather", [o.tolist() for o in outs])
    m = torch.arange(8.0).reshape(2, 4).t() * (rank + 1)  # (gloo reduces a strided slice wrongly)
    dist.all_reduce(m)
    print("transposed all_reduce", m.tolist())
    w = torch.arange(6.0).reshape(2, 3).t() * (rank + 1)
    dist.all_reduce(w, op=dist.ReduceOp.MAX, async_op=True).wait()
    print("transposed async max", w.tolist())
    flat = torch.arange(1.0, 2 * size + 1, dtype=torch.bfloat16) * (rank + 1)  # (ZeRO's in-place
    shard = flat[rank * 2 : rank * 2 + 2]  # reduce-scatter: the output is a slice of the input)
    dist.reduce_scatter_tensor(shard, flat)
    print("bf16 in-place reduce_scatter_tensor", shard.tolist())
    expanded = torch.full((1, 2), rank + 1.0).expand(3, 2)  # (stride 0: gloo writes it once)
    dist.all_reduce(expanded)
    print("expanded all_reduce", expanded.tolist())
    peer = 1 - rank  # (QA25: arendez.sync's isend/irecv refused bfloat16)
    got = torch.zeros(3, dtype=torch.bfloat16)
    mine = torch.full((3,), rank + 0.75, dtype=torch.bfloat16)
    works = (
        [dist.isend(mine, peer), dist.irecv(got, peer)]
        if rank == 0
        else [dist.irecv(got, peer), dist.isend(mine, peer)]
    )
    for work in works:
        work.wait()
    print("bf16 isend/irecv", got.dtype, got.tolist())
    got = torch.zeros(2, dtype=torch.bfloat16)
    ops = [dist.P2POp(dist.isend, mine[:2] * 2, peer), dist.P2POp(dist.irecv, got, peer)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    print("bf16 batch_isend_irecv", got.dtype, got.tolist())


def everything(rank: int, size: int) -> None:
    """Every two-rank scenario above, one after the other in one world."""
    for scenario in (
        p2p_blocking,
        p2p_nonblocking,
        group_all_reduce,
        ring,
        training,
        extras,
        dtypes_and_layouts,
    ):
        print("--", scenario.__name__)
        scenario(rank, size)


def main() -> None:
    global dist
    module, scenario, rank, size = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    dist = importlib.import_module(module)
    if len(sys.argv) > 5:  # an init_method such as file:///tmp/x (else MASTER_ADDR/MASTER_PORT)
        dist.init_process_group("gloo", init_method=sys.argv[5], rank=rank, world_size=size)
    else:
        dist.init_process_group("gloo", rank=rank, world_size=size)
    globals()[scenario](rank, size)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
