"""Shared-memory payloads between ranks on one host.

TCP over loopback copies every byte twice inside the kernel and pays the socket stack on top.
When two ranks can map the same file (same host, same ``/dev/shm``, same user), the sender
instead copies a collective's payload once into a segment it owns, and the TCP frame carries
only where it lies; the receiver reduces straight from the segment (or copies it into place)
and tells the sender, in a batched ``FREE`` frame, which ranges it may reuse. The TCP stream
stays the control channel, so ordering, matching and failure detection are unchanged.

A link is set up in three messages. Each rank first tells every peer its *host key* (boot id
and the identity of its shared-memory directory); only peers with the same key go on. The sender
then creates a file, reserves its pages, writes a random cookie into it and offers
``(path, size, cookie)``. The receiver maps the path read-only and checks the cookie, which
proves both see the same file, and answers; both unlink the file at once, so nothing outlives the
processes.

Nothing here does I/O on the network: ``RingSpace`` is the sender's allocator, ``Segment`` one
mapped file, and ``Channels`` one rank's links, which says what to send and leaves the sending to
its owner.
"""

from __future__ import annotations

import collections
import contextlib
import mmap
import os
import secrets
import socket
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .settings import env_int

#: Bytes of the segment a rank writes to one peer (``ARENDEZ_SHM_BYTES``).
SEGMENT_BYTES = env_int("ARENDEZ_SHM_BYTES", 8 << 20, minimum=4096)
#: Bytes of outbound segments one process may hold (``ARENDEZ_SHM_PROCESS_BYTES``; default 16
#: segments). Segments are real memory (their pages are reserved): past the budget, or when a
#: segment would leave the shared-memory directory nearly full, a pair uses sockets.
PROCESS_BYTES = env_int("ARENDEZ_SHM_PROCESS_BYTES", 16 * SEGMENT_BYTES, minimum=0)
#: Bytes a new segment leaves free in the shared-memory directory at least (capped at a quarter).
DIRECTORY_RESERVE = 1 << 30
#: Payloads smaller than this go inline in the TCP frame: for them a shared-memory round trip
#: saves nothing.
MIN_PAYLOAD = 64 * 1024
#: Allocations start on cache-line boundaries.
ALIGN = 64
COOKIE_BYTES = 16
#: A segment file older than this whose creator is gone was left by a crash mid-handshake.
STALE_SECONDS = 60.0
_PREFIX = "arendez-"


def enabled() -> bool:
    """Shared memory is on unless ``ARENDEZ_SHM=0`` (or the platform has no ``/dev/shm``)."""
    return os.environ.get("ARENDEZ_SHM", "1") != "0" and os.path.isdir(_directory())


def _directory() -> str:
    return os.path.realpath(os.environ.get("ARENDEZ_SHM_DIR", "/dev/shm"))


_held = 0  # bytes of the outbound segments this process holds


def _check_room(directory: str, nbytes: int) -> None:
    """``ShmUnavailable`` if ``nbytes`` more would pass this process's budget or leave the
    directory (a tmpfs: memory) with less than ``DIRECTORY_RESERVE`` (or a quarter) free."""
    if _held + nbytes > PROCESS_BYTES:
        raise ShmUnavailable(
            f"this process holds {_held >> 20} MiB of shared-memory segments; another would pass "
            f"its budget of {PROCESS_BYTES >> 20} MiB (ARENDEZ_SHM_PROCESS_BYTES; ARENDEZ_SHM_BYTES "
            "per peer): this pair uses sockets"
        )
    try:
        fs = os.statvfs(directory)
    except OSError:
        return  # (the reservation itself will tell)
    free, size = fs.f_bavail * fs.f_frsize, fs.f_blocks * fs.f_frsize
    reserve = min(size // 4, DIRECTORY_RESERVE)
    if free - nbytes < reserve:
        raise ShmUnavailable(
            f"{directory} has {free >> 20} MiB of {size >> 20} MiB free; arendez leaves "
            f"{reserve >> 20} MiB to others: this pair uses sockets"
        )


def host_key() -> str:
    """Equal on two ranks only if they can share memory: same boot, same shm directory."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = socket.gethostname()
    st = os.stat(_directory())
    return f"{boot}:{st.st_dev}:{st.st_ino}"


def sweep_stale() -> int:
    """Remove segment files that a process killed mid-handshake left behind; return how many."""
    removed = 0
    directory = _directory()
    with contextlib.suppress(OSError):
        for name in os.listdir(directory):
            pid = name[len(_PREFIX) :].split("-", 1)[0]
            if not name.startswith(_PREFIX) or not pid.isdigit():
                continue
            path = os.path.join(directory, name)
            try:
                st = os.stat(path, follow_symlinks=False)
                if st.st_uid != os.getuid() or time.time() - st.st_mtime < STALE_SECONDS:
                    continue
                os.kill(int(pid), 0)  # still alive (or not ours to signal): leave it
            except ProcessLookupError:
                with contextlib.suppress(OSError):
                    os.unlink(path)
                    removed += 1
            except OSError:
                continue
    return removed


class ShmUnavailable(OSError):
    """A segment could not be created or attached; the link stays on TCP."""


def _aligned(nbytes: int) -> int:
    """The bytes a range of ``nbytes`` takes in a ring (at least one, rounded up to ``ALIGN``)."""
    return -(-max(1, nbytes) // ALIGN) * ALIGN


class RingSpace:
    """First-in-first-out allocator of byte ranges in a ring of ``size`` bytes.

    Ranges are handed out in order and may be freed in any order; space is reclaimed from the
    oldest live range forward. ``alloc`` never waits: ``None`` means "no room now" and the
    caller sends the payload another way, so a full ring can never deadlock a collective.
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self._live: collections.deque[list[int]] = collections.deque()  # [offset, length, freed]
        self._by_offset: dict[int, list[int]] = {}
        self._head = 0  # where the next range starts

    @property
    def used(self) -> int:
        """Bytes between the oldest live range and the head (what is not free)."""
        if not self._live:
            return 0
        tail = self._live[0][0]
        return self._head - tail if self._head > tail else self.size - tail + self._head

    def fits(self, nbytes: int) -> bool:
        """True if ``nbytes`` fit the ring when it is empty."""
        return _aligned(nbytes) <= self.size

    def alloc(self, nbytes: int) -> int | None:
        """The offset of ``nbytes`` free bytes, or ``None`` if they do not fit now."""
        need = _aligned(nbytes)
        if need > self.size:
            return None
        if not self._live:
            self._head = 0
            start: int | None = 0
        else:
            tail = self._live[0][0]
            if self._head > tail:  # free space: [head, size) and [0, tail)
                start = self._head if self._head + need <= self.size else (0 if need <= tail else None)
            else:  # wrapped: free space is [head, tail)
                start = self._head if self._head + need <= tail else None
        if start is None:
            return None
        entry = [start, need, 0]
        self._live.append(entry)
        self._by_offset[start] = entry
        self._head = start + need
        return start

    def free(self, offset: int) -> None:
        """Give back the range that starts at ``offset`` (unknown offsets raise ``KeyError``)."""
        entry = self._by_offset.pop(offset)
        entry[2] = 1
        while self._live and self._live[0][2]:
            self._live.popleft()


@dataclass
class Segment:
    """One mapped shared-memory file."""

    path: str
    size: int
    cookie: bytes
    _map: mmap.mmap = field(repr=False)
    _unlinked: bool = False
    _reserved: int = 0  # bytes counted against this process's budget (our own segments)

    @property
    def buffer(self) -> memoryview:
        return memoryview(self._map)

    @classmethod
    def create(cls, size: int = SEGMENT_BYTES) -> Segment:
        """A new file of ``size`` usable bytes with its pages reserved (a full tmpfs fails here,
        not later with SIGBUS), mapped, with a fresh cookie in front."""
        directory = _directory()
        _check_room(directory, COOKIE_BYTES + size)
        try:
            fd, path = tempfile.mkstemp(prefix=f"{_PREFIX}{os.getpid()}-", dir=directory)
        except OSError as exc:
            raise ShmUnavailable(f"cannot create a segment in {directory}: {exc}") from None
        try:
            total = COOKIE_BYTES + size
            os.posix_fallocate(fd, 0, total)
            mapped = mmap.mmap(fd, total)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.unlink(path)
            raise ShmUnavailable(f"cannot reserve {size} bytes in {directory}: {exc}") from None
        finally:
            os.close(fd)
        cookie = secrets.token_bytes(COOKIE_BYTES)
        mapped[:COOKIE_BYTES] = cookie
        global _held
        _held += total
        return cls(path, size, cookie, mapped, _reserved=total)

    @classmethod
    def attach(cls, path: str, size: int, cookie: bytes) -> Segment:
        """Map the peer's segment read-only; it must be ours to open and carry ``cookie``."""
        name = os.path.basename(path)
        if not name.startswith(_PREFIX) or os.path.dirname(path) != _directory():
            raise ShmUnavailable(f"{path!r} is not a segment in {_directory()}")
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError as exc:
            raise ShmUnavailable(f"cannot open {path}: {exc.strerror}") from None
        try:
            if os.fstat(fd).st_size != COOKIE_BYTES + size:
                raise ShmUnavailable(f"{path} is not {size} bytes")
            mapped = mmap.mmap(fd, COOKIE_BYTES + size, prot=mmap.PROT_READ)  # the sender's to write
        except OSError as exc:
            raise ShmUnavailable(f"cannot map {path}: {exc}") from None
        finally:
            os.close(fd)
        if mapped[:COOKIE_BYTES] != cookie:
            mapped.close()
            raise ShmUnavailable(f"{path} belongs to someone else")
        return cls(path, size, cookie, mapped)

    def view(self, offset: int, nbytes: int) -> memoryview:
        """Bytes ``[offset, offset + nbytes)`` of the payload area, checked against its size."""
        if offset < 0 or nbytes < 0 or offset + nbytes > self.size:
            raise ValueError(f"range {offset}+{nbytes} outside a {self.size}-byte segment")
        start = COOKIE_BYTES + offset
        return self.buffer[start : start + nbytes]

    def unlink(self) -> None:
        """Remove the file (the mapping lives on until closed)."""
        if not self._unlinked:
            self._unlinked = True
            with contextlib.suppress(OSError):
                os.unlink(self.path)

    def close(self) -> None:
        """Unlink and unmap; views still alive keep the pages until they go."""
        global _held
        _held -= self._reserved
        self._reserved = 0
        self.unlink()
        with contextlib.suppress(BufferError):
            self._map.close()


@dataclass
class Link:
    """The shared-memory channel with one peer: our outbound segment (once the peer accepted
    it), the peer's inbound one, and what the peer may reuse but was not told yet."""

    outbound: Segment | None = None
    space: RingSpace | None = None
    ready: bool = False
    inbound: Segment | None = None
    to_free: list[int] = field(default_factory=list)
    #: sends waiting for room in our ring, first come first served (``Channels.wait_room``)
    waiting: collections.deque[Callable[[], bool]] = field(default_factory=collections.deque)

    def close(self) -> None:
        self.ready = False
        for segment in (self.outbound, self.inbound):
            if segment is not None:
                segment.close()


class Channels:
    """One rank's shared-memory links: the handshake, the sender's rings, the receiver's frees.

    Methods take what a peer sent and return what to send back (``None``: nothing); the owner
    moves the frames. A link's life: ``hello`` to every peer; ``on_hello`` from one on this host
    makes our offer; ``on_offer`` maps theirs and answers; ``on_answer`` makes ours ready.
    """

    def __init__(self, allowed: bool, size: int = SEGMENT_BYTES) -> None:
        self.allowed = allowed
        self.size = size
        self.links: dict[int, Link] = {}
        self.settled: set[int] = set()  # peers whose answer about our segment is in (or moot)
        #: peers that said hello from this host (both ends agree: the same keys, compared)
        self.same_host: set[int] = set()
        self.host = ""
        if allowed:
            try:
                self.host = host_key()
            except OSError:
                self.allowed = False
            else:
                sweep_stale()

    def _link(self, peer: int) -> Link:
        return self.links.setdefault(peer, Link())

    def on_hello(self, peer: int, key: Any) -> tuple[str, int, bytes] | None:
        """A peer's host key; returns our offer (path, size, cookie) if we can share memory."""
        if self.allowed and key == self.host:
            self.same_host.add(peer)
        if not self.allowed or key != self.host or self._link(peer).outbound is not None:
            self.settled.add(peer)
            return None
        try:
            segment = Segment.create(self.size)
        except ShmUnavailable:
            self.settled.add(peer)
            raise
        self._link(peer).outbound = segment
        return segment.path, segment.size, segment.cookie

    def on_offer(self, peer: int, path: Any, size: Any, cookie: Any) -> tuple[bool, str]:
        """A peer's segment: map it; returns the answer (accepted, why not)."""
        if not self.allowed:
            return False, "shared memory is off on this rank"
        link = self._link(peer)
        if link.inbound is not None:
            return False, "this link already has a segment"
        if not isinstance(path, str) or not isinstance(size, int) or not 0 < size <= 1 << 31:
            return False, "malformed offer"
        if not isinstance(cookie, bytes) or len(cookie) != COOKIE_BYTES:
            return False, "malformed offer"
        try:
            segment = Segment.attach(path, size, cookie)
        except ShmUnavailable as exc:
            return False, str(exc)
        segment.unlink()
        link.inbound = segment
        return True, ""

    def on_answer(self, peer: int, accepted: Any) -> bool:
        """The peer's answer to our offer; True if the link now carries payloads."""
        self.settled.add(peer)
        link = self.links.get(peer)
        if link is None or link.outbound is None or link.ready:
            return False
        link.outbound.unlink()
        if accepted is True:
            link.space = RingSpace(link.outbound.size)
            link.ready = True
            return True
        link.outbound.close()
        link.outbound = None
        return False

    def abandon_unanswered(self) -> None:
        """Close offers still waiting for an answer (init gave up waiting, or was cancelled)."""
        for link in self.links.values():
            if link.outbound is not None and not link.ready:
                link.outbound.close()
                link.outbound = None

    def carries(self, peer: int, nbytes: int) -> bool:
        """True if an ``nbytes`` payload to ``peer`` should go through shared memory."""
        link = self.links.get(peer)
        return nbytes >= MIN_PAYLOAD and link is not None and link.ready

    def reserve(self, peer: int, nbytes: int, queued: bool = False) -> tuple[int, memoryview] | None:
        """Room for a payload to ``peer`` (``carries`` must be true): (offset, where to copy
        it), or ``None`` while the ring is full or other sends wait for room before this one
        (``queued``: this is the first of them)."""
        link = self.links[peer]
        assert link.space is not None and link.outbound is not None
        if link.waiting and not queued:
            return None
        offset = link.space.alloc(nbytes)
        return None if offset is None else (offset, link.outbound.view(offset, nbytes))

    def fits(self, peer: int, nbytes: int) -> bool:
        """True if an ``nbytes`` payload fits ``peer``'s ring when empty (else waiting is futile)."""
        space = self.links[peer].space
        return space is not None and space.fits(nbytes)

    def wait_room(self, peer: int, retry: Callable[[], bool]) -> None:
        """Call ``retry`` (first come first served) whenever ``peer`` hands back room, and once
        more if the link goes; it returns True when it is done waiting."""
        self.links[peer].waiting.append(retry)

    def stop_waiting(self, peer: int, retry: Callable[[], bool]) -> None:
        link = self.links.get(peer)
        if link is not None and retry in link.waiting:
            link.waiting.remove(retry)

    @staticmethod
    def _serve_waiting(link: Link) -> None:
        waiting = link.waiting
        while waiting and waiting[0]():
            waiting.popleft()

    def payload(self, peer: int, offset: Any, nbytes: Any) -> memoryview:
        """The bytes a peer's frame points at in its segment (``ValueError`` if it cannot)."""
        link = self.links.get(peer)
        if link is None or link.inbound is None:
            raise ValueError(f"rank {peer} sent a shared-memory payload without a segment")
        if not isinstance(offset, int) or not isinstance(nbytes, int):
            raise ValueError(f"rank {peer} sent a malformed shared-memory reference")
        return link.inbound.view(offset, nbytes)

    def free(self, peer: int, lease: int) -> bool:
        """Note that ``peer`` may reuse ``lease`` (sent with ``take_frees``); False if the link is
        gone."""
        link = self.links.get(peer)
        if link is None or link.inbound is None:
            return False
        link.to_free.append(lease)
        return True

    def take_frees(self) -> list[tuple[int, list[int]]]:
        """Per peer, the offsets to hand back now."""
        out = []
        for peer, link in self.links.items():
            if link.to_free:
                out.append((peer, link.to_free))
                link.to_free = []
        return out

    def on_free(self, peer: int, offsets: Any) -> None:
        link = self.links.get(peer)
        if link is None or link.space is None or not isinstance(offsets, list):
            raise ValueError(f"rank {peer} freed shared memory it was never given")
        for offset in offsets:
            try:
                link.space.free(offset)
            except KeyError:
                raise ValueError(f"rank {peer} freed offset {offset!r}, which it does not hold") from None
        self._serve_waiting(link)

    def drop(self, peer: int) -> None:
        """The peer is gone: unmap both segments (views still in use keep their pages)."""
        self.settled.add(peer)
        link = self.links.pop(peer, None)
        if link is not None:
            link.close()
            waiting, link.waiting = list(link.waiting), collections.deque()
            for retry in waiting:  # (each finds the link gone and stops waiting)
                retry()

    def close(self) -> None:
        for peer in list(self.links):
            self.drop(peer)
