"""Blocking client of the arendez store: plain sockets, no event loop.

For plain scripts, threads and torch-like code (``TCPStore``'s clients are blocking too):
one request at a time on one connection, two system calls per operation. Same server, same
keys and errors as the async ``Store``: a failed request raises the server's error, a call
that gets no answer in time raises ``StoreTimeoutError``, and a lost connection fails the call
that was in flight with ``StoreError`` and is reopened by the next call. Not thread-safe: use
one client per thread.
"""

from __future__ import annotations

import socket
import ssl as _ssl
import time
from collections.abc import Iterable
from typing import Any

import msgpack

from . import transport, validate, wire
from .errors import (
    AuthenticationError,
    LimitError,
    ProtocolError,
    RendezvousError,
    StoreError,
    StoreTimeoutError,
)

_REPLY_LIMIT = 64 << 20  # replies carry values in their header (server bound: 1 MiB by default)
_CALL_TIMEOUT = 30.0
_REPLY_SLACK = 2.0

transport.register_remote_errors(
    StoreError, StoreTimeoutError, RendezvousError, ProtocolError, AuthenticationError, LimitError
)


def _to_bytes(value: str | bytes | bytearray | memoryview) -> bytes:
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    raise TypeError(f"store values are str or bytes, not {type(value).__name__}")


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
        self._buf = bytearray()
        self._packer = msgpack.Packer(use_bin_type=True)
        self._id = 0

    # -- connection ------------------------------------------------------------------------
    def connect(self) -> BlockingStore:
        """Open the connection now (otherwise the first call opens it)."""
        self._ensure()
        return self

    def _ensure(self) -> socket.socket:
        if self._sock is not None:
            return self._sock
        try:
            sock = socket.create_connection((self.host, self.port), timeout=self._connect_timeout)
        except OSError as exc:
            raise StoreError(f"store at {self.host}:{self.port} unreachable: {exc}") from None
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._ssl is not None:
                sock = self._ssl.wrap_socket(sock, server_hostname=self.host)
            self._sock, self._buf = sock, bytearray()
            peer = f"{self.host}:{self.port}"
            challenge = self._recv(time.monotonic() + self._connect_timeout)
            reply, nonce = transport.answer_challenge(challenge, self._token, {"job": self.job}, peer)
            self._sendall(self._frame(reply))
            welcome = self._recv(time.monotonic() + self._connect_timeout)
            transport.check_welcome(welcome, self._token, nonce, peer)
        except BaseException:
            self.close()
            raise
        return sock

    def close(self) -> None:
        """Close the connection (a later call reopens it)."""
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()

    def __enter__(self) -> BlockingStore:
        return self.connect()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- framing ---------------------------------------------------------------------------
    def _frame(self, header: Any) -> bytes:
        raw: bytes = self._packer.pack(header)
        return wire.PREFIX.pack(len(raw), 0) + raw

    def _sendall(self, data: bytes) -> None:
        assert self._sock is not None
        self._sock.settimeout(self._connect_timeout)
        self._sock.sendall(data)

    def _recv(self, deadline: float) -> Any:
        """The next frame's header (blocking until ``deadline``)."""
        sock, buf = self._sock, self._buf
        assert sock is not None
        while True:
            if len(buf) >= wire.PREFIX.size:
                hlen, plen = wire.PREFIX.unpack_from(buf)
                if hlen > _REPLY_LIMIT or plen:
                    raise ProtocolError(f"unexpected store frame: {hlen}-byte header, {plen}-byte payload")
                end = wire.PREFIX.size + hlen
                if len(buf) >= end:
                    try:
                        header = msgpack.unpackb(memoryview(buf)[wire.PREFIX.size : end], raw=False)
                    except Exception as exc:
                        raise ProtocolError(f"undecodable frame from the store: {exc}") from None
                    del buf[:end]
                    return header
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError
            sock.settimeout(remaining)
            data = sock.recv(1 << 16)
            if not data:
                raise ConnectionResetError("the store closed the connection")
            buf += data

    def _call(self, op: str, timeout: float | None = None, wait: bool = False, **fields: Any) -> Any:
        budget = self.timeout if timeout is None else float(timeout)
        if not wait:
            budget = min(budget, _CALL_TIMEOUT)
        deadline = time.monotonic() + budget
        self._ensure()
        self._id += 1
        rid = fields["id"] = self._id
        fields["op"] = op
        if wait:
            fields["timeout"] = budget
        try:
            self._sendall(self._frame(fields))
            while True:
                header = self._recv(deadline + (_REPLY_SLACK if wait else 0.0))
                if not isinstance(header, dict):
                    continue
                if header.get("id") == rid:
                    break
                if header.get("id") is None and "error" in header:  # dropped for a protocol error
                    raise transport.remote_error(header, StoreError)
        except TimeoutError:
            self.close()  # the answer may still come: this connection is out of step now
            raise StoreTimeoutError(f"store {op} got no answer within {budget:g}s") from None
        except (OSError, ProtocolError) as exc:
            self.close()
            where = f"{self.host}:{self.port}"
            raise StoreError(f"store {op} failed: lost the connection to {where}: {exc}") from None
        if "error" in header:
            raise transport.remote_error(header, StoreError)
        return header.get("ok")

    # -- operations ------------------------------------------------------------------------
    def set(self, key: str, value: str | bytes, timeout: float | None = None) -> None:
        """Store ``value`` under ``key``."""
        self._call("set", timeout, key=key, value=_to_bytes(value))

    def get(self, key: str, timeout: float | None = None) -> bytes:
        """The value of ``key``, waiting up to ``timeout`` for it to be set."""
        value: bytes = self._call("get", timeout, wait=True, key=key)
        return value

    def add(self, key: str, amount: int = 1, timeout: float | None = None) -> int:
        """Atomically add ``amount`` to the integer at ``key`` (missing = 0); return the sum."""
        total: int = self._call("add", timeout, key=key, amount=int(amount))
        return total

    def compare_set(
        self, key: str, expected: str | bytes, desired: str | bytes, timeout: float | None = None
    ) -> bytes:
        """Set ``desired`` if ``key`` holds ``expected`` (or is missing and ``expected`` is
        empty); return the value the key holds afterwards."""
        value: bytes = self._call(
            "compare_set", timeout, key=key, expected=_to_bytes(expected), desired=_to_bytes(desired)
        )
        return value

    def wait(self, keys: Iterable[str], timeout: float | None = None) -> None:
        """Wait until every key in ``keys`` is set; ``StoreTimeoutError`` after ``timeout``."""
        self._call("wait", timeout, wait=True, keys=list(keys))

    def check(self, keys: Iterable[str], timeout: float | None = None) -> bool:
        """True if every key in ``keys`` is set (no waiting)."""
        found: bool = self._call("check", timeout, keys=list(keys))
        return found

    def delete(self, key: str, timeout: float | None = None) -> bool:
        """Delete ``key``; True if it existed."""
        existed: bool = self._call("delete", timeout, key=key)
        return existed

    def num_keys(self, timeout: float | None = None) -> int:
        """How many keys the job's store holds."""
        count: int = self._call("num_keys", timeout)
        return count


__all__ = ["BlockingStore"]
