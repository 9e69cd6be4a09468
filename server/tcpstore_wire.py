"""torch's ``TCPStore`` wire protocol, sans-I/O: its clients' requests parsed, its replies built.

torch's C++ ``TCPStore`` client (torch 2.13, as captured from it talking to torch's own server)
sends a query type byte, then the query's fields, little-endian, with no framing: strings and
byte strings as a ``uint64`` length and the bytes, counts as ``uint64``, ``add``'s amount as
``int64``. The first request is ``VALIDATE`` (a ``uint32`` magic number), then ``PING`` (a
``uint32`` nonce the server sends back). The server never reports an error: it closes the
connection, and the client raises ``DistNetworkError``. Replies are values of the same
encodings, or nothing (``set``, ``append``, ``multi_set``, ``queue_push``); ``barrier`` (a key and
its count) is answered like a ``wait``, once passed, and ``CANCEL_WAIT`` ends it unpassed.

``RequestReader`` bounds what it buffers: a request longer than ``max_request`` bytes, or naming
more than ``max_keys`` keys, is refused (``LimitError``) as soon as its header says so; bytes that
cannot be a request are a ``ProtocolError``.
"""

from __future__ import annotations

import enum
import struct
from typing import Any

from arendez.errors import LimitError, ProtocolError

#: What a ``VALIDATE`` request carries (torch's ``validationMagicNumber``).
VALIDATION_MAGIC = 0x3C85F7CE


class Query(enum.IntEnum):
    """torch's ``QueryType`` (``TCPStoreBackend.hpp``)."""

    VALIDATE = 0
    SET = 1
    COMPARE_SET = 2
    GET = 3
    ADD = 4
    CHECK = 5
    WAIT = 6
    GETNUMKEYS = 7
    DELETE_KEY = 8
    APPEND = 9
    MULTI_GET = 10
    MULTI_SET = 11
    CANCEL_WAIT = 12
    PING = 13
    QUEUE_PUSH = 14
    QUEUE_POP = 15
    QUEUE_LEN = 16
    LIST_KEYS = 17
    BARRIER = 18


#: ``check``'s answer (``CheckResponseType``).
READY, NOT_READY = b"\x00", b"\x01"
#: ``wait``'s answers (``WaitResponseType``): the keys are there; the wait was cancelled.
STOP_WAITING, WAIT_CANCELED = b"\x00", b"\x01"

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_I64 = struct.Struct("<q")

#: The fields of each query after its type byte: s = string, b = byte string, q = int64,
#: I = uint32, K = a count of strings, P = a count of (string, byte string) pairs.
_FIELDS: dict[int, str] = {
    Query.VALIDATE: "I",
    Query.SET: "sb",
    Query.COMPARE_SET: "sbb",
    Query.GET: "s",
    Query.ADD: "sq",
    Query.CHECK: "K",
    Query.WAIT: "K",
    Query.GETNUMKEYS: "",
    Query.DELETE_KEY: "s",
    Query.APPEND: "sb",
    Query.MULTI_GET: "K",
    Query.MULTI_SET: "P",
    Query.CANCEL_WAIT: "",
    Query.PING: "I",
    Query.QUEUE_PUSH: "sb",
    Query.QUEUE_POP: "s",
    Query.QUEUE_LEN: "s",
    Query.LIST_KEYS: "",
    Query.BARRIER: "sq",
}


#: The queries of one string and at most one more field (its kind: None, "b" or "q"): parsed
#: straight from a whole buffer (``RequestReader.next``), the others field by field.
_ONE_STRING: dict[int, str | None] = {
    kind: fields[1:] or None for kind, fields in _FIELDS.items() if fields in ("s", "sb", "sq")
}
_QUERIES = {int(q): q for q in Query}


class _Short(Exception):
    """The buffer ends before the request does; ``need``: the bytes it needs at least."""

    def __init__(self, need: int) -> None:
        self.need = need


class _Partial:
    """A request parsed as far as its bytes have arrived: its fields so far, where the next one
    starts, and for a list of keys (or pairs), the items so far and how many are still to come.
    A request that arrives in many small reads is parsed once, not again from its start."""

    __slots__ = ("field", "items", "out", "pos", "remaining")

    def __init__(self, kind: int) -> None:
        self.out: list[Any] = [Query(kind)]
        self.pos = 1
        self.field = 0
        self.items: list[Any] | None = None
        self.remaining = 0


class RequestReader:
    """Requests out of the bytes a client sent, one at a time, each ``(Query, *fields)``."""

    def __init__(self, max_request: int, max_keys: int, max_list_request: int | None = None) -> None:
        self.max_request = max_request
        self.max_keys = max_keys
        #: the bound of a request naming keys (``wait``, ``check``, ``multi_get``, ``multi_set``)
        self.max_list_request = max(max_request, max_list_request or 0)
        self._limit = max_request  # (the bound of the request being parsed)
        self._buf = bytearray()
        self._need = 1  # bytes the next request needs at least (no parse before they are here)
        self._partial: _Partial | None = None

    def feed(self, data: bytes) -> None:
        self._buf += data

    def buffered(self) -> int:
        return len(self._buf)

    def peek(self) -> int | None:
        """The query type of the next request, if its first byte is here."""
        return self._buf[0] if self._buf else None

    def next(self) -> tuple[Any, ...] | None:
        """The next whole request, taken out of the buffer; None until it has all arrived."""
        buf = self._buf
        have = len(buf)
        if have < self._need:
            return None
        if self._partial is None and have >= 9 and buf[0] in _ONE_STRING:
            # the usual requests (get, set, add, a key and maybe a value or an amount), whole
            kind, (size,) = buf[0], _U64.unpack_from(buf, 1)
            end = 9 + size
            if end <= self.max_request and have >= end:
                rest = _ONE_STRING[kind]
                if rest is None:
                    request: tuple[Any, ...] = (_QUERIES[kind], bytes(buf[9:end]))
                    del buf[:end]
                    return request
                if rest == "q" and have >= end + 8:
                    request = (_QUERIES[kind], bytes(buf[9:end]), _I64.unpack_from(buf, end)[0])
                    del buf[: end + 8]
                    return request
                if rest == "b" and have >= end + 8:
                    (vsize,) = _U64.unpack_from(buf, end)
                    vend = end + 8 + vsize
                    if vend <= self.max_request and have >= vend:
                        request = (_QUERIES[kind], bytes(buf[9:end]), bytes(buf[end + 8 : vend]))
                        del buf[:vend]
                        return request
        try:
            request, end = self._parse(buf)
        except _Short as short:
            self._need = short.need
            self._check_size(short.need)
            return None
        del buf[:end]
        self._need = 1
        return request

    def _check_size(self, need: int) -> None:
        if need > self._limit:
            if self._limit == self.max_request:
                why = "its largest value and key, plus 4096"
            else:
                why = f"{self.max_keys} keys of {self.max_list_request // self.max_keys - 8} bytes or less"
            raise LimitError(
                f"a TCPStore request of more than {self._limit} bytes (the server's limit: {why})"
            )

    def _parse(self, buf: bytearray) -> tuple[tuple[Any, ...], int]:
        p = self._partial
        if p is None:
            if buf[0] not in _FIELDS:
                raise ProtocolError(f"unknown TCPStore query type {buf[0]}")
            p = self._partial = _Partial(buf[0])
            lists = "K" in _FIELDS[buf[0]] or "P" in _FIELDS[buf[0]]
            self._limit = self.max_list_request if lists else self.max_request
        fields = _FIELDS[p.out[0]]
        while p.field < len(fields):  # (each step takes effect only once its bytes are all here)
            field = fields[p.field]
            if field == "I":
                p.out.append(self._fixed(buf, p.pos, _U32))
                p.pos += 4
            elif field == "q":
                p.out.append(self._fixed(buf, p.pos, _I64))
                p.pos += 8
            elif field in "sb":
                value, p.pos = self._bytes(buf, p.pos)
                p.out.append(value)
            else:  # a count of keys, or of key-value pairs
                if p.items is None:
                    count = self._fixed(buf, p.pos, _U64)
                    if count > self.max_keys:
                        raise LimitError(
                            f"a TCPStore request names {count} keys, over the server's limit of "
                            f"{self.max_keys} keys per request"
                        )
                    p.pos, p.items, p.remaining = p.pos + 8, [], count
                while p.remaining:
                    key, pos = self._bytes(buf, p.pos)
                    if field == "P":
                        value, pos = self._bytes(buf, pos)
                        p.items.append((key, value))
                    else:
                        p.items.append(key)
                    p.pos, p.remaining = pos, p.remaining - 1
                p.out.append(p.items)
                p.items = None
            p.field += 1
        self._partial = None
        return tuple(p.out), p.pos

    @staticmethod
    def _fixed(buf: bytearray, pos: int, form: struct.Struct) -> int:
        if len(buf) < pos + form.size:
            raise _Short(pos + form.size)
        value: int = form.unpack_from(buf, pos)[0]
        return value

    def _bytes(self, buf: bytearray, pos: int) -> tuple[bytes, int]:
        size = self._fixed(buf, pos, _U64)
        start, end = pos + 8, pos + 8 + size
        if end > self._limit:
            self._check_size(end)
        if len(buf) < end:
            raise _Short(end)
        return bytes(buf[start:end]), end


def u32(value: int) -> bytes:
    return _U32.pack(value)


def i64(value: int) -> bytes:
    return _I64.pack(value)


def blob(value: bytes) -> bytes:
    """A byte string as torch's client reads one: its ``uint64`` length, then the bytes."""
    return _U64.pack(len(value)) + value


def blobs(values: list[bytes]) -> bytes:
    """``multi_get``'s answer: each value as a byte string, no count ahead."""
    return b"".join(blob(v) for v in values)


def key_list(keys: list[str]) -> bytes:
    """``list_keys``'s answer: the count, then each key as a string."""
    return _U64.pack(len(keys)) + b"".join(blob(k.encode()) for k in keys)


def popped(item: bytes | None) -> bytes:
    """``queue_pop``'s answer: ``uint64`` 0 for an empty queue, else 1 and the value."""
    return _U64.pack(0) if item is None else _U64.pack(1) + blob(item)
