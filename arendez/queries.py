"""torch.distributed's query functions, ``group``/``reduce_op``, and the names arendez leaves out."""

from __future__ import annotations

import os
import warnings
from typing import Any

from .arrays import ReduceOp
from .errors import ArendezError
from .group import GroupMember, ProcessGroup
from .registry import default_group, resolve, world_or_none


class Backend(str):
    """Backend names, as torch's: arendez's tcp transport answers to ``gloo`` (also to ``tcp`` and
    ``arendez``), so a ported script's ``get_backend() == "gloo"`` holds; the device backends
    cannot apply."""

    UNDEFINED = "undefined"
    GLOO = "gloo"
    TCP = "gloo"
    NCCL = "nccl"
    UCC = "ucc"
    MPI = "mpi"
    XCCL = "xccl"

    def __new__(cls, name: str) -> Backend:
        value = str(name).lower()
        if value in ("gloo", "tcp", "arendez"):
            return super().__new__(cls, "gloo")
        if value == "undefined":
            return super().__new__(cls, value)
        raise ValueError(
            f"backend {name!r} cannot apply: arendez runs CPU collectives over its tcp transport "
            "(use 'gloo' or 'tcp'); NCCL/UCC/MPI/XCCL are device or external-library backends"
        )


def get_backend(group: Any = None) -> Backend:
    """The backend of ``group``: always ``Backend.GLOO``, the name arendez's tcp transport
    answers to (as torch's gloo: ``get_backend() == "gloo"``)."""
    if resolve(group) is None:
        raise ValueError("this rank is not a member of the group")
    return Backend("gloo")


def is_available() -> bool:
    """True: arendez needs no optional build."""
    return True


def is_backend_available(backend: str) -> bool:
    """True for the names arendez's tcp transport answers to (gloo, tcp, arendez)."""
    return str(backend).lower() in ("gloo", "tcp", "arendez")


def is_gloo_available() -> bool:
    """True: ``gloo`` is served by arendez's tcp transport."""
    return True


def is_nccl_available() -> bool:
    """False: NCCL is a CUDA library; arendez moves CPU data."""
    return False


def is_mpi_available() -> bool:
    """False: arendez does not use MPI."""
    return False


def is_ucc_available() -> bool:
    """False: arendez does not use UCC."""
    return False


def is_xccl_available() -> bool:
    """False: XCCL is an XPU library; arendez moves CPU data."""
    return False


def get_pg_count() -> int:
    """How many process groups this process has (the default group and its subgroups)."""
    world = world_or_none()
    return 0 if world is None else len(world.groups)


def get_global_rank(group: Any, group_rank: int) -> int:
    """The global rank of ``group``'s rank ``group_rank``."""
    g = _member(group)
    if not 0 <= group_rank < g.size:
        raise ValueError(f"group rank {group_rank} is not in 0..{g.size - 1}")
    return g.ranks[group_rank]


def get_group_rank(group: Any, global_rank: int) -> int:
    """The rank in ``group`` of global rank ``global_rank``."""
    return _member(group).group_rank(global_rank, "global rank")


def _member(group: Any) -> ProcessGroup:
    g = resolve(group)
    if g is None:
        raise ValueError("this rank is not a member of the group")
    return g


def get_node_local_rank(fallback_rank: int | None = None) -> int:
    """``LOCAL_RANK`` from the environment (set by launchers), else ``fallback_rank``."""
    raw = os.environ.get("LOCAL_RANK")
    if raw is not None:
        return int(raw)
    if fallback_rank is not None:
        return int(fallback_rank)
    raise ArendezError(
        "LOCAL_RANK is not in the environment: start under a launcher (arendez launch, torchrun) "
        "or pass fallback_rank"
    )


def is_torchelastic_launched() -> bool:
    """True when started by torchrun (``TORCHELASTIC_RUN_ID`` is set)."""
    return os.environ.get("TORCHELASTIC_RUN_ID") is not None


class _GroupMeta(type):
    @property
    def WORLD(cls) -> ProcessGroup | None:
        return default_group()


class group(metaclass=_GroupMeta):
    """``group.WORLD``: the default process group (None before init)."""

    NON_GROUP_MEMBER = GroupMember.NON_GROUP_MEMBER


class _DeprecatedReduceOp:
    """torch's ``reduce_op``: ``ReduceOp``'s members, with a deprecation warning."""

    def __getattr__(self, name: str) -> ReduceOp:
        warnings.warn(
            "reduce_op is deprecated (as in torch.distributed): use ReduceOp", FutureWarning, stacklevel=2
        )
        try:
            return ReduceOp[name]
        except KeyError:
            raise AttributeError(f"ReduceOp has no member {name!r}") from None


reduce_op = _DeprecatedReduceOp()


_C10D = (
    "torch's C++ process-group internals (used by DDP and torch's own backends); where torch "
    "needs them, use arendez as a torch backend: init_process_group(backend='arendez')"
)
_MESH = (
    "device meshes (DTensor, FSDP2) are torch's own machinery: use arendez as a torch backend "
    "under torch.distributed for them"
)
_MODULE = "a torch.distributed submodule or import, not an API name"
#: torch.distributed's public names that ``arendez.sync`` deliberately does not provide, and why
UNSUPPORTED: dict[str, str] = {
    **dict.fromkeys(
        [
            "AllToAllOptions",
            "AllreduceCoalescedOptions",
            "AllreduceOptions",
            "BarrierOptions",
            "BroadcastOptions",
            "GatherOptions",
            "ReduceOptions",
            "ReduceScatterOptions",
            "ScatterOptions",
            "ProcessGroupGloo",
            "BackendConfig",
            "get_backend_config",
            "Reducer",
            "GradBucket",
            "BuiltinCommHookType",
            "Logger",
        ],
        _C10D,
    ),
    **dict.fromkeys(["DeviceMesh", "init_device_mesh", "get_default_backend_for_device"], _MESH),
    **dict.fromkeys(
        ["DebugLevel", "get_debug_level", "set_debug_level", "set_debug_level_from_env"],
        "TORCH_DISTRIBUTED_DEBUG levels of c10d; arendez checks collective fingerprints always "
        "(CollectiveMismatchError) and logs through the 'arendez' logger",
    ),
    "record_comm": "a profiler label for c10d collectives; arendez has no torch profiler hook",
    "rendezvous": "torch's pluggable rendezvous handlers; arendez's init_method URLs are fixed",
    "register_rendezvous_handler": "torch's pluggable rendezvous handlers; init_method URLs are fixed",
    "shrink_group": "NCCL-only in torch (it needs ncclCommShrink); arendez has no counterpart",
    "GroupName": "a typing alias of torch's internals",
    "RankType": "a typing alias of torch's internals",
    "timedelta": _MODULE,
    "log": "torch's module logger; arendez logs to the 'arendez' logger",
    **dict.fromkeys(
        [
            "algorithms",
            "autograd",
            "c10d_logger",
            "config",
            "constants",
            "device_mesh",
            "distributed_c10d",
            "logging",
            "logging_handlers",
            "remote_device",
            "rpc",
            "sys",
            "torch",
            "traceback",
            "typing",
            "utils",
        ],
        _MODULE,
    ),
}
