"""One client connection of the server: its reads (the hello, then batches of requests) and its
replies (those to one read go out in one write; a client that does not read them is dropped)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from arendez import burstlog, transport, wire
from arendez.errors import ArendezError, LimitError, ProtocolError
from arendez.store_wire import HeaderReader, OversizedFrame, frame

from .rounds import Lease, Round

if TYPE_CHECKING:
    from .app import Server

log = logging.getLogger("arendez.server")


def by_host(what: str) -> Callable[[Sequence[tuple[str, str]]], str]:
    """A burst's summary line for items ``(host, text)``: how many ``what``, from how many
    hosts, and the last one's text."""

    def summarise(items: Sequence[tuple[str, str]]) -> str:
        hosts = {host for host, _ in items}
        return (
            f"{len(items)} more {what} in the last {burstlog.WINDOW:g} s, from {len(hosts)} "
            f"host(s); the last: {items[-1][1]}"
        )

    return summarise


#: Clients closed for a failed handshake (a wrong token) or a protocol error: the first of a
#: burst logged, the rest summed up (a client looping on a wrong token would flood the log).
CLOSINGS = burstlog.BurstLog(log, by_host("client(s) closed for a bad handshake or request"))


def note_closing(conn: transport.Connection, host: str, what: str, exc: BaseException) -> None:
    """Log ``what`` (``"closing"``, ``"protocol error from"``) of a client from ``host`` that
    is closed for ``exc``, in bursts (``CLOSINGS``)."""
    where = conn.where
    CLOSINGS.note(None, logging.INFO, (host, f"{where}: {exc}"), "%s %s: %s", what, where, exc)


#: Reply bytes a client may leave unread before the server drops it (all clients together:
#: ``ServerConfig.max_unread_bytes``).
MAX_UNREAD_REPLIES = 16 << 20
#: Unread reply bytes of one client from which the total of all is checked too.
CHECK_TOTAL_FROM = 1 << 20
#: Reply bytes gathered from one read that are written at once (and the reader checked).
FLUSH_AT = 64 << 10
#: Seconds a dropped client's connection stays open to read (and ignore) what it sent.
DROP_DELAY = 0.2
#: Frames a client may queue before its hello is checked.
HELLO_FRAMES = 2
#: Where the bytes a refused client still sends are read to, and dropped (``refuse``).
_DISCARD = memoryview(bytearray(64 << 10))


def unread_excess(server: Server, unread: int) -> str | None:
    """Why a client that left ``unread`` bytes of replies unread is past a limit: over
    ``MAX_UNREAD_REPLIES`` of its own, or while all clients' unread replies pass the server's
    ``max_unread_bytes``; None if it is not."""
    if unread <= CHECK_TOTAL_FROM:
        return None
    if unread > MAX_UNREAD_REPLIES:
        return f"client left {unread} bytes of replies unread (limit {MAX_UNREAD_REPLIES})"
    budget = server.config.max_unread_bytes
    total = sum(c.buffered() for c in server.backlogged)
    if total > budget:
        return (
            f"client left {unread} bytes of replies unread while all clients left {total} "
            f"(the server's limit, --max-unread-bytes: {budget})"
        )
    return None


class Backlogged(Protocol):
    """A connection whose replies wait to be read (an arendez client's or a torch one's)."""

    def buffered(self) -> int: ...


class Pending(Protocol):
    """A request of a session still waiting: a task, or a join (``joins.JoinWait``)."""

    def cancel(self) -> object: ...


class Session:
    """One client connection after its handshake; the replies to one read go out in one write."""

    def __init__(self, server: Server, conn: ServerConnection, job: str) -> None:
        self.server = server
        self.conn = conn
        self.job = job
        self.rank: int | None = None  # set once this connection is a member of a round
        self.round: Round | None = None
        self.lease: Lease | None = None  # set on the lease connection of a client process
        #: What waits for this connection (tasks of blocking requests, joins): cancelled with it.
        self.tasks: set[Pending] = set()
        self.packer = server.packer
        self._out: list[bytes | memoryview] = []
        self._out_bytes = 0
        self.dropped = False  # no more answers: the connection closes shortly

    def reply(self, rid: Any, value: Any) -> None:
        if rid is not None:
            self.send({"id": rid, "ok": value})

    def reply_value(self, rid: Any, value: Any) -> None:
        """The compact reply ``[rid, value]`` (to a compact request)."""
        data = frame(self.packer.pack([rid, value]))
        if self.conn.corked:
            self._out.append(data)
            self._out_bytes += len(data)
            if self._out_bytes >= FLUSH_AT:  # large replies go out at once, checked as they go
                self.flush()
        else:
            self.send_encoded([data])

    def reply_error(self, rid: Any, exc: ArendezError) -> None:
        frame = transport.error_frame(exc)
        frame["id"] = rid
        self.send(frame)

    def send(self, frame: dict[str, Any]) -> None:
        self.send_encoded(wire.encode(frame))

    def send_encoded(self, buffers: list[bytes | memoryview]) -> None:
        """Send encoded frames: at once, or, while the connection is handing us a batch of
        requests, together with the other replies of that batch in one write."""
        conn = self.conn
        if self.dropped or not conn.is_open:
            return
        if conn.corked:
            self._out.extend(buffers)
            self._out_bytes += sum(len(b) for b in buffers)
            if self._out_bytes >= FLUSH_AT:  # large replies go out at once, checked as they go
                self.flush()
            return
        conn.send_encoded(buffers)
        self.check_unread()

    def check_unread(self) -> None:
        """Drop a client that leaves too many replies unread (``unread_excess``)."""
        if self.dropped:
            return
        why = unread_excess(self.server, self.conn.buffered())
        if why is not None:
            self.drop(ProtocolError(why))

    def drop(self, exc: ArendezError) -> None:
        """Stop answering; close soon, once what the client already sent has been read
        (closing on unread bytes would reset the connection and lose the replies it has),
        freeing the replies it left unread."""
        self.dropped = True
        log.warning("dropping a client of job %r at %s: %s", self.job, self.conn.where, exc)
        asyncio.get_running_loop().call_later(DROP_DELAY, self._abort, exc)

    def _abort(self, exc: ArendezError) -> None:
        self.conn.fail(exc)
        self.conn.abort()  # (a close would keep the unread replies until the client reads them)

    def flush(self) -> None:
        """Write the replies gathered while corked (one write for a batch of requests)."""
        out, self._out, self._out_bytes = self._out, [], 0
        if out and not self.dropped and self.conn.is_open:
            self.conn.send_encoded(out)
            self.check_unread()


def count_unfinished(server: Server, before: int, now: int, pending: int) -> LimitError | None:
    """Move one client's share of the server's unfinished-request bytes from ``before`` to
    ``now`` (``pending``: its request's bytes so far); the refusal if that growth passes
    ``--max-unfinished-bytes`` (all clients' together)."""
    server.unfinished += now - before
    budget = server.config.max_unfinished_bytes
    if now <= before or server.unfinished <= budget:
        return None
    return LimitError(
        f"a request of {pending}+ bytes still arriving while all clients' unfinished requests "
        f"hold {server.unfinished} bytes (the server's limit, --max-unfinished-bytes: {budget})"
    )


def _named(exc: ProtocolError) -> ArendezError:
    """A request past the server's size limit as the ``LimitError`` the clients raise before
    sending one; any other protocol error as it is."""
    if not isinstance(exc, OversizedFrame):
        return exc
    return LimitError(
        f"a request of {exc.size} bytes exceeds the server's limit of {exc.limit} bytes per "
        "request (its largest value and key, plus 4096)"
    )


class ServerConnection(transport.Connection):
    """A client connection of the server: tells the server when it is made."""

    TUNE_SOCKET = False  # the listening socket was tuned (``Server.start``); no payloads come

    def __init__(self, server: Server, limits: wire.Limits) -> None:
        super().__init__(limits, max_queued=HELLO_FRAMES)
        self._decoder.one_frame = True  # the hello alone: requests behind it get the session's limits
        self.server = server
        self.host = ""
        self.nonce = b""
        self.deadline = 0.0
        self.session: Session | None = None
        #: Reads the requests once the handshake is done (``wire.Decoder`` reads the hello).
        self.reader: HeaderReader | None = None
        #: True while the frames of one read are being answered: replies wait for one write.
        self.corked = False
        #: Bytes counted toward the server's ``unfinished`` (``HeaderReader.held``), and the
        #: refusal once they pass its budget.
        self.held = 0
        self.over: ArendezError | None = None

    def connection_made(self, transport_: asyncio.BaseTransport) -> None:
        super().connection_made(transport_)
        self.server._made(self)

    def pause_writing(self) -> None:  # (replies wait in our buffer: counted toward the total)
        super().pause_writing()
        self.server.backlogged.add(self)

    def resume_writing(self) -> None:
        super().resume_writing()
        self.server.backlogged.discard(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.server.backlogged.discard(self)
        self.server.unfinished -= self.held
        self.held = 0
        super().connection_lost(exc)

    def start_session(self, session: Session, max_header: int) -> None:
        """Read requests of up to ``max_header`` bytes from now on (what came after the hello too)."""
        self.session = session
        self.reader = HeaderReader(max_header, self._decoder.take_rest())

    def get_buffer(self, sizehint: int) -> memoryview:
        reader = self.reader
        if self.over is not None:  # (refused: what it still sends is read and dropped)
            return _DISCARD
        if reader is None:
            return super().get_buffer(sizehint)
        view = reader.get_buffer()
        if reader.held() != self.held:
            self._count_held(reader)
        return view

    def refuse(self, exc: ArendezError) -> None:
        """Tell the client why at once, let go of its request, read and drop what it still
        sends for ``DROP_DELAY`` (so that it can finish sending and read why), then close."""
        note_closing(self, self.host, "refusing", exc)
        if self.over is None:
            self.over = transport.detached(exc)  # (its traceback's frames would keep us alive)
        self.reader = None
        self.server.unfinished -= self.held
        self.held = 0
        if self._transport is not None and not self._transport.is_closing():
            self._transport.writelines(wire.encode(self._error_header(exc)))
        asyncio.get_running_loop().call_later(DROP_DELAY, self.abort)

    def _count_held(self, reader: HeaderReader) -> None:
        """Count the bytes this connection's unfinished request holds toward the server's
        ``--max-unfinished-bytes`` (all clients' together)."""
        held = reader.held()
        refusal = count_unfinished(self.server, self.held, held, reader.pending())
        self.held = held
        if refusal is not None and self.over is None:
            self.over = refusal

    def buffer_updated(self, nbytes: int) -> None:
        if self.over is not None:  # (its request passed the server's budget: refused)
            if self.reader is not None:
                self.refuse(self.over)
            return
        session, reader = self.session, self.reader
        if session is None or reader is None:
            super().buffer_updated(nbytes)  # the handshake (its handlers take over from it)
            if self.session is not None and self.reader is not None and self.reader.pending():
                self._requests(self.session, self.reader, 0)  # sent right behind the hello
            return
        self._requests(session, reader, nbytes)

    def _requests(self, session: Session, reader: HeaderReader, nbytes: int) -> None:
        """Answer the requests completed by ``nbytes`` more bytes (their replies in one write)."""
        try:
            requests = reader.feed(nbytes)
        except ProtocolError as exc:
            self.refuse(_named(exc))
            return
        if reader.held() != self.held:  # (a large request done: its buffer let go)
            self._count_held(reader)
        if not requests:
            return
        server = self.server
        compact = server._compact
        self.corked = True
        try:
            for request in requests:
                if session.dropped:
                    break
                if type(request) is list:
                    compact(session, request)
                else:
                    server._on_request(session, request)
        except Exception as exc:  # a request the server could not digest
            self.fail(ProtocolError(f"bad frame: {type(exc).__name__}: {exc}"), tell_peer=True)
        finally:
            self.corked = False
            session.flush()
