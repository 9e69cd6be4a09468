"""Sparse (COO) all_reduce for the torch backend, as gloo's: DDP with sparse gradients
(``nn.Embedding(sparse=True)``) reduces them this way.

Every rank's indices and values are gathered (padded to the largest count of non-zeros, which a
first gather of the counts finds), and each rank builds the same coalesced sum, which it copies
into the caller's tensor.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

import torch

from .arrays import ReduceOp
from .errors import InvalidArgumentError
from .torchstage import raw, writing

#: ``gather(outputs, input)``: the group's all_gather (one output per member, in group order)
Gather = Callable[[list[torch.Tensor], torch.Tensor], Coroutine[Any, Any, None]]


def check(t: torch.Tensor, op: ReduceOp) -> None:
    """Refuse, before any message, what a sparse all_reduce cannot do (as gloo does)."""
    if t.layout is not torch.sparse_coo:
        raise InvalidArgumentError(f"sparse all_reduce supports sparse COO tensors, not {t.layout}")
    if op is not ReduceOp.SUM:
        raise InvalidArgumentError(f"sparse all_reduce supports ReduceOp.SUM only, not ReduceOp.{op.name}")


async def all_reduce(t: torch.Tensor, gather: Gather, size: int) -> None:
    """Sum the sparse COO tensor ``t`` over the group's ``size`` members, in place."""
    mine = t.coalesce()
    indices, values = mine.indices(), mine.values()
    counts = [torch.empty(1, dtype=torch.int64) for _ in range(size)]
    await gather(counts, torch.tensor([indices.shape[1]], dtype=torch.int64))
    nnz = [int(c) for c in counts]
    most = max(nnz)
    sent_indices = torch.zeros((indices.shape[0], most), dtype=torch.int64)
    sent_indices[:, : indices.shape[1]] = indices
    sent_values = torch.zeros((most, *values.shape[1:]), dtype=values.dtype)
    sent_values[: values.shape[0]] = values
    got_indices = [torch.empty_like(sent_indices) for _ in range(size)]
    got_values = [torch.empty_like(sent_values) for _ in range(size)]
    await gather(got_indices, sent_indices)
    await gather([raw(v) for v in got_values], raw(sent_values))
    total = torch.sparse_coo_tensor(
        torch.cat([g[:, :n] for g, n in zip(got_indices, nnz, strict=True)], dim=1),
        torch.cat([g[:n] for g, n in zip(got_values, nnz, strict=True)]),
        t.shape,
    ).coalesce()
    with writing(t):  # (on the loop thread: the caller's modes are its thread's)
        t.copy_(total)
