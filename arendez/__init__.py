"""arendez: an asyncio-native distributed runtime with the torch.distributed API.

``import arendez as dist``; every call that talks to the network is a coroutine. For plain
scripts, ``import arendez.sync as dist`` offers the same names, blocking.
"""

from __future__ import annotations

from . import api, errors
from .api import *  # noqa: F403 - the API's names (api.__all__)
from .arrays import ReduceOp
from .blocking_store import BlockingStore
from .errors import *  # noqa: F403 - the error hierarchy (errors.__all__)
from .group import GroupMember, ProcessGroup
from .registry import current_world
from .store import PrefixStore, Store

__version__ = "0.1.0"

__all__ = [
    *api.__all__,
    *errors.__all__,
    "BlockingStore",
    "GroupMember",
    "PrefixStore",
    "ProcessGroup",
    "ReduceOp",
    "Store",
    "current_world",
]
