"""Point-to-point ``send`` / ``recv`` (``src=None``: from any rank) on a group's ranks."""

from __future__ import annotations

from typing import Any

from . import wire
from .arrays import as_array, byte_view
from .errors import InvalidArgumentError, RankFailedError
from .group import ProcessGroup
from .registry import named_rank, on_group, root_rank
from .validate import index


def _tag(tag: object) -> int:
    value = index(tag, "tag")
    if not -(1 << 63) <= value < 1 << 63:
        raise InvalidArgumentError(f"tag must fit in 64 signed bits, got {value}")
    return value


def _fp(x: Any) -> str:
    return f"send|{x.dtype.str}|{x.size}"


@on_group(sequenced=False)
async def send(
    tensor: Any, dst: int | None = None, group: Any = None, tag: int = 0, group_dst: int | None = None
) -> None:
    """Send ``tensor`` to global rank ``dst`` (or ``group_dst``, its rank in ``group``); returns
    once the bytes are in the kernel."""
    g: ProcessGroup = group
    g.check_usable("send")
    dst = root_rank(g, dst, group_dst, "dst", "send")
    x = as_array(tensor, writable=False)
    await _send(g, x, dst, tag, _fp(x))


@on_group(sequenced=False)
async def send_as(tensor: Any, dst: int, group: Any, tag: int, fingerprint: str) -> None:
    """``send`` of a message that says what it is part of (``fingerprint``: a collective built
    on messages, its dtype and op); ``recv_as`` with another fingerprint refuses it."""
    g: ProcessGroup = group
    g.check_usable("send", among=(dst,))  # (a subgroup's messages: a death elsewhere is no matter)
    await _send(g, as_array(tensor, writable=False), dst, tag, fingerprint)


async def _send(g: ProcessGroup, x: Any, dst: int, tag: int, fingerprint: str) -> None:
    g.group_rank(index(dst, "dst"), "dst")
    if dst == g.world.rank:
        raise InvalidArgumentError("cannot send to this rank itself")
    raw = byte_view(x)
    if raw.nbytes > wire.MAX_SEGMENT:
        raise InvalidArgumentError(
            f"send carries at most {wire.MAX_SEGMENT} bytes; split the tensor (got {raw.nbytes})"
        )
    await g.world.send_p2p(dst, g.gid, _tag(tag), fingerprint, raw, g.timeout)


@on_group(missing=-1, sequenced=False)
async def recv(
    tensor: Any, src: int | None = None, group: Any = None, tag: int = 0, group_src: int | None = None
) -> int:
    """Receive into ``tensor`` from global rank ``src`` (or ``group_src``; any rank if neither);
    return the sender's global rank."""
    g: ProcessGroup = group
    src = named_rank(g, src, group_src, "src")
    check_receivable(g, "recv", src, _tag(tag))
    return await _recv(g, as_array(tensor), src, tag, None)


@on_group(missing=-1, sequenced=False)
async def recv_as(tensor: Any, src: int, group: Any, tag: int, fingerprint: str) -> int:
    """``recv`` of a message sent by ``send_as`` with the same ``fingerprint``: another one is a
    ``CollectiveMismatchError`` naming both (gloo checks this only under
    ``TORCH_DISTRIBUTED_DEBUG=DETAIL``; a mismatch is otherwise silent)."""
    g: ProcessGroup = group
    check_receivable(g, "recv", src, _tag(tag), among=(src,))
    return await _recv(g, as_array(tensor), src, tag, fingerprint)


def check_receivable(
    g: ProcessGroup, name: str, src: int | None, tag: int, among: tuple[int, ...] | None = None
) -> None:
    """``g.check_usable``, except that a message from ``src`` that arrived before a rank failed
    is received all the same (as gloo's: a rank that sends and then dies has sent it)."""
    try:
        g.check_usable(name, among)
    except RankFailedError:
        if src is None or not g.world.p2p.has_stashed(src, g.gid, tag):
            raise


async def _recv(g: ProcessGroup, out: Any, src: int | None, tag: int, expect: str | None) -> int:
    if src is not None:
        g.group_rank(index(src, "src"), "src")
        if src == g.world.rank:  # (it would wait its whole timeout: no rank sends to itself)
            raise InvalidArgumentError(f"recv: src={src} is this rank; a rank cannot receive from itself")
    others = [r for r in g.ranks if r != g.world.rank] if src is None else [src]
    return await g.world.recv_p2p(src, g.gid, _tag(tag), byte_view(out), g.timeout, others, expect)
