"""The store's compact request form, and a lean reader of frames without payloads.

Store requests and replies are ordinary frames (``wire``: prefix | msgpack header) with no
payload. Key-value operations use a short msgpack array instead of a map::

    request  [op, id, *args]          e.g. ["set", 7, "key", b"value"], ["get", 8, "key", 30.0]
    reply    [id, value]              the operation's result
             {"id", "error", "message"}   an error (as every other request's)

Requests in the map form (``{"op", "id", ...}``: join, lease, heartbeat, ...) are answered in
the map form ``{"id", "ok"}``. A server that speaks this form says ``"store": STORE_PROTOCOL``
in its welcome; a client checks it before sending one.
"""

from __future__ import annotations

from typing import Any

import msgpack

from .errors import (
    AuthenticationError,
    LimitError,
    ProtocolError,
    QueueEmptyError,
    RendezvousError,
    RendezvousTimeoutError,
    StoreError,
    StoreTimeoutError,
)
from .wire import PREFIX

#: Version of the store's request forms, announced in the server's welcome.
STORE_PROTOCOL = 2

#: The server's default bounds on one key, one value, and so on one request's frame (a larger
#: frame ends the connection as a protocol error: clients refuse to send one, naming the limit).
MAX_KEY = 4096
MAX_VALUE = 1 << 20


def request_limit(max_value: int, max_key: int) -> int:
    """The largest request frame a server with these key and value bounds reads."""
    return max_value + max_key + 4096


MAX_REQUEST = request_limit(MAX_VALUE, MAX_KEY)
#: The most keys one request may name (a request that waits holds its keys on the server); the
#: clients split longer key lists into several requests (``key_batches``).
MAX_KEYS = 10_000
#: The longest reason a rank may give for its failure as it leaves (``leave``'s ``failed``).
MAX_REASON = 1000
#: The server job every ``TCPStore`` client uses (``arendez.tcpstore``, and torch's own client on
#: ``arendez-server --tcpstore-port``): one server, one key space, as torch's.
TCPSTORE_JOB = "tcpstore"
#: That job's count of store users (torch's has one too, ``init/``), not listed.
TCPSTORE_WORKERS_KEY = "__arendez_tcpstore/workers"


def key_batches(keys: list[str], values: list[bytes] | None = None) -> list[slice]:
    """Slices of ``keys`` (and of ``values``, for ``multi_set``) that each fit one request: at most
    ``MAX_KEYS`` keys and, with their values, about half the server's default request frame."""
    if len(keys) <= MAX_KEYS and values is None:
        return [slice(0, len(keys))]
    cuts, start, size = [], 0, 0
    room = MAX_REQUEST // 2
    for i, key in enumerate(keys):
        item = len(key) + (len(values[i]) if values is not None else 0) + 16
        if i > start and (i - start == MAX_KEYS or size + item > room):
            cuts.append(slice(start, i))
            start, size = i, 0
        size += item
    cuts.append(slice(start, len(keys)))
    return cuts


def check_request_size(op: str, nbytes: int) -> None:
    """``LimitError`` if a request of ``nbytes`` would exceed the server's frame limit."""
    if nbytes > MAX_REQUEST:
        raise LimitError(
            f"store {op} request of {nbytes} bytes exceeds the server's limit of {MAX_REQUEST} bytes "
            f"per request (a value may hold up to {MAX_VALUE} bytes; split a larger multi_set)"
        )


#: The errors a store server sends back that its clients raise as themselves.
STORE_ERRORS = (
    StoreError,
    StoreTimeoutError,
    RendezvousError,
    RendezvousTimeoutError,
    ProtocolError,
    AuthenticationError,
    LimitError,
    QueueEmptyError,
)


def to_bytes(value: str | bytes | bytearray | memoryview) -> bytes:
    """A store value as bytes (``str`` as UTF-8); ``TypeError`` for anything else."""
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    raise TypeError(f"store values are str or bytes, not {type(value).__name__}")


def store_key(key: str | bytes) -> str:
    """A store key as ``str``: UTF-8 ``bytes`` are taken, as torch's stores take them; anything
    else is a ``TypeError`` here, not a refusal a later call reports."""
    if type(key) is str:
        return key
    if isinstance(key, str):
        return str(key)
    if isinstance(key, bytes | bytearray | memoryview):
        try:
            return bytes(key).decode()
        except UnicodeDecodeError:
            raise TypeError(f"store keys are str or UTF-8 bytes, got non-UTF-8 {bytes(key)!r:.80}") from None
    raise TypeError(f"store keys are str (or UTF-8 bytes), not {type(key).__name__} {key!r:.40}")


#: Arguments of each compact operation, in order (``timeout``: seconds the server may wait).
OPS: dict[str, tuple[str, ...]] = {
    "set": ("key", "value"),
    "get": ("key", "timeout"),
    "add": ("key", "amount"),
    "compare_set": ("key", "expected", "desired"),
    "append": ("key", "value"),
    "delete": ("key",),
    "num_keys": (),
    "check": ("keys",),
    "wait": ("keys", "timeout"),
    "multi_get": ("keys", "timeout"),
    "multi_set": ("keys", "values"),
    "list_keys": (),
    "queue_push": ("key", "value"),
    "queue_pop": ("key", "block", "timeout"),
    "queue_len": ("key",),
    "barrier": ("key", "count", "timeout"),
}

_INITIAL = 4096  # bytes a reader holds between frames; it grows for a larger frame only
_SHRINK_AT = 64 << 10
_unpack_prefix = PREFIX.unpack_from
_PREFIX_SIZE = PREFIX.size
#: Prefixes of headers up to this many bytes, made once.
_SMALL = 512
_PREFIXES = [PREFIX.pack(n, 0) for n in range(_SMALL)]
_pack_prefix = PREFIX.pack


def _decode(header: memoryview) -> Any:
    """One frame's msgpack header; ``ProtocolError`` if it does not decode."""
    try:
        return msgpack.unpackb(header, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types
        raise ProtocolError(f"undecodable frame header: {exc}") from None


def frame(raw: bytes) -> bytes:
    """One payload-less frame around the msgpack ``raw``."""
    n = len(raw)
    return (_PREFIXES[n] if n < _SMALL else _pack_prefix(n, 0)) + raw


class OversizedFrame(ProtocolError):
    """A frame announced past the reader's ``max_header`` (the same words as ``wire.Decoder``'s)."""

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(f"frame header of {size} bytes exceeds {limit}")
        self.size, self.limit = size, limit


class HeaderReader:
    """Incremental reader of frames that carry no payload (what the store exchanges).

    ``get_buffer`` is where the next bytes go, ``feed(n)`` returns the headers completed.
    A frame with a payload, or a header over ``max_header`` bytes, is a ``ProtocolError``
    (the same words as ``wire.Decoder``'s).
    """

    __slots__ = ("_buf", "_filled", "_view", "max_header")

    def __init__(self, max_header: int, initial: bytes = b"") -> None:
        self.max_header = max_header
        self._buf = bytearray(max(_INITIAL, len(initial)))
        self._view = memoryview(self._buf)
        self._view[: len(initial)] = initial
        self._filled = len(initial)

    def get_buffer(self) -> memoryview:
        filled = self._filled
        if filled == len(self._buf):  # a frame larger than the buffer: room for more of it
            cap = _PREFIX_SIZE + self.max_header
            if filled >= _PREFIX_SIZE:
                cap = _PREFIX_SIZE + min(_unpack_prefix(self._view, 0)[0], self.max_header)
            self._grow(filled + 1, cap)
        return self._view[filled:]

    def _grow(self, need: int, cap: int) -> None:
        """Double the buffer (at most to ``cap``, the frame's announced size): what a peer makes
        this reader hold stays within twice what it actually sent, whatever it announced."""
        bigger = bytearray(max(need, min(2 * len(self._buf), cap)))
        bigger[: self._filled] = self._view[: self._filled]
        self._buf, self._view = bigger, memoryview(bigger)

    def pending(self) -> int:
        """Bytes of an incomplete frame held."""
        return self._filled

    def held(self) -> int:
        """Bytes the buffer holds beyond its initial size (a large request under way)."""
        return len(self._buf) - _INITIAL

    def recv(self, sock: Any) -> list[Any]:
        """One ``recv_into`` from ``sock``: the headers it completed (``[]`` if none, or if the
        socket's timeout expired: the caller decides whether its own time is up). A closed
        connection is ``ConnectionResetError``. The usual store reply, one whole frame in one
        read into an empty buffer, is decoded in place."""
        view = self._view
        filled = self._filled
        try:
            n = sock.recv_into(view if not filled else self.get_buffer())
        except (BlockingIOError, TimeoutError):
            return []
        if n == 0:
            raise ConnectionResetError("the store closed the connection")
        if not filled and n > _PREFIX_SIZE:
            hlen, plen = _unpack_prefix(view, 0)
            if n == _PREFIX_SIZE + hlen and not plen and hlen <= self.max_header:
                return [_decode(view[_PREFIX_SIZE:n])]
        return self.feed(n)

    def feed(self, nbytes: int) -> list[Any]:
        """Account for ``nbytes`` written into the last buffer; return the completed headers."""
        view = self._view
        end = self._filled = self._filled + nbytes
        start = 0
        out: list[Any] = []
        while end - start >= _PREFIX_SIZE:
            hlen, plen = _unpack_prefix(view, start)
            if hlen > self.max_header:
                raise OversizedFrame(hlen, self.max_header)
            if plen:
                raise ProtocolError(f"frame payload of {plen} bytes exceeds 0")
            body = start + _PREFIX_SIZE
            stop = body + hlen
            if stop > end:
                break
            out.append(_decode(view[body:stop]))
            start = stop
        if start:
            rest = end - start
            if rest:
                view[:rest] = view[start:end]
            self._filled = rest
            if len(self._buf) > _SHRINK_AT and rest < _INITIAL:  # a large frame went: let go of it
                small = bytearray(_INITIAL)
                small[:rest] = view[:rest]
                self._buf, self._view = small, memoryview(small)
        return out


def pack_reply(packer: msgpack.Packer, rid: Any, value: Any) -> bytes:
    """The frame of a compact reply ``[rid, value]``."""
    raw: bytes = packer.pack([rid, value])
    return frame(raw)


def arity_error(op: str, got: int) -> str:
    names = OPS[op]
    return f"store {op} takes {len(names)} argument(s) ({', '.join(names) or 'none'}), got {got}"
