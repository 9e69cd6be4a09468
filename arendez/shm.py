"""Shared-memory payloads between ranks on one host.

TCP over loopback copies every byte twice inside the kernel and pays the socket stack on top.
When two ranks can map the same file (same host, same ``/dev/shm``, same user), the sender
instead copies a collective's payload once into a segment it owns, and the TCP frame carries
only where it lies; the receiver reduces straight from the segment (or copies it into place)
and tells the sender, in a batched ``FREE`` frame, which ranges it may reuse. The TCP stream
stays the control channel, so ordering, matching and failure detection are unchanged.

A link is set up by an offer: the sender creates a file, reserves its pages, writes a random
cookie into it and sends ``(path, size, cookie)``. The receiver maps the path and checks the
cookie, which proves both see the same file; a rank on another host or in another container
cannot, and answers no. Both then unlink the file, so nothing outlives the processes.

Nothing here is async: ``RingSpace`` is the sender's allocator (sans-I/O, tested alone) and
``Segment`` one mapped file.
"""

from __future__ import annotations

import collections
import contextlib
import mmap
import os
import secrets
import tempfile
from dataclasses import dataclass, field

#: Bytes of the segment a rank writes to one peer (``ARENDEZ_SHM_BYTES``).
SEGMENT_BYTES = int(os.environ.get("ARENDEZ_SHM_BYTES", 8 << 20))
#: Payloads smaller than this go inline in the TCP frame: for them a shared-memory round trip
#: saves nothing.
MIN_PAYLOAD = 64 * 1024
#: Allocations start on cache-line boundaries.
ALIGN = 64
COOKIE_BYTES = 16
_PREFIX = "arendez-"


def enabled() -> bool:
    """Shared memory is on unless ``ARENDEZ_SHM=0`` (or the platform has no ``/dev/shm``)."""
    return os.environ.get("ARENDEZ_SHM", "1") != "0" and os.path.isdir(_directory())


def _directory() -> str:
    return os.environ.get("ARENDEZ_SHM_DIR", "/dev/shm")


class ShmUnavailable(OSError):
    """A segment could not be created or attached; the link stays on TCP."""


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

    def alloc(self, nbytes: int) -> int | None:
        """The offset of ``nbytes`` free bytes, or ``None`` if they do not fit now."""
        need = -(-max(1, nbytes) // ALIGN) * ALIGN
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

    @property
    def buffer(self) -> memoryview:
        return memoryview(self._map)

    @classmethod
    def create(cls, size: int = SEGMENT_BYTES) -> Segment:
        """A new file of ``size`` usable bytes with its pages reserved (a full tmpfs fails here,
        not later with SIGBUS), mapped, with a fresh cookie in front."""
        directory = _directory()
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
        return cls(path, size, cookie, mapped)

    @classmethod
    def attach(cls, path: str, size: int, cookie: bytes) -> Segment:
        """Map the peer's segment; it must be ours to open and carry ``cookie``."""
        name = os.path.basename(path)
        if not name.startswith(_PREFIX) or os.path.dirname(path) != _directory():
            raise ShmUnavailable(f"{path!r} is not a segment in {_directory()}")
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        except OSError as exc:
            raise ShmUnavailable(f"cannot open {path}: {exc.strerror}") from None
        try:
            if os.fstat(fd).st_size != COOKIE_BYTES + size:
                raise ShmUnavailable(f"{path} is not {size} bytes")
            mapped = mmap.mmap(fd, COOKIE_BYTES + size)
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

    def close(self) -> None:
        self.ready = False
        for segment in (self.outbound, self.inbound):
            if segment is not None:
                segment.close()
