"""torch's own ``TCPStore`` clients on the server (``arendez-server --tcpstore-port``).

A second listener speaks torch's TCPStore wire protocol (``tcpstore_wire``), so that torch's C++
client (``torch.distributed.TCPStore(host, port, is_master=False)``, torchrun's ``c10d``
rendezvous with this server as its endpoint, and the store torch's workers then share) keeps its
keys on this server, in one job (``tcpstore``, the job ``arendez.sync.TCPStore`` uses: clients of
both kinds share its keys). The key mapping: torch's client puts ``/`` before every key, which is
taken off here (``/k`` is ``k``); its worker count ``init/`` is the count
``arendez.sync.TCPStore`` keeps; any other key without the ``/`` is refused.

torch's clients cannot authenticate, so the port refuses to open on a server with a token or
TLS. Every limit of the server applies (connections, keys, bytes, key and value sizes, keys per
request); the protocol has no error reply, so a request past one, or one the store refuses (an
``add`` on a key that holds no integer), closes that client's connection, which torch's client
raises as ``DistNetworkError``; the server's log names the reason. A connection must validate
within the handshake timeout.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

from arendez import burstlog
from arendez.errors import ArendezError, LimitError, ProtocolError, StoreError
from arendez.store_wire import MAX_KEYS, TCPSTORE_WORKERS_KEY, request_limit

from . import barriers
from . import tcpstore_wire as tw
from .barriers import Barrier
from .connection import FLUSH_AT, MAX_UNREAD_REPLIES, count_unfinished, unread_excess
from .tcpstore_wire import Query

if TYPE_CHECKING:
    from .app import Server
    from .state import Job

log = logging.getLogger("arendez.server")

#: torch's client's worker count key (sent without the prefix): ``TCPSTORE_WORKERS_KEY`` here.
TORCH_WORKERS_KEY = "init/"
#: Bytes a client's unfinished request may hold before they count toward the server's
#: ``--max-unfinished-bytes`` (``ServerConnection`` counts its buffer beyond the same size).
UNCOUNTED_BYTES = 4096
#: Bytes beyond one whole request a client may have sent while its requests wait (behind a
#: ``wait``, or while it does not read its replies): then it is closed.
MAX_BUFFERED_EXTRA = 64 << 10


def _closings(items: Any) -> str:
    """The burst's summary: how many were closed for each reason (the most frequent first, at
    most ``_REASONS`` of them: a client closed by a limit stays findable in a flood of garbage)."""
    reasons = collections.Counter(why for _, why in items)
    shown = "; ".join(f"{n} x {why}" for why, n in reasons.most_common(_REASONS))
    more = f"; and {len(reasons) - _REASONS} other reason(s)" if len(reasons) > _REASONS else ""
    peer, why = items[-1]
    window = burstlog.WINDOW
    return (
        f"{len(items)} more TCPStore client(s) closed in the last {window:g} s: {shown}{more}; "
        f"the last: {peer}: {why}"
    )


_REASONS = 5


_CLOSINGS = burstlog.BurstLog(log, _closings)


def store_key(raw: bytes) -> str:
    """The server's key for a key torch's client sent."""
    try:
        key = raw.decode()
    except UnicodeDecodeError:
        raise ProtocolError(f"TCPStore key is not UTF-8: {raw!r:.80}") from None
    if key.startswith("/"):
        return key[1:]
    if key == TORCH_WORKERS_KEY:
        return TCPSTORE_WORKERS_KEY
    raise ProtocolError(f"TCPStore key {key!r:.80} lacks the '/' torch's client puts before every key")


#: The average key length a request naming a key per rank of the largest world may have
#: (``default_pg/0//rank_65535`` is 24 bytes): 65,536 such keys make a request of up to 9 MiB.
LIST_KEY_BYTES = 136


def client_key(key: str) -> str:
    """``store_key`` undone: the key torch's client expects in ``list_keys``."""
    return TORCH_WORKERS_KEY if key == TCPSTORE_WORKERS_KEY else "/" + key


class TorchStoreConnection(asyncio.Protocol):
    """One torch ``TCPStore`` client: its requests answered in order, one ``wait`` at a time."""

    def __init__(self, server: Server) -> None:
        self.server = server
        limits = server.config.limits
        # (torch's client cannot split a key list: a rank 0 that waits on every rank's key names
        # as many as the world has ranks, each key within LIST_KEY_BYTES on average)
        keys = max(MAX_KEYS, limits.max_world_size)
        self.reader = tw.RequestReader(
            request_limit(limits.max_value, limits.max_key), keys, keys * (8 + LIST_KEY_BYTES)
        )
        self.transport: asyncio.Transport | None = None
        self.host = ""
        self.peer = ""
        self.deadline = 0.0  # the handshake's (``Admission.sweep_handshakes``)
        self.session = None  # (not an arendez client: the server's shutdown notice is not for it)
        self.validated = False
        self.waiting: KeysWait | BarrierWait | None = None
        #: True while the client leaves replies unread (the transport's buffer is full): no
        #: request is answered, nor read, until it reads them (no reply piles up unbounded).
        self.paused = False
        self._out: list[bytes] = []
        self._out_bytes = 0
        #: Bytes of an unfinished request counted toward the server's ``unfinished``.
        self.held = 0
        self._closed = asyncio.get_running_loop().create_future()

    # -- the connection ------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # (uvloop's is no subclass of it)
        peer = self.transport.get_extra_info("peername")
        self.host = peer[0] if isinstance(peer, tuple) else str(peer)
        self.peer = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        admission = self.server.admission
        admission.add(self)
        refused = admission.refusal(self.host)
        if self.server.closing:
            self.abort()
            return
        if refused is not None:
            self._close(refused)
            return
        self.deadline = time.monotonic() + self.server.config.handshake_timeout
        admission.handshaking.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.server.unfinished -= self.held
        self.held = 0
        self.server.admission.remove(self)
        self.server.backlogged.discard(self)
        if self.validated:
            self.server.lifetimes.torch_went()
        if self.waiting is not None:
            self.waiting.cancel()
            self.waiting = None
        if not self._closed.done():
            self._closed.set_result(None)

    def pause_writing(self) -> None:  # replies it does not read: answer and read nothing more
        self.paused = True
        self.server.backlogged.add(self)
        if self.transport is not None:
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        self.paused = False
        self.server.backlogged.discard(self)
        if self.transport is not None and not self.transport.is_closing():
            self.transport.resume_reading()
            self._serve_and_flush()  # (what it sent meanwhile)

    def buffered(self) -> int:
        """Reply bytes the client has not read yet."""
        return self.transport.get_write_buffer_size() if self.transport is not None else 0

    @property
    def is_open(self) -> bool:
        return self.transport is not None and not self.transport.is_closing()

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()

    async def wait_closed(self, timeout: float) -> None:
        """Close (the server is shutting down) and wait up to ``timeout`` for it (at once for a
        client that leaves replies unread: it would not read them now)."""
        if self.transport is not None and self.buffered():
            self.abort()
        elif self.transport is not None and not self.transport.is_closing():
            self.transport.close()
        try:
            async with asyncio.timeout(timeout):
                await asyncio.shield(self._closed)
        except TimeoutError:
            self.abort()

    def _close(self, why: ArendezError) -> None:
        """Refuse this client: close, and say why in the server's log (its client cannot)."""
        item = (self.peer, str(why))
        _CLOSINGS.note(None, logging.WARNING, item, "closing a TCPStore client at %s: %s", self.peer, why)
        self._flush()  # (the answers to the requests before it go first, as torch's server does)
        if self.waiting is not None:
            self.waiting.cancel()
            self.waiting = None
        if self.transport is not None:
            self.transport.close()

    # -- requests ------------------------------------------------------------------------------
    def data_received(self, data: bytes) -> None:
        reader = self.reader
        reader.feed(data)
        if not self.validated and reader.peek() != Query.VALIDATE:
            self._close(ProtocolError("not a TCPStore client: its first request was no VALIDATE"))
            return
        self._serve_and_flush()
        if self.held or reader.buffered() > UNCOUNTED_BYTES:
            self._count_held()

    def _count_held(self) -> None:
        """Count what this client's unfinished request holds toward the server's
        ``--max-unfinished-bytes`` (as ``connection.ServerConnection`` does); refuse it past that."""
        buffered = self.reader.buffered()
        held = max(0, buffered - UNCOUNTED_BYTES)
        refusal = count_unfinished(self.server, self.held, held, buffered)
        self.held = held
        if refusal is not None and self.is_open:
            self._close(refusal)

    def _serve_and_flush(self) -> None:
        reader = self.reader
        try:
            self._serve()
            if (self.waiting is not None or self.paused) and (
                reader.buffered() > reader.max_request + MAX_BUFFERED_EXTRA
            ):
                raise LimitError(
                    f"client sent {reader.buffered()} bytes that wait for an answer while it "
                    f"{'waits' if self.waiting is not None else 'leaves replies unread'}"
                )
        except ArendezError as exc:
            self._close(exc)
            return
        self._flush()

    def _serve(self) -> None:
        """Answer the whole requests that have arrived, in order, until the client leaves too
        many replies unread (``paused``); behind a ``wait`` only its ``CANCEL_WAIT`` is taken
        (torch's client sends nothing else while it waits)."""
        reader, transport = self.reader, self.transport
        while transport is not None and not transport.is_closing() and not self.paused:
            if self.waiting is not None and reader.peek() != Query.CANCEL_WAIT:
                return
            request = reader.next()
            if request is None:
                return
            self._answer(request)
            if self._out_bytes >= FLUSH_AT:
                self._flush()  # (a full buffer pauses us here: ``pause_writing``)

    def _answer(self, request: tuple[Any, ...]) -> None:
        kind = request[0]
        if not self.validated:
            if kind != Query.VALIDATE or request[1] != tw.VALIDATION_MAGIC:
                raise ProtocolError("not a TCPStore client: its first request was no VALIDATE")
            self.validated = True
            self.server.admission.handshaking.discard(self)
            self.server.lifetimes.torch_came()
            return
        server = self.server
        timed = server.timed
        started = time.perf_counter() if timed else 0.0
        try:
            reply = _HANDLERS[kind](self, request)
        except StoreError as exc:  # (limits and refusals: the client can only be closed)
            if timed:
                server.config.hooks.request(f"tcpstore.{kind.name.lower()}", 0.0, type(exc).__name__)
            raise
        if reply:
            self._out.append(reply)
            self._out_bytes += len(reply)
        if timed:
            server.config.hooks.request(f"tcpstore.{kind.name.lower()}", time.perf_counter() - started, None)

    def _flush(self) -> None:
        out, self._out, self._out_bytes = self._out, [], 0
        if out and self.is_open:
            assert self.transport is not None
            self.transport.writelines(out)
            self._check_unread()

    def _check_unread(self) -> None:
        """Close a client past the replies it may leave unread (``connection.unread_excess``)."""
        why = unread_excess(self.server, self.buffered())
        if why is not None:
            self._close(LimitError(why))
            self.abort()  # (a close would keep the unread replies until it reads them)

    def wait_ended(self, wait: KeysWait | BarrierWait) -> None:
        """``wait``'s keys are all there, or its barrier is passed (called soon after, not
        inside the change that did it: a chain of clients each woken by the last one's queued
        ``set`` would nest without end)."""
        if self.waiting is not wait or not self.is_open:
            return  # (cancelled meanwhile: its CANCEL_WAIT was answered instead)
        self.waiting = None
        self._out.append(tw.STOP_WAITING)
        self._out_bytes += 1
        self._serve_and_flush()

    @property
    def job(self) -> Job:
        state = self.server.state
        return state.jobs.get(self.server.tcpstore_job) or state.job(self.server.tcpstore_job)

    def changed(self, key: str) -> None:
        self.server.waits.changed(self.server.tcpstore_job, key)

    # -- each query ------------------------------------------------------------------------
    def _set(self, request: tuple[Any, ...]) -> bytes:
        key = store_key(request[1])
        self.job.set(key, request[2])
        self.changed(key)
        return b""

    def _compare_set(self, request: tuple[Any, ...]) -> bytes:
        key = store_key(request[1])
        value = self.job.compare_set(key, request[2], request[3])
        self.changed(key)
        return tw.blob(value)

    def _get(self, request: tuple[Any, ...]) -> bytes:
        key = store_key(request[1])
        value = self.job.get(key)  # (a key deleted after the client's wait: empty, as torch's)
        return tw.blob(b"" if value is None else value)

    def _add(self, request: tuple[Any, ...]) -> bytes:
        key = store_key(request[1])
        total = self.job.add(key, request[2])
        self.changed(key)
        return tw.i64(total)

    def _check(self, request: tuple[Any, ...]) -> bytes:
        keys = [store_key(k) for k in request[1]]
        return tw.READY if self.job.has_all(keys) else tw.NOT_READY

    def _wait(self, request: tuple[Any, ...]) -> bytes:
        keys = [store_key(k) for k in request[1]]
        if self.job.has_all(keys):
            return tw.STOP_WAITING
        self.waiting = KeysWait(self, keys)
        self.waiting.wake()
        return b""

    def _barrier(self, request: tuple[Any, ...]) -> bytes:
        key, members = store_key(request[1]), request[2]
        found = barriers.barrier(self.server, self.server.tcpstore_job, key)
        if found.arrive(self.job, members):
            return tw.STOP_WAITING
        self.waiting = BarrierWait(self, found)
        found.hold(self.waiting)
        return b""

    def _cancel_wait(self, request: tuple[Any, ...]) -> bytes:
        if self.waiting is not None:  # (else it ended already: its STOP_WAITING went first)
            self.waiting.cancel()
            self.waiting = None
        return tw.WAIT_CANCELED

    def _num_keys(self, request: tuple[Any, ...]) -> bytes:
        return tw.i64(len(self.job.kv))

    def _delete(self, request: tuple[Any, ...]) -> bytes:
        return tw.i64(1 if self.job.delete(store_key(request[1])) else 0)

    def _append(self, request: tuple[Any, ...]) -> bytes:
        key = store_key(request[1])
        self.job.append(key, request[2])
        self.changed(key)
        return b""

    def _multi_get(self, request: tuple[Any, ...]) -> bytes:
        keys = [store_key(k) for k in request[1]]
        job = self.job
        values = [job.get(k) or b"" for k in keys]  # (deleted after the client's wait: empty)
        size = sum(len(v) + 8 for v in values)
        if size > MAX_UNREAD_REPLIES:
            limit = MAX_UNREAD_REPLIES
            raise LimitError(
                f"multi_get answer of {size} bytes, more than a client may leave unread ({limit})"
            )
        return tw.blobs(values)

    def _multi_set(self, request: tuple[Any, ...]) -> bytes:
        pairs = request[1]
        keys = [store_key(k) for k, _ in pairs]
        self.job.set_all(keys, [v for _, v in pairs])
        for key in keys:
            self.changed(key)
        return b""

    def _ping(self, request: tuple[Any, ...]) -> bytes:
        return tw.u32(request[1])

    def _queue_push(self, request: tuple[Any, ...]) -> bytes:
        key = store_key(request[1])
        self.job.queue_push(key, request[2])
        self.changed(key)
        return b""

    def _queue_pop(self, request: tuple[Any, ...]) -> bytes:
        return tw.popped(self.job.queue_pop(store_key(request[1])))

    def _queue_len(self, request: tuple[Any, ...]) -> bytes:
        return tw.i64(self.job.queue_len(store_key(request[1])))

    def _list_keys(self, request: tuple[Any, ...]) -> bytes:
        held = self.job.keys()  # (checked against one answer's size)
        return tw.key_list([client_key(k) for k in held])

    def _validate_again(self, request: tuple[Any, ...]) -> bytes:
        raise ProtocolError("a second VALIDATE")


_HANDLERS: dict[int, Callable[[TorchStoreConnection, tuple[Any, ...]], bytes]] = {
    Query.VALIDATE: TorchStoreConnection._validate_again,
    Query.SET: TorchStoreConnection._set,
    Query.COMPARE_SET: TorchStoreConnection._compare_set,
    Query.GET: TorchStoreConnection._get,
    Query.ADD: TorchStoreConnection._add,
    Query.CHECK: TorchStoreConnection._check,
    Query.WAIT: TorchStoreConnection._wait,
    Query.GETNUMKEYS: TorchStoreConnection._num_keys,
    Query.DELETE_KEY: TorchStoreConnection._delete,
    Query.APPEND: TorchStoreConnection._append,
    Query.MULTI_GET: TorchStoreConnection._multi_get,
    Query.MULTI_SET: TorchStoreConnection._multi_set,
    Query.CANCEL_WAIT: TorchStoreConnection._cancel_wait,
    Query.PING: TorchStoreConnection._ping,
    Query.QUEUE_PUSH: TorchStoreConnection._queue_push,
    Query.QUEUE_POP: TorchStoreConnection._queue_pop,
    Query.QUEUE_LEN: TorchStoreConnection._queue_len,
    Query.LIST_KEYS: TorchStoreConnection._list_keys,
    Query.BARRIER: TorchStoreConnection._barrier,
}


class KeysWait:
    """A client's ``wait``: parked on its first missing key (``waits.KeyWaits``) until every key
    has been there (a key seen keeps counting if deleted after, as torch's server counts sets;
    each wake looks on from the key it stopped at: a wait on N keys set one by one is O(N));
    no deadline of its own (torch's client sends ``CANCEL_WAIT`` at its timeout)."""

    __slots__ = ("_conn", "_keys", "_next", "parked")

    def __init__(self, conn: TorchStoreConnection, keys: list[str]) -> None:
        self._conn, self._keys = conn, keys
        self._next = 0
        self.parked: str | None = None

    def wake(self) -> None:
        conn = self._conn
        if conn.waiting is not self:
            return
        self.parked = None
        job, keys = conn.job, self._keys
        while self._next < len(keys):
            key = keys[self._next]
            if not job.present(key):
                self.parked = key
                conn.server.waits.park(conn.server.tcpstore_job, key, self)
                return
            self._next += 1
        asyncio.get_running_loop().call_soon(conn.wait_ended, self)

    def cancel(self) -> None:
        if self.parked is not None:
            self._conn.server.waits.unpark(self._conn.server.tcpstore_job, self.parked, self)
            self.parked = None


class BarrierWait:
    """A client's ``barrier`` not yet passed; no deadline of its own (torch's client sends
    ``CANCEL_WAIT`` at its timeout, and its arrival keeps counting, as on torch's server)."""

    __slots__ = ("_barrier", "conn")

    def __init__(self, conn: TorchStoreConnection, barrier: Barrier) -> None:
        self.conn, self._barrier = conn, barrier

    def passed(self) -> None:
        self.conn.wait_ended(self)

    def cancel(self) -> None:
        self._barrier.leave(self)


async def listen(server: Server, host: str, port: int, backlog: int) -> asyncio.Server:
    """Serve torch's TCPStore clients on ``host:port`` for ``server``."""
    loop = asyncio.get_running_loop()
    return await loop.create_server(
        lambda: TorchStoreConnection(server), host, port, reuse_address=True, backlog=backlog
    )
