"""Object collectives: msgpack-serialisable values (never pickle) over the byte algorithms."""

from __future__ import annotations

from typing import Any

import msgpack

from . import algorithms as algo
from .group import ProcessGroup
from .registry import on_group


def _pack(obj: Any) -> bytes:
    try:
        packed: bytes = msgpack.packb(obj, use_bin_type=True)
        return packed
    except TypeError as exc:
        raise TypeError(f"object collectives carry msgpack-serialisable values only: {exc}") from None


def _unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


@on_group()
async def all_gather_object(object_list: list[Any], obj: Any, group: Any = None) -> None:
    """Fill ``object_list[i]`` with rank ``i``'s ``obj``."""
    g: ProcessGroup = group
    if len(object_list) != g.size:
        raise ValueError(f"object_list must have {g.size} entries, got {len(object_list)}")
    mine = _pack(obj)

    async def body(c: Any) -> list[bytes]:
        return [mine] if g.size == 1 else await algo.all_gather_bytes(c, mine)

    parts = await g.run("all_gather_object", "all_gather_object", body)
    object_list[:] = [_unpack(p) for p in parts]


@on_group()
async def broadcast_object_list(object_list: list[Any], src: int = 0, group: Any = None) -> None:
    """Replace ``object_list``'s entries with those of global rank ``src``."""
    g: ProcessGroup = group
    root = g.group_rank(src, "src")
    mine = _pack(list(object_list)) if g.rank == root else None
    fp = f"broadcast_object_list|{src}|{len(object_list)}"

    async def body(c: Any) -> bytes:
        return mine if g.size == 1 else await algo.broadcast_bytes(c, mine, root)  # type: ignore[return-value]

    data = await g.run("broadcast_object_list", fp, body)
    object_list[:] = _unpack(data)


@on_group()
async def gather_object(
    obj: Any, object_gather_list: list[Any] | None = None, dst: int = 0, group: Any = None
) -> None:
    """On ``dst``, fill ``object_gather_list[i]`` with rank ``i``'s ``obj``."""
    g: ProcessGroup = group
    root = g.group_rank(dst, "dst")
    if g.rank == root and (object_gather_list is None or len(object_gather_list) != g.size):
        raise ValueError(f"object_gather_list on the dst rank must have {g.size} entries")
    mine = _pack(obj)

    async def body(c: Any) -> list[bytes] | None:
        return [mine] if g.size == 1 else await algo.gather_bytes(c, mine, root)

    parts = await g.run("gather_object", f"gather_object|{dst}", body)
    if parts is not None and object_gather_list is not None:
        object_gather_list[:] = [_unpack(p) for p in parts]


@on_group()
async def scatter_object_list(
    scatter_object_output_list: list[Any],
    scatter_object_input_list: list[Any] | None = None,
    src: int = 0,
    group: Any = None,
) -> None:
    """Rank ``i`` gets ``scatter_object_input_list[i]`` of ``src`` in its output list's slot 0."""
    g: ProcessGroup = group
    root = g.group_rank(src, "src")
    parts = None
    if g.rank == root:
        if scatter_object_input_list is None or len(scatter_object_input_list) != g.size:
            raise ValueError(f"scatter_object_input_list on the src rank must have {g.size} entries")
        parts = [_pack(o) for o in scatter_object_input_list]
    if not scatter_object_output_list:
        raise ValueError("scatter_object_output_list must have at least one entry")

    async def body(c: Any) -> bytes:
        return parts[0] if g.size == 1 and parts else await algo.scatter_bytes(c, parts, root)

    data = await g.run("scatter_object_list", f"scatter_object_list|{src}", body)
    scatter_object_output_list[0] = _unpack(data)
