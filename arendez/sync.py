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

from . import compat, farewell, flightrec
from . import registry as _registry
from .errors import *  # noqa: F403 - the same error names as the async API
from .group import not_member as _not_member
from .handshake import endpoint
from .loop import shared
from .synccall import blocking as _blocking
from .syncstore import FileStore, HashStore, PrefixStore, Store, meeting_point
from .syncwork import Future, Work
from .tcpstore import TCPStore

Backend = compat.Backend
GroupMember = api.GroupMember
P2POp = compat.P2POp
ProcessGroup = api.ProcessGroup
ReduceOp = api.ReduceOp
group = compat.group
reduce_op = compat.reduce_op

_init_process_group = _blocking(api.init_process_group)  # (a world left up is closed at exit: loop.py)


#: torch's ``init_process_group`` parameters in order (torch 2.13), with its defaults: positional
#: arguments bind so, and ``help()`` shows them
_INIT_DEFAULTS: dict[str, Any] = {
    "backend": None, "init_method": None, "timeout": None, "world_size": -1, "rank": -1, "store": None,
    "group_name": "", "pg_options": None, "device_id": None,
}  # fmt: skip
_INIT_PARAMS = tuple(_INIT_DEFAULTS)
#: torch's default for a CPU (gloo) group, which a ported script may rely on (a long checkpoint
#: or evaluation on one rank before the next collective); the async API's stays 300 s.
default_pg_timeout = datetime.timedelta(minutes=30)


def _cpu_backend(name: object) -> str:
    """The backend a torch spelling names for CPU tensors: ``"GLOO"`` or a device map
    (``"cpu:gloo,cuda:nccl"``: its ``cpu`` entry); refused as ``Backend`` refuses it."""
    text = str(name).lower()
    if ":" in text:
        entries = dict(entry.split(":", 1) for entry in text.split(",") if ":" in entry)
        if "cpu" not in entries:
            raise ValueError(f"backend {name!r} names no backend for the cpu device, which arendez serves")
        text = entries["cpu"].strip()
    return str(Backend(text))


def init_process_group(*args: Any, **kwargs: Any) -> Any:
    """As ``arendez.init_process_group``, blocking, with torch's signature and defaults: the
    parameters bind in torch's order, ``timeout`` defaults to ``default_pg_timeout`` (30
    minutes, as torch's), ``backend`` may be spelled as torch takes it (``"GLOO"``,
    ``"cpu:gloo,cuda:nccl"``), and ``pg_options``/``device_id`` may be None (``device_id`` a CPU
    device). ``store=`` also takes this module's ``TCPStore`` (or a ``PrefixStore`` over one):
    the ranks meet on its server."""
    if len(args) > len(_INIT_PARAMS):
        raise TypeError(f"init_process_group() takes at most {len(_INIT_PARAMS)} positional arguments")
    for name, value in zip(_INIT_PARAMS, args, strict=False):
        if name in kwargs:
            raise TypeError(f"init_process_group() got multiple values for argument '{name}'")
        kwargs[name] = value
    if kwargs.pop("pg_options", None) is not None:
        raise ValueError("init_process_group(): pg_options is not supported by arendez (give None)")
    device = kwargs.pop("device_id", None)
    if device is not None and str(device) != "cpu":
        raise ValueError(f"init_process_group(): device_id={device!r} is not supported: arendez runs on CPU")
    if kwargs.get("backend") is not None:
        kwargs["backend"] = _cpu_backend(kwargs["backend"])
    if kwargs.get("timeout") is None:
        kwargs["timeout"] = default_pg_timeout
    flightrec.install_signal_handler()  # (from this thread: the loop thread cannot install them)
    farewell.install_sigterm_handler()
    store = kwargs.get("store")
    if store is not None and not isinstance(store, Store) and _is_torch_store(store):
        return _init_through_torch_store(kwargs)
    if not isinstance(store, Store):
        return _init_process_group(**kwargs)
    host, port, job = meeting_point(kwargs.pop("store"))  # (the world joins that server's job)
    kwargs["init_method"] = f"arendez://{endpoint((host, port))}/{job}"
    world = _init_process_group(**kwargs)
    _meeting_stores.append(store)  # (a master's server lives while the world does, as in torch)
    return world


#: what ``help()`` and ``inspect.signature`` show: torch's parameters, order and defaults
init_process_group.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
    [
        inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=default)
        for name, default in _INIT_DEFAULTS.items()
    ]
)


def _is_torch_store(store: object) -> bool:
    torch_dist = _sys.modules.get("torch.distributed")
    return torch_dist is not None and isinstance(store, torch_dist.Store)


def _init_through_torch_store(kwargs: dict[str, Any]) -> Any:
    """``store=`` a torch ``Store`` (torch's own ``TCPStore``, ``FileStore``, a ``PrefixStore``):
    rank 0 hosts a store server and publishes its URL there, as the torch backend does."""
    from . import torch as backend  # (imports torch, which the store's owner did already)

    store = kwargs.pop("store")
    rank, size = kwargs.get("rank", -1), kwargs.get("world_size", -1)
    if not isinstance(rank, int) or not isinstance(size, int) or rank < 0 or size < 1:
        raise ValueError(f"init_process_group(store=...) needs rank and world_size, got {rank} and {size}")
    limit = _registry.seconds(kwargs["timeout"], default_pg_timeout.total_seconds())
    kwargs["init_method"] = backend.meeting_url(store, rank, size, limit)
    kwargs["backend"] = kwargs.get("backend") or "tcp"
    world = _init_process_group(**kwargs)
    _meeting_stores.append(store)
    return world


#: The stores the default worlds met on, held until they are destroyed (as torch's process group
#: holds its store): a master ``TCPStore`` passed inline keeps its server up.
_meeting_stores: list[Any] = []

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


def _p2p_run(
    start: Callable[[Any], Coroutine[Any, Any, int | None]], tensor: Any, writes: bool
) -> Callable[[], Coroutine[Any, Any, int | None]]:
    """``start`` on what arendez can carry for ``tensor``: a torch tensor of a dtype numpy
    lacks (bfloat16) or not contiguous gets a stand-in, as in the blocking calls, which a
    receive copies back into ``tensor`` once it has arrived."""
    if "torch" in _sys.modules:
        import torch

        from .torchstage import Stage, stand_in_needed

        if isinstance(tensor, torch.Tensor) and stand_in_needed(tensor):
            stage = Stage()
            return functools.partial(stage.run, start, stage(tensor, writes))
    return functools.partial(start, tensor)


def isend(
    tensor: Any, dst: int | None = None, group: Any = None, tag: int = 0, group_dst: int | None = None
) -> Work | None:
    """Start sending ``tensor`` to ``dst``; ``wait()`` on the ``Work`` (None outside ``group``)."""

    if _not_member(group):
        return None

    async def start(carried: Any) -> int | None:
        return await _posted(compat.isend(carried, dst, group, tag, group_dst))

    return Work(shared.start(_p2p_run(start, tensor, writes=False)), [tensor])


def irecv(
    tensor: Any, src: int | None = None, group: Any = None, tag: int = 0, group_src: int | None = None
) -> Work | None:
    """Post a receive into ``tensor`` from ``src`` (any rank if None); ``wait()`` on the ``Work``."""

    if _not_member(group):
        return None

    async def start(carried: Any) -> int | None:
        return await _posted(compat.irecv(carried, src, group, tag, group_src))

    return Work(shared.start(_p2p_run(start, tensor, writes=True)), [tensor])


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
