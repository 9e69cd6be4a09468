"""Blocking client of the arendez store: plain sockets, no event loop.

For plain scripts, threads and torch-like code (``TCPStore``'s clients are blocking too):
one request at a time on one connection, two system calls per operation (the compact request
form of ``store_wire``; deadlines are the kernel's ``SO_RCVTIMEO``/``SO_SNDTIMEO``, set only
when they change, so no ``poll`` precedes each call). Same server, same keys and errors as the
async ``Store``: a failed request raises the server's error, a call that gets no answer in
time raises ``StoreTimeoutError``, and a lost connection fails the call that was in flight
with ``StoreError`` and is reopened by the next call. Not thread-safe: use one client per thread.
"""

from __future__ import annotations

import collections
import socket
import ssl as _ssl
import struct
import time
from collections.abc import Iterable
from typing import Any

from . import handshake, transport, validate
from .errors import (
    ProtocolError,
    StoreConnectionError,
    StoreError,
    StoreTimeoutError,
    earlier_set_error,
)
from .store_wire import (
    MAX_KEY,
    MAX_REQUEST,
    STORE_ERRORS,
    STORE_PROTOCOL,
    HeaderReader,
    check_request_size,
    frame,
    store_key,
    to_bytes,
)
from .transports import local
from .wire import small_packer

_REPLY_LIMIT = 64 << 20  # replies carry values in their header (server bound: 1 MiB by default)
_TIMEVAL = struct.Struct("@ll")
_CALL_TIMEOUT = 30.0
_monotonic = time.monotonic
#: ``set``s that may be sent before their answers are read (then one waits for all of them)
_MAX_UNACKED = 256
#: ... each of at most this many bytes (a larger one waits, so a refusal of its size is raised)
MAX_UNACKED_BYTES = 64 << 10
#: A set whose key is longer waits for its answer: the server may refuse it (``MAX_KEY`` bytes by
#: default), and that refusal then names the limit at once, not on a later call.
LONG_KEY = MAX_KEY // 4
_REPLY_SLACK = 1.0  # how long past a waiting op's timeout the server's own answer may take
#: Ops that only wait for keys: one that reads the refusal of an earlier ``set`` raises it at
#: once (its key may never come; the late answer of the abandoned request is skipped).
WAITING_READS = frozenset({"get", "wait", "multi_get"})

transport.register_remote_errors(*STORE_ERRORS)


class BlockingStore:
    """A blocking connection to one job's namespace on an arendez server."""

    def __init__(
        self,
        host: str,
        port: int,
        job: str = "",
        *,
        token: str | None = None,
        ssl: _ssl.SSLContext | None = None,
        timeout: float = 300.0,
        connect_timeout: float = 20.0,
    ) -> None:
        port = validate.store_address(host, port, job)
        timeout = validate.seconds(timeout, "timeout")
        connect_timeout = validate.seconds(connect_timeout, "connect_timeout")
        self.host, self.port, self.job = host, port, job
        self.timeout = timeout
        self._connect_timeout = connect_timeout
        self._token = token
        self._ssl = ssl
        self._sock: socket.socket | None = None
        self._reader = HeaderReader(_REPLY_LIMIT)
        self._ready: collections.deque[Any] = collections.deque()  # frames read, not yet used
        self._packer = small_packer()
        self._pack = self._packer.pack
        self._id = 0
        #: ``set``s sent whose answers were not read yet (request id -> key), and the errors they
        #: got, each raised by a later call (torch's ``set`` waits for no answer either)
        self._unacked: dict[int, str] = {}
        self._set_errors: list[StoreError] = []  # refused sets not raised yet, first first
        self._wait_set = -1.0  # the socket's current timeout for one call

    # -- connection ------------------------------------------------------------------------
    def connect(self, timeout: float | None = None) -> BlockingStore:
        """Open the connection now (otherwise the first call opens it), within ``timeout``
        seconds if that is less than the connect timeout."""
        self._ensure(timeout)
        return self

    def _ensure(self, timeout: float | None = None) -> socket.socket:
        if self._sock is not None:
            return self._sock
        budget = self._connect_timeout if timeout is None else min(max(timeout, 0.001), self._connect_timeout)
        started = time.monotonic()  # (one deadline for the connect and the whole handshake)
        try:  # (TLS never takes the server's local socket)
            sock = local.open_blocking(self.host, self.port, budget, local_ok=self._ssl is None)
        except OSError as exc:
            raise StoreConnectionError(f"store at {self.host}:{self.port} unreachable: {exc}") from None
        try:
            if self._ssl is not None:
                sock.settimeout(max(started + budget - time.monotonic(), 0.001))
                sock = self._ssl.wrap_socket(sock, server_hostname=self.host)
            self._sock = sock
            self._reader, self._ready, self._wait_set = HeaderReader(_REPLY_LIMIT), collections.deque(), -1.0
            peer = f"{self.host}:{self.port}"
            self._set_wait(sock, max(started + budget - time.monotonic(), 0.001))
            challenge = self._next(sock, started, budget)
            reply, nonce = handshake.answer_challenge(challenge, self._token, {"job": self.job}, peer)
            welcome = handshake.early_welcome(challenge, self._token)
            if welcome is not None:  # (no welcome follows: requests may go right behind the hello)
                reply["early"] = True
            sock.sendall(frame(self._packer.pack(reply)))
            if welcome is None:
                self._set_wait(sock, max(started + budget - time.monotonic(), 0.001))
                welcome = self._next(sock, started, budget)
                handshake.check_welcome(welcome, self._token, nonce, peer)
            if welcome.get("store") != STORE_PROTOCOL:
                raise ProtocolError(
                    f"the store at {peer} speaks store protocol {welcome.get('store', 1)}, "
                    f"this client needs {STORE_PROTOCOL} (upgrade arendez-server)"
                )
            if self._ssl is None:  # deadlines from the kernel from now on (no poll per call)
                sock.settimeout(None)
                self._wait_set = -1.0
        except TimeoutError:
            self.close()
            raise StoreConnectionError(
                f"store at {self.host}:{self.port} did not answer the handshake (a very busy server, "
                "not an arendez-server's store port"
                + (")" if self._ssl is not None else ", or a server with TLS: pass ssl=)")
            ) from None
        except OSError as exc:  # (e.g. the server gave up on a handshake that came too late)
            self.close()
            raise StoreConnectionError(
                f"store at {self.host}:{self.port} closed the connection during the handshake: {exc}"
            ) from None
        except BaseException:
            self.close()
            raise
        return sock

    def close(self) -> None:
        """Close the connection (a later call reopens it)."""
        sock, self._sock = self._sock, None
        self._unacked.clear()
        if sock is not None:
            sock.close()

    def _answered(self, reply: Any) -> bool:
        """Take ``reply`` if it answers an unacknowledged ``set`` (keeping its error, to raise
        from a later call: each refused set is raised once, in order)."""
        if type(reply) is list:
            return len(reply) == 2 and self._unacked.pop(reply[0], None) is not None
        if not isinstance(reply, dict):
            return False
        key = self._unacked.pop(reply.get("id"), None)  # type: ignore[arg-type]
        if key is None:
            return False
        if "error" in reply:
            self._set_errors.append(earlier_set_error(key, transport.remote_error(reply, StoreError)))
        return True

    def _raise_set_error(self) -> None:
        if self._set_errors:
            raise self._set_errors.pop(0)

    def __enter__(self) -> BlockingStore:
        return self.connect()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- framing ---------------------------------------------------------------------------
    def _set_wait(self, sock: socket.socket, seconds: float) -> None:
        """Let the next send and receive block for at most ``seconds``."""
        self._wait_set = seconds
        if sock.gettimeout() is not None:  # the handshake, or TLS: Python's own timeout
            sock.settimeout(seconds)
            return
        micros = max(1, round(seconds * 1e6))  # (0 would mean "forever")
        tv = _TIMEVAL.pack(micros // 1_000_000, micros % 1_000_000)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)

    def _next(self, sock: socket.socket, started: float, budget: float) -> Any:
        """The next frame's header, within ``budget`` seconds of ``started``."""
        ready = self._ready
        reader = self._reader
        while not ready:
            ready.extend(reader.recv(sock))
            if ready:
                break
            remaining = started + budget - _monotonic()  # (the socket's timeout may be shorter)
            if remaining <= 0:
                raise TimeoutError
            self._set_wait(sock, remaining)
        return ready.popleft()

    def _framed(self, request: list[Any]) -> tuple[socket.socket, int, bytes]:
        """Before a request goes: an earlier set's error raised, the connection (opened if
        needed), the request's id filled in, and its frame (refused past the size limit)."""
        if self._set_errors:
            self._raise_set_error()
        sock = self._sock or self._ensure()
        self._id = request[1] = rid = self._id + 1
        data = frame(self._pack(request))
        if len(data) > MAX_REQUEST:
            check_request_size(request[0], len(data))
        return sock, rid, data

    def _wait_within(self, sock: socket.socket, budget: float) -> None:
        """Let the socket block for at most ``budget``: its timeout only has to be no longer
        than that (a shorter one wakes a long wait up now and then, which ``_next`` waits on),
        so it changes rarely."""
        current = self._wait_set
        if current > budget or current < 0.5 * min(budget, _CALL_TIMEOUT):
            self._set_wait(sock, budget)

    def _call(self, request: list[Any], budget: float, waited: float | None = None) -> Any:
        """Send the compact ``request`` ``[op, None, *args]`` (its id filled in here); its answer
        within ``budget`` seconds (``waited``: the caller's timeout of a waiting op, which the
        server itself enforces)."""
        started = _monotonic()
        sock, rid, data = self._framed(request)
        op = request[0]
        reader = self._reader
        try:
            self._wait_within(sock, budget)
            try:
                sock.sendall(data)
            except BlockingIOError:  # SO_SNDTIMEO expired
                raise TimeoutError from None
            if not self._ready:  # the usual case: the reply, whole in one read
                got = reader.recv(sock)
                if len(got) == 1:
                    reply = got[0]
                    if type(reply) is list and len(reply) == 2 and reply[0] == rid:
                        return reply[1]
                self._ready.extend(got)
            while True:
                reply = self._next(sock, started, budget)
                if self._unacked and self._answered(reply):
                    if self._set_errors and op in WAITING_READS:
                        break  # (raised below, outside this block: it may be a TimeoutError)
                    continue
                if type(reply) is list:
                    if len(reply) == 2 and reply[0] == rid:
                        return reply[1]
                    continue
                if not isinstance(reply, dict):
                    continue
                found = reply.get("id")
                if found == rid:
                    break
                if found is None and "error" in reply:  # dropped for a protocol error
                    raise transport.remote_error(reply, StoreError)
        except TimeoutError:
            self.close()  # the answer may still come: this connection is out of step now
            if waited is not None:  # the server did not even answer that the wait timed out
                raise StoreTimeoutError(
                    f"store {op} timed out: not satisfied within {waited:g}s, and no answer from the store "
                    f"at {self.host}:{self.port} {_REPLY_SLACK:g}s past that (unreachable or stalled?)"
                ) from None
            raise StoreTimeoutError(f"store {op} got no answer within {budget:g}s") from None
        except (OSError, ProtocolError) as exc:
            self.close()
            where = f"{self.host}:{self.port}"
            raise StoreConnectionError(f"store {op} failed: lost the connection to {where}: {exc}") from None
        if self._set_errors and op in WAITING_READS:
            self._raise_set_error()
        if "error" in reply:
            raise transport.remote_error(reply, StoreError)
        return reply.get("ok")

    def _budget(self, timeout: float | None) -> float:
        """Seconds a call that does not wait on the server may take."""
        seconds = self.timeout if timeout is None else float(timeout)
        return seconds if seconds < _CALL_TIMEOUT else _CALL_TIMEOUT

    def _wait_budget(self, timeout: float | None) -> float:
        return self.timeout if timeout is None else float(timeout)

    # -- operations ------------------------------------------------------------------------
    def set(self, key: str, value: str | bytes, timeout: float | None = None) -> None:
        """Store ``value`` under ``key``. Returns once the request is sent, as torch's: its answer
        is read by a later call, and an error in it (a limit, say) is raised, as its own class, by
        the call after that. A value over 64 KiB, or a key over 1 KiB, waits for its answer."""
        if type(key) is not str:
            key = store_key(key)
        if type(value) is not bytes:
            value = to_bytes(value)
        request: list[Any] = ["set", None, key, value]
        budget = self._budget(timeout)
        if (
            len(self._unacked) >= _MAX_UNACKED
            or len(value) > MAX_UNACKED_BYTES
            or len(key) > LONG_KEY
            or self._ssl is not None
        ):
            self._call(request, budget)  # (its answer comes after theirs: all are read)
            return
        sock, rid, data = self._framed(request)
        self._wait_within(sock, budget)
        try:
            sock.sendall(data)
        except BlockingIOError:  # SO_SNDTIMEO expired
            self.close()
            raise StoreTimeoutError(f"store set of {key!r} could not be sent within {budget:g}s") from None
        except OSError as exc:
            self.close()
            where = f"{self.host}:{self.port}"
            raise StoreConnectionError(f"store set failed: lost the connection to {where}: {exc}") from None
        self._unacked[rid] = key

    def get(self, key: str, timeout: float | None = None) -> bytes:
        """The value of ``key``, waiting up to ``timeout`` for it to be set."""
        wait = self._wait_budget(timeout)
        value: bytes = self._call(["get", None, key, wait], wait + _REPLY_SLACK, waited=wait)
        return value

    def add(self, key: str, amount: int = 1, timeout: float | None = None) -> int:
        """Atomically add ``amount`` to the integer at ``key`` (missing = 0); return the sum."""
        if type(amount) is not int:
            amount = int(amount)
        total: int = self._call(["add", None, key, amount], self._budget(timeout))
        return total

    def compare_set(
        self, key: str, expected: str | bytes, desired: str | bytes, timeout: float | None = None
    ) -> bytes:
        """Set ``desired`` if ``key`` holds ``expected`` (or is missing and ``expected`` is
        empty); return the value the key holds afterwards."""
        value: bytes = self._call(
            ["compare_set", None, key, to_bytes(expected), to_bytes(desired)], self._budget(timeout)
        )
        return value

    def wait(self, keys: Iterable[str], timeout: float | None = None) -> None:
        """Wait until every key in ``keys`` is set; ``StoreTimeoutError`` after ``timeout``."""
        wait = self._wait_budget(timeout)
        self._call(["wait", None, list(keys), wait], wait + _REPLY_SLACK, waited=wait)

    def barrier(self, key: str, count: int, timeout: float | None = None) -> None:
        """Count this caller at ``key`` and return once the counter there reaches ``count``
        (``arendez.sync.TCPStore.barrier``: torch's ``TCPStore.barrier`` rules)."""
        wait = self._wait_budget(timeout)
        self._call(["barrier", None, key, int(count), wait], wait + _REPLY_SLACK, waited=wait)

    def check(self, keys: Iterable[str], timeout: float | None = None) -> bool:
        """True if every key in ``keys`` is set (no waiting)."""
        found: bool = self._call(["check", None, list(keys)], self._budget(timeout))
        return found

    def delete(self, key: str, timeout: float | None = None) -> bool:
        """Delete ``key``; True if it existed."""
        existed: bool = self._call(["delete", None, key], self._budget(timeout))
        return existed

    def num_keys(self, timeout: float | None = None) -> int:
        """How many keys the job's store holds."""
        count: int = self._call(["num_keys", None], self._budget(timeout))
        return count

    def multi_get(self, keys: Iterable[str], timeout: float | None = None) -> list[bytes]:
        """The values of ``keys``, in order, waiting up to ``timeout`` for any not yet set."""
        wait = self._wait_budget(timeout)
        values: list[bytes] = self._call(
            ["multi_get", None, list(keys), wait], wait + _REPLY_SLACK, waited=wait
        )
        return values

    def multi_set(
        self, keys: Iterable[str], values: Iterable[str | bytes], timeout: float | None = None
    ) -> None:
        """Set each of ``keys`` to the value at its position in ``values``, in one request."""
        keys, values = list(keys), [to_bytes(v) for v in values]
        if len(keys) != len(values):
            raise ValueError(f"multi_set got {len(keys)} keys but {len(values)} values")
        self._call(["multi_set", None, keys, values], self._budget(timeout))

    def list_keys(self, timeout: float | None = None) -> list[str]:
        """Every key of the job's store that holds a value (queues are not listed)."""
        keys: list[str] = self._call(["list_keys", None], self._budget(timeout))
        return keys

    def append(self, key: str, value: str | bytes, timeout: float | None = None) -> None:
        """Append ``value`` to the bytes at ``key`` (created if missing), atomically."""
        self._call(["append", None, key, to_bytes(value)], self._budget(timeout))

    def queue_push(self, key: str, value: str | bytes, timeout: float | None = None) -> None:
        """Append ``value`` to the queue ``key`` (queues are apart from the keys' values)."""
        self._call(["queue_push", None, key, to_bytes(value)], self._budget(timeout))

    def queue_pop(self, key: str, block: bool = True, timeout: float | None = None) -> bytes:
        """The oldest value of the queue ``key``, removed: waiting up to ``timeout`` for one
        (``StoreTimeoutError``), or with ``block=False`` ``QueueEmptyError`` at once."""
        wait = self._wait_budget(timeout) if block else 0.0
        value: bytes = self._call(
            ["queue_pop", None, key, bool(block), wait], wait + _REPLY_SLACK, waited=wait
        )
        return value

    def queue_len(self, key: str, timeout: float | None = None) -> int:
        """How many values the queue ``key`` holds."""
        count: int = self._call(["queue_len", None, key], self._budget(timeout))
        return count


__all__ = ["BlockingStore"]
