"""The lease keeper: a rank's heartbeats, sent from a thread of their own.

Heartbeats that ran on the event loop would stop whenever user code keeps the loop busy (a
long numpy step between collectives), and the server would declare a healthy rank failed.
The keeper thread holds its own small blocking connection to the server, attaches to the
rank's membership and heartbeats every ``interval`` seconds; a rank whose whole process stops
(killed, SIGSTOP, frozen host) still loses its lease.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import socket
import ssl as _ssl
import threading
from typing import Any

from . import transport, wire
from .errors import ArendezError, AuthenticationError, RendezvousError

log = logging.getLogger("arendez.lease")


class _FrameSocket:
    """Blocking framed socket: the same codec as the asyncio connections."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._decoder = wire.Decoder(limits=wire.Limits(max_header=64 << 20, max_payload=0))
        self._frames: collections.deque[Any] = collections.deque()

    def send(self, header: Any) -> None:
        self.sock.sendall(b"".join(bytes(b) for b in wire.encode(header)))

    def recv(self) -> Any:
        while not self._frames:
            buf = self._decoder.get_buffer()
            n = self.sock.recv_into(buf)
            if not n:
                raise ConnectionResetError("the server closed the lease connection")
            self._frames.extend(h for h, _ in self._decoder.feed(n))
        return self._frames.popleft()

    def discard_pending(self) -> None:
        """Read and drop what the server pushed (events) without blocking."""
        self.sock.setblocking(False)
        try:
            while True:
                self.recv()
        except (BlockingIOError, _ssl.SSLWantReadError):
            pass
        finally:
            self.sock.settimeout(5.0)


class LeaseKeeper:
    """Keeps the lease of ``rank`` of round ``nonce`` of ``job`` alive until ``stop``."""

    def __init__(
        self,
        host: str,
        port: int,
        job: str,
        membership: dict[str, Any],
        *,
        token: str | None,
        ssl: _ssl.SSLContext | None,
        interval: float = 0.5,
    ) -> None:
        self._where = (host, port)
        self._job = job
        self._attach = {"op": "attach", "id": 0, **membership}
        self._token = token
        self._ssl = ssl
        self._interval = interval
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="arendez-lease", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 1.0) -> None:
        self._stopped.set()
        self._thread.join(timeout)

    def _open(self) -> _FrameSocket:
        sock = socket.create_connection(self._where, timeout=5.0)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._ssl is not None:
                sock = self._ssl.wrap_socket(sock, server_hostname=self._where[0])
            conn = _FrameSocket(sock)
            reply, nonce = transport.answer_challenge(
                conn.recv(), self._token, {"job": self._job}, self._where
            )
            conn.send(reply)
            transport.check_welcome(conn.recv(), self._token, nonce, self._where)
            conn.send(self._attach)
            answer = conn.recv()
            if isinstance(answer, dict) and "error" in answer:
                raise transport.remote_error(answer, RendezvousError)
            return conn
        except BaseException:
            sock.close()
            raise

    def _run(self) -> None:
        delay = 0.05
        while not self._stopped.is_set():
            conn = None
            try:
                conn = self._open()
                delay = 0.05
                while not self._stopped.wait(self._interval):
                    conn.send({"op": "heartbeat"})
                    conn.discard_pending()
            except (AuthenticationError, RendezvousError) as exc:  # nothing left to keep alive
                log.warning("lease keeper stops: %s", exc)
                return
            except (OSError, ValueError, ArendezError) as exc:
                log.debug("lease connection to %s:%s failed: %s", *self._where, exc)
                self._stopped.wait(delay)
                delay = min(delay * 2, 1.0)
            finally:
                if conn is not None:
                    with contextlib.suppress(OSError):
                        conn.sock.close()
