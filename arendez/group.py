"""Process groups over a world's peer mesh: sequencing, matching, failure and destroy.

A ``World`` is what one ``init_process_group`` built: its rank, the store, the mesh and every
group over it. Incoming frames are matched to receives by ``(sender, group, seq, tag, segment)``;
a receive posted before its frame arrives gets the payload written straight into its buffer.

Each collective is an ``Op``: it has the group's next sequence number and a fingerprint
(collective, op, dtype, count) carried by every frame, so ranks that started different
collectives at the same sequence number fail with ``CollectiveMismatchError`` instead of
exchanging garbage. An ``Op`` fails as a unit: a dead peer, a deadline or a destroy wakes every
future it waits on with the same error.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import itertools
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

import numpy as np

from . import frames, shm, wire
from .arrays import byte_view
from .errors import (
    ArendezError,
    CollectiveMismatchError,
    CollectiveTimeoutError,
    GroupDestroyedError,
    NotInitializedError,
    ProtocolError,
    RankFailedError,
)
from .mesh import Mesh

log = logging.getLogger("arendez.group")

T = TypeVar("T")
Array = np.ndarray[Any, Any]

#: Payloads at least this large that arrive before their receive land in pooled buffers.
POOLED_EARLY_BYTES = 64 * 1024
#: How long a timed-out collective waits for peers to report their progress.
DIAGNOSE_SECONDS = 1.0


class _Slot:
    """A receive: where the payload goes (``out``), who waits (``fut``), or data that came early."""

    __slots__ = ("any", "data", "fp", "fut", "give_back", "out", "shared")

    def __init__(self) -> None:
        self.any = False  # the receiver takes whichever buffer the payload landed in
        self.out: memoryview | None = None
        self.fut: asyncio.Future[Any] | None = None
        self.data: memoryview | None = None
        self.give_back: Callable[[], None] | None = None  # returns ``data``'s buffer once read
        self.shared = False  # ``data`` lies in the sender's shared memory
        self.fp = ""


def _give(give_back: Callable[[], None] | None) -> None:
    if give_back is not None:
        give_back()


def _settle(fut: asyncio.Future[Any], exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
        fut.exception()  # mark retrieved: the op reports the error once, through its caller


@dataclass
class _P2PRecv:
    src: int | None
    gid: int
    tag: int
    out: memoryview
    fut: asyncio.Future[int]
    error: BaseException | None = None


class BufferPool:
    """Work buffers reused across collectives: fresh pages cost a fault each, every call."""

    def __init__(self, budget: int = 64 << 20) -> None:
        self._free: dict[int, list[Array]] = {}
        self._held = 0
        self._budget = budget

    def take(self, nbytes: int) -> Array:
        free = self._free.get(nbytes)
        if free:
            self._held -= nbytes
            return free.pop()
        return np.empty(nbytes, np.uint8)

    def give(self, buffer: Array) -> None:
        if self._held + buffer.nbytes <= self._budget:
            self._free.setdefault(buffer.nbytes, []).append(buffer)
            self._held += buffer.nbytes


@dataclass
class Stats:
    """Counters a benchmark or test can read: payload bytes the receive path had to copy."""

    copied_bytes: int = 0
    copied_messages: int = 0
    received_bytes: int = 0
    #: the part of ``received_bytes`` that came through shared memory, not the socket
    shm_bytes: int = 0
    #: large payloads sent inline because the peer's shared-memory ring was full
    shm_full: int = 0


class World:
    """One initialised process group world: rank, store, mesh and groups."""

    def __init__(self, rank: int, world_size: int, timeout: float) -> None:
        self.rank = rank
        self.world_size = world_size
        self.timeout = timeout
        self.mesh: Mesh | None = None
        self.store: Any = None
        self.server: Any = None  # the embedded server this rank hosts, if any
        self.address = ""  # host:port of this rank's peer listener
        self.groups: dict[int, ProcessGroup] = {}
        self.next_gid = 0
        self.dead: dict[int, str] = {}  # ranks gone for good, with why
        self.failed: dict[int, str] = {}  # the subset that died rather than left
        self.stats = Stats()
        self._mail: dict[tuple[Any, ...], _Slot] = {}
        self._p2p_posted: list[_P2PRecv] = []
        # per peer, what the sink chose for each P2P frame whose payload is still arriving (the
        # decoder may consult the sink for the next frame before the current one is routed)
        self._p2p_receiving: dict[int, collections.deque[_P2PRecv | None]] = {}
        self._p2p_stash: collections.deque[tuple[int, int, int, memoryview | None]] = collections.deque()
        self._queries: dict[int, tuple[dict[int, int], asyncio.Future[None], int]] = {}
        self._qids = itertools.count()
        self._early_poison: dict[int, dict[int, str]] = {}  # MISMATCH for groups not made yet
        self._early_mail: dict[int, dict[int, list[tuple[Any, ...]]]] = {}  # DATA for them, by seq
        self._pending_gids: set[int] = set()
        self.pool = BufferPool()
        self._pooled: dict[int, Array] = {}  # pool buffers early payloads are arriving in
        self.shm = shm.Channels(allowed=False)  # init enables it unless disabled or under TLS
        self._shm_settled: asyncio.Future[None] | None = None
        self._shm_flush: asyncio.Handle | None = None
        self.closed = False
        self.groups[0] = ProcessGroup(self, 0, list(range(world_size)), timeout)
        self.next_gid = 1

    def reserve_gid(self) -> int:
        """The next subgroup's id, taken before new_group's barrier so ranks never disagree."""
        gid = self.next_gid
        self.next_gid += 1
        self._pending_gids.add(gid)
        return gid

    def add_group(self, gid: int, ranks: list[int], timeout: float) -> ProcessGroup | None:
        """Register subgroup ``gid`` (None for a rank outside it)."""
        self._pending_gids.discard(gid)
        early = self._early_mail.pop(gid, {})
        if self.rank not in ranks:
            self._early_poison.pop(gid, None)
            for keys in early.values():
                self.drop_stashes(keys)
            return None
        group = self.groups[gid] = ProcessGroup(self, gid, ranks, timeout)
        group.poisoned.update(self._early_poison.pop(gid, {}))
        group.early_keys.update(early)
        return group

    # -- frames from the mesh --------------------------------------------------------------
    def sink(self, peer: int, frame: frames.Frame, nbytes: int) -> memoryview | None:
        if isinstance(frame, frames.Data):
            slot = self._mail.get((peer, frame.gid, frame.seq, frame.tag, frame.seg))
            out = slot.out if slot is not None and slot.fp == frame.fp else None
            if out is not None and out.nbytes == nbytes:
                return out  # (a mismatched frame goes to a throwaway buffer instead)
            if nbytes >= POOLED_EARLY_BYTES:  # early: a reused buffer (fresh pages fault)
                buffer = self.pool.take(nbytes)
                self._pooled[id(buffer)] = buffer
                return memoryview(cast(Any, buffer))
        elif isinstance(frame, frames.P2P):
            posted = self._claim_p2p(peer, frame.gid, frame.tag, nbytes)
            self._p2p_receiving.setdefault(peer, collections.deque()).append(posted)
            if posted is not None and posted.error is None:
                return posted.out
        return None

    def _claim_p2p(self, peer: int, gid: int, tag: int, nbytes: int) -> _P2PRecv | None:
        """Take the oldest posted recv that a message from ``peer`` satisfies."""
        for i, posted in enumerate(self._p2p_posted):
            if posted.fut.done():
                continue
            if posted.gid == gid and posted.tag == tag and posted.src in (None, peer):
                del self._p2p_posted[i]
                if posted.out.nbytes != nbytes:
                    posted.error = CollectiveMismatchError(
                        f"recv of {posted.out.nbytes} bytes from rank {peer} got a send of {nbytes}"
                    )
                return posted
        return None

    def route(self, peer: int, frame: frames.Frame, payload: memoryview | None) -> None:
        if payload is not None:
            self.stats.received_bytes += payload.nbytes
        if isinstance(frame, frames.Data | frames.ShmData):
            self._on_data(peer, frame, payload)
        elif isinstance(frame, frames.P2P):
            self._on_p2p(peer, frame, payload)
        elif isinstance(frame, frames.Mismatch):
            group = self.groups.get(frame.gid)
            if group is not None:
                group.poison(frame.seq, frame.message, tell=False)
            elif frame.gid >= self.next_gid and len(self._early_poison) < 1024:
                self._early_poison.setdefault(frame.gid, {})[frame.seq] = frame.message
        elif isinstance(frame, frames.Bye):
            # the leaver tells us who it saw die: blame the root cause, not the messenger
            for rank, reason in frame.failed.items():
                if rank != self.rank:
                    self.peer_lost(rank, f"{reason} (reported by rank {peer})")
            self.peer_lost(peer, "it destroyed its process group", left=True)
        elif isinstance(frame, frames.Query):
            group = self.groups.get(frame.gid)
            self.mesh_send(peer, frames.Answer(frame.qid, group.next_seq if group is not None else -1))
        elif isinstance(frame, frames.Answer):
            entry = self._queries.get(frame.qid)
            if entry is not None:
                answers, done, expected = entry
                answers[peer] = frame.started
                if len(answers) >= expected and not done.done():
                    done.set_result(None)
        elif isinstance(frame, frames.Error):
            self.peer_lost(peer, f"it reported {frame.exception()!r}")
        elif peer not in self.dead:  # shared-memory control (a dead peer's link is already gone)
            self._on_shm(peer, frame)

    def _on_data(self, peer: int, frame: frames.Data | frames.ShmData, payload: memoryview | None) -> None:
        gid, seq, fp = frame.gid, frame.seq, frame.fp
        give_back: Callable[[], None] | None = None
        shared = isinstance(frame, frames.ShmData)
        if isinstance(frame, frames.ShmData):  # the payload lies in the sender's shared memory
            if peer in self.dead:
                return  # its link (and what it pointed at) went with it
            try:
                payload = self.shm.payload(peer, frame.offset, frame.nbytes)
            except ValueError as exc:
                raise ProtocolError(str(exc)) from None
            give_back = functools.partial(self.free_shm, peer, frame.offset)
            self.stats.received_bytes += payload.nbytes
            self.stats.shm_bytes += payload.nbytes
        elif payload is not None and id(payload.obj) in self._pooled:  # came before its receive
            give_back = functools.partial(self.pool.give, self._pooled.pop(id(payload.obj)))
        key = (peer, gid, seq, frame.tag, frame.seg)
        group = self.groups.get(gid)
        op: Op | None = None
        if group is not None:
            op = group.active.get(seq)
            if op is None and seq < group.next_seq:
                return _give(give_back)  # a late frame of a collective that already ended
            if op is not None and op.fp != fp:
                group.mismatch(seq, op.fp, fp, peer)
                return _give(give_back)
            if op is None:
                group.early_fps.setdefault(seq, (peer, fp))
        elif gid < self.next_gid and gid not in self._pending_gids:
            return _give(give_back)  # a group this rank destroyed or is not a member of
        slot = self._mail.get(key)
        if slot is None or slot.fut is None:
            stash = _Slot()
            stash.data = payload if payload is not None else memoryview(b"")
            stash.fp = fp
            stash.give_back, stash.shared = give_back, shared
            self._mail[key] = stash
            if op is not None:
                op.keys.append(key)
            elif group is not None:
                group.early_keys.setdefault(seq, []).append(key)
            else:  # a subgroup this rank has not made yet: add_group hands these over
                self._early_mail.setdefault(gid, {}).setdefault(seq, []).append(key)
            return
        del self._mail[key]
        fut = slot.fut
        if fut.done():
            return _give(give_back)
        if slot.out is None or slot.any:
            if op is not None and give_back is not None and payload is not None:
                op.hold(payload, give_back)
            fut.set_result(payload if payload is not None else memoryview(b""))
            return
        if payload is not None and payload.obj is not slot.out.obj:
            if payload.nbytes != slot.out.nbytes:
                fut.set_exception(
                    CollectiveMismatchError(f"expected {slot.out.nbytes} bytes, got {payload.nbytes}")
                )
                return _give(give_back)
            slot.out[:] = payload
            if not shared:  # (copying out of shared memory is the transfer itself, as the kernel's)
                self.stats.copied_bytes += payload.nbytes
                self.stats.copied_messages += 1
            _give(give_back)
        fut.set_result(None)

    def _on_p2p(self, peer: int, frame: frames.P2P, payload: memoryview | None) -> None:
        claims = self._p2p_receiving.get(peer)
        posted = claims.popleft() if payload is not None and claims else None
        if posted is None:  # the recv may have been posted while the payload streamed in
            posted = self._claim_p2p(peer, frame.gid, frame.tag, 0 if payload is None else payload.nbytes)
        if posted is None:
            self._p2p_stash.append((peer, frame.gid, frame.tag, payload))
            return
        if posted.fut.done():
            return
        if posted.error is not None:
            posted.fut.set_exception(posted.error)
            return
        if payload is not None and payload.obj is not posted.out.obj:
            posted.out[:] = payload
            self.stats.copied_bytes += payload.nbytes
        posted.fut.set_result(peer)

    # -- shared memory ---------------------------------------------------------------------
    async def open_shm(self, timeout: float) -> None:
        """Set up shared memory with the peers on this host, waiting at most ``timeout``.

        Peers elsewhere (or that cannot map our segment) stay on TCP only. ``self.shm`` must be
        in place before the mesh connects: a faster peer's hello may come first.
        """
        assert self.mesh is not None
        if not self.shm.allowed:
            return
        self._shm_settled = asyncio.get_running_loop().create_future()
        try:
            for peer in sorted(self.mesh.conns):
                self.mesh_send(peer, frames.ShmHello(self.shm.host))
            self._check_shm_settled()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await self._shm_settled
        finally:
            self._shm_settled = None
            self.shm.abandon_unanswered()  # no answer in time (or init was cancelled): TCP only

    def _check_shm_settled(self) -> None:
        done, mesh = self._shm_settled, self.mesh
        if done is None or done.done() or mesh is None:
            return
        if all(p in self.shm.settled for p in mesh.conns):
            done.set_result(None)

    def _on_shm(self, peer: int, frame: frames.Frame) -> None:
        try:
            if isinstance(frame, frames.ShmHello):
                try:
                    offer = self.shm.on_hello(peer, frame.host)
                except shm.ShmUnavailable as exc:
                    log.info("rank %d: no shared memory for rank %d: %s", self.rank, peer, exc)
                else:
                    if offer is not None:
                        self.mesh_send(peer, frames.ShmOffer(*offer))
            elif isinstance(frame, frames.ShmOffer):
                accepted, why = self.shm.on_offer(peer, frame.path, frame.size, frame.cookie)
                self.mesh_send(peer, frames.ShmAnswer(accepted, why))
            elif isinstance(frame, frames.ShmAnswer):
                if not self.shm.on_answer(peer, frame.accepted):
                    log.info("rank %d: rank %d takes no shared memory: %s", self.rank, peer, frame.why)
            elif isinstance(frame, frames.ShmFree):
                self.shm.on_free(peer, frame.offsets)
        except ValueError as exc:
            raise ProtocolError(f"bad shared-memory frame from rank {peer}: {exc}") from None
        self._check_shm_settled()

    def free_shm(self, peer: int, lease: int) -> None:
        """Let ``peer`` reuse the range at ``lease`` of its segment (batched: one frame per
        peer per loop turn)."""
        if self.shm.free(peer, lease) and self._shm_flush is None:
            self._shm_flush = asyncio.get_running_loop().call_soon(self._flush_frees)

    def _flush_frees(self) -> None:
        self._shm_flush = None
        for peer, offsets in self.shm.take_frees():
            self.mesh_send(peer, frames.ShmFree(offsets))

    def drop_stashes(self, keys: list[tuple[Any, ...]]) -> None:
        """Forget frames that came for receives that will never be posted."""
        for key in keys:
            slot = self._mail.get(key)
            if slot is not None and slot.fut is None:
                del self._mail[key]
                _give(slot.give_back)

    def mesh_send(self, peer: int, frame: frames.Frame) -> None:
        """Send a control frame to ``peer`` if it is still connected."""
        if self.mesh is not None and peer in self.mesh.conns:
            with contextlib.suppress(ConnectionError):
                self.mesh.send(peer, frame)

    # -- point to point --------------------------------------------------------------------
    def post_p2p(self, src: int | None, gid: int, tag: int, out: memoryview) -> asyncio.Future[int]:
        fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        for i, (sender, g, t, data) in enumerate(self._p2p_stash):
            if g == gid and t == tag and src in (None, sender):
                del self._p2p_stash[i]
                size = 0 if data is None else data.nbytes
                if size != out.nbytes:
                    fut.set_exception(
                        CollectiveMismatchError(
                            f"recv of {out.nbytes} bytes from rank {sender} got a send of {size}"
                        )
                    )
                else:
                    if data is not None:
                        out[:] = data
                        self.stats.copied_bytes += size
                    fut.set_result(sender)
                return fut
        if src is not None and src in self.dead:
            fut.set_exception(RankFailedError(src, "recv", self.dead[src]))
            return fut
        self._p2p_posted.append(_P2PRecv(src, gid, tag, out, fut))
        return fut

    async def send_p2p(self, dst: int, gid: int, tag: int, fp: str, raw: memoryview, timeout: float) -> None:
        """Send one point-to-point message and wait until its bytes are in the kernel."""
        conn = self.mesh.conns.get(dst) if self.mesh is not None else None
        if conn is None or not conn.is_open or dst in self.dead:
            raise RankFailedError(dst, "send", self.dead.get(dst, "no connection"))
        try:
            conn.send(frames.encode(frames.P2P(gid, tag, fp)), raw if raw.nbytes else None)
            async with asyncio.timeout(timeout):
                await conn.drain()
        except ConnectionError as exc:
            raise RankFailedError(dst, "send", f"connection lost ({exc})") from None
        except TimeoutError:
            raise CollectiveTimeoutError("send", timeout, [dst]) from None

    async def recv_p2p(
        self, src: int | None, gid: int, tag: int, out: memoryview, timeout: float, others: list[int]
    ) -> int:
        """Receive one point-to-point message into ``out``; return its sender."""
        fut = self.post_p2p(src, gid, tag, out)
        try:
            async with asyncio.timeout(timeout):
                return await fut
        except TimeoutError:
            raise CollectiveTimeoutError("recv", timeout, others) from None
        finally:
            self.cancel_p2p(fut)  # a recv that timed out or was cancelled must not eat a message

    def say_goodbye(self) -> None:
        """Tell every peer this rank leaves, and which ranks it saw fail."""
        if self.mesh is not None:
            for peer in list(self.mesh.conns):
                self.mesh_send(peer, frames.Bye(dict(self.failed)))

    def cancel_p2p(self, fut: asyncio.Future[int]) -> None:
        self._p2p_posted = [p for p in self._p2p_posted if p.fut is not fut]

    def fail_p2p(self, gid: int, exc: BaseException) -> None:
        """Wake every pending recv of group ``gid`` with ``exc``."""
        for posted in self._p2p_posted:
            if posted.gid == gid:
                _settle(posted.fut, exc)
        for claims in self._p2p_receiving.values():
            for claimed in claims:
                if claimed is not None and claimed.gid == gid:
                    _settle(claimed.fut, exc)

    # -- failures --------------------------------------------------------------------------
    def peer_lost(self, peer: int, reason: str, *, left: bool = False) -> None:
        """``peer`` died, left or was declared failed: fail everything that depends on it."""
        if peer in self.dead or peer == self.rank or self.closed:
            return
        self.dead[peer] = reason
        self.shm.drop(peer)
        self._check_shm_settled()
        if not left:
            self.failed[peer] = reason
        (log.info if left else log.warning)("rank %d: peer rank %d %s", self.rank, peer, reason)
        for group in list(self.groups.values()):
            if peer in group.ranks:
                for op in list(group.active.values()):
                    # A rank that left said goodbye after its last frame: only what we still
                    # expect from it is lost. A rank that died may hold up anyone: fail all.
                    if not left or op.expects_from(peer):
                        op.fail(RankFailedError(peer, op.name, reason))
        for posted in self._p2p_posted:
            if posted.src == peer:
                _settle(posted.fut, RankFailedError(peer, "recv", reason))
        for claimed in self._p2p_receiving.pop(peer, ()):
            if claimed is not None:
                _settle(claimed.fut, RankFailedError(peer, "recv", reason))

    async def progress(self, group: ProcessGroup, timeout: float) -> dict[int, int]:
        """Ask every live member of ``group`` how many of its collectives it has started."""
        assert self.mesh is not None
        peers = [g for g in group.ranks if g != self.rank and g in self.mesh.conns]
        qid = next(self._qids)
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        answers: dict[int, int] = {}
        self._queries[qid] = (answers, done, len(peers))
        try:
            for peer in peers:
                with contextlib.suppress(ConnectionError):
                    self.mesh.send(peer, frames.Query(group.gid, qid))
            if peers:
                try:
                    async with asyncio.timeout(timeout):
                        await done
                except TimeoutError:
                    pass
            return dict(answers)
        finally:
            del self._queries[qid]


@dataclass
class _Trivial:
    """The ``Comm`` of a one-rank group: nothing to send."""

    rank: int = 0
    size: int = 1


class Op:
    """One collective in flight: the ``Comm`` its algorithm runs over."""

    def __init__(self, group: ProcessGroup, seq: int, name: str, fp: str) -> None:
        self.group = group
        self.world = group.world
        self.seq = seq
        self.name = name
        self.fp = fp
        self.rank = group.rank
        self.size = group.size
        self.error: BaseException | None = None
        self.keys: list[tuple[Any, ...]] = []
        self._held: dict[int, Callable[[], None]] = {}  # id(view) -> how to give it back
        self._waiting: set[asyncio.Future[Any]] = set()  # what fail() must wake
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def fail(self, exc: BaseException) -> None:
        if self.error is not None:
            return
        self.error = exc
        waiting, self._waiting = self._waiting, set()
        for fut in waiting:
            _settle(fut, exc)

    def _wait_on(self, fut: asyncio.Future[Any]) -> None:
        self._waiting.add(fut)
        fut.add_done_callback(self._waiting.discard)  # done ones (and their buffers) let go

    def expects_from(self, peer: int) -> bool:
        """True if this op still waits for a frame from global rank ``peer``."""
        mail = self.world._mail
        for key in self.keys:
            if key[0] == peer:
                slot = mail.get(key)
                if slot is not None and slot.fut is not None and not slot.fut.done():
                    return True
        return False

    def _check(self) -> None:
        if self.error is not None:
            raise self.error

    def _conn(self, peer: int) -> Any:
        world = self.world
        target = self.group.ranks[peer]
        assert world.mesh is not None
        conn = world.mesh.conns.get(target)
        if conn is None or not conn.is_open or target in world.dead:
            reason = world.dead.get(target, "no connection")
            exc = RankFailedError(target, self.name, reason)
            self.fail(exc)
            raise exc
        return conn

    def hold(self, view: memoryview, give_back: Callable[[], None]) -> None:
        """``view`` is borrowed (a peer's shared memory, a pooled buffer): give it back on
        ``release`` or when the op ends."""
        self._held[id(view)] = give_back

    def release(self, buffer: memoryview) -> None:
        _give(self._held.pop(id(buffer), None))

    def release_all(self) -> None:
        """Give back what this op still borrows (it has ended)."""
        held, self._held = self._held, {}
        for give_back in held.values():
            give_back()

    def _send_shm(self, target: int, conn: Any, tag: int, raw: memoryview) -> bool:
        """Copy ``raw`` into our segment for ``target`` and send where it lies; False if there
        is no segment or no room in it now (the caller sends it inline instead)."""
        channels = self.world.shm
        if not channels.carries(target, raw.nbytes):
            return False
        room = channels.reserve(target, raw.nbytes)
        if room is None:
            self.world.stats.shm_full += 1
            return False
        offset, dest = room
        dest[:] = raw if raw.ndim == 1 else raw.cast("B")
        frame = frames.ShmData(self.group.gid, self.seq, tag, 0, self.fp, offset, raw.nbytes)
        conn.send(frames.encode(frame))
        return True

    def send(self, peer: int, tag: int, data: Array) -> Awaitable[None] | None:
        self._check()
        conn = self._conn(peer)
        raw = byte_view(data)
        gid = self.group.gid
        if self._send_shm(self.group.ranks[peer], conn, tag, raw):
            return None  # copied: the caller may reuse ``data`` at once
        if raw.nbytes <= wire.MAX_SEGMENT:
            conn.send(frames.encode(frames.Data(gid, self.seq, tag, 0, self.fp)), raw if raw.nbytes else None)
        else:
            for seg, start in enumerate(range(0, raw.nbytes, wire.MAX_SEGMENT)):
                part = raw[start : start + wire.MAX_SEGMENT]
                conn.send(frames.encode(frames.Data(gid, self.seq, tag, seg, self.fp)), part)
        fut: asyncio.Future[None] | None = conn.drain_future()
        if fut is not None:
            self._wait_on(fut)
        return fut

    def _slot(self, peer: int, tag: int, seg: int) -> tuple[tuple[Any, ...], _Slot | None]:
        key = (self.group.ranks[peer], self.group.gid, self.seq, tag, seg)
        slot = self.world._mail.get(key)
        if slot is not None and slot.data is not None and slot.fp != self.fp:
            self.group.mismatch(self.seq, self.fp, slot.fp, key[0])
            self._check()
        return key, slot

    def _wait_slot(self, key: tuple[Any, ...], out: memoryview | None) -> asyncio.Future[Any]:
        slot = _Slot()
        slot.out = out
        slot.fp = self.fp
        slot.fut = fut = asyncio.get_running_loop().create_future()
        self.world._mail[key] = slot
        self.keys.append(key)
        self._wait_on(fut)
        target = key[0]
        if target in self.world.dead:
            self.fail(RankFailedError(target, self.name, self.world.dead[target]))
        return fut

    def recv_into(self, peer: int, tag: int, out: Array) -> Awaitable[None]:
        self._check()
        raw = byte_view(out)
        parts = [raw[i : i + wire.MAX_SEGMENT] for i in range(0, raw.nbytes, wire.MAX_SEGMENT)]
        futs: list[asyncio.Future[Any]] = []
        for seg, part in enumerate(parts or [raw]):
            key, slot = self._slot(peer, tag, seg)
            if slot is not None and slot.data is not None:  # it came before we asked
                del self.world._mail[key]
                try:
                    if slot.data.nbytes != part.nbytes:
                        theirs = f"{slot.data.nbytes} bytes"
                        self.group.mismatch(self.seq, f"{self.fp} ({part.nbytes} bytes)", theirs, key[0])
                        self._check()
                    if part.nbytes:
                        part[:] = slot.data
                        if not slot.shared:  # (out of shared memory it is the transfer's one copy)
                            self.world.stats.copied_bytes += part.nbytes
                            self.world.stats.copied_messages += 1
                finally:
                    _give(slot.give_back)
                continue
            futs.append(self._wait_slot(key, part))
        if not futs:
            return _done()
        return futs[0] if len(futs) == 1 else _gather(futs)

    def scratch(self, nbytes: int) -> Array:
        return self.world.pool.take(nbytes)

    def recycle(self, buffer: Array) -> None:
        self.world.pool.give(buffer)

    def recv_any(self, peer: int, tag: int, scratch: Array | None = None) -> Awaitable[memoryview]:
        self._check()
        key, slot = self._slot(peer, tag, 0)
        if slot is not None and slot.data is not None:
            del self.world._mail[key]
            if slot.give_back is not None:
                self.hold(slot.data, slot.give_back)
            return _done(slot.data)
        if scratch is None or scratch.nbytes > wire.MAX_SEGMENT:
            return self._wait_slot(key, None)
        fut = self._wait_slot(key, byte_view(scratch))
        self.world._mail[key].any = True
        return fut


async def _gather(futs: list[asyncio.Future[Any]]) -> None:
    await asyncio.gather(*futs)


def _done(value: Any = None) -> asyncio.Future[Any]:
    fut = asyncio.get_running_loop().create_future()
    fut.set_result(value)
    return fut


class GroupMember:
    """Markers shared with torch: a rank outside a group gets ``NON_GROUP_MEMBER``."""

    WORLD: ProcessGroup | None = None
    NON_GROUP_MEMBER = object()


@dataclass(eq=False)
class ProcessGroup:
    """A set of ranks of one world that run collectives together."""

    world: World
    gid: int
    ranks: list[int]
    timeout: float
    active: dict[int, Op] = field(default_factory=dict)
    next_seq: int = 0
    closing: bool = False
    destroyed: bool = False
    early_fps: dict[int, tuple[int, str]] = field(default_factory=dict)
    early_keys: dict[int, list[tuple[Any, ...]]] = field(default_factory=dict)
    poisoned: dict[int, str] = field(default_factory=dict)

    @property
    def rank(self) -> int:
        return self.ranks.index(self.world.rank)

    @property
    def size(self) -> int:
        return len(self.ranks)

    def group_rank(self, global_rank: int, what: str = "rank") -> int:
        try:
            return self.ranks.index(global_rank)
        except ValueError:
            raise ValueError(f"{what} {global_rank} is not in this group (ranks {self.ranks})") from None

    def check_usable(self, name: str = "this group") -> None:
        """Raise if collective ``name`` cannot start: the group is destroyed or a member failed."""
        if self.destroyed:
            raise NotInitializedError(
                "this process group was destroyed; call init_process_group() (or new_group()) again"
            )
        if self.closing:
            raise GroupDestroyedError("the process group is being destroyed")
        for peer in self.ranks:  # (a peer that left cleanly may have sent all we still need)
            if peer in self.world.failed:
                raise RankFailedError(peer, name, self.world.failed[peer])

    async def run(
        self, name: str, fp: str, body: Callable[[Any], Awaitable[T]], timeout: float | None = None
    ) -> T:
        """Run ``body(op)`` as the group's next collective, under its deadline."""
        self.check_usable(name)
        seq = self.next_seq
        self.next_seq += 1
        if self.size == 1:
            return await body(_Trivial())
        op = Op(self, seq, name, fp)
        self.active[seq] = op
        op.keys.extend(self.early_keys.pop(seq, ()))
        early = self.early_fps.pop(seq, None)
        if early is not None and early[1] != fp:
            self.mismatch(seq, fp, early[1], early[0])
        reason = self.poisoned.pop(seq, None)
        if reason is not None:
            op.fail(CollectiveMismatchError(reason))
        loop = asyncio.get_running_loop()
        limit = self.timeout if timeout is None else timeout
        timer = loop.call_later(limit, self._expire, op, limit)
        try:
            op._check()
            result = await body(op)
            op._check()
            return result
        except ArendezError as exc:
            op.fail(exc)
            raise
        except ConnectionError as exc:
            peer = self._first_dead_member()
            err = RankFailedError(peer, name, f"connection lost ({exc})")
            op.fail(err)
            raise err from None
        except BaseException as exc:
            op.fail(exc)
            raise
        finally:
            timer.cancel()
            del self.active[seq]
            mail = self.world._mail
            for key in op.keys:
                slot = mail.pop(key, None)
                if slot is not None:  # came, but was never taken
                    _give(slot.give_back)
            op.release_all()
            if not op.done.done():
                op.done.set_result(None)

    def _first_dead_member(self) -> int:
        """The member whose loss most likely broke a connection (-1 if none is known dead)."""
        for peer in self.ranks:
            if peer in self.world.dead:
                return peer
        return -1

    def _expire(self, op: Op, limit: float) -> None:
        async def diagnose() -> None:
            progress = await self.world.progress(self, min(DIAGNOSE_SECONDS, limit))
            peers = [g for g in self.ranks if g != self.world.rank]
            missing = [g for g in peers if g in progress and progress[g] <= op.seq]
            silent = [g for g in peers if g not in progress]
            op.fail(CollectiveTimeoutError(f"{op.name} (seq {op.seq})", limit, missing, silent))

        if op.error is None and op.seq in self.active:
            task = asyncio.get_running_loop().create_task(diagnose())
            op.done.add_done_callback(lambda _: task.cancel())

    def mismatch(self, seq: int, mine: str, theirs: str, peer: int) -> None:
        """Fail collective ``seq`` here and tell every other member why."""
        message = f"collective #{seq}: this rank runs {mine}, rank {peer} runs {theirs}"
        self.poison(seq, message, tell=True)

    def poison(self, seq: int, message: str, *, tell: bool) -> None:
        op = self.active.get(seq)
        if op is not None:
            if op.error is not None:
                return
            op.fail(CollectiveMismatchError(message))
        elif seq >= self.next_seq:
            if seq in self.poisoned:
                return
            self.poisoned[seq] = message
        else:
            return
        mesh = self.world.mesh
        if tell and mesh is not None:
            for peer in self.ranks:
                if peer != self.world.rank and peer in mesh.conns:
                    with contextlib.suppress(ConnectionError):
                        mesh.send(peer, frames.Mismatch(self.gid, seq, message))

    async def drain(self, timeout: float) -> None:
        """Mark closing, let in-flight collectives finish within ``timeout``, fail the rest."""
        self.closing = True
        pending = [op.done for op in self.active.values()]
        if pending:
            await asyncio.wait(pending, timeout=timeout)
        leftovers = list(self.active.values())
        for op in leftovers:
            op.fail(GroupDestroyedError(f"{op.name} cancelled: the process group was destroyed"))
        self.world.fail_p2p(self.gid, GroupDestroyedError("recv cancelled: the process group was destroyed"))
        if leftovers:  # their awaiters wake on the next loop turns
            await asyncio.wait([op.done for op in leftovers], timeout=0.5)
        for keys in self.early_keys.values():  # frames of collectives this rank never started
            self.world.drop_stashes(keys)
        self.early_keys.clear()
        self.destroyed = True
