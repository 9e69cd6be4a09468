"""Blocking facade: ``import arendez.sync as dist`` gives the async API's names, blocking.

The coroutines run on one private event loop (uvloop when available) in a daemon thread that
holds the peer connections (``arendez.loop.shared``, also used by the torch backend), so a
torch.distributed script ports by changing its import line. The hop into the loop and back
costs one ``call_soon_threadsafe`` and one lock release (see ``arendez.loop``).
``async_op=True`` returns a ``Work`` whose ``wait()`` blocks, as in torch.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Coroutine
from typing import Any

import arendez as api  # the public async API only

from .errors import *  # noqa: F403 - the same error names as the async API
from .loop import Completion, shared

GroupMember = api.GroupMember
ProcessGroup = api.ProcessGroup
ReduceOp = api.ReduceOp


class Work:
    """Handle of a collective started with ``async_op=True``."""

    def __init__(self, done: Completion) -> None:
        self._done = done

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the collective is done; re-raises its error."""
        self._done.result(timeout)
        return True

    def is_completed(self) -> bool:
        return self._done.done()

    def result(self) -> Any:
        return self._done.result()


def _blocking(fn: Callable[..., Coroutine[Any, Any, Any]]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def call(*args: Any, async_op: bool = False, **kwargs: Any) -> Any:
        if async_op:
            return Work(shared.start(fn, args, kwargs))
        return shared.call(fn, *args, **kwargs)

    return call


init_process_group = _blocking(api.init_process_group)
destroy_process_group = _blocking(api.destroy_process_group)
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

is_initialized = api.is_initialized
get_rank = api.get_rank
get_world_size = api.get_world_size
get_process_group_ranks = api.get_process_group_ranks
transport_stats = api.transport_stats

__all__ = [
    "GroupMember",
    "ProcessGroup",
    "ReduceOp",
    "Work",
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
    "recv",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scatter",
    "scatter_object_list",
    "send",
    "transport_stats",
]
