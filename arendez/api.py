"""The torch.distributed-shaped async API, gathered from the modules that implement it.

``import arendez`` exposes the same names; this module stays for code that imports
``arendez.api`` (the blocking facade does).
"""

from __future__ import annotations

from .collectives import (
    all_gather,
    all_gather_into_tensor,
    all_reduce,
    all_to_all,
    all_to_all_single,
    barrier,
    broadcast,
    gather,
    reduce,
    reduce_scatter,
    reduce_scatter_tensor,
    scatter,
)
from .lifecycle import destroy_process_group, init_process_group, new_group, process_group
from .objects import all_gather_object, broadcast_object_list, gather_object, scatter_object_list
from .p2p import recv, send
from .registry import (
    get_process_group_ranks,
    get_rank,
    get_world_size,
    is_initialized,
    transport_stats,
)

__all__ = [
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_reduce",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "broadcast",
    "broadcast_object_list",
    "destroy_process_group",
    "gather",
    "gather_object",
    "get_process_group_ranks",
    "get_rank",
    "get_world_size",
    "init_process_group",
    "is_initialized",
    "new_group",
    "process_group",
    "recv",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scatter",
    "scatter_object_list",
    "send",
    "transport_stats",
]
