"""Subgroup collectives of the torch backend: direct exchange over arendez point-to-point.

torch creates a subgroup's backend on its members only, while arendez's ``new_group`` must be
entered by every rank of the world; so a subgroup's collectives run here as one message per pair
of members (correct and identical on every member, not bandwidth-optimal).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from typing import Any

import torch

import arendez
from arendez.errors import (
    ArendezError,
    CollectiveCancelledError,
    CollectiveMismatchError,
    CollectiveTimeoutError,
    InvalidArgumentError,
)
from arendez.p2p import recv_as, send_as
from arendez.torchstage import writing

_REDUCE: dict[arendez.ReduceOp, Callable[[torch.Tensor, torch.Tensor], Any]] = {
    arendez.ReduceOp.SUM: lambda a, b: a.add_(b),
    arendez.ReduceOp.AVG: lambda a, b: a.add_(b),
    arendez.ReduceOp.PRODUCT: lambda a, b: a.mul_(b),
    arendez.ReduceOp.MIN: lambda a, b: torch.minimum(a, b, out=a),
    arendez.ReduceOp.MAX: lambda a, b: torch.maximum(a, b, out=a),
    arendez.ReduceOp.BAND: lambda a, b: a.bitwise_and_(b),
    arendez.ReduceOp.BOR: lambda a, b: a.bitwise_or_(b),
    arendez.ReduceOp.BXOR: lambda a, b: a.bitwise_xor_(b),
}


def _fingerprint(collective: str, t: torch.Tensor, op: str) -> str:
    """What one subgroup message belongs to: the collective, the dtype it moves (as staged: a
    bfloat16 tensor moves as its bits, ``int16``) and the reduce op, for ``p2p.recv_as``."""
    return f"{collective}|{str(t.dtype).removeprefix('torch.')}|{op}"


#: The fingerprint of the message a member that timed out sends every other member: a late
#: member may still complete the call it timed out of (its part had arrived), but its next call
#: reads this instead of a part, and the subgroup is unusable there too.
TIMED_OUT = "timed out"


def _ignore_outcome(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()  # (retrieved: a peer gone meanwhile is no news here)


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr())


class Direct:
    """Collectives of one subgroup as direct messages between its members, one at a time.

    Every contribution is combined in group-rank order, so all members get identical results.
    """

    def __init__(self, ranks: list[int], me: int, tag: int, timeout: float) -> None:
        self.ranks, self.me, self.tag, self.timeout = ranks, me, tag, timeout
        self._lock: asyncio.Lock | None = None
        self._broken: ArendezError | None = None

    async def _exchange(
        self,
        collective: str,
        sends: dict[int, torch.Tensor],
        recvs: dict[int, torch.Tensor],
        op: arendez.ReduceOp | None = None,
        timeout: float | None = None,
    ) -> None:
        """Send and receive one collective's messages within ``timeout`` (the subgroup's if
        None). Each says which collective, dtype and op it belongs to: a member that runs another
        one gets ``CollectiveMismatchError`` (as gloo's under ``TORCH_DISTRIBUTED_DEBUG=DETAIL``)
        rather than another call's bytes. After a timeout or a mismatch the subgroup is unusable
        (messages of that call may still arrive, and would be taken for the next one's): later
        calls raise the same error, as gloo's do."""
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:  # subgroup collectives match by order: one at a time
            if self._broken is not None:
                raise self._broken.with_traceback(None)
            if not sends and not recvs:  # (a group of one)
                return
            tail = op.name if op is not None else ""
            peers: dict[asyncio.Future[Any], int] = {}  # each message's task -> the peer's group rank
            for p, t in sends.items():
                sent = send_as(t, self.ranks[p], None, self.tag, _fingerprint(collective, t, tail))
                peers[asyncio.ensure_future(sent)] = p
            for p, t in recvs.items():
                got = recv_as(t, self.ranks[p], None, self.tag, _fingerprint(collective, t, tail))
                peers[asyncio.ensure_future(got)] = p
            try:
                limit = self.timeout if timeout is None else timeout
                done, pending = await asyncio.wait(peers, timeout=limit, return_when=asyncio.FIRST_EXCEPTION)
            except BaseException:  # (cancelled: withdraw every message of this call)
                for task in peers:
                    task.cancel()
                raise
            for task in pending:
                task.cancel()
            for task in done:
                exc = task.exception()
                if isinstance(exc, arendez.RankFailedError):  # (name the call, not its send or recv)
                    raise exc.during(collective) from exc
                if isinstance(exc, CollectiveMismatchError):
                    self._broken = CollectiveMismatchError(f"{collective} on subgroup {self.ranks}: {exc}")
                    if f"part of '{TIMED_OUT} " in str(exc):  # (not a mismatch: a call-off)
                        why = f"timed out of an earlier call on subgroup {self.ranks}, which then refuses"
                        self._broken = CollectiveCancelledError(self.ranks[peers[task]], collective, -1, why)
                    raise self._broken
                if exc is not None:
                    raise exc
            if pending:
                late = sorted({self.ranks[peers[task]] for task in pending})
                what = f"{collective} on subgroup {self.ranks}"
                self._broken = CollectiveTimeoutError(what, limit, late)
                self._tell_timed_out(collective)
                raise self._broken

    def _tell_timed_out(self, collective: str) -> None:
        """Send every other member the ``TIMED_OUT`` message (not waited for: best effort)."""
        nothing = torch.empty(0, dtype=torch.uint8)
        for p in self._others():
            sent = send_as(nothing, self.ranks[p], None, self.tag, f"{TIMED_OUT}|{collective}")
            asyncio.ensure_future(sent).add_done_callback(_ignore_outcome)

    def _others(self) -> Iterator[int]:
        return (p for p in range(len(self.ranks)) if p != self.me)

    def _combine(self, parts: list[torch.Tensor], out: torch.Tensor, op: arendez.ReduceOp) -> None:
        with writing(out):  # (the caller's modes are its thread's; this runs on the loop's)
            acc = parts[0].clone()
            for part in parts[1:]:
                _REDUCE[op](acc, part)
            if op is arendez.ReduceOp.AVG:
                acc.div_(len(parts))
            out.copy_(acc.view_as(out))

    def _sizes(self, collective: str, tensors: list[torch.Tensor], each: int, what: str) -> None:
        """Refuse a call whose tensors do not fit before any message goes: a call that failed
        on one member after another had sent would leave that message to the next call."""
        if len(tensors) != len(self.ranks):
            raise InvalidArgumentError(
                f"{collective}: {what} has {len(tensors)} tensors, the subgroup {len(self.ranks)} ranks"
            )
        for i, t in enumerate(tensors):
            if t.numel() != each:
                raise InvalidArgumentError(
                    f"{collective}: {what}[{i}] has {t.numel()} elements, expected {each}"
                )

    async def all_reduce(
        self, t: torch.Tensor, op: arendez.ReduceOp, name: str = "all_reduce", timeout: float | None = None
    ) -> None:
        flat = t.reshape(-1)
        parts = [flat if p == self.me else torch.empty_like(flat) for p in range(len(self.ranks))]
        await self._exchange(
            name, {p: flat for p in self._others()}, {p: parts[p] for p in self._others()}, op, timeout
        )
        self._combine(parts, t, op)

    async def reduce(self, t: torch.Tensor, root: int, op: arendez.ReduceOp) -> None:
        r = self.ranks.index(root)
        if self.me != r:
            await self._exchange("reduce", {r: t}, {}, op)
            return
        parts = [t.reshape(-1) if p == r else torch.empty_like(t.reshape(-1)) for p in range(len(self.ranks))]
        await self._exchange("reduce", {}, {p: parts[p] for p in self._others()}, op)
        self._combine(parts, t, op)

    async def reduce_scatter(self, out: torch.Tensor, ins: list[torch.Tensor], op: arendez.ReduceOp) -> None:
        self._sizes("reduce_scatter", ins, out.numel(), "the input list")
        parts = [
            ins[self.me].reshape(-1) if p == self.me else torch.empty_like(out.reshape(-1))
            for p in range(len(self.ranks))
        ]
        await self._exchange(
            "reduce_scatter", {p: ins[p] for p in self._others()}, {p: parts[p] for p in self._others()}, op
        )
        self._combine(parts, out, op)

    async def broadcast(self, t: torch.Tensor, root: int) -> None:
        r = self.ranks.index(root)
        await self._exchange(
            "broadcast",
            {p: t for p in self._others()} if self.me == r else {},
            {} if self.me == r else {r: t},
        )

    async def all_gather(self, outs: list[torch.Tensor], x: torch.Tensor) -> None:
        self._sizes("all_gather", outs, x.numel(), "the output list")
        with writing(outs[self.me]):
            outs[self.me].copy_(x.view_as(outs[self.me]))
        await self._exchange(
            "all_gather", {p: x for p in self._others()}, {p: outs[p] for p in self._others()}
        )

    async def gather(self, x: torch.Tensor, outs: list[torch.Tensor] | None, root: int) -> None:
        r = self.ranks.index(root)
        if self.me != r:
            await self._exchange("gather", {r: x}, {})
            return
        assert outs is not None
        try:
            self._sizes("gather", outs, x.numel(), "the gather list")
        except InvalidArgumentError:  # the members' parts are on their way: take them first
            await self._exchange("gather", {}, {p: torch.empty_like(x) for p in self._others()})
            raise
        with writing(outs[r]):
            outs[r].copy_(x.view_as(outs[r]))
        await self._exchange("gather", {}, {p: outs[p] for p in self._others()})

    async def scatter(self, out: torch.Tensor, ins: list[torch.Tensor] | None, root: int) -> None:
        r = self.ranks.index(root)
        if self.me != r:
            await self._exchange("scatter", {}, {r: out})
            return
        assert ins is not None
        self._sizes("scatter", ins, out.numel(), "the scatter list")
        with writing(out):
            out.copy_(ins[r].view_as(out))
        await self._exchange("scatter", {p: ins[p] for p in self._others()}, {})

    async def all_to_all(self, outs: list[torch.Tensor], ins: list[torch.Tensor]) -> None:
        if len(outs) != len(self.ranks) or len(ins) != len(self.ranks):
            raise InvalidArgumentError(
                f"all_to_all: {len(outs)} outputs and {len(ins)} inputs for a subgroup of {len(self.ranks)}"
            )
        # (in place, as all_to_all(ts, ts): send from copies, not from what is received into)
        ins = [x.clone() if any(_same_storage(x, o) for o in outs) else x for x in ins]
        with writing(outs[self.me]):
            outs[self.me].copy_(ins[self.me].view_as(outs[self.me]))
        await self._exchange(
            "all_to_all", {p: ins[p] for p in self._others()}, {p: outs[p] for p in self._others()}
        )

    async def barrier(self, timeout: float | None = None) -> None:
        """Every member arrives, within ``timeout`` (the subgroup's if None)."""
        flag = torch.zeros(1, dtype=torch.uint8)
        await self.all_reduce(flag, arendez.ReduceOp.MAX, "barrier", timeout)
