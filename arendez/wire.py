"""Sans-I/O frame codec.

A frame is ``prefix | header | payload``: the prefix packs the header length (u32) and the
payload length (u64), the header is one msgpack object, the payload raw bytes. The encoder
returns buffers for ``writelines`` without copying the payload; the incremental decoder says
where the next bytes should go (its header scratch, or a slice of the destination buffer the
receiver chose for the payload), so large payloads land straight in their final place. A receiver
may instead pick a ``Stream``: the payload is then read into a small cache-sized scratch, piece
by piece, and each piece is handed to the stream as it lands (``fold.Fold`` reduces it).
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, cast

import msgpack

from .errors import ProtocolError
from .settings import env_int

PREFIX = struct.Struct("<IQ")
#: Largest payload one frame may carry; bigger messages are split by the sender.
MAX_SEGMENT = (1 << 30) - 1
_SCRATCH = 8 * 1024  # grows for a larger header; reads between payloads are HEADER_READ
_MIN_SCRATCH = 256


_DISCARD = 1 << 20  # what a diverted payload's bytes are read into (and forgotten), at once
#: Bytes read at once between payloads: a small frame whole, little of a large payload.
HEADER_READ = 4096

#: The payload of a frame whose bytes were thrown away (``Decoder.divert``).
DIVERTED = memoryview(b"")
#: Bytes of a ``Stream``'s payload read at once: within a core's L2 cache, so the pieces are
#: still cached when the stream consumes them (``ARENDEZ_PIECE_BYTES``; 128 KiB to 512 KiB
#: measured alike on a 512 KiB L2, 256 KiB takes half the reads of 128 KiB).
PIECE_BYTES = env_int("ARENDEZ_PIECE_BYTES", 256 << 10, minimum=4096)
#: Room at the end of the piece scratch for the carried bytes of a partial element.
_PIECE_SLACK = 64


def small_packer() -> msgpack.Packer:
    """A msgpack packer whose buffer starts small and grows as needed: msgpack's default holds
    256 KiB per packer, and a process of thousands of store clients holds one each."""
    try:
        return msgpack.Packer(use_bin_type=True, buf_size=1024)
    except TypeError:  # (msgpack before 1.1)
        return msgpack.Packer(use_bin_type=True)


#: A packer that packed more than this lets go of its buffer (``ReleasingPacker``).
RELEASE_AT = 4 << 20


class ReleasingPacker:
    """msgpack's packer, but one that does not keep a large buffer: msgpack's holds its buffer
    at the size of the largest object it ever packed (one 300 MiB answer kept 300 MiB for good),
    so after packing more than ``RELEASE_AT`` bytes this one starts over with a small one."""

    __slots__ = ("_packer",)

    def __init__(self) -> None:
        self._packer = small_packer()

    def pack(self, obj: Any) -> bytes:
        data: bytes = self._packer.pack(obj)
        if len(data) > RELEASE_AT:
            self._packer = small_packer()
        return data


_packer = ReleasingPacker()


@dataclass(frozen=True)
class Limits:
    """Upper bounds a decoder enforces on what the other side may send."""

    max_header: int = 1 << 20
    max_payload: int = MAX_SEGMENT


DEFAULT_LIMITS = Limits()


def encode(header: Any, payload: memoryview | bytes | None = None) -> list[bytes | memoryview]:
    """Return the buffers of one frame, ready for ``transport.writelines`` (payload not copied)."""
    raw = _packer.pack(header)
    size = 0 if payload is None else memoryview(payload).nbytes
    head = PREFIX.pack(len(raw), size) + raw
    if not size:
        return [head]
    assert payload is not None
    return [head, payload]


class Stream(Protocol):
    """A payload consumed piece by piece as it arrives instead of landing whole in one buffer
    (``fold.Fold`` reduces it into an array). The decoder reads the payload into its small piece
    scratch and hands every piece over at once."""

    @property
    def view(self) -> memoryview:
        """What the frame completes with (the bytes the stream fills)."""
        ...

    def landing(self, scratch: memoryview, left: int) -> memoryview:
        """Where in ``scratch`` the next at most ``left`` bytes go (the same answer until
        ``absorb``)."""
        ...

    def absorb(self, scratch: memoryview, nbytes: int) -> None:
        """``nbytes`` landed where ``landing`` said."""
        ...

    def write(self, data: memoryview) -> None:
        """Consume bytes read elsewhere (with the header, or a whole payload)."""
        ...


#: ``sink(header, nbytes)`` picks the buffer a payload goes into, or a ``Stream`` that consumes
#: it; ``None`` lets the decoder allocate a buffer. It is called for every frame, in order,
#: before the frame is complete (for a frame without payload with ``nbytes`` 0, its answer unused).
Sink = Callable[[Any, int], "memoryview | Stream | None"]


def _uninitialized(nbytes: int) -> memoryview:
    """A writable byte buffer of ``nbytes`` without zero-filling it (numpy is imported on first
    use: the store server's start-up needs the codec, not numpy)."""
    import numpy as np

    return memoryview(cast(Any, np.empty(nbytes, np.uint8)))


def _default_sink(header: Any, nbytes: int) -> memoryview | Stream | None:
    return None


def _as_is(header: Any) -> Any:
    return header


class Decoder:
    """Incremental frame decoder: ``get_buffer`` to read into, ``feed`` to parse what arrived."""

    def __init__(self, sink: Sink = _default_sink, limits: Limits = Limits()) -> None:
        self._sink = sink
        self._limits = limits
        self._parse_header: Callable[[Any], Any] = _as_is
        # no bigger than the largest frame allowed: a connection that may only send a hello costs
        # a hello's worth of buffer until it sends something (many silent ones cost little)
        self._scratch = bytearray(min(_SCRATCH, max(_MIN_SCRATCH, PREFIX.size + limits.max_header)))
        self._view = memoryview(self._scratch)
        self._filled = 0
        self._header: Any = None
        self._dest: memoryview | None = None
        self._got = 0
        self._discard_left = 0  # bytes of a diverted payload still to read and throw away
        self._discard: memoryview | None = None
        self._stream: Stream | None = None  # consumes the payload now arriving, piece by piece
        self._stream_left = 0
        self._piece: memoryview | None = None  # where a stream's pieces land (made on first use)
        #: Return after each complete frame, keeping what follows it unparsed (``take_rest``): a
        #: server reads a hello this way, and what a client sent right behind it under the limits
        #: the hello earns.
        self.one_frame = False

    def set_sink(self, sink: Sink) -> None:
        """Route future payloads through ``sink``."""
        self._sink = sink

    def set_limits(self, limits: Limits) -> None:
        """Enforce ``limits`` from the next frame on."""
        self._limits = limits

    def set_parser(self, parse: Callable[[Any], Any]) -> None:
        """Turn every later header into ``parse(header)`` before the sink or the caller sees it
        (``parse`` raises ``ProtocolError`` for a header it rejects)."""
        self._parse_header = parse
        if self._header is not None:  # a payload is arriving: its header was read unparsed
            self._header = parse(self._header)

    def divert(self, should: Callable[[Any, memoryview], bool], *, keep: bool = False) -> memoryview | None:
        """If a payload is arriving and ``should(header, buffer)`` for it, stop writing that
        buffer and return it (else None): it is never written again. The remaining bytes are read
        into a throwaway buffer and the frame completes with an empty payload (``DIVERTED``), or,
        with ``keep``, into a fresh buffer (what came so far is copied there) that the frame
        completes with. Either way the stream, and whoever counts frames, stay in step.

        A ``Stream`` (its ``view`` is the buffer ``should`` sees) is never kept: what came was
        consumed, so its remaining bytes are thrown away either way."""
        stream = self._stream
        if stream is not None:
            if not should(self._header, stream.view):
                return None
            self._stream, self._discard_left = None, self._stream_left
            return stream.view
        if self._dest is None or not should(self._header, self._dest):
            return None
        dest, self._dest = self._dest, None
        if keep:
            fresh = _uninitialized(dest.nbytes)
            fresh[: self._got] = dest[: self._got]
            self._dest = fresh
        else:
            self._discard_left = dest.nbytes - self._got
        return dest

    def take_rest(self) -> bytes:
        """The bytes read past the last complete frame (for another reader to continue with);
        the decoder forgets them. Only between frames: a payload being read is an error."""
        if self._dest is not None or self._stream is not None or self._discard_left:
            raise ProtocolError("a payload is arriving: the stream cannot change readers now")
        rest = bytes(self._view[: self._filled])
        self._filled = 0
        return rest

    def get_buffer(self) -> memoryview:
        """Where the next bytes from the stream should be written.

        Between payloads the decoder reads at most ``HEADER_READ`` bytes into its scratch (a
        whole small frame in one read), or exactly the rest of a header it has the length of,
        so at most that much of a large payload is ever copied out of the scratch.
        """
        if self._dest is not None:
            return self._dest[self._got :]
        if self._stream is not None:
            return self._stream.landing(self._piece_scratch(), self._stream_left)
        if self._discard_left:
            if self._discard is None:
                self._discard = memoryview(bytearray(_DISCARD))
            return self._discard[: min(self._discard_left, _DISCARD)]
        # between frames, a whole small frame per read (and up to 4 KiB a bad client sent is read
        # before we close, so the close is no reset); the scratch grows to that only once bytes
        # have come, and after it only for a header larger than it, not for read-ahead (a process
        # of thousands of connections holds one scratch each)
        filled = self._filled
        if filled >= PREFIX.size:  # _parse already checked this length against the limit
            hlen, _ = PREFIX.unpack_from(self._view, 0)
            end = max(PREFIX.size + hlen, filled + 1)
        elif filled == 0:  # (a whole read, so up to HEADER_READ of a bad client's bytes are read)
            end = HEADER_READ
        else:
            end = max(PREFIX.size, min(filled + HEADER_READ, len(self._scratch)))
        if end > len(self._scratch):  # a header larger than the scratch
            bigger = bytearray(max(end, 2 * len(self._scratch)))
            bigger[:filled] = self._view[:filled]
            self._scratch, self._view = bigger, memoryview(bigger)
        return self._view[filled:end]

    def _piece_scratch(self) -> memoryview:
        if self._piece is None:
            self._piece = _uninitialized(PIECE_BYTES + _PIECE_SLACK)
        return self._piece

    def feed(self, nbytes: int) -> list[tuple[Any, memoryview | None]]:
        """Account for ``nbytes`` written into the last buffer; return the completed frames."""
        frames: list[tuple[Any, memoryview | None]] = []
        if self._discard_left:
            self._discard_left -= nbytes
            if not self._discard_left:
                frames.append((self._header, DIVERTED))
                self._header = None
            return frames
        if self._dest is not None:
            self._got += nbytes
            if self._got < len(self._dest):
                return frames
            frames.append((self._header, self._dest))
            self._dest = None
            self._header = None
            return frames
        if self._stream is not None:
            self._stream.absorb(self._piece_scratch(), nbytes)
            self._stream_left -= nbytes
            if not self._stream_left:
                frames.append((self._header, self._stream.view))
                self._stream = None
                self._header = None
            return frames
        self._filled += nbytes
        self._parse(frames)
        return frames

    def _parse(self, frames: list[tuple[Any, memoryview | None]]) -> None:
        view, start, end = self._view, 0, self._filled
        while end - start >= PREFIX.size and not (frames and self.one_frame):
            hlen, plen = PREFIX.unpack_from(view, start)
            if hlen > self._limits.max_header:
                raise ProtocolError(f"frame header of {hlen} bytes exceeds {self._limits.max_header}")
            if plen > self._limits.max_payload:
                raise ProtocolError(f"frame payload of {plen} bytes exceeds {self._limits.max_payload}")
            body = start + PREFIX.size
            if end - body < hlen:
                break
            try:
                header = msgpack.unpackb(view[body : body + hlen], raw=False, strict_map_key=False)
            except Exception as exc:  # msgpack raises several unrelated types
                raise ProtocolError(f"undecodable frame header: {exc}") from None
            header = self._parse_header(header)
            start = body + hlen
            if plen == 0:  # the sink sees every frame in order (a 0-byte p2p message claims its recv)
                self._sink(header, 0)
                frames.append((header, None))
                continue
            dest = self._sink(header, plen)
            if dest is not None and not isinstance(dest, memoryview):
                start += self._start_stream(header, dest, plen, view[start:end])
                if self._stream is not None:
                    break
                frames.append((header, dest.view))
                continue
            if dest is None:
                dest = _uninitialized(plen)
            elif dest.nbytes != plen:
                raise ProtocolError(f"payload of {plen} bytes for a {dest.nbytes}-byte buffer")
            dest = dest.cast("B")
            have = min(end - start, plen)
            dest[:have] = view[start : start + have]
            start += have
            if have == plen:
                frames.append((header, dest))
                continue
            self._header, self._dest, self._got = header, dest, have
            break
        rest = end - start
        if rest and start:
            view[:rest] = view[start:end]
        self._filled = rest

    def _start_stream(self, header: Any, stream: Stream, plen: int, read: memoryview) -> int:
        """Hand ``stream`` the bytes of its payload already ``read`` (with the header); unless
        that was all of it, stream the rest. Return how many of ``read`` it took."""
        if stream.view.nbytes != plen:
            raise ProtocolError(f"payload of {plen} bytes for a {stream.view.nbytes}-byte stream")
        have = min(len(read), plen)
        if have:
            stream.write(read[:have])
        if have < plen:
            self._header, self._stream, self._stream_left = header, stream, plen - have
        return have
