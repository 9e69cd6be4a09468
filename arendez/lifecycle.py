"""Lifecycle: build a world (store, peer mesh, shared memory); ``teardown`` takes it down."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import hashlib
import logging
import os
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from . import algorithms as algo
from . import elastic, embedded, farewell, shm, tls, validate
from .arrays import ReduceOp
from .errors import RendezvousError, StoreConnectTimeoutError
from .group import GroupMember
from .handle import Handle
from .loop import shared
from .loopcpu import cpus_to_spare
from .registry import (
    DEFAULT_TIMEOUT,
    forming,
    install,
    resolve_to_run,
    seconds,
)
from .rendezvous import Plan, is_loopback, plan
from .rendezvous import int_env as env_int
from .store import Store
from .teardown import destroy_process_group
from .transports import inproc, local
from .transports.tcp import Mesh
from .world import World

log = logging.getLogger("arendez")

#: The longest init waits for same-host peers to answer a shared-memory offer.
SHM_SETUP_SECONDS = 2.0


async def init_process_group(
    backend: str | None = "tcp",
    init_method: str | None = None,
    *,
    world_size: int | tuple[int, int] = -1,
    rank: int = -1,
    timeout: float | datetime.timedelta | None = None,
    store: Store | None = None,
    group_name: str = "",
) -> None:
    """Join (or form) the default process group (``init_method``: see the README).

    ``world_size=(min, max)`` (or ``ARENDEZ_MIN_WORLD_SIZE`` in the environment) joins an
    elastic world on a standalone server (``arendez.elastic``). ``group_name`` is accepted for
    torch compatibility and unused.
    """
    range_ = elastic.bounds(world_size)
    if range_ is not None:
        where, limit = _checked_elastic(backend, init_method, range_, rank, timeout, store, group_name)
        await init_elastic(where, limit, limit)
        return
    where, limit = _checked(backend, init_method, world_size, rank, timeout, store, group_name)
    build = _BUILDERS.get(where.transport)
    if build is None:
        raise RendezvousError(f"no transport {where.transport!r}; known: {', '.join(_BUILDERS)}")
    with forming():
        world = await build(where, limit, store)
        farewell.register(world)  # a process that ends without destroy still says goodbye
        install(world)
        if where.transport != "inproc":  # (tcp, and what builds a tcp world: file, agent)
            _settle_cpus(world)


def _checked_common(
    backend: object, init_method: object, timeout: object, group_name: object
) -> tuple[str | None, float]:
    """The arguments every world checks first: the init URL and the timeout in seconds."""
    validate.backend(backend)
    url = validate.init_method(init_method)
    limit = DEFAULT_TIMEOUT if timeout is None else validate.seconds(timeout, "timeout")
    validate.text(group_name, "group_name")
    algo.forced_algorithm()  # a bad ARENDEZ_ALGORITHM fails here, not inside a collective
    return url, limit


def _checked(
    backend: object,
    init_method: object,
    world_size: object,
    rank: object,
    timeout: object,
    store: object,
    group_name: object,
) -> tuple[Plan, float]:
    """Every argument of ``init_process_group`` checked (and the plan made) before any I/O."""
    url, limit = _checked_common(backend, init_method, timeout, group_name)
    size = validate.world_size(validate.index(world_size, "world_size"))
    me = validate.rank(validate.index(rank, "rank"), size)
    if store is not None:
        if not isinstance(store, Store):
            raise TypeError(f"store must be an arendez Store, got {type(store).__name__}")
        if size < 1:
            raise ValueError(f"init_process_group(store=...) needs world_size >= 1, got {size}")
        where = Plan(size, me, store.host, store.port, store.job)
    else:
        where = plan(url, size, me)
    # the environment may have supplied what the arguments left open: check the result too
    validate.rank(where.rank, where.world_size, "rank" if me != -1 else "RANK")
    return where, limit


def _checked_elastic(
    backend: object,
    init_method: object,
    range_: elastic.Bounds,
    rank: object,
    timeout: object,
    store: object,
    group_name: object,
) -> tuple[Plan, float]:
    """``init_process_group``'s arguments for an elastic world, checked before any I/O."""
    url, limit = _checked_common(backend, init_method, timeout, group_name)
    if validate.index(rank, "rank") != -1:
        raise ValueError(f"an elastic world assigns ranks: leave rank=-1 (got rank={rank})")
    if store is not None:
        raise ValueError("an elastic world joins through init_method (arendez://...), not store=")
    where = plan(url, range_.max_size, 0)  # (rank 0: the plan must not take RANK as the rank)
    if where.host_server or where.transport != "tcp" or where.store_url or not where.host:
        raise RendezvousError(
            "an elastic world needs a standalone arendez-server (init_method arendez://host:port/job, "
            "or ARENDEZ_URL as arendez-run sets it): a server embedded in rank 0 (tcp://, env:// with "
            "MASTER_ADDR, file://) dies with rank 0, and then nobody can re-form; inproc:// and etcd:// "
            "have no elastic rounds"
        )
    slot = env_int(os.environ, "RANK")  # (the launcher's slot: orders new ranks, nothing more)
    return (
        Plan(
            range_.max_size,
            -1,
            where.host,
            where.port,
            where.job,
            where.token,
            min_size=range_.min_size,
            settle=elastic.settle_seconds(),
            hint=slot if slot is not None and slot >= 0 else -1,
        ),
        limit,
    )


def _settle_cpus(world: World) -> None:
    """How a world's loop uses the CPUs (``arendez.loopcpu``): it polls for the messages of a
    call that is waited on while the host's ranks (``LOCAL_WORLD_SIZE``, else all of them if
    the round says they share this host, else this one) have a CPU each; the blocking callers'
    loop thread also keeps to one CPU (the ``LOCAL_RANK``-th, else the rank's), and polls for
    the whole call (``LoopThread.spin_for``, ``keep_on_one_cpu``)."""
    local_rank, local_size = os.environ.get("LOCAL_RANK", ""), os.environ.get("LOCAL_WORLD_SIZE", "")
    here = int(local_size) if local_size.isdigit() else world.world_size if world.one_machine else 1
    if not shared.in_loop_thread():
        world.spin.configure(here, cpus_to_spare())
        return
    shared.spin_for(here)  # (first: it counts the CPUs the thread may use before it is pinned)
    shared.keep_on_one_cpu(int(local_rank) if local_rank.isdigit() else world.rank)


async def init_elastic(where: Plan, timeout: float, join_timeout: float) -> None:
    """Join an elastic round (``where.min_size`` > 0) and install the world; collectives get
    ``timeout``, the join ``join_timeout``.

    A member of the round that dies before its peers reach it (a second failure while the
    world re-forms) does not end the job: this rank joins the next round, naming it dead, as
    the round's other members will once they see it fail; all within ``join_timeout``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + join_timeout
    with forming():
        while True:
            formed: list[tuple[int, int]] = []  # (generation, rank) of the round joined
            try:
                world = await _tcp_world(
                    where, timeout, None, join_timeout=max(0.001, deadline - loop.time()), formed=formed
                )
                break
            except RendezvousError as exc:
                if not exc.unreachable or not formed or loop.time() >= deadline:
                    raise
                generation, rank = formed[0]
                log.warning("rank %d of round %d: %s; joining the next round", rank, generation, exc)
                where = replace(where, came_from=generation, hint=rank, dead=exc.unreachable)
        farewell.register(world)
        install(world)
        _settle_cpus(world)


async def _inproc_world(where: Plan, timeout: float, given: Store | None) -> World:
    """Ranks that are tasks of this event loop (one rank: a world of its own): no store."""
    job = where.job or f"local-{os.urandom(8).hex()}"
    links = await inproc.join(job, where.world_size, where.rank, timeout)
    world = World(links.rank, where.world_size, timeout)
    world.mesh = links
    links.attach(world.route, world.sink, world.link_lost)
    return world


async def _connect(store: Any, where: Plan, timeout: float) -> None:
    """``store.connect``; a store rank 0 hosts (tcp://, env://) that never answers names rank 0."""
    try:
        await store.connect(timeout)
    except StoreConnectTimeoutError as exc:
        if not where.hosted_by_rank0 or where.host_server:
            raise
        raise StoreConnectTimeoutError(
            f"{exc}; with {where.host}:{where.port} as MASTER_ADDR:MASTER_PORT (tcp://, env://) rank 0 "
            "hosts the store: did rank 0 start, and is it still running?"
        ) from None


async def _tcp_world(
    where: Plan,
    timeout: float,
    given: Store | None,
    *,
    join_timeout: float | None = None,
    formed: list[tuple[int, int]] | None = None,
) -> World:
    """Join through the store, connect to the algorithms' neighbours (the rest of the mesh
    connects on first use), set up same-host shared memory. An elastic join appends the round's
    ``(generation, rank)`` to ``formed`` once the round closed."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + (timeout if join_timeout is None else join_timeout)
    secure = tls.from_env()
    if secure is not None and secure.server is None and where.world_size != 1:
        raise RendezvousError(
            "with ARENDEZ_TLS_CA set, every rank needs ARENDEZ_TLS_CERT and ARENDEZ_TLS_KEY"
        )
    server = None
    if where.host_server:  # kept across rounds while this process lives (arendez.embedded)
        server = await embedded.acquire(
            where.host, where.port, where.token, secure.server if secure else None
        )
    elif not where.local:  # another rank hosts this port now: a server this process kept must go
        await embedded.release(where.port)
    store: Any = given
    if store is None and where.store_url:  # etcd://: same interface as Store
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
            await _connect(store, where, timeout)
        mesh = Mesh(
            token=where.token,
            server_ssl=secure.server if secure else None,
            client_ssl=secure.client if secure else None,
        )
        advertise = os.environ.get("ARENDEZ_ADVERTISE_ADDR") or _local_address(store, where.host)
        port = await mesh.listen(os.environ.get("ARENDEZ_LISTEN_ADDR") or advertise, 0)
        address = mesh.advertised(f"[{advertise}]:{port}" if ":" in advertise else f"{advertise}:{port}")
        offsets = neighbour_offsets(where.world_size)
        channels = shm.Channels(allowed=shm.enabled() and secure is None)
        machine = channels.host if channels.allowed else ""
        if where.min_size:  # elastic: the size is known once the round closes
            member = await store.join(
                where.world_size,
                -1,
                address,
                deadline - loop.time(),
                peers=False,
                neighbours=offsets,
                min_size=where.min_size,
                settle=where.settle,
                came_from=where.came_from,
                hint=where.hint,
                dead=where.dead,
                machine=machine,
            )
            offsets = neighbour_offsets(member.world_size)
            known, resolve = dict(member.addresses), store.addresses
            if formed is not None:
                formed.append((member.generation, member.rank))
        elif isinstance(store, Store):  # only the neighbours' addresses; the rest on first use
            member = await store.join(
                where.world_size,
                where.rank,
                address,
                deadline - loop.time(),
                peers=False,
                neighbours=offsets,
                machine=machine,
            )
            known, resolve = dict(member.addresses), store.addresses
        else:  # (etcd: every address comes with the round)
            member = await store.join(where.world_size, where.rank, address, deadline - loop.time())
            known, resolve = dict(enumerate(member.peers)), None
        world = World(member.rank, member.world_size, timeout)
        world.store, world.mesh, world.server, world.address = store, mesh, server, address
        world.shm = channels  # (before peers say hello)
        # lane sizes and algorithms follow from it, so every rank must see the same: the round's
        # answer (etcd's has none: TCP's lanes, whatever the links turn out to be)
        world.one_machine = getattr(member, "one_machine", None) is True
        store.on_event = lambda event, w=world: _on_server_event(w, event)
        mesh.start(
            member.rank,
            member.world_size,
            member.nonce,
            known,
            world.route,
            world.sink,
            world.link_lost,
            resolve=resolve,
            on_connected=world.on_connected,
            dial_timeout=timeout,
        )
        neighbours = {(member.rank + k) % member.world_size for k in offsets}
        if isinstance(store, Store):  # (tcp://: the store dies with rank 0, which may have failed)
            store.on_lost = mesh.doubt
        try:
            await mesh.preconnect(neighbours, max(0.0, deadline - loop.time()))
        finally:
            if isinstance(store, Store):
                store.on_lost = None
        await world.open_shm(max(0.0, min(SHM_SETUP_SECONDS, deadline - loop.time())))
        if where.min_size:
            elastic.remember(elastic.Config(where, timeout), world, member.generation, member.survivors)
        return world
    except BaseException:  # undo what was built, within what is left of init's deadline
        if world is not None:
            world.shm.close()
        if mesh is not None:
            await mesh.close(max(0.0, deadline - loop.time()))
        await store.leave(max(0.0, deadline - loop.time()))
        if given is None:
            await store.close()
        raise  # an embedded server stays up for the next attempt, as a standalone one would


async def _file_world(where: Plan, timeout: float, given: Store | None) -> World:
    """``file:///path``: the shared file names the server (``arendez.filerdzv``), then as tcp://."""
    from .filerdzv import resolve as read_file

    return await _tcp_world(await read_file(where, timeout), timeout, given)


async def _agent_world(where: Plan, timeout: float, given: Store | None) -> World:
    """``env://`` under torchrun's agent store: it names rank 0's server (``arendez.agentstore``)."""
    from .agentstore import resolve as read_agent_store

    return await _tcp_world(await read_agent_store(where, timeout), timeout, given)


#: how each transport (``Plan.transport``, from the ``init_method`` scheme) builds a world
_BUILDERS: dict[str, Callable[[Plan, float, Store | None], Awaitable[World]]] = {
    "tcp": _tcp_world,
    "inproc": _inproc_world,
    "file": _file_world,
    "agent": _agent_world,
}


def _local_address(store: Store, server_host: str) -> str:
    """The address peers should dial: the one our store connection leaves from."""
    if is_loopback(server_host):
        return "127.0.0.1"
    sockname = store.sockname()
    if isinstance(sockname, tuple) and sockname:
        return str(sockname[0])
    if sockname is not None and local.server_candidates(server_host, store.port):
        return server_host  # (over the server's local socket: its address is ours)
    return socket.gethostbyname(socket.gethostname())


def neighbour_offsets(world_size: int) -> list[int]:
    """The rank offsets init connects to: +-1 (rings) and +-2^k (recursive doubling and
    binomial trees), O(log W); every other pair connects on first use."""
    offsets: set[int] = set()
    step = 1
    while step < world_size:
        offsets.update((step, -step))
        step *= 2
    return sorted(offsets)


def _on_server_event(world: World, event: dict[str, Any]) -> None:
    """The server's word on ranks this one may never have connected to."""
    kind = event.get("event")
    rank = event.get("rank")
    if kind == "rank_failed" and isinstance(rank, int) and event.get("said"):
        # it failed by its own word as it left: a connected rank says so on its connection too,
        # after its last frame (this news may overtake them); another sent us nothing
        if rank not in _connected(world):
            world.peer_lost(rank, f"{event.get('reason')} (the server says)")
    elif kind == "rank_failed" and isinstance(rank, int):
        world.peer_lost(rank, f"declared failed by the server ({event.get('reason')})")
    elif kind == "self_failed":
        world.expelled(f"this rank was declared failed by the server ({event.get('reason')})")
    elif kind == "rank_left" and isinstance(rank, int) and rank not in _connected(world):
        # (a connected rank says goodbye on its connection, after its last frame)
        world.peer_lost(rank, "it left the job (the server says)", left=True)


def _connected(world: World) -> Any:
    return world.mesh.conns if world.mesh is not None else ()


@contextlib.asynccontextmanager
async def process_group(*args: Any, **kwargs: Any) -> AsyncIterator[Handle]:
    """``async with process_group(...) as pg:`` initialises, and always destroys on exit;
    ``pg`` has the collectives as methods (``await pg.all_reduce(x)``)."""
    await init_process_group(*args, **kwargs)
    try:
        yield Handle()
    finally:
        await destroy_process_group()


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
    default = resolve_to_run(None)
    assert default is not None
    world = default.world
    members = list(range(world.world_size)) if ranks is None else validate.rank_list(ranks, world.world_size)
    limit = seconds(timeout, default.timeout)
    validate.backend(backend)
    fp = f"new_group|{_digest(repr(members))}"
    gid = world.reserve_gid()
    await default.run(
        "new_group", fp, lambda comm: algo.all_reduce(comm, np.zeros(1, np.uint8), ReduceOp.MAX)
    )
    group = world.add_group(gid, members, limit)
    return GroupMember.NON_GROUP_MEMBER if group is None else group
