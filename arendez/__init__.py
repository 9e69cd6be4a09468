"""arendez: an asyncio-native distributed runtime with the torch.distributed API.

``import arendez as dist``; every call that talks to the network is a coroutine. For plain
scripts, ``import arendez.sync as dist`` offers the same names, blocking.
"""

from __future__ import annotations

from .api import (
    all_gather,
    all_gather_into_tensor,
    all_gather_object,
    all_reduce,
    all_to_all,
    all_to_all_single,
    barrier,
    broadcast,
    broadcast_object_list,
    destroy_process_group,
    gather,
    gather_object,
    get_process_group_ranks,
    get_rank,
    get_world_size,
    init_process_group,
    is_initialized,
    new_group,
    process_group,
    recv,
    reduce,
    reduce_scatter,
    reduce_scatter_tensor,
    scatter,
    scatter_object_list,
    send,
    transport_stats,
)
from .arrays import ReduceOp
from .errors import (
    ArendezError,
    AuthenticationError,
    CollectiveMismatchError,
    CollectiveTimeoutError,
    GroupDestroyedError,
    LimitError,
    NotInitializedError,
    ProtocolError,
    RankFailedError,
    RendezvousError,
    StoreError,
    StoreTimeoutError,
)
from .group import GroupMember, ProcessGroup
from .store import PrefixStore, Store

__version__ = "0.1.0"

__all__ = [
    "ArendezError",
    "AuthenticationError",
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "GroupDestroyedError",
    "GroupMember",
    "LimitError",
    "NotInitializedError",
    "PrefixStore",
    "ProcessGroup",
    "ProtocolError",
    "RankFailedError",
    "ReduceOp",
    "RendezvousError",
    "Store",
    "StoreError",
    "StoreTimeoutError",
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
