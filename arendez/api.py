"""The torch.distributed-shaped async API and the one registry of the current world."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import hashlib
import importlib
import logging
import os
import socket
from collections.abc import AsyncIterator, Sequence
from typing import Any

import msgpack
import numpy as np

from . import algorithms as algo
from . import shm, tls, wire
from .arrays import ReduceOp, as_array, as_bytes, byte_view, ufunc_for
from .errors import (
    CollectiveTimeoutError,
    NotInitializedError,
    RankFailedError,
    RendezvousError,
)
from .group import BYE, P2P, GroupMember, ProcessGroup, Stats, World
from .mesh import Mesh
from .rendezvous import Plan, is_loopback, plan
from .store import Store

log = logging.getLogger("arendez")

DEFAULT_TIMEOUT = 300.0


class _Registry:
    """The only global state: the current world (with its default group and subgroups)."""

    world: World | None = None
    default: ProcessGroup | None = None


_registry = _Registry()


def _seconds(timeout: float | datetime.timedelta | None, default: float) -> float:
    if timeout is None:
        return default
    if isinstance(timeout, datetime.timedelta):
        return timeout.total_seconds()
    value = float(timeout)
    if value <= 0:
        raise ValueError(f"timeout must be positive, got {timeout!r}")
    return value


def _resolve(group: Any) -> ProcessGroup | None:
    """The group a call acts on; None for a rank outside ``group``."""
    if group is GroupMember.NON_GROUP_MEMBER:
        return None
    if group is None or group is GroupMember.WORLD:
        if _registry.default is None:
            raise NotInitializedError("no default process group: call init_process_group() first")
        return _registry.default
    if not isinstance(group, ProcessGroup):
        raise TypeError(f"group must be a ProcessGroup, got {type(group).__name__}")
    if group.destroyed or group.world is not _registry.world:
        raise NotInitializedError(
            "this process group was destroyed; call init_process_group() / new_group() again"
        )
    return group


# -- lifecycle -------------------------------------------------------------------------------
def is_initialized() -> bool:
    """True between a successful ``init_process_group`` and ``destroy_process_group``."""
    return _registry.default is not None


async def init_process_group(
    backend: str | None = "tcp",
    init_method: str | None = None,
    *,
    world_size: int = -1,
    rank: int = -1,
    timeout: float | datetime.timedelta | None = None,
    store: Store | None = None,
    group_name: str = "",
) -> None:
    """Join (or form) the default process group (``init_method``: see the README).

    ``group_name`` is accepted for torch compatibility and unused.
    """
    if backend not in (None, "tcp", "gloo", "arendez"):
        raise ValueError(f"backend {backend!r} is not available; use 'tcp' (or its alias 'gloo')")
    if _registry.default is not None:
        raise RendezvousError("the default process group is already initialized")
    algo.forced_algorithm()  # a bad ARENDEZ_ALGORITHM fails here, not inside a collective
    limit = _seconds(timeout, DEFAULT_TIMEOUT)
    if store is not None:
        if world_size < 1:
            raise RendezvousError("init_process_group(store=...) needs world_size")
        where = Plan(world_size, rank, store.host, store.port, store.job)
    else:
        where = plan(init_method, world_size, rank)
    world = await _build_world(where, limit, store)
    default = world.groups[0]
    _registry.world, _registry.default = world, default
    GroupMember.WORLD = default


async def _build_world(where: Plan, timeout: float, given: Store | None) -> World:
    if where.local:
        return World(0, 1, timeout)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    secure = tls.from_env()
    if secure is not None and secure.server is None and where.world_size != 1:
        raise RendezvousError(
            "with ARENDEZ_TLS_CA set, every rank needs ARENDEZ_TLS_CERT and ARENDEZ_TLS_KEY"
        )
    server = None
    if where.host_server:
        server = await _host_server(where, secure.server if secure else None)
    store: Any = given
    if store is None and where.store_url:  # etcd backend (issue 14): same interface as Store
        from .etcd import open_store

        store = open_store(where.store_url, timeout)
    store = store or Store(
        where.host,
        where.port,
        where.job,
        token=where.token,
        ssl=secure.client if secure else None,
        timeout=timeout,
    )
    mesh: Mesh | None = None
    world: World | None = None
    try:
        if given is None:
            await store.connect(timeout)
        mesh = Mesh(
            token=where.token,
            server_ssl=secure.server if secure else None,
            client_ssl=secure.client if secure else None,
        )
        advertise = os.environ.get("ARENDEZ_ADVERTISE_ADDR") or _local_address(store, where.host)
        port = await mesh.listen(os.environ.get("ARENDEZ_LISTEN_ADDR") or advertise, 0)
        address = f"[{advertise}]:{port}" if ":" in advertise else f"{advertise}:{port}"
        member = await store.join(where.world_size, where.rank, address, deadline - loop.time())
        world = World(member.rank, member.world_size, timeout)
        world.store, world.mesh, world.server, world.address = store, mesh, server, address
        world.shm = shm.Channels(allowed=shm.enabled() and secure is None)  # before peers say hello
        store.on_event = lambda event, w=world: _on_server_event(w, event)
        await mesh.connect(
            member.rank,
            member.world_size,
            member.nonce,
            member.peers,
            world.route,
            world.sink,
            world.peer_lost,
            max(0.1, deadline - loop.time()),
        )
        await world.open_shm(max(0.1, min(2.0, deadline - loop.time())))
        return world
    except BaseException:
        if world is not None:
            world.shm.close()
        if mesh is not None:
            await mesh.close(1.0)
        await store.leave(1.0)
        if given is None:
            await store.close()
        if server is not None:
            await server.close()
        raise


async def _host_server(where: Plan, ssl_context: Any) -> Any:
    server = importlib.import_module("arendez_server")  # installed from server/
    Server, ServerConfig = server.Server, server.ServerConfig
    for host in (where.host, "0.0.0.0"):
        srv = Server(ServerConfig(host=host, port=where.port, token=where.token, ssl=ssl_context))
        try:
            await srv.start()
            return srv
        except OSError as exc:
            if host == "0.0.0.0":
                raise RendezvousError(f"rank 0 cannot host the store on port {where.port}: {exc}") from None
    raise AssertionError("unreachable")


def _local_address(store: Store, server_host: str) -> str:
    """The address peers should dial: the one our store connection leaves from."""
    if is_loopback(server_host):
        return "127.0.0.1"
    sockname = store.sockname()
    if sockname:
        return str(sockname[0])
    return socket.gethostbyname(socket.gethostname())


def _on_server_event(world: World, event: dict[str, Any]) -> None:
    kind = event.get("event")
    rank = event.get("rank")
    if kind == "rank_failed" and isinstance(rank, int):
        world.peer_lost(rank, f"declared failed by the server ({event.get('reason')})")


async def destroy_process_group(group: Any = None, timeout: float | datetime.timedelta | None = None) -> None:
    """Drain in-flight collectives within ``timeout``, cancel the rest, close, leave.

    ``group=None`` destroys the default group and every subgroup; a subgroup leaves the
    default group alive. Quiet when nothing is initialized or the group is already gone.
    """
    world = _registry.world
    if world is None or group is GroupMember.NON_GROUP_MEMBER:
        return
    if group is not None and group is not GroupMember.WORLD and group is not _registry.default:
        if isinstance(group, ProcessGroup) and not group.destroyed and group.world is world:
            await group.drain(_seconds(timeout, group.timeout))
            world.groups.pop(group.gid, None)
        return
    loop = asyncio.get_running_loop()
    assert _registry.default is not None
    budget = _seconds(timeout, _registry.default.timeout)
    deadline = loop.time() + budget
    groups = sorted(world.groups.values(), key=lambda g: -g.gid)  # subgroups first
    for g in groups:
        g.closing = True  # new collectives now raise GroupDestroyedError
    try:
        await asyncio.gather(*(g.drain(max(0.0, deadline - loop.time())) for g in groups))
    finally:
        _registry.world = _registry.default = None
        GroupMember.WORLD = None
    world.groups.clear()
    world.closed = True
    if world.mesh is not None:
        for peer in list(world.mesh.conns):
            with contextlib.suppress(ConnectionError):
                world.mesh.send(peer, [BYE, dict(world.failed)])
        await world.mesh.close(max(0.2, min(2.0, deadline - loop.time())))
    world.shm.close()
    if world.store is not None:
        await world.store.leave(max(0.2, min(2.0, deadline - loop.time())))
        if world.server is not None:
            await _linger(world, deadline)
        await world.store.close()
    if world.server is not None:
        await world.server.close(max(0.2, min(2.0, deadline - loop.time())))


async def _linger(world: World, deadline: float) -> None:
    """The hosting rank keeps its embedded server up until the other ranks have left."""
    loop = asyncio.get_running_loop()
    until = min(deadline, loop.time() + 10.0)
    nonce = world.mesh.nonce if world.mesh is not None else b""
    while world.server.members_active(world.store.job, nonce) and loop.time() < until:
        await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def process_group(*args: Any, **kwargs: Any) -> AsyncIterator[Any]:
    """``async with process_group(...) as pg:`` initialises, and always destroys on exit."""
    await init_process_group(*args, **kwargs)
    try:
        import arendez

        yield arendez
    finally:
        await destroy_process_group()


def get_rank(group: Any = None) -> int:
    """This process's rank in ``group`` (-1 if it is not a member)."""
    g = _resolve(group)
    return -1 if g is None else g.rank


def get_world_size(group: Any = None) -> int:
    """How many ranks ``group`` has (-1 if this process is not a member)."""
    g = _resolve(group)
    return -1 if g is None else g.size


def get_process_group_ranks(group: Any = None) -> list[int]:
    g = _resolve(group)
    return [] if g is None else list(g.ranks)


def _digest(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()[:12]


async def new_group(
    ranks: Sequence[int] | None = None,
    timeout: float | datetime.timedelta | None = None,
    backend: str | None = None,
) -> Any:
    """Create a subgroup; every rank of the default group must call it, in the same order.

    Members get the new ``ProcessGroup``; the others ``GroupMember.NON_GROUP_MEMBER``.
    """
    default = _resolve(None)
    assert default is not None
    world = default.world
    members = sorted(set(range(world.world_size) if ranks is None else ranks))
    if any(not 0 <= r < world.world_size for r in members) or not members:
        raise ValueError(f"ranks must be distinct ranks in 0..{world.world_size - 1}, got {ranks!r}")
    fp = f"new_group|{_digest(repr(members))}"
    gid = world.reserve_gid()
    await default.run(
        "new_group", fp, lambda comm: algo.all_reduce(comm, np.zeros(1, np.uint8), ReduceOp.MAX)
    )
    group = world.add_group(gid, members, _seconds(timeout, default.timeout))
    return GroupMember.NON_GROUP_MEMBER if group is None else group


# -- collectives -----------------------------------------------------------------------------
def _fp(name: str, x: np.ndarray[Any, Any], *extra: Any) -> str:
    return "|".join([name, x.dtype.str, str(x.size), *map(str, extra)])


async def barrier(group: Any = None, timeout: float | None = None) -> None:
    """Wait until every rank of ``group`` reaches the barrier."""
    g = _resolve(group)
    if g is not None:
        flag = np.zeros(1, np.uint8)
        await g.run("barrier", "barrier", lambda c: algo.all_reduce(c, flag, ReduceOp.MAX), timeout)


def _reduction(tensor: Any, op: Any, what: str = "tensor") -> tuple[np.ndarray[Any, Any], ReduceOp]:
    """The array and op of a reduction, checked before the collective takes a sequence number."""
    x = as_array(tensor, what=what)
    rop = ReduceOp.parse(op)
    ufunc_for(rop, x.dtype)
    return x, rop


async def all_reduce(
    tensor: Any, op: Any = ReduceOp.SUM, group: Any = None, *, algorithm: str | None = None
) -> None:
    """Reduce ``tensor`` across the group, in place, with ``op``."""
    g = _resolve(group)
    if g is None:
        return
    x, rop = _reduction(tensor, op)
    algo.check_algorithm(algorithm)
    await g.run("all_reduce", _fp("all_reduce", x, rop.name), lambda c: algo.all_reduce(c, x, rop, algorithm))


async def reduce(
    tensor: Any, dst: int, op: Any = ReduceOp.SUM, group: Any = None, *, algorithm: str | None = None
) -> None:
    """Reduce into ``tensor`` on global rank ``dst``."""
    g = _resolve(group)
    if g is None:
        return
    x, rop = _reduction(tensor, op)
    algo.check_algorithm(algorithm)
    root = g.group_rank(dst, "dst")
    await g.run("reduce", _fp("reduce", x, rop.name, dst), lambda c: algo.reduce(c, x, root, rop, algorithm))


async def broadcast(tensor: Any, src: int, group: Any = None, *, algorithm: str | None = None) -> None:
    """Copy ``tensor`` of global rank ``src`` into every rank's ``tensor``."""
    g = _resolve(group)
    if g is None:
        return
    x = as_array(tensor)
    algo.check_algorithm(algorithm)
    root = g.group_rank(src, "src")
    await g.run("broadcast", _fp("broadcast", x, src), lambda c: algo.broadcast(c, x, root, algorithm))


def _blocks(
    arrays: Sequence[Any], size: int, like: np.ndarray[Any, Any], what: str
) -> list[np.ndarray[Any, Any]]:
    if len(arrays) != size:
        raise ValueError(f"{what} must hold {size} tensors (one per rank), got {len(arrays)}")
    out = [as_array(a, what=what) for a in arrays]
    for a in out:
        if a.dtype != like.dtype or a.size != like.size:
            raise ValueError(
                f"every tensor in {what} must be {like.dtype} x {like.size}, got {a.dtype} x {a.size}"
            )
    return out


async def all_gather(tensor_list: list[Any], tensor: Any, group: Any = None) -> None:
    """Fill ``tensor_list[i]`` with rank ``i``'s ``tensor``."""
    g = _resolve(group)
    if g is None:
        return
    x = as_array(tensor, writable=False)
    outs = _blocks(tensor_list, g.size, x, "tensor_list")
    if outs[g.rank].ctypes.data != x.ctypes.data:
        np.copyto(outs[g.rank], x)
    blocks = [as_bytes(o) for o in outs]
    await g.run("all_gather", _fp("all_gather", x), lambda c: algo.all_gather(c, blocks))


async def all_gather_into_tensor(output_tensor: Any, input_tensor: Any, group: Any = None) -> None:
    """Concatenate every rank's ``input_tensor`` into ``output_tensor`` (rank order)."""
    g = _resolve(group)
    if g is None:
        return
    x = as_array(input_tensor, writable=False)
    out = as_array(output_tensor, what="output_tensor")
    if out.dtype != x.dtype or out.size != x.size * g.size:
        raise ValueError(f"output_tensor must be {x.dtype} x {x.size * g.size}, got {out.dtype} x {out.size}")
    blocks = np.split(as_bytes(out), g.size) if out.size else [as_bytes(out)] * g.size
    mine = out[g.rank * x.size : (g.rank + 1) * x.size]
    if x.size and mine.ctypes.data != x.ctypes.data:
        np.copyto(mine, x)
    await g.run("all_gather", _fp("all_gather", x), lambda c: algo.all_gather(c, blocks))


async def gather(tensor: Any, gather_list: list[Any] | None = None, dst: int = 0, group: Any = None) -> None:
    """On ``dst``, fill ``gather_list[i]`` with rank ``i``'s ``tensor``."""
    g = _resolve(group)
    if g is None:
        return
    x = as_array(tensor, writable=False)
    root = g.group_rank(dst, "dst")
    outs = None
    if g.rank == root:
        if gather_list is None:
            raise ValueError("gather_list is required on the dst rank")
        outs = _blocks(gather_list, g.size, x, "gather_list")
    await g.run("gather", _fp("gather", x, dst), lambda c: algo.gather(c, x, outs, root))


async def scatter(
    tensor: Any, scatter_list: list[Any] | None = None, src: int = 0, group: Any = None
) -> None:
    """Rank ``i`` receives ``scatter_list[i]`` of ``src`` into ``tensor``."""
    g = _resolve(group)
    if g is None:
        return
    out = as_array(tensor)
    root = g.group_rank(src, "src")
    ins = None
    if g.rank == root:
        if scatter_list is None:
            raise ValueError("scatter_list is required on the src rank")
        ins = [as_array(a, writable=False, what="scatter_list") for a in scatter_list]
        _blocks(ins, g.size, out, "scatter_list")
    await g.run("scatter", _fp("scatter", out, src), lambda c: algo.scatter(c, out, ins, root))


async def reduce_scatter(
    output: Any, input_list: list[Any], op: Any = ReduceOp.SUM, group: Any = None
) -> None:
    """``output`` on rank ``i`` = reduction over ranks of their ``input_list[i]``."""
    g = _resolve(group)
    if g is None:
        return
    out, rop = _reduction(output, op, "output")
    ins = _blocks([as_array(a, writable=False) for a in input_list], g.size, out, "input_list")
    await g.run(
        "reduce_scatter",
        _fp("reduce_scatter", out, rop.name),
        lambda c: algo.reduce_scatter(c, out, ins, rop),
    )


async def reduce_scatter_tensor(output: Any, input: Any, op: Any = ReduceOp.SUM, group: Any = None) -> None:
    """``output`` on rank ``i`` = reduction of block ``i`` of every rank's ``input``."""
    g = _resolve(group)
    if g is None:
        return
    out, rop = _reduction(output, op, "output")
    x = as_array(input, writable=False, what="input")
    if x.dtype != out.dtype or x.size != out.size * g.size:
        raise ValueError(f"input must be {out.dtype} x {out.size * g.size}, got {x.dtype} x {x.size}")
    ins = [x[i * out.size : (i + 1) * out.size] for i in range(g.size)]
    await g.run(
        "reduce_scatter",
        _fp("reduce_scatter", out, rop.name),
        lambda c: algo.reduce_scatter(c, out, ins, rop),
    )


async def all_to_all(output_tensor_list: list[Any], input_tensor_list: list[Any], group: Any = None) -> None:
    """``output_tensor_list[j]`` on rank ``i`` = ``input_tensor_list[i]`` of rank ``j``."""
    g = _resolve(group)
    if g is None:
        return
    if len(input_tensor_list) != g.size or len(output_tensor_list) != g.size:
        raise ValueError(f"all_to_all needs {g.size} input and output tensors")
    ins = [as_array(a, writable=False, what="input_tensor_list") for a in input_tensor_list]
    outs = [as_array(a, what="output_tensor_list") for a in output_tensor_list]
    for i, (a, b) in enumerate(zip(ins, outs, strict=True)):
        if a.dtype != ins[0].dtype or b.dtype != ins[0].dtype:
            raise ValueError(f"all_to_all tensors must share one dtype (tensor {i} differs)")
    fp = "|".join(["all_to_all", ins[0].dtype.str, str(g.size)])
    await g.run("all_to_all", fp, lambda c: _exchange(c, outs, ins))


async def _exchange(comm: Any, outs: list[np.ndarray[Any, Any]], ins: list[np.ndarray[Any, Any]]) -> None:
    if comm.size == 1:
        np.copyto(outs[0], ins[0])
    else:
        await algo.all_to_all(comm, outs, ins)


def _split(
    array: np.ndarray[Any, Any], shape: tuple[int, ...], sizes: Sequence[int] | None, n: int, what: str
) -> list[np.ndarray[Any, Any]]:
    rows = shape[0] if shape else array.size
    row = array.size // rows if rows else 0
    if sizes is None:
        if rows % n:
            raise ValueError(f"{what} has {rows} rows, not divisible by the group size {n}")
        sizes = [rows // n] * n
    if len(sizes) != n or sum(sizes) != rows:
        raise ValueError(f"{what} split sizes {list(sizes)} must be {n} numbers summing to {rows}")
    bounds = np.cumsum([0, *sizes]) * row
    return [array[bounds[i] : bounds[i + 1]] for i in range(n)]


async def all_to_all_single(
    output: Any,
    input: Any,
    output_split_sizes: Sequence[int] | None = None,
    input_split_sizes: Sequence[int] | None = None,
    group: Any = None,
) -> None:
    """Split ``input`` by rows, send piece ``j`` to rank ``j``, gather the pieces into ``output``."""
    g = _resolve(group)
    if g is None:
        return
    out = as_array(output, what="output")
    x = as_array(input, writable=False, what="input")
    ins = _split(x, tuple(np.shape(input)), input_split_sizes, g.size, "input")
    outs = _split(out, tuple(np.shape(output)), output_split_sizes, g.size, "output")
    fp = "|".join(["all_to_all_single", x.dtype.str, str(g.size)])
    await g.run("all_to_all_single", fp, lambda c: _exchange(c, outs, ins))


# -- point to point --------------------------------------------------------------------------
async def send(tensor: Any, dst: int, group: Any = None, tag: int = 0) -> None:
    """Send ``tensor`` to global rank ``dst``; returns once the bytes are in the kernel."""
    g = _resolve(group)
    if g is None:
        return
    g.check_usable("send")
    x = as_array(tensor, writable=False)
    g.group_rank(dst, "dst")
    world = g.world
    if dst == world.rank:
        raise ValueError("cannot send to this rank itself")
    assert world.mesh is not None
    conn = world.mesh.conns.get(dst)
    if conn is None or not conn.is_open or dst in world.dead:
        raise RankFailedError(dst, "send", world.dead.get(dst, "no connection"))
    raw = byte_view(x)
    if raw.nbytes > wire.MAX_SEGMENT:
        raise ValueError(
            f"send carries at most {wire.MAX_SEGMENT} bytes; split the tensor (got {raw.nbytes})"
        )
    try:
        conn.send([P2P, g.gid, int(tag), _fp("send", x)], raw if raw.nbytes else None)
        async with asyncio.timeout(g.timeout):
            await conn.drain()
    except ConnectionError as exc:
        raise RankFailedError(dst, "send", f"connection lost ({exc})") from None
    except TimeoutError:
        raise CollectiveTimeoutError("send", g.timeout, [dst]) from None


async def recv(tensor: Any, src: int | None = None, group: Any = None, tag: int = 0) -> int:
    """Receive into ``tensor`` from global rank ``src`` (any rank if None); return the sender."""
    g = _resolve(group)
    if g is None:
        return -1
    g.check_usable("recv")
    out = as_array(tensor)
    if src is not None:
        g.group_rank(src, "src")
    fut = g.world.post_p2p(src, g.gid, int(tag), byte_view(out))
    try:
        async with asyncio.timeout(g.timeout):
            return await fut
    except TimeoutError:
        others = [r for r in g.ranks if r != g.world.rank] if src is None else [src]
        raise CollectiveTimeoutError("recv", g.timeout, others) from None
    finally:
        g.world.cancel_p2p(fut)  # a recv that timed out or was cancelled must not eat a message


# -- object collectives (msgpack, never pickle) ----------------------------------------------
def _pack(obj: Any) -> bytes:
    try:
        packed: bytes = msgpack.packb(obj, use_bin_type=True)
        return packed
    except TypeError as exc:
        raise TypeError(f"object collectives carry msgpack-serialisable values only: {exc}") from None


def _unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


async def all_gather_object(object_list: list[Any], obj: Any, group: Any = None) -> None:
    """Fill ``object_list[i]`` with rank ``i``'s ``obj``."""
    g = _resolve(group)
    if g is None:
        return
    if len(object_list) != g.size:
        raise ValueError(f"object_list must have {g.size} entries, got {len(object_list)}")
    mine = _pack(obj)

    async def body(c: Any) -> list[bytes]:
        return [mine] if g.size == 1 else await algo.all_gather_bytes(c, mine)

    parts = await g.run("all_gather_object", "all_gather_object", body)
    object_list[:] = [_unpack(p) for p in parts]


async def broadcast_object_list(object_list: list[Any], src: int = 0, group: Any = None) -> None:
    """Replace ``object_list``'s entries with those of global rank ``src``."""
    g = _resolve(group)
    if g is None:
        return
    root = g.group_rank(src, "src")
    mine = _pack(list(object_list)) if g.rank == root else None
    fp = f"broadcast_object_list|{src}|{len(object_list)}"

    async def body(c: Any) -> bytes:
        return mine if g.size == 1 else await algo.broadcast_bytes(c, mine, root)  # type: ignore[return-value]

    data = await g.run("broadcast_object_list", fp, body)
    object_list[:] = _unpack(data)


async def gather_object(
    obj: Any, object_gather_list: list[Any] | None = None, dst: int = 0, group: Any = None
) -> None:
    """On ``dst``, fill ``object_gather_list[i]`` with rank ``i``'s ``obj``."""
    g = _resolve(group)
    if g is None:
        return
    root = g.group_rank(dst, "dst")
    if g.rank == root and (object_gather_list is None or len(object_gather_list) != g.size):
        raise ValueError(f"object_gather_list on the dst rank must have {g.size} entries")
    mine = _pack(obj)

    async def body(c: Any) -> list[bytes] | None:
        return [mine] if g.size == 1 else await algo.gather_bytes(c, mine, root)

    parts = await g.run("gather_object", f"gather_object|{dst}", body)
    if parts is not None and object_gather_list is not None:
        object_gather_list[:] = [_unpack(p) for p in parts]


async def scatter_object_list(
    scatter_object_output_list: list[Any],
    scatter_object_input_list: list[Any] | None = None,
    src: int = 0,
    group: Any = None,
) -> None:
    """Rank ``i`` gets ``scatter_object_input_list[i]`` of ``src`` in its output list's slot 0."""
    g = _resolve(group)
    if g is None:
        return
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


def transport_stats() -> Stats:
    """Transport counters of the current world: payload bytes received, those the receive path
    had to copy (a frame that arrived before its receive was posted), those that came through
    shared memory, and large sends that took TCP because the peer's ring was full."""
    world = _registry.world
    if world is None:
        raise NotInitializedError("no process group: call init_process_group() first")
    return world.stats
