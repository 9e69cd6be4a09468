"""The torch backend's process group: torch's collectives, each started as one arendez call.

``ProcessGroupArendez`` is a Python subclass of torch's ``ProcessGroup`` (see ``arendez.torch``
for how torch creates it). Each method checks its arguments, stages tensors arendez cannot carry
as they are (``arendez.torchstage``) and returns a ``Work`` (``arendez.torchwork``) for the call
started on the loop thread; the default group runs on arendez's world, a subgroup on
point-to-point messages among its members (``arendez.torchsub``).
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine, Sequence
from typing import Any

import torch
import torch.distributed as dist

import arendez

from . import torchsparse
from .arrays import check_reducible
from .compat import check_gather_coalesced
from .errors import InvalidArgumentError
from .loop import shared
from .teardown import abort_world
from .torchstage import Stage, split_rows, writing
from .torchstore import close_stores, seconds, total_seconds
from .torchsub import Direct
from .torchwork import Work, start

# torch's stubs type this class's virtual methods with overloads our trampoline overrides do not
# mirror; it is subclassed through an Any alias (the overrides are exercised by the tests).
_TorchProcessGroup: Any = dist.ProcessGroup

BACKEND = "arendez"

_KIND: Any = dist.ReduceOp.RedOpType
_OPS = {  # keyed by torch's op kind (a dict hit, not a name lookup per call)
    _KIND.SUM: arendez.ReduceOp.SUM,
    _KIND.AVG: arendez.ReduceOp.AVG,
    _KIND.PRODUCT: arendez.ReduceOp.PRODUCT,
    _KIND.MIN: arendez.ReduceOp.MIN,
    _KIND.MAX: arendez.ReduceOp.MAX,
    _KIND.BAND: arendez.ReduceOp.BAND,
    _KIND.BOR: arendez.ReduceOp.BOR,
    _KIND.BXOR: arendez.ReduceOp.BXOR,
}


def _with_root(opts: Any, make: Callable[[], Any]) -> Any:
    """The options of a rooted collective: ``opts``; the defaults if None; made with root
    ``opts`` if it is an int (torch's short overloads, ``pg.reduce(t, 0)``, pass the root there)."""
    if opts is None:
        return make()
    if isinstance(opts, int):
        made = make()
        made.rootRank = opts
        return made
    return opts


def _reducible(op: arendez.ReduceOp, *tensors: torch.Tensor) -> arendez.ReduceOp:
    """``op``, if it is defined for the tensors' dtype (checked on the dtype the caller gave, on
    every rank, before any message goes: a subgroup reduces with torch's own ops, on a staged
    copy); else ``InvalidArgumentError`` naming both, as on the default group."""
    if op is arendez.ReduceOp.SUM or op is arendez.ReduceOp.PRODUCT:  # (any dtype: DDP's path)
        return op
    for t in tensors:
        kind = "c" if t.is_complex() else "f" if t.is_floating_point() else "i"  # (bool too: "iub")
        check_reducible(op, kind, str(t.dtype).removeprefix("torch."))
    return op


def _op(opts: Any) -> arendez.ReduceOp:
    """The reduce op of an options object, a ``ReduceOp`` or a ``ReduceOp.SUM``-style kind
    (torch's ``pg.allreduce(tensor, op)`` overload, which a Python group receives as is)."""
    kind = opts.reduceOp.op if hasattr(opts, "reduceOp") else getattr(opts, "op", opts)
    found = _OPS.get(kind)
    if found is None:
        names = [k.name for k in _OPS]
        raise InvalidArgumentError(
            f"ReduceOp.{kind.name} is not supported by the arendez backend; use one of {names}"
        )
    return found


class ProcessGroupArendez(_TorchProcessGroup):  # type: ignore[misc]
    """One torch process group backed by arendez; the default group maps onto arendez's world."""

    def __init__(
        self, rank: int, size: int, ranks: Sequence[int] | None, tag: int, timeout: float = 1800.0
    ) -> None:
        super().__init__(rank, size)
        self._ranks = list(ranks) if ranks else list(range(size))
        self._engine = None if not ranks else Direct(self._ranks, rank, tag, timeout)
        self._closed = False
        self._name = ""
        self._desc = ""

    def getBackendName(self) -> str:
        return BACKEND

    # torch asks a group which devices it serves and for the backend of one (DCP's async save,
    # broadcast_from_rank0 state dicts, FSDP's default device); a Python group registers no
    # C++ backend, so it answers both itself: it serves the CPU, and is its own backend
    @property
    def _device_types(self) -> list[torch.device]:
        return [torch.device("cpu")]

    def _get_backend(self, device: Any) -> ProcessGroupArendez:
        kind = torch.device(device).type
        if kind != "cpu":
            raise RuntimeError(f"No backend type associated with device type {kind}")
        return self

    supports_splitting = False
    supports_coalescing = False
    supports_time_estimate = False

    # torch keeps a group's name on its C++ backends, which a Python group has none of; device
    # meshes (DTensor, FSDP2) find groups by these names (torch's registry maps name -> group)
    def _set_group_name(self, name: str) -> None:
        self._name = name

    @property
    def group_name(self) -> str:
        """The name torch gave this group (``"0"`` for the default group)."""
        return self._name

    def _set_group_desc(self, desc: str) -> None:
        self._desc = desc

    @property
    def group_desc(self) -> str:
        """torch's description of this group (``"default_pg"``, ``"undefined"``...)."""
        return self._desc

    def _global(self, group_rank: int, arg: str) -> int:
        if not 0 <= group_rank < len(self._ranks):  # (a ValueError as torch's own checks raise, and
            raise InvalidArgumentError(  # a RuntimeError as gloo's "invalid root rank")
                f"{arg}={group_rank} is not a rank of this group: it must be in [0, {len(self._ranks) - 1}]"
            )
        return self._ranks[group_rank]

    def _run(self, value: Any, stage: Stage, fn: Callable[..., Coroutine[Any, Any, Any]], *args: Any) -> Work:
        if stage.back:
            return start(value, stage.run, fn, *args)
        return start(value, fn, *args)

    # -- reductions (bfloat16 is reduced as float32) -------------------------------------------
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Work:
        if isinstance(tensors, torch.Tensor):  # torch's pg.allreduce(tensor[, op]) (DDP's join calls it)
            tensors = [tensors]
        op, stage = _op(opts or dist.AllreduceOptions()), Stage(widen=True)
        _reducible(op, tensors[0])
        if tensors[0].layout is not torch.strided:  # (sparse gradients: DDP of a sparse Embedding)
            torchsparse.check(tensors[0], op)
            gather = self._engine.all_gather if self._engine else arendez.all_gather
            return self._run(tensors, stage, torchsparse.all_reduce, tensors[0], gather, self.size())
        t = stage(tensors[0])
        if self._engine:
            return self._run(tensors, stage, self._engine.all_reduce, t, op)
        return self._run(tensors, stage, arendez.all_reduce, t, op)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> Work:
        op = _reducible(_op(opts or dist.AllreduceCoalescedOptions()), *tensors)
        return self._run(tensors, Stage(), self._coalesced, tensors, op)

    async def _coalesced(self, tensors: list[torch.Tensor], op: arendez.ReduceOp) -> None:
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in tensors:
            by_dtype.setdefault(t.dtype, []).append(t)
        for group in by_dtype.values():  # one collective per dtype, over a flat copy
            flat = torch.cat([t.reshape(-1) for t in group])
            stage = Stage(widen=True)
            carried = stage(flat)
            if self._engine:
                await stage.run(self._engine.all_reduce, carried, op)
            else:
                await stage.run(arendez.all_reduce, carried, op)
            offset = 0
            for t in group:
                with writing(t):  # (on the loop thread: the caller's modes are its thread's)
                    t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None, op: Any = None) -> Work:
        if isinstance(tensors, torch.Tensor):  # torch's pg.reduce(tensor, root[, op]) overload
            tensors = [tensors]
        opts = _with_root(opts, dist.ReduceOptions)
        root, stage = self._global(opts.rootRank, "dst"), Stage(widen=True)
        op = _reducible(_op(opts if op is None else op), tensors[0])
        t = stage(tensors[0])
        if self._engine:
            return self._run(tensors, stage, self._engine.reduce, t, root, op)
        return self._run(tensors, stage, arendez.reduce, t, root, op)

    def reduce_scatter(
        self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None
    ) -> Work:
        if isinstance(outputs, torch.Tensor):  # torch's pg.reduce_scatter(out, ins[, op]) overload
            outputs, inputs = [outputs], [inputs]
        op, stage = _op(dist.ReduceScatterOptions() if opts is None else opts), Stage(widen=True)
        _reducible(op, outputs[0], *inputs[0])
        out, ins = stage(outputs[0]), stage.all(inputs[0], out=False)
        if self._engine:
            return self._run(outputs, stage, self._engine.reduce_scatter, out, ins, op)
        return self._run(outputs, stage, arendez.reduce_scatter, out, ins, op)

    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Work:
        op, stage = _op(dist.ReduceScatterOptions() if opts is None else opts), Stage(widen=True)
        _reducible(op, output, input)
        out, x = stage(output), stage(input, out=False)
        if self._engine:
            parts = list(x.reshape(-1).chunk(self.size()))
            return self._run([output], stage, self._engine.reduce_scatter, out, parts, op)
        return self._run([output], stage, arendez.reduce_scatter_tensor, out, x, op)

    def reduce_scatter_tensor_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any
    ) -> Work:
        op, stage = _reducible(_op(opts), *outputs, *inputs), Stage(widen=True)
        outs, ins = stage.all(outputs), stage.all(inputs, out=False)

        async def each() -> None:
            for out, x in zip(outs, ins, strict=True):
                if self._engine:
                    await self._engine.reduce_scatter(out, list(x.reshape(-1).chunk(self.size())), op)
                else:
                    await arendez.reduce_scatter_tensor(out, x, op)

        return self._run(outputs, stage, each)

    # -- data movement (bfloat16 moves as its bits) --------------------------------------------
    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> Work:
        if isinstance(tensors, torch.Tensor):  # torch's pg.broadcast(tensor, root) overload
            tensors = [tensors]
        opts = _with_root(opts, dist.BroadcastOptions)
        root, stage = self._global(opts.rootRank, "src"), Stage()
        t = stage(tensors[0], out=opts.rootRank != self.rank())  # (the source is only read)
        if self._engine:
            return self._run(tensors, stage, self._engine.broadcast, t, root)
        return self._run(tensors, stage, arendez.broadcast, t, root)

    def allgather(
        self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
    ) -> Work:
        if isinstance(inputs, torch.Tensor):  # torch's pg.allgather(outs, tensor) overload
            outputs, inputs = [outputs], [inputs]
        stage = Stage()
        outs, x = stage.all(outputs[0]), stage(inputs[0], out=False)
        if self._engine:  # (the future holds the output list, ``[t0, t1]``, as gloo's)
            return self._run(outputs[0], stage, self._engine.all_gather, outs, x)
        return self._run(outputs[0], stage, arendez.all_gather, outs, x)

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Work:
        stage = Stage()
        out, x = stage(output), stage(input, out=False)
        value = list(output.chunk(self.size()))  # (the future holds the rank's slices, as gloo's)
        if self._engine:
            outs = list(out.reshape(-1).chunk(self.size()))
            return self._run(value, stage, self._engine.all_gather, outs, x)
        return self._run(value, stage, arendez.all_gather_into_tensor, out, x)

    def allgather_into_tensor_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> Work:
        stage = Stage()
        outs, ins = stage.all(outputs), stage.all(inputs, out=False)

        async def each() -> None:
            for out, x in zip(outs, ins, strict=True):
                if self._engine:
                    await self._engine.all_gather(list(out.reshape(-1).chunk(self.size())), x)
                else:
                    await arendez.all_gather_into_tensor(out, x)

        return self._run(outputs, stage, each)

    def allgather_coalesced(
        self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
    ) -> Work:
        check_gather_coalesced(outputs, inputs, self.size())
        stage = Stage()
        per_rank, ins = [stage.all(o) for o in outputs], stage.all(inputs, out=False)

        async def each() -> None:  # output_tensor_lists[rank][i] gets that rank's inputs[i]
            for i, x in enumerate(ins):
                raw = [outs[i] for outs in per_rank]
                if self._engine:
                    await self._engine.all_gather(raw, x)
                else:
                    await arendez.all_gather(raw, x)

        return self._run(outputs, stage, each)

    def gather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None) -> Work:
        if isinstance(inputs, torch.Tensor):  # torch's pg.gather(outs, tensor, root) overload
            outputs, inputs = [outputs] if outputs else [], [inputs]
        opts = _with_root(opts, dist.GatherOptions)
        root, stage = self._global(opts.rootRank, "dst"), Stage()
        outs = stage.all(outputs[0]) if outputs else None
        x = stage(inputs[0], out=False)
        value = outputs[0] if outputs else []  # (gloo's future: the gather list, [] off the root)
        if self._engine:
            return self._run(value, stage, self._engine.gather, x, outs, root)
        return self._run(value, stage, arendez.gather, x, outs, root)

    def scatter(
        self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None
    ) -> Work:
        if isinstance(outputs, torch.Tensor):  # torch's pg.scatter(out, ins, root) overload
            outputs, inputs = [outputs], [inputs] if inputs else []
        opts = _with_root(opts, dist.ScatterOptions)
        root, stage = self._global(opts.rootRank, "src"), Stage()
        ins = stage.all(inputs[0], out=False) if inputs else None
        out = stage(outputs[0])
        if self._engine:
            return self._run(outputs, stage, self._engine.scatter, out, ins, root)
        return self._run(outputs, stage, arendez.scatter, out, ins, root)

    def alltoall(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None) -> Work:
        stage = Stage()
        outs, ins = stage.all(outputs), stage.all(inputs, out=False)
        if self._engine:
            return self._run(outputs, stage, self._engine.all_to_all, outs, ins)
        return self._run(outputs, stage, arendez.all_to_all, outs, ins)

    def alltoall_base(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        opts: Any = None,
    ) -> Work:
        stage = Stage()
        out, x = stage(output), stage(input, out=False)
        if self._engine:
            outs = split_rows(out, output_split_sizes, self.size())
            ins = split_rows(x, input_split_sizes, self.size())
            return self._run([output], stage, self._engine.all_to_all, outs, ins)
        return self._run(
            [output],
            stage,
            arendez.all_to_all_single,
            out,
            x,
            output_split_sizes or None,
            input_split_sizes or None,
        )

    # torch 2.13's Python front end calls these names; they dispatch to a C++ backend by
    # device, which a Python group has none of, so they are answered here
    all_gather_single = _allgather_base
    all_gather_single_coalesced = allgather_into_tensor_coalesced
    reduce_scatter_single = _reduce_scatter_base
    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced
    all_to_all_single = alltoall_base

    def barrier(self, opts: Any = None) -> Work:
        if self._engine:
            return self._run([], Stage(), self._engine.barrier)
        limit = seconds(getattr(opts, "timeout", None))  # (torch's unset timeout: the group's)
        return self._run([], Stage(), arendez.barrier, None, limit)

    def monitored_barrier(self, timeout: Any = None, wait_all_ranks: bool = False) -> None:
        """torch's ``pg.monitored_barrier``: a barrier whose timeout (the group's if None) is a
        ``CollectiveTimeoutError`` naming the ranks that did not arrive (all of them, always).
        (``dist.monitored_barrier`` itself refuses every backend but gloo by name.)"""
        # (0 is "at once", as gloo's: not the "no limit" of a store's timeout, ``seconds``)
        limit = None if timeout is None else max(total_seconds(timeout), 0.001)
        if self._engine:
            self._run([], Stage(), self._engine.barrier, limit).wait()
            return
        self._run([], Stage(), arendez.barrier, None, limit).wait()

    # -- point to point (ranks are group ranks) ----------------------------------------------
    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> Work:
        peer, stage = self._global(dst, "dst"), Stage()
        t = stage(tensors[0], out=False)
        return self._run(tensors, stage, arendez.send, t, peer, None, self._p2p_tag(tag))

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> Work:
        peer, stage = self._global(src, "src"), Stage()
        return self._run(tensors, stage, self._recv, stage(tensors[0]), peer, self._p2p_tag(tag))

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> Work:
        stage = Stage()
        return self._run(None, stage, self._recv, stage(tensors[0]), None, self._p2p_tag(tag))

    def _p2p_tag(self, tag: int) -> int:
        """The world's tag for this group's ``tag``: a subgroup's messages travel on the world,
        in a tag space of their own (else a subgroup's receive took the world's, or another
        subgroup's, message of the same tag, and a receive from any source took a non-member's)."""
        if self._engine is None:
            return tag
        if not -(1 << 31) <= tag < 1 << 31:
            raise ValueError(f"tag {tag} of a subgroup's send or recv must fit in 32 signed bits")
        return (1 << 61) | ((self._engine.tag & 0xFFFFFFF) << 32) | (tag & 0xFFFFFFFF)

    async def _recv(self, tensor: torch.Tensor, src: int | None, tag: int) -> int:
        sender = await arendez.recv(tensor, src, None, tag)
        return self._ranks.index(sender) if sender in self._ranks else sender

    # -- lifecycle -------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Destroy the arendez world behind the default group (subgroups just stop): the calls
        in flight may finish within the group's timeout (torch's ``destroy_process_group`` has
        no timeout of its own), then the rest fail with ``GroupDestroyedError``."""
        self._end(arendez.destroy_process_group)

    def abort(self) -> None:
        """``shutdown`` without waiting: the calls in flight fail at once (torch's
        ``_abort_process_group``, which fault-tolerant trainers call on an error)."""
        self._end(abort_world)

    def _end(self, end: Callable[[], Coroutine[Any, Any, None]]) -> None:
        if self._closed:
            return
        self._closed = True
        if self._engine is None:
            try:
                shared.call(end)
            finally:
                close_stores()


def _run_uncompiled(*classes: type) -> None:
    """Make ``torch.compile`` run these classes' methods, and all they call, as they are: DDP's
    bucket rebuild calls ``broadcast`` from inside a compiled forward, and Dynamo then tried to
    trace it and failed ("Member '_global' is not registered"). A flag on the code objects
    (torch's eval-frame API, as its ``skip_code``; nothing per call, and no import of Dynamo,
    which costs a second); with a torch without that API nothing is marked."""
    try:
        from torch._C._dynamo import eval_frame

        skip = eval_frame._FrameExecStrategy(eval_frame._FrameAction.SKIP, eval_frame._FrameAction.SKIP)
    except (ImportError, AttributeError):
        return
    for cls in classes:
        for value in vars(cls).values():
            code = getattr(getattr(value, "fget", value), "__code__", None)
            if code is not None:
                eval_frame.set_code_exec_strategy(code, skip)


_run_uncompiled(ProcessGroupArendez, Work)

__all__ = ["BACKEND", "ProcessGroupArendez"]
