"""Blocking facade: ``import arendez.sync as dist`` gives the async API's names, blocking.

The coroutines run on one private event loop (uvloop when available) in a daemon thread that
holds the peer connections (``arendez.loop.shared``, also used by the torch backend), so a
torch.distributed script ports by changing its import line. The hop into the loop and back
costs one ``call_soon_threadsafe`` and one lock release (see ``arendez.loop``).
``async_op=True`` returns a ``Work`` whose ``wait()`` blocks, as in torch.
"""

from __future__ import annotations

import datetime
import functools
import inspect
import sys as _sys
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

import arendez as api  # the public async API only

from . import callbacks, compat, farewell, flightrec
from .errors import *  # noqa: F403 - the same error names as the async API
from .handshake import endpoint
from .loop import CANCEL_GRACE_SECONDS, Completion, shared
from .registry import seconds
from .syncstore import FileStore, HashStore, PrefixStore, Store, meeting_point
from .tcpstore import TCPStore

Backend = compat.Backend
GroupMember = api.GroupMember
P2POp = compat.P2POp
ProcessGroup = api.ProcessGroup
ReduceOp = api.ReduceOp
group = compat.group
reduce_op = compat.reduce_op


class Future:
    """The outcome of a ``Work``, shaped as torch's ``Future``: ``wait()`` blocks, then returns
    the call's output tensors (``[tensor]`` for ``all_reduce``, as torch's) or re-raises its
    error; ``then(callback)`` chains."""

    def __init__(self, done: Completion, outputs: Any = None, *, chained: bool = False) -> None:
        self._done = done
        self._outputs = outputs
        self._chained = chained  # the value is the Completion's own (a then() callback's result)

    def done(self) -> bool:
        return self._done.done()

    def wait(self) -> Any:
        """Block until done; return the value or re-raise the error."""
        result = self._done.result()
        return result if self._chained else self._outputs

    def value(self) -> Any:
        return self.wait()

    def then(self, callback: Callable[[Future], Any]) -> Future:
        """A future of ``callback(self)``, called once this one is done: at once if it is, else
        on a callback thread (``arendez.callbacks``), where it may make blocking arendez calls."""
        child = Completion()

        def run(_: Completion) -> None:
            try:
                value = callback(self)
            except Exception as exc:  # the chained future holds it, as torch's does
                child.set(None, exc)
            else:
                child.set(value)

        def deliver(done: Completion) -> None:
            if shared.in_loop_thread():
                callbacks.shared.submit(run, done)
            else:
                run(done)

        self._done.add_done_callback(deliver)
        return Future(child, chained=True)


class Work:
    """Handle of a call started with ``async_op=True``, ``isend`` or ``irecv``."""

    def __init__(self, done: Completion, outputs: Any = None) -> None:
        self._done = done
        self._outputs = outputs  # what get_future() holds once done

    def wait(self, timeout: float | datetime.timedelta | None = None) -> bool:
        """Block until the call is done; re-raises its error. After ``timeout`` seconds raises
        ``WaitTimeoutError`` (a ``TimeoutError``) and the call goes on, as with torch's gloo:
        a later ``wait()`` returns once it finishes."""
        limit = None if timeout is None else seconds(timeout, 0.0)
        if not self._done.wait(limit):
            raise WaitTimeoutError("the call", limit or 0.0)  # noqa: F405
        self._done.result()
        return True

    def cancel(self, grace: float = CANCEL_GRACE_SECONDS) -> bool:
        """Cancel the call as an asyncio ``task.cancel()`` would (an arendez extension: its
        peers get ``CollectiveCancelledError`` naming this rank, its buffers are not written any
        more; ``wait()`` then raises ``CallCancelledError``); True once it has ended, within
        ``grace`` seconds."""
        return self._done.cancel(grace)

    def is_completed(self) -> bool:
        return self._done.done()

    def is_success(self) -> bool:
        return self._done.done() and self._done.error is None

    def exception(self) -> BaseException | None:
        return self._done.error

    def get_future(self) -> Future:
        return Future(self._done, self._outputs)

    def source_rank(self) -> int:
        """The rank a finished ``irecv`` received from."""
        if not self._done.done():
            raise ArendezError("source_rank() of an irecv that has not finished")  # noqa: F405
        return int(self._done.result())

    def result(self) -> Any:
        """Wait, then the call's output tensors, as ``get_future().wait()`` (gloo's)."""
        self._done.result()
        return self._outputs

    def _source_rank(self) -> int:  # (torch's private spelling, which some scripts use)
        return self.source_rank()


#: Collectives that reduce: a bfloat16 tensor travels as a float32 copy in them (as its bits
#: in the others), as in the torch backend (``arendez.torchstage``).
_REDUCING = frozenset(
    {
        "all_reduce",
        "reduce",
        "reduce_scatter",
        "reduce_scatter_tensor",
        "all_reduce_coalesced",
        "reduce_scatter_single",
    }
)


#: torch.distributed's parameters in order (torch 2.13), for the calls whose torch signature has
#: parameters the async API's lacks: positional arguments bind by torch's order, so
#: ``all_reduce(t, op, group, True)`` is an ``async_op``, as in torch.
_TORCH_PARAMS: dict[str, tuple[str, ...]] = {
    "all_reduce": ("tensor", "op", "group", "async_op"),
    "reduce": ("tensor", "dst", "op", "group", "async_op", "group_dst"),
    "broadcast": ("tensor", "src", "group", "async_op", "group_src"),
    "all_gather": ("tensor_list", "tensor", "group", "async_op"),
    "all_gather_into_tensor": ("output_tensor", "input_tensor", "group", "async_op"),
    "gather": ("tensor", "gather_list", "dst", "group", "async_op", "group_dst"),
    "scatter": ("tensor", "scatter_list", "src", "group", "async_op", "group_src"),
    "reduce_scatter": ("output", "input_list", "op", "group", "async_op"),
    "reduce_scatter_tensor": ("output", "input", "op", "group", "async_op"),
    "all_to_all": ("output_tensor_list", "input_tensor_list", "group", "async_op"),
    "all_to_all_single": ("output", "input", "output_split_sizes", "input_split_sizes", "group", "async_op"),
    "all_reduce_coalesced": ("tensors", "op", "group", "async_op"),
    "all_gather_coalesced": ("output_tensor_lists", "input_tensor_list", "group", "async_op"),
    "all_gather_single": ("output_tensor", "input_tensor", "group", "async_op"),
    "reduce_scatter_single": ("output", "input", "op", "group", "async_op"),
    "barrier": ("group", "async_op", "device_ids", "timeout"),
    "broadcast_object_list": ("object_list", "src", "group", "device", "group_src"),
    "recv_object_list": ("object_list", "src", "group", "device", "group_src", "use_batch"),
    "new_group": (
        "ranks", "timeout", "backend", "pg_options", "use_local_synchronization", "group_desc",
        "device_id", "sort_ranks",
    ),
}  # fmt: skip
#: what each torch-only parameter may be here (its default, or what changes nothing on CPU)
_TORCH_ONLY: dict[str, Callable[[Any], bool]] = {
    "device": lambda v: v is None or str(v) == "cpu",
    "device_id": lambda v: v is None or str(v) == "cpu",
    "device_ids": lambda v: v is None or isinstance(v, list),  # (CUDA devices; gloo ignores them)
    "pg_options": lambda v: v is None,
    "use_local_synchronization": lambda v: not v,  # (every rank calls new_group here)
    "group_desc": lambda v: v is None or isinstance(v, str),
    "sort_ranks": lambda v: bool(v),
    "use_batch": lambda v: not v,
}


def _first_torch_only(names: tuple[str, ...]) -> int:
    return next(i for i, n in enumerate(names) if n == "async_op" or n in _TORCH_ONLY)


def _as_torch(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], bool]:
    """Bind ``args`` by torch's parameter order into ``kwargs`` (in place) from the first
    parameter the async API lacks; return the positional rest and ``async_op``. A torch-only
    parameter that would change what the call does here is a ``ValueError`` naming it."""
    names = _TORCH_PARAMS[name]
    at = _first_torch_only(names)
    if len(args) > len(names):
        raise TypeError(f"{name}() takes at most {len(names)} positional arguments ({len(args)} given)")
    for param, value in zip(names[at:], args[at:], strict=False):
        if param in kwargs:
            raise TypeError(f"{name}() got multiple values for argument '{param}'")
        kwargs[param] = value
    async_op = bool(kwargs.pop("async_op", False))
    for param in _TORCH_ONLY.keys() & kwargs.keys():
        value = kwargs.pop(param)
        if not _TORCH_ONLY[param](value):
            raise ValueError(f"{name}(): {param}={value!r} is not supported by arendez (CPU; all ranks call)")
    return args[:at], async_op


def _blocking(fn: Callable[..., Coroutine[Any, Any, Any]]) -> Callable[..., Any]:
    name = fn.__name__
    reduces = name in _REDUCING
    names = _TORCH_PARAMS.get(name)
    at = _sys.maxsize if names is None else _first_torch_only(names)
    torch_only = {"async_op", *_TORCH_ONLY}

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        run = fn
        async_op = False
        if len(args) > at or (kwargs and not torch_only.isdisjoint(kwargs)):
            if names is None:
                async_op = bool(kwargs.pop("async_op", False))
            else:
                args, async_op = _as_torch(name, args, kwargs)
        outputs = _outputs(name, args, kwargs) if async_op else []  # (the caller's, not stand-ins)
        if "torch" in _sys.modules:  # (bfloat16 and non-contiguous tensors go as stand-ins)
            staged = _staged(fn, args, kwargs, reduces)
            if staged is not None:
                run, args, kwargs = staged
        if async_op:
            return Work(shared.start(run, args, kwargs), outputs)
        return shared.call(run, *args, **kwargs)

    return call


def _is_data(value: Any) -> bool:
    """A tensor or array, or a list (of them, or of objects): what a collective writes."""
    return isinstance(value, list) or hasattr(value, "shape")


#: collectives whose future holds their output list itself (``[t0, t1]``), as gloo's does
_LISTED = frozenset({"all_gather", "all_to_all"})


def _outputs(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    """What gloo's future of a collective holds: its first data argument (the tensor written),
    positional or by keyword (``broadcast(src=0, tensor=t)``), in a list; the output list itself
    for ``all_gather`` and ``all_to_all``; ``gather``'s gather list where it is given (the
    destination), else ``[]``; ``[]`` for a call without one (``barrier``)."""
    if name == "gather":
        listed = kwargs.get("gather_list", args[1] if len(args) > 1 else None)
        return list(listed) if listed is not None else []
    for value in (*args, *kwargs.values()):
        if _is_data(value):
            return value if name in _LISTED and isinstance(value, list) else [value]
    return []


#: arguments the collectives only read (their stand-ins are not copied back)
_READ_ONLY = frozenset({"input", "input_tensor", "input_list", "input_tensor_list", "scatter_list"})
_READ_ONLY_OF = {
    "send": frozenset({"tensor"}),
    "isend": frozenset({"tensor"}),
    "gather": frozenset({"tensor"}),
}


def _staged(
    fn: Callable[..., Coroutine[Any, Any, Any]], args: tuple[Any, ...], kwargs: dict[str, Any], widen: bool
) -> tuple[Callable[..., Coroutine[Any, Any, Any]], tuple[Any, ...], dict[str, Any]] | None:
    """The call with stand-ins for the torch tensors arendez cannot carry as they are (None if
    there are none); the stand-ins written are copied back when the call succeeds."""
    import torch

    from .torchstage import Stage, stand_in_needed

    def needs(v: Any) -> bool:
        return isinstance(v, torch.Tensor) and stand_in_needed(v)

    values = [*args, *kwargs.values()]
    if not any(needs(v) or (isinstance(v, list) and any(needs(t) for t in v)) for v in values):
        return None
    stage = Stage(widen=widen)
    bound = inspect.signature(fn).bind(*args, **kwargs).arguments
    read = _READ_ONLY | _READ_ONLY_OF.get(fn.__name__, frozenset())

    def swap(v: Any, out: bool) -> Any:
        if isinstance(v, torch.Tensor):
            return stage(v, out) if needs(v) else v
        if isinstance(v, list) and any(isinstance(t, torch.Tensor) for t in v):
            return [swap(t, out) for t in v]
        return v

    # only what the call writes is copied back: an input's stand-in written back over an output
    # that is a slice of it (an in-place reduce_scatter_tensor) undid the result
    staged = {name: swap(v, name not in read) for name, v in bound.items()}
    return functools.partial(stage.run, functools.partial(fn, **staged)), (), {}


_init_process_group = _blocking(api.init_process_group)  # (a world left up is closed at exit: loop.py)


@functools.wraps(api.init_process_group)
def init_process_group(*args: Any, **kwargs: Any) -> Any:
    """As ``arendez.init_process_group``, blocking; ``store=`` also takes this module's
    ``TCPStore`` (or a ``PrefixStore`` over one): the ranks meet on its server."""
    flightrec.install_signal_handler()  # (from this thread: the loop thread cannot install them)
    farewell.install_sigterm_handler()
    store = kwargs.get("store")
    if not isinstance(store, Store):
        return _init_process_group(*args, **kwargs)
    host, port, job = meeting_point(kwargs.pop("store"))  # (the world joins that server's job)
    kwargs["init_method"] = f"arendez://{endpoint((host, port))}/{job}"
    world = _init_process_group(*args, **kwargs)
    _meeting_stores.append(store)  # (a master's server lives while the world does, as in torch)
    return world


#: The stores the default worlds met on, held until they are destroyed (as torch's process group
#: holds its store): a master ``TCPStore`` passed inline keeps its server up.
_meeting_stores: list[Store] = []

_destroy_process_group = _blocking(api.destroy_process_group)


@functools.wraps(api.destroy_process_group)
def destroy_process_group(*args: Any, **kwargs: Any) -> Any:
    """As ``arendez.destroy_process_group``, blocking; destroying the default world lets go of
    the store it met on."""
    try:
        return _destroy_process_group(*args, **kwargs)
    finally:
        if (args[0] if args else kwargs.get("group")) is None:
            _meeting_stores.clear()


new_group = _blocking(api.new_group)
barrier = _blocking(api.barrier)
all_reduce = _blocking(api.all_reduce)
reduce = _blocking(api.reduce)
broadcast = _blocking(api.broadcast)
all_gather = _blocking(api.all_gather)
all_gather_into_tensor = _blocking(api.all_gather_into_tensor)
gather = _blocking(api.gather)
scatter = _blocking(api.scatter)
reduce_scatter = _blocking(api.reduce_scatter)
reduce_scatter_tensor = _blocking(api.reduce_scatter_tensor)
all_to_all = _blocking(api.all_to_all)
all_to_all_single = _blocking(api.all_to_all_single)
send = _blocking(api.send)
recv = _blocking(api.recv)
all_gather_object = _blocking(api.all_gather_object)
broadcast_object_list = _blocking(api.broadcast_object_list)
gather_object = _blocking(api.gather_object)
scatter_object_list = _blocking(api.scatter_object_list)
reform = _blocking(api.reform)  # elastic worlds (arendez.elastic)
share_state = _blocking(api.share_state)
joiners_waiting = api.joiners_waiting

monitored_barrier = _blocking(compat.monitored_barrier)
all_reduce_coalesced = _blocking(compat.all_reduce_coalesced)
send_object_list = _blocking(compat.send_object_list)
recv_object_list = _blocking(compat.recv_object_list)
new_subgroups = _blocking(compat.new_subgroups)
new_subgroups_by_enumeration = _blocking(compat.new_subgroups_by_enumeration)
split_group = _blocking(compat.split_group)
all_gather_coalesced = _blocking(compat.all_gather_coalesced)
all_gather_single = _blocking(compat.all_gather_single)
reduce_scatter_single = _blocking(compat.reduce_scatter_single)


async def _flight_recorder() -> dict[str, Any]:
    return api.flight_recorder()


async def _dump_flight_recorder(path: Any = None) -> str:
    return api.dump_flight_recorder(path)


def flight_recorder() -> dict[str, Any]:
    """This rank's flight recorder as a dict (read on the loop thread)."""
    return dict(shared.call(_flight_recorder))


def dump_flight_recorder(path: Any = None) -> str:
    """Write this rank's flight recorder as JSON (on the loop thread); return the path."""
    return str(shared.call(_dump_flight_recorder, path))


def breakpoint(rank: int = 0, skip: int = 0, timeout_s: float = 3600) -> None:
    """Stop in the debugger on ``rank`` only; the other ranks wait in a barrier (``timeout_s``)."""
    if get_rank() == rank and skip <= 0:
        import pdb
        import sys

        pdb.Pdb().set_trace(sys._getframe(1))
    barrier(timeout=timeout_s)


async def _posted(work: compat.Work | None) -> int | None:
    if work is None:
        return None
    await work.wait()
    result = work.get_future().result()
    return None if result is None else int(result)


def isend(
    tensor: Any, dst: int | None = None, group: Any = None, tag: int = 0, group_dst: int | None = None
) -> Work | None:
    """Start sending ``tensor`` to ``dst``; ``wait()`` on the ``Work`` (None outside ``group``)."""

    if group is GroupMember.NON_GROUP_MEMBER:
        return None

    async def start() -> int | None:
        return await _posted(compat.isend(tensor, dst, group, tag, group_dst))

    return Work(shared.start(start), [tensor])


def irecv(
    tensor: Any, src: int | None = None, group: Any = None, tag: int = 0, group_src: int | None = None
) -> Work | None:
    """Post a receive into ``tensor`` from ``src`` (any rank if None); ``wait()`` on the ``Work``."""

    if group is GroupMember.NON_GROUP_MEMBER:
        return None

    async def start() -> int | None:
        return await _posted(compat.irecv(tensor, src, group, tag, group_src))

    return Work(shared.start(start), [tensor])


def batch_isend_irecv(p2p_op_list: Sequence[compat.P2POp]) -> list[Work]:
    """Start every op of the list, in order; one ``Work`` per op."""
    return compat.start_batch(p2p_op_list, isend, irecv)


get_backend = compat.get_backend
is_available = compat.is_available
is_backend_available = compat.is_backend_available
is_gloo_available = compat.is_gloo_available
is_mpi_available = compat.is_mpi_available
is_nccl_available = compat.is_nccl_available
is_ucc_available = compat.is_ucc_available
is_xccl_available = compat.is_xccl_available
get_pg_count = compat.get_pg_count
supports_complex = compat.supports_complex
default_pg_timeout = compat.default_pg_timeout
DistError = compat.DistError
DistBackendError = compat.DistBackendError
DistNetworkError = compat.DistNetworkError
DistStoreError = compat.DistStoreError
get_global_rank = compat.get_global_rank
get_group_rank = compat.get_group_rank
get_node_local_rank = compat.get_node_local_rank
is_torchelastic_launched = compat.is_torchelastic_launched
is_initialized = api.is_initialized
get_rank = api.get_rank
get_world_size = api.get_world_size
get_process_group_ranks = api.get_process_group_ranks
transport_stats = api.transport_stats

__all__ = [
    "Backend",
    "DistBackendError",
    "DistError",
    "DistNetworkError",
    "DistStoreError",
    "FileStore",
    "Future",
    "GroupMember",
    "HashStore",
    "P2POp",
    "PrefixStore",
    "ProcessGroup",
    "ReduceOp",
    "Store",
    "TCPStore",
    "Work",
    "all_gather",
    "all_gather_coalesced",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_gather_single",
    "all_reduce",
    "all_reduce_coalesced",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "batch_isend_irecv",
    "breakpoint",
    "broadcast",
    "broadcast_object_list",
    "default_pg_timeout",
    "destroy_process_group",
    "dump_flight_recorder",
    "flight_recorder",
    "gather",
    "gather_object",
    "get_backend",
    "get_global_rank",
    "get_group_rank",
    "get_node_local_rank",
    "get_pg_count",
    "get_process_group_ranks",
    "get_rank",
    "get_world_size",
    "group",
    "init_process_group",
    "irecv",
    "is_available",
    "is_backend_available",
    "is_gloo_available",
    "is_initialized",
    "is_mpi_available",
    "is_nccl_available",
    "is_torchelastic_launched",
    "is_ucc_available",
    "is_xccl_available",
    "isend",
    "joiners_waiting",
    "monitored_barrier",
    "new_group",
    "new_subgroups",
    "new_subgroups_by_enumeration",
    "recv",
    "recv_object_list",
    "reduce",
    "reduce_op",
    "reduce_scatter",
    "reduce_scatter_single",
    "reduce_scatter_tensor",
    "reform",
    "scatter",
    "scatter_object_list",
    "send",
    "send_object_list",
    "share_state",
    "split_group",
    "supports_complex",
    "transport_stats",
]
