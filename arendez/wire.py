"""Sans-I/O frame codec.

A frame is ``prefix | header | payload``: the prefix packs the header length (u32) and the
payload length (u64), the header is one msgpack object, the payload raw bytes. The encoder
returns buffers for ``writelines`` without copying the payload; the incremental decoder says
where the next bytes should go (its header scratch, or a slice of the destination buffer the
receiver chose for the payload), so large payloads land straight in their final place.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import msgpack
import numpy as np

from .errors import ProtocolError

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

_packer = msgpack.Packer(use_bin_type=True)


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


#: ``sink(header, nbytes)`` picks the buffer a payload goes into; ``None`` lets the decoder
#: allocate one.
Sink = Callable[[Any, int], memoryview | None]


def _default_sink(header: Any, nbytes: int) -> memoryview | None:
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
        completes with. Either way the stream, and whoever counts frames, stay in step."""
        if self._dest is None or not should(self._header, self._dest):
            return None
        dest, self._dest = self._dest, None
        if keep:
            fresh = memoryview(cast(Any, np.empty(dest.nbytes, np.uint8))).cast("B")
            fresh[: self._got] = dest[: self._got]
            self._dest = fresh
        else:
            self._discard_left = dest.nbytes - self._got
        return dest

    def take_rest(self) -> bytes:
        """The bytes read past the last complete frame (for another reader to continue with);
        the decoder forgets them. Only between frames: a payload being read is an error."""
        if self._dest is not None or self._discard_left:
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
        if self._discard_left:
            if self._discard is None:
                self._discard = memoryview(bytearray(_DISCARD))
            return self._discard[: min(self._discard_left, _DISCARD)]
        # a whole small frame per read (and up to 4 KiB a bad client sent is read before we close,
        # so the close is no reset); the scratch grows to it only once bytes have come
        want = HEADER_READ
        if self._filled >= PREFIX.size:  # _parse already checked this length against the limit
            hlen, _ = PREFIX.unpack_from(self._view, 0)
            want = PREFIX.size + hlen - self._filled
        end = self._filled + max(1, want)
        if end > len(self._scratch):  # a header larger than the scratch
            bigger = bytearray(max(end, 2 * len(self._scratch)))
            bigger[: self._filled] = self._view[: self._filled]
            self._scratch, self._view = bigger, memoryview(bigger)
        return self._view[self._filled : end]

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
        self._filled += nbytes
        self._parse(frames)
        return frames

    def _parse(self, frames: list[tuple[Any, memoryview | None]]) -> None:
        view, start, end = self._view, 0, self._filled
        while end - start >= PREFIX.size:
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
            if plen == 0:
                frames.append((header, None))
                continue
            dest = self._sink(header, plen)
            if dest is None:
                dest = memoryview(cast(Any, np.empty(plen, np.uint8)))  # no zero-fill
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
