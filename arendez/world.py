"""A world: what one ``init_process_group`` built. Peers, liveness, and routing frames to groups.

Frames from the mesh arrive here (``sink`` picks where a payload lands, ``route`` handles the
completed frame) and go to the job that owns them: collective data to the ``Mailbox`` and the
group's running ``Op``, point-to-point messages to the ``P2PMatcher``, shared-memory control to
``ShmControl``, progress queries to ``Progress``. A lost peer fans out from ``peer_lost`` to
everything that waits on it (``arendez.losses``, the world's base).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Callable
from typing import Any, cast

from . import frames, linkwatch, shm, stall, wire
from .algorithms import Chooser
from .errors import (
    ArendezError,
    CollectiveCancelledError,
    CollectiveMismatchError,
    CollectiveTimeoutError,
    ProtocolError,
    RankFailedError,
)
from .flightrec import Recorder
from .group import ProcessGroup
from .loopcpu import Spin
from .losses import PeerLosses
from .mailbox import BufferPool, Key, Mailbox, Outcome, Stats, give
from .p2pmatch import P2PMatcher
from .progress import Progress
from .shmlink import ShmControl
from .transports import Links

log = logging.getLogger("arendez.world")


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:  # (unit tests build worlds outside any loop)
        return None


Array = Any

#: Payloads at least this large that arrive before their receive land in pooled buffers.
POOLED_EARLY_BYTES = 64 * 1024


class World(PeerLosses):
    """One initialised process group world: rank, store, mesh and groups."""

    def __init__(self, rank: int, world_size: int, timeout: float) -> None:
        self.rank = rank
        self.world_size = world_size
        self.timeout = timeout
        #: the event loop the world runs on (its links, timers and collectives): the caller's for
        #: the async API, the loop thread for ``arendez.sync`` and the torch backend
        self.loop = _running_loop()
        self.mesh: Links | None = None  # the peer links (tcp mesh or in-process)
        self.store: Any = None
        self.server: Any = None  # the embedded server this rank hosts, if any
        self.address = ""  # host:port of this rank's peer listener
        self.groups: dict[int, ProcessGroup] = {}
        self.next_gid = 0
        self.dead: dict[int, str] = {}  # ranks gone for good, with why
        self.failed: dict[int, str] = {}  # the subset that died rather than left
        #: Why this rank's process is ending, if by a failure (an uncaught exception): its
        #: goodbye then names it as failed, with this reason, rather than as a clean leave.
        self.ending: str | None = None
        self.expulsion: str | None = None  # why the others count this rank as failed, if they do
        self.stats = Stats()
        self.chooser = Chooser()  # (reads ARENDEZ_ALGORITHM and the link variables now, once)
        self.mail = Mailbox(self.stats)
        self.p2p = P2PMatcher(self.stats)
        self.progress = Progress(self.send_control)
        self.pool = BufferPool()
        self._pooled: dict[int, Array] = {}  # pool buffers early payloads are arriving in
        self._draining: dict[int, list[asyncio.Future[None]]] = {}  # p2p sends waiting, by peer
        # MISMATCH / CANCEL for groups not made yet, by gid and seq
        self._early_poison: dict[int, dict[int, ArendezError]] = {}
        self._early_mail: dict[int, dict[int, list[Key]]] = {}  # DATA for them, by seq
        self._pending_gids: set[int] = set()
        self.shm_control = ShmControl(rank, shm.Channels(allowed=False), self.send_control)
        #: Whether the round said every rank is on this machine (shared memory on everywhere):
        #: the link kind all ranks agree on. None: not known (in-process worlds: by the hellos).
        self.one_machine: bool | None = None
        self.closed = False
        self._peers_gone = asyncio.Event()
        if world_size == 1:
            self._peers_gone.set()
        self.flight = Recorder(self)  # the last collectives, for dumps (arendez.flightrec)
        #: How long the loop polls for an awaited collective's messages (``arendez.loopcpu``;
        #: set by init for a world in the caller's own loop)
        self.spin = Spin()
        self._doubted: dict[int, str] = {}  # lost links seen just after a stall, not blamed yet
        self._hearing: asyncio.Task[None] | None = None
        self._settling: asyncio.Task[None] | None = None
        try:
            self.stall: stall.StallWatch | None = stall.watch_for(asyncio.get_running_loop())
            self.stall.watch(self)
            linkwatch.watch(self, asyncio.get_running_loop())
        except RuntimeError:  # (built outside a loop: tests)
            self.stall = None
        self.groups[0] = ProcessGroup(self, 0, range(world_size), timeout)
        self.flight.groups[0] = self.groups[0].ranks
        self.next_gid = 1

    @property
    def shm(self) -> shm.Channels:
        """This rank's shared-memory segments (off until init enables them)."""
        return self.shm_control.channels

    @shm.setter
    def shm(self, channels: shm.Channels) -> None:
        self.shm_control.channels = channels

    # -- groups ----------------------------------------------------------------------------
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
                self.mail.drop(keys)
            return None
        group = self.groups[gid] = ProcessGroup(self, gid, ranks, timeout)
        self.flight.groups[gid] = ranks
        group.poisoned.update(self._early_poison.pop(gid, {}))
        group.early_keys.update(early)
        return group

    # -- sending ---------------------------------------------------------------------------
    def connection(self, peer: int) -> Any:
        """The open link to ``peer``, dialing it on first use; None if it is gone."""
        if self.mesh is None or peer in self.dead:
            return None
        conn = self.mesh.link(peer)
        if conn is None or not conn.is_open:
            return None
        return conn

    def why_gone(self, peer: int) -> str:
        """Why there is no link to ``peer``: its recorded death, else what closed its connection
        (a close whose news has not been handled yet), else "no connection"."""
        found = self.dead.get(peer)
        if found is not None:
            return found
        conn = self.mesh.conns.get(peer) if self.mesh is not None else None
        error = getattr(conn, "error", None)
        if error is not None:
            return f"connection lost ({error})"
        if conn is not None and not conn.is_open:
            return "connection lost (closed)"
        return "no connection"

    def send_control(self, peer: int, frame: frames.Frame, *, dial: bool = False) -> bool:
        """Send a control frame to ``peer`` if it is connected (or, with ``dial``, after
        connecting to it); True if it went out (or is queued to)."""
        if self.mesh is None:
            return False
        try:
            if dial:
                link = self.connection(peer)
                if link is None:
                    return False
                link.send(frames.encode(frame))
            elif peer in self.mesh.conns:
                self.mesh.send(peer, frame)
            else:
                return False
        except ConnectionError:
            return False
        return True

    def on_connected(self, peer: int) -> None:
        """A connection to ``peer`` is up (dialed or accepted): offer it shared memory."""
        self.stats.connections += 1
        if self.mesh is not None and self.mesh.is_local(peer):
            self.stats.local_connections += 1
        self.shm_control.hello(peer)

    async def send_p2p(self, dst: int, gid: int, tag: int, fp: str, raw: memoryview, timeout: float) -> None:
        """Send one point-to-point message and wait until its bytes are in the kernel."""
        conn = self.connection(dst)
        if conn is None:
            raise await self.blame(dst, "send", self.why_gone(dst))
        try:
            conn.send(frames.encode(frames.P2P(gid, tag, fp)), raw if raw.nbytes else None)
            drained = conn.drain_future()
            if drained is None:
                return
            # (a stopped peer never reads: its failure, declared by the server, ends the wait)
            waiting = self._draining.setdefault(dst, [])
            waiting.append(drained)
            try:
                async with asyncio.timeout(timeout):
                    await drained
            finally:
                with contextlib.suppress(ValueError):
                    waiting.remove(drained)
                if not waiting and self._draining.get(dst) is waiting:
                    del self._draining[dst]
            if not conn.is_open:
                raise ConnectionResetError(f"connection to rank {dst} is closed") from conn.error
        except ConnectionError as exc:
            raise await self.blame(dst, "send", f"connection lost ({exc})") from None
        except TimeoutError:
            raise CollectiveTimeoutError("send", timeout, [dst]) from None

    async def recv_p2p(
        self,
        src: int | None,
        gid: int,
        tag: int,
        out: memoryview,
        timeout: float,
        others: list[int],
        expect: str | None = None,
    ) -> int:
        """Receive one point-to-point message into ``out`` (one whose fingerprint is ``expect``,
        if given); return its sender."""
        fut = self.p2p.post(src, gid, tag, out, self.dead, expect)
        if src is not None:
            self.connection(src)  # connect on first use: its loss is seen while we wait
        try:
            async with asyncio.timeout(timeout):
                return await fut
        except RankFailedError as exc:
            if self.expulsion is not None and exc.rank != self.rank:  # (the peer left without us)
                raise RankFailedError(self.rank, "recv", self.expulsion) from None
            raise
        except TimeoutError:
            raise CollectiveTimeoutError("recv", timeout, others) from None
        finally:
            self.p2p.cancel(fut)
            if not fut.done() or fut.cancelled() or fut.exception() is not None:
                # given up (timeout, cancel): a message streaming into ``out`` lands elsewhere
                # and is left for the next recv, as one that had not started to arrive
                pick = lambda h, dest: isinstance(h, frames.P2P) and dest.obj is out.obj  # noqa: E731
                for peer in self.divert(pick, keep=True):
                    self.p2p.unclaim(peer, fut)

    def divert(self, should: Callable[[Any, memoryview], bool], *, keep: bool = False) -> list[int]:
        """A receive gave up: the payload now arriving on any link whose header and buffer
        ``should`` picks no longer lands in that buffer (``wire.Decoder.divert``); return the
        peers whose payload was diverted."""
        peers: list[int] = []
        if self.mesh is None:
            return peers
        for peer, conn in list(self.mesh.conns.items()):
            landing = conn.divert(should, keep=keep)
            if landing is not None:
                peers.append(peer)
                pooled = self._pooled.pop(id(landing.obj), None)  # a pool buffer goes back
                if pooled is not None:
                    self.pool.give(pooled)
        return peers

    def say_goodbye(self, done: dict[int, int] | None = None) -> None:
        """Tell every peer this rank leaves, and which ranks it saw fail (itself last, if its
        process is ending by a failure: ``ending``; then ``done``, by group, the first
        collective it had not done its part of: ``finished``)."""
        if self.mesh is not None:
            failed = dict(self.failed)
            if self.ending is not None:
                failed[self.rank] = self.ending
            for peer in list(self.mesh.conns):
                self.send_control(peer, frames.Bye(failed, done or {}))

    def busy(self) -> bool:
        """Whether a collective or a point-to-point call is in progress here."""
        # (``_draining`` holds a peer's entry only while one of its sends waits)
        return bool(self._draining) or self.p2p.waiting() or any(g.active for g in self.groups.values())

    def finished(self) -> dict[int, int]:
        """By group id, the first collective this rank has not done its part of (those before
        it are done here: a peer's copy of one of them needs nothing more from this rank)."""
        return {gid: min(g.active, default=g.next_seq) for gid, g in self.groups.items()}

    async def open_shm(self, timeout: float) -> None:
        """Wait (at most ``timeout``) until the shared-memory links with the peers connected
        now are settled; later connections set theirs up as they open."""
        if self.mesh is not None:
            await self.shm_control.open(list(self.mesh.conns), timeout)

    # -- frames from the mesh --------------------------------------------------------------
    def sink(self, peer: int, frame: frames.Frame, nbytes: int) -> memoryview | wire.Stream | None:
        """Where the ``nbytes`` payload of ``frame`` should land, or the stream that consumes it
        (``Op.recv_reduce``); None: a fresh buffer."""
        if isinstance(frame, frames.Data):
            key = (peer, frame.gid, frame.seq, frame.tag, frame.seg)
            out = self.mail.destination(key, frame.fp, nbytes)
            if out is not None:
                return out  # (a mismatched frame goes to a throwaway buffer instead)
            if nbytes >= POOLED_EARLY_BYTES:  # early: a reused buffer (fresh pages fault)
                buffer = self.pool.take(nbytes)
                self._pooled[id(buffer)] = buffer
                return memoryview(cast(Any, buffer))
        elif isinstance(frame, frames.P2P):
            return self.p2p.sink(peer, frame.gid, frame.tag, nbytes, frame.fp)
        return None

    def route(self, peer: int, frame: frames.Frame, payload: memoryview | None) -> None:
        """Handle one complete frame from ``peer``."""
        if payload is not None:
            self.stats.received_bytes += payload.nbytes
        if isinstance(frame, frames.Data | frames.ShmData):
            self._on_data(peer, frame, payload)
        elif isinstance(frame, frames.P2P):
            self.p2p.deliver(peer, frame.gid, frame.tag, payload, frame.fp)
        elif isinstance(frame, frames.Mismatch):
            group = self.groups.get(frame.gid)
            if group is not None and group.disowned(frame.seq, f"rank {peer} refused it ({frame.message})"):
                return
            self._fail_seq(frame.gid, frame.seq, CollectiveMismatchError(frame.message))
        elif isinstance(frame, frames.Cancel):  # (one too late for a call done here changes nothing)
            self._fail_seq(frame.gid, frame.seq, CollectiveCancelledError(peer, frame.collective, frame.seq))
        elif isinstance(frame, frames.TimedOut):
            group = self.groups.get(frame.gid)
            if group is not None and group.times_out_soon(frame.seq):
                return  # (it waited as long: its own timeout, due now, names the late ranks)
            if group is not None and group.split(frame.seq, peer, frame.collective, frame.ms / 1000):
                return
            why = f"timed out after {frame.ms / 1000:g}s in"
            self._fail_seq(
                frame.gid, frame.seq, CollectiveCancelledError(peer, frame.collective, frame.seq, why)
            )
        elif isinstance(frame, frames.Bye):
            # the leaver tells us who it saw die: blame the root cause, not the messenger
            # (it names itself when its process ended without destroy_process_group)
            for rank, reason in frame.failed.items():
                if rank == peer:  # it ends by a failure, saying so after its last frame
                    self.peer_lost(rank, reason, done=frame.started)
                elif rank == self.rank:  # it went on without us: say so, do not blame it
                    self.expelled(f"rank {peer} saw this rank fail: {reason}")
                else:
                    self.peer_lost(rank, f"{reason} (reported by rank {peer})")
            self.peer_lost(peer, "it left: it destroyed its process group, or its process ended", left=True)
        elif isinstance(frame, frames.Query):
            if not self.closed:  # (a rank that is leaving has no progress to report: silence)
                group = self.groups.get(frame.gid)
                started = group.next_seq if group is not None else -1  # -1: not made (yet)
                self.send_control(peer, frames.Answer(frame.qid, started))
        elif isinstance(frame, frames.Answer):
            self.progress.on_answer(peer, frame)
        elif isinstance(frame, frames.Error):
            self.peer_lost(peer, f"it reported {frame.exception()!r}")
        elif peer not in self.dead:  # shared-memory control (a dead peer's link is already gone)
            self.shm_control.on_frame(peer, frame)

    def _fail_seq(self, gid: int, seq: int, exc: ArendezError) -> None:
        """A peer says collective ``seq`` of group ``gid`` failed (mismatch, cancel)."""
        group = self.groups.get(gid)
        if group is not None:
            group.fail_seq(seq, exc)
        elif (gid >= self.next_gid or gid in self._pending_gids) and len(self._early_poison) < 1024:
            self._early_poison.setdefault(gid, {}).setdefault(seq, exc)  # made later: add_group

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
            give_back = functools.partial(self.shm_control.free, peer, frame.offset)
            self.stats.received_bytes += payload.nbytes
            self.stats.shm_bytes += payload.nbytes
        elif payload is not None and id(payload.obj) in self._pooled:  # came before its receive
            give_back = functools.partial(self.pool.give, self._pooled.pop(id(payload.obj)))
        key = (peer, gid, seq, frame.tag, frame.seg)
        group = self.groups.get(gid)
        op = None
        if group is not None:
            op = group.active.get(seq)
            if op is None and seq < group.next_seq:
                return give(give_back)  # a late frame of a collective that already ended
            if op is not None and op.fp != fp:
                group.mismatch(seq, op.fp, fp, peer)
                return give(give_back)
            if op is None:
                group.early_fps.setdefault(seq, (peer, fp))
        elif gid < self.next_gid and gid not in self._pending_gids:
            return give(give_back)  # a group this rank destroyed or is not a member of
        outcome = self.mail.deliver(
            key, fp, payload, give_back, shared=shared, hold=op.hold if op is not None else None
        )
        if outcome is Outcome.STASHED:
            if op is not None:
                op.keys.append(key)
            elif group is not None:
                group.early_keys.setdefault(seq, []).append(key)
            else:  # a subgroup this rank has not made yet: add_group hands these over
                self._early_mail.setdefault(gid, {}).setdefault(seq, []).append(key)
