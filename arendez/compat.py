"""The rest of torch.distributed's names, async: non-blocking p2p, object p2p, group helpers.

``isend``/``irecv`` are plain functions, as in torch: the send is handed to the connection and
the receive posted before they return (so calls match in the order they were made, as torch's
do), and the returned ``Work``'s ``wait`` is awaited.
"""

from __future__ import annotations

import asyncio
import datetime
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np

from . import frames, objcodec, wire
from . import lifecycle as _lifecycle
from .arrays import ReduceOp, as_array, byte_view
from .collectives import all_gather, all_gather_into_tensor, all_reduce, barrier, reduce_scatter_tensor
from .errors import (
    ArendezError,
    CollectiveTimeoutError,
    InvalidArgumentError,
    NetworkError,
    ProtocolError,
    RankFailedError,
    StoreError,
    WaitTimeoutError,
    received_from,
)
from .group import ProcessGroup
from .p2p import check_receivable, recv, send
from .queries import (
    Backend,
    get_backend,
    get_global_rank,
    get_group_rank,
    get_node_local_rank,
    get_pg_count,
    group,
    is_available,
    is_backend_available,
    is_gloo_available,
    is_mpi_available,
    is_nccl_available,
    is_torchelastic_launched,
    is_ucc_available,
    is_xccl_available,
    reduce_op,
)
from .registry import (
    DEFAULT_TIMEOUT,
    default_group,
    named_rank,
    on_group,
    resolve,
    resolve_to_run,
    root_rank,
    seconds,
)

__all__ = [
    "Backend",
    "DistBackendError",
    "DistError",
    "DistNetworkError",
    "DistStoreError",
    "P2POp",
    "Work",
    "all_gather_coalesced",
    "all_gather_single",
    "all_reduce_coalesced",
    "batch_isend_irecv",
    "default_pg_timeout",
    "get_backend",
    "get_global_rank",
    "get_group_rank",
    "get_node_local_rank",
    "get_pg_count",
    "group",
    "irecv",
    "is_available",
    "is_backend_available",
    "is_gloo_available",
    "is_mpi_available",
    "is_nccl_available",
    "is_ucc_available",
    "is_xccl_available",
    "is_torchelastic_launched",
    "isend",
    "monitored_barrier",
    "new_subgroups",
    "new_subgroups_by_enumeration",
    "recv_object_list",
    "reduce_op",
    "reduce_scatter_single",
    "send_object_list",
    "split_group",
    "supports_complex",
]

#: torch's error classes, as the arendez errors that play their part
DistError = ArendezError
DistBackendError = ArendezError
DistNetworkError = NetworkError
DistStoreError = StoreError
#: torch's default collective deadline (arendez's too)
default_pg_timeout = datetime.timedelta(seconds=DEFAULT_TIMEOUT)

W = TypeVar("W")  # a Work of the async API or of the blocking facade


class Work:
    """Handle of a non-blocking call: ``await work.wait()`` re-raises its error."""

    def __init__(self, task: asyncio.Future[Any]) -> None:
        self._task = task

    async def wait(self, timeout: float | None = None) -> bool:
        """Wait until done (``WaitTimeoutError``, a ``TimeoutError``, after ``timeout`` seconds;
        the call goes on, as in ``arendez.sync``)."""
        try:
            await asyncio.wait_for(asyncio.shield(self._task), timeout)
        except TimeoutError:
            if self._task.done():  # (the call's own timeout, not this wait's)
                raise
            raise WaitTimeoutError("the call", timeout or 0.0) from None
        return True

    def is_completed(self) -> bool:
        return self._task.done()

    def is_success(self) -> bool:
        return self._task.done() and not self._task.cancelled() and self._task.exception() is None

    def exception(self) -> BaseException | None:
        return self._task.exception() if self._task.done() else None

    def get_future(self) -> asyncio.Future[Any]:
        """The asyncio future of the call (its result: the sender's rank for ``irecv``)."""
        return self._task

    def source_rank(self) -> int:
        """The rank a finished ``irecv`` received from."""
        return received_from(self._task)


def _task(coro: Any) -> asyncio.Future[Any]:
    task = asyncio.get_running_loop().create_task(coro)
    task.add_done_callback(_consume)  # an unawaited failed Work is no "never retrieved" warning
    return task


def _consume(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()


def isend(
    tensor: Any, dst: int | None = None, group: Any = None, tag: int = 0, group_dst: int | None = None
) -> Work | None:
    """Start sending ``tensor`` to ``dst``; None on a rank outside ``group`` (as torch)."""
    g = resolve_to_run(group)
    if g is None:
        return None
    target = root_rank(g, dst, group_dst, "dst", "isend")
    g.check_usable("isend")
    x = as_array(tensor, writable=False)
    g.group_rank(target, "dst")
    if target == g.world.rank:
        raise ValueError("cannot send to this rank itself")
    raw = byte_view(x)
    if raw.nbytes > wire.MAX_SEGMENT:
        raise ValueError(
            f"isend carries at most {wire.MAX_SEGMENT} bytes; split the tensor (got {raw.nbytes})"
        )
    world = g.world
    conn = world.connection(target)
    if conn is None:
        raise RankFailedError(target, "isend", world.why_gone(target))
    fp = f"send|{x.dtype.str}|{x.size}"  # as arendez.p2p.send, so send and isend interoperate
    conn.send(frames.encode(frames.P2P(g.gid, int(tag), fp)), raw if raw.nbytes else None)

    async def drained() -> None:
        try:
            async with asyncio.timeout(g.timeout):
                await conn.drain()
        except ConnectionError as exc:
            raise RankFailedError(target, "isend", f"connection lost ({exc})") from None
        except TimeoutError:
            raise CollectiveTimeoutError("isend", g.timeout, [target]) from None

    return Work(_task(drained()))


def irecv(
    tensor: Any, src: int | None = None, group: Any = None, tag: int = 0, group_src: int | None = None
) -> Work | None:
    """Post a receive into ``tensor`` from ``src`` (any rank if None); None outside ``group``."""
    g = resolve_to_run(group)
    if g is None:
        return None
    source = named_rank(g, src, group_src, "src")
    check_receivable(g, "irecv", source, int(tag))
    out = as_array(tensor)
    if source is not None:
        g.group_rank(source, "src")
        if source == g.world.rank:  # (nothing would ever match it: the wait would be the timeout)
            raise ValueError("cannot receive from this rank itself")
    others = [r for r in g.ranks if r != g.world.rank] if source is None else [source]
    world = g.world
    fut = world.p2p.post(source, g.gid, int(tag), byte_view(out), world.dead)

    async def received() -> int:
        try:
            async with asyncio.timeout(g.timeout):
                return await fut
        except TimeoutError:
            raise CollectiveTimeoutError("irecv", g.timeout, others) from None
        finally:
            world.p2p.cancel(fut)

    return Work(_task(received()))


class P2POp:
    """One operation of ``batch_isend_irecv``: ``op`` is ``isend`` or ``irecv`` (of any arendez
    module), ``peer`` a global rank (or ``group_peer`` a rank in ``group``)."""

    def __init__(
        self,
        op: Callable[..., Any],
        tensor: Any,
        peer: int | None = None,
        group: Any = None,
        tag: int = 0,
        group_peer: int | None = None,
    ) -> None:
        kind = getattr(op, "__name__", "")
        if kind not in ("isend", "irecv"):
            raise ValueError(f"P2POp's op must be isend or irecv, got {op!r}")
        if peer is None and group_peer is None:
            raise ValueError("P2POp needs peer (or group_peer)")
        self.op, self.kind, self.tensor = op, kind, tensor
        self.peer, self.group, self.tag, self.group_peer = peer, group, tag, group_peer

    def __repr__(self) -> str:
        return f"P2POp({self.kind}, peer={self.peer}, group_peer={self.group_peer}, tag={self.tag})"


def check_batch(p2p_op_list: Sequence[P2POp]) -> None:
    """torch's rules for a batch: a non-empty list of ``P2POp`` on one group."""
    if not p2p_op_list or not all(isinstance(p, P2POp) for p in p2p_op_list):
        raise ValueError("batch_isend_irecv expects a non-empty list of P2POp")
    if len({id(p.group) for p in p2p_op_list}) > 1:
        raise ValueError("all ops of batch_isend_irecv must use the same group")


def batch_isend_irecv(p2p_op_list: Sequence[P2POp]) -> list[Work]:
    """Start every op of the list, in order; one ``Work`` per op."""
    return start_batch(p2p_op_list, isend, irecv)


def start_batch(
    p2p_op_list: Sequence[P2POp], isend: Callable[..., W | None], irecv: Callable[..., W | None]
) -> list[W]:
    """``batch_isend_irecv`` over the given ``isend``/``irecv`` (async or blocking flavour)."""
    check_batch(p2p_op_list)
    works: list[W] = []
    for p in p2p_op_list:
        start = isend if p.kind == "isend" else irecv
        if p.group_peer is not None:
            work = start(p.tensor, None, p.group, p.tag, p.group_peer)
        else:
            work = start(p.tensor, p.peer, p.group, p.tag)
        if work is not None:
            works.append(work)
    return works


# -- object point-to-point (msgpack, never pickle) --------------------------------------------
def _no_device(device: Any) -> None:
    if device is not None and str(device) != "cpu":
        raise ArendezError(f"device={device!r}: arendez moves CPU data only (objects are msgpack bytes)")


@on_group(sequenced=False)
async def send_object_list(
    object_list: list[Any],
    dst: int | None = None,
    group: Any = None,
    device: Any = None,
    group_dst: int | None = None,
    use_batch: bool = False,
) -> None:
    """Send the objects of ``object_list`` (what ``objcodec`` carries) to ``dst``. One that
    cannot be encoded is an ``ObjectSerializationError`` here and at the receiver."""
    g: ProcessGroup = group
    _no_device(device)
    target = root_rank(g, dst, group_dst, "dst", "send_object_list")
    packed, failed = objcodec.encode_each(object_list)
    if failed is not None:  # the receiver raises too: a first size below zero is a note's
        sizes = np.full(len(packed), -1, np.int64)
        sizes[0] = -len(packed[0])
        await send(sizes, target, g)
        await send(np.frombuffer(packed[0], np.uint8), target, g)
        raise objcodec.own_error(g.ranks[g.rank], "send_object_list", failed) from failed
    await send(np.array([len(p) for p in packed], np.int64), target, g)
    await send(np.frombuffer(b"".join(packed), np.uint8), target, g)


@on_group(missing=-1, sequenced=False)
async def recv_object_list(
    object_list: list[Any],
    src: int | None = None,
    group: Any = None,
    device: Any = None,
    group_src: int | None = None,
) -> int:
    """Fill ``object_list`` with the objects ``src`` (any rank if None) sent; return the sender."""
    g: ProcessGroup = group
    _no_device(device)
    source = named_rank(g, src, group_src, "src")
    sizes = np.zeros(len(object_list), np.int64)
    sender = await recv(sizes, source, g)
    noted = len(sizes) > 0 and sizes[0] < 0  # the sender could not encode an object: its note
    if (sizes[1:] != -1).any() if noted else (sizes < 0).any():
        raise ProtocolError(f"rank {sender} sent malformed object sizes {sizes.tolist()[:8]}")
    data = np.zeros(-int(sizes[0]) if noted else int(sizes.sum()), np.uint8)
    await recv(data, sender, g)
    raw, at = data.tobytes(), 0
    if noted:
        objcodec.raise_if_note(objcodec.decode(raw), sender, "send_object_list")
        raise ProtocolError(f"rank {sender} sent a negative object size without a failure note")
    for i, n in enumerate(sizes.tolist()):
        object_list[i] = objcodec.decode(raw[at : at + n])
        at += n
    return sender


# -- collectives torch has under other names --------------------------------------------------
@on_group()
async def monitored_barrier(
    group: Any = None, timeout: float | datetime.timedelta | None = None, wait_all_ranks: bool = False
) -> None:
    """A barrier that, on timeout, raises ``CollectiveTimeoutError`` naming the ranks that did
    not arrive (all of them: ``wait_all_ranks`` is accepted and always true here)."""
    g: ProcessGroup = group
    await barrier(g, None if timeout is None else seconds(timeout, g.timeout))


@on_group()
async def all_reduce_coalesced(tensors: Sequence[Any], op: Any = ReduceOp.SUM, group: Any = None) -> None:
    """Reduce every tensor of ``tensors`` in place: one collective per dtype, not one per tensor."""
    g: ProcessGroup = group
    arrays = [as_array(t, what="tensors") for t in tensors]
    by_dtype: dict[str, list[np.ndarray[Any, Any]]] = {}
    for a in arrays:
        by_dtype.setdefault(a.dtype.str, []).append(a)
    for same in by_dtype.values():
        flat = np.concatenate([a.reshape(-1) for a in same]) if len(same) > 1 else same[0]
        await all_reduce(flat, op, g)
        if len(same) > 1:
            at = 0
            for a in same:
                a.reshape(-1)[:] = flat[at : at + a.size]
                at += a.size


def check_gather_coalesced(outputs: Sequence[Sequence[Any]], inputs: Sequence[Any], size: int) -> None:
    """``all_gather_coalesced``'s layout (torch's): ``size`` output lists, one per rank, each
    of one tensor per input; ``InvalidArgumentError`` naming the list that is not."""
    if len(outputs) != size:
        raise InvalidArgumentError(
            f"output_tensor_lists must hold {size} lists (one per rank), got {len(outputs)}"
        )
    for r, row in enumerate(outputs):
        if len(row) != len(inputs):
            raise InvalidArgumentError(
                f"output_tensor_lists[{r}] must hold {len(inputs)} tensors (one per input "
                f"tensor), got {len(row)}"
            )


@on_group()
async def all_gather_coalesced(
    output_tensor_lists: Sequence[Sequence[Any]], input_tensor_list: Sequence[Any], group: Any = None
) -> None:
    """``all_gather`` of each input tensor: ``output_tensor_lists[r][i]`` receives rank ``r``'s
    ``input_tensor_list[i]`` (torch's layout: one list per rank)."""
    g: ProcessGroup = group
    check_gather_coalesced(output_tensor_lists, input_tensor_list, g.size)
    for i, tensor in enumerate(input_tensor_list):
        await all_gather([outputs[i] for outputs in output_tensor_lists], tensor, g)


@on_group()
async def all_gather_single(output_tensor: Any, input_tensor: Any, group: Any = None) -> None:
    """torch's other name of ``all_gather_into_tensor``."""
    await all_gather_into_tensor(output_tensor, input_tensor, group)


@on_group()
async def reduce_scatter_single(output: Any, input: Any, op: Any = ReduceOp.SUM, group: Any = None) -> None:
    """torch's other name of ``reduce_scatter_tensor``."""
    await reduce_scatter_tensor(output, input, op, group)


def supports_complex(reduceOp: Any) -> bool:
    """True if ``reduceOp`` is defined for complex tensors (SUM, PRODUCT, AVG)."""
    return ReduceOp.parse(reduceOp) in (ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.AVG)


# -- subgroups ---------------------------------------------------------------------------------
async def new_subgroups_by_enumeration(
    ranks_per_subgroup_list: Sequence[Sequence[int]],
    timeout: Any = None,
    backend: Any = None,
    pg_options: Any = None,
    group_desc: str | None = None,
) -> tuple[Any, list[Any]]:
    """One subgroup per list of ranks (disjoint); returns (this rank's subgroup or None, all)."""
    if not ranks_per_subgroup_list:
        raise ValueError("ranks_per_subgroup_list must not be empty")
    seen: set[int] = set()
    for ranks in ranks_per_subgroup_list:
        if seen & set(ranks):
            raise ValueError(f"rank(s) {sorted(seen & set(ranks))} are in more than one subgroup")
        seen |= set(ranks)
    _no_options(pg_options)
    mine: Any = None
    subgroups = []
    for ranks in ranks_per_subgroup_list:
        sub = await _lifecycle.new_group(list(ranks), timeout, backend)
        subgroups.append(sub)
        if isinstance(sub, ProcessGroup):
            mine = sub
    return mine, subgroups


async def new_subgroups(
    group_size: int | None = None,
    group: Any = None,
    timeout: Any = None,
    backend: Any = None,
    pg_options: Any = None,
    group_desc: str | None = None,
) -> tuple[Any, list[Any]]:
    """Split the world into consecutive subgroups of ``group_size`` ranks."""
    if group_size is None:
        raise ValueError(
            "new_subgroups needs group_size: torch's default (one subgroup per machine's CUDA "
            "devices) does not apply to CPU ranks"
        )
    if group is not None and resolve(group) is not default_group():
        raise ArendezError("new_subgroups of a subgroup is not supported: split the default group")
    world_size = resolve(None).size  # type: ignore[union-attr]
    if group_size <= 0 or world_size % group_size:
        raise ValueError(
            f"group_size must be positive and divide the world size {world_size}, got {group_size}"
        )
    chunks = [list(range(s, s + group_size)) for s in range(0, world_size, group_size)]
    return await new_subgroups_by_enumeration(chunks, timeout, backend, pg_options, group_desc)


async def split_group(
    parent_pg: Any = None,
    split_ranks: Sequence[Sequence[int]] | None = None,
    timeout: Any = None,
    pg_options: Any = None,
    group_desc: str | None = None,
    backend: Any = None,
) -> Any:
    """torch's ``split_group`` of the default group: this rank's part of ``split_ranks`` (None if
    it is in none). torch needs NCCL for it; here it runs on the default group's peers."""
    if parent_pg is not None and resolve(parent_pg) is not default_group():
        raise ArendezError("split_group of a subgroup is not supported: split the default group")
    if not split_ranks:
        raise ValueError("split_group needs split_ranks (a list of lists of global ranks)")
    mine, _ = await new_subgroups_by_enumeration(split_ranks, timeout, None, pg_options, group_desc)
    return mine


def _no_options(pg_options: Any) -> None:
    if pg_options is not None:
        raise ArendezError("pg_options are backend options of NCCL/gloo; arendez takes none")
