"""The lease keeper: one lease connection per server for the whole process, and its heartbeats.

Heartbeats that ran on the event loop would stop whenever user code keeps the loop busy (a
long numpy step between collectives), and the server would declare a healthy rank failed.
So a thread opens a small blocking connection of its own and, on Linux, hands it to a sidecar
process (``leaseproc``) that sends the heartbeats without needing this process's GIL: a C call
that holds it for seconds does not cost the lease either. Without ``/proc`` (or with TLS, whose
session cannot change process, or ``ARENDEZ_LEASE_SIDECAR=0``) the thread sends them itself.
There is one keeper per server address in a process, however many ranks (``Store``
memberships) it hosts: each rank names the keeper's random lease key when it joins, and every
heartbeat renews them all. A process that stops as a whole (killed, SIGSTOP, frozen host)
loses the lease of all its ranks.

A keeper whose last rank left in good order lingers for ``LINGER`` seconds: a process that
initialises again (elastic recovery, a test or app that cycles init and destroy) keeps its
lease connection and sidecar, where starting them again cost more than the rest of a cycle
(35 of 60 ms through the embedded server). A lingering keeper whose connection fails ends;
one that a rank let go of without a good leave does not linger (``release``).
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import logging
import os
import socket
import ssl as _ssl
import subprocess
import sys
import threading
import time
from typing import Any

from . import handshake, leaseproc, loopcpu, transport, wire
from .errors import ArendezError, AuthenticationError, LimitError, RendezvousError
from .transports import local

log = logging.getLogger("arendez.lease")

#: Connect + handshake budget: a server answering a storm of thousands of connecting ranks is
#: late, and giving up on a connection that is almost through would leave the lease unrenewed
#: for longer (the server gives a lease its keeper has not renewed yet extra grace).
OPEN_TIMEOUT = 20.0
#: The heartbeat frame, the same for every keeper.
HEARTBEAT = b"".join(bytes(b) for b in wire.encode({"op": "heartbeat"}))
#: The frame that ends the lease in order: the server counts its remaining members as left.
LEASE_END = b"".join(bytes(b) for b in wire.encode({"op": "lease_end"}))
#: How long a keeper with no rank left stays up for the process's next rank (seconds).
LINGER = 3.0


def sidecar_possible(ssl: _ssl.SSLContext | None) -> bool:
    """Whether heartbeats can come from a sidecar process here (see the module docstring)."""
    return (
        ssl is None
        and os.environ.get("ARENDEZ_LEASE_SIDECAR", "1") != "0"
        and bool(sys.executable)
        and not getattr(sys, "frozen", False)  # (a frozen app's executable is the app itself)
        and os.path.exists(f"/proc/{os.getpid()}/stat")
    )


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
    """Renews lease ``key`` on the server at ``host:port`` every ``interval`` s until ``stop``."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        token: str | None,
        ssl: _ssl.SSLContext | None,
        interval: float = 0.5,
    ) -> None:
        self.key = os.urandom(16)
        self.users = 0
        #: when the last user left in good order (``time.monotonic()``); None while in use
        self.idle_since: float | None = None
        #: a user let go without a good leave: the lease must end in order with the last user
        self.dirty = False
        self._where = (host, port)
        self._token = token
        self._ssl = ssl
        self._interval = interval
        self._stopped = threading.Event()
        #: set once the server has taken the lease (its members' lease clock runs from then)
        self.armed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="arendez-lease", daemon=True)
        self._sidecar: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Tell the thread to close its connection and end (does not wait for it)."""
        self._stopped.set()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    def _done(self, wait: float) -> bool:
        """Wait up to ``wait`` s; whether to stop now: stopped, or idle past its linger."""
        if self._stopped.wait(wait):
            return True
        if self.idle_since is not None:
            _retire_if_idle(self, lingered=True)
        return self._stopped.is_set()

    def _open(self) -> _FrameSocket:
        sock = local.open_blocking(*self._where, OPEN_TIMEOUT, local_ok=self._ssl is None)
        try:
            sock.settimeout(OPEN_TIMEOUT)  # the handshake, under a storm of connecting ranks
            if self._ssl is not None:
                sock = self._ssl.wrap_socket(sock, server_hostname=self._where[0])
            conn = _FrameSocket(sock)
            reply, nonce = handshake.answer_challenge(conn.recv(), self._token, {"job": ""}, self._where)
            conn.send(reply)
            handshake.check_welcome(conn.recv(), self._token, nonce, self._where)
            conn.send({"op": "lease", "id": 0, "key": self.key})
            answer = conn.recv()
            if isinstance(answer, dict) and "error" in answer:
                raise transport.remote_error(answer, RendezvousError)
            sock.settimeout(5.0)
            self.armed.set()
            log.debug("lease keeper connected to %s:%s", *self._where)
            return conn
        except BaseException:
            sock.close()
            raise

    def _beat_here(self, conn: _FrameSocket) -> None:
        """Send the heartbeats from this thread until stopped (then the lease's end), or until
        the connection fails."""
        while not self._done(self._interval):
            conn.send({"op": "heartbeat"})
            conn.discard_pending()
        conn.sock.sendall(LEASE_END)

    def _beat_from_sidecar(self, conn: _FrameSocket) -> bool:
        """Hand the connection to a sidecar process and wait until stopped (True) or until the
        sidecar ends (False: reconnect). Raises ``OSError`` if it cannot be started."""
        fd = conn.sock.fileno()
        argv = [sys.executable, "-I", "-S", leaseproc.__file__, str(fd), str(os.getpid())]
        proc = subprocess.Popen(
            [*argv, repr(self._interval), HEARTBEAT.hex(), LEASE_END.hex()],
            stdin=subprocess.PIPE,
            pass_fds=(fd,),
            stdout=subprocess.DEVNULL,
            # a group of its own: a Ctrl-C at the terminal is the parent's (it reached the sidecar
            # before its SIGINT handler was set, as a traceback; QA26); it ends with its parent
            process_group=0,
        )
        conn.sock.close()  # the sidecar's now (children forked later must not hold it)
        self._sidecar = proc
        try:
            while not self._done(min(self._interval, 0.5)):
                if proc.poll() is not None:
                    log.debug("lease sidecar ended (%s): reconnecting", proc.returncode)
                    return False
            return True
        finally:
            assert proc.stdin is not None
            with contextlib.suppress(OSError):
                if self._stopped.is_set():  # in order: the sidecar ends the lease
                    proc.stdin.write(leaseproc.STOP)
                    proc.stdin.flush()
                proc.stdin.close()
            if proc.poll() is None and self._stopped.is_set():
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(1.0)  # (it sends the lease's end, then exits)
            if proc.poll() is None:
                proc.terminate()  # (the pipe may be held open by children forked since)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(2.0)
            self._sidecar = None

    def _run(self) -> None:
        loopcpu.release_thread()  # (started by the loop thread, maybe pinned: nor its sidecar)
        delay = 0.05
        sidecar = sidecar_possible(self._ssl)
        refused = False  # (a limit's refusal is a warning once, until the lease is taken)
        while not self._stopped.is_set():
            if self.idle_since is not None:  # lingering: no rank needs a new connection
                _retire_if_idle(self)
                continue
            conn = None
            try:
                conn = self._open()
                delay, refused = 0.05, False
                if sidecar:
                    try:
                        if self._beat_from_sidecar(conn):
                            return
                        continue
                    except OSError as exc:
                        if conn.sock.fileno() < 0:
                            raise
                        log.info("no lease sidecar (%s): heartbeats from a thread", exc)
                        sidecar = False
                self._beat_here(conn)
            except AuthenticationError as exc:  # nothing left to keep alive
                (log.debug if self._stopped.is_set() else log.warning)("lease keeper stops: %s", exc)
                return
            except (OSError, ValueError, ArendezError) as exc:
                if isinstance(exc, LimitError) and not refused:  # (the server cannot tell a stop)
                    refused = True
                    log.warning(
                        "the server refused this process's lease, so a stop of it would not be "
                        "noticed; retrying: %s",
                        exc,
                    )
                else:
                    log.debug("lease connection to %s:%s failed: %s", *self._where, exc)
                self._stopped.wait(delay)
                delay = min(delay * 2, 1.0)
            finally:
                if conn is not None:
                    with contextlib.suppress(OSError):
                        conn.sock.close()


_keepers: dict[tuple[Any, ...], LeaseKeeper] = {}
_lock = threading.Lock()


def _forget_after_fork() -> None:
    """In a forked child: the parent's keepers renew the parent's lease, not the child's (and
    their thread did not come along); a lock another thread held at the fork stays held."""
    global _lock
    _lock = threading.Lock()
    _keepers.clear()


os.register_at_fork(after_in_child=_forget_after_fork)


def acquire(
    host: str, port: int, *, token: str | None, ssl: _ssl.SSLContext | None, interval: float
) -> LeaseKeeper:
    """This process's keeper for the server at ``host:port`` (started on first use)."""
    where = (host, port, token, id(ssl))
    with _lock:
        keeper = _keepers.get(where)
        if keeper is not None and not keeper._thread.is_alive():  # (a stopped one is not here)
            _retire(keeper)  # (its thread gave up, e.g. on an authentication error)
            keeper = None
        if keeper is None:  # (a forked child starts with none: _forget_after_fork)
            keeper = _keepers[where] = LeaseKeeper(host, port, token=token, ssl=ssl, interval=interval)
            keeper.start()
        keeper.users += 1
        keeper.idle_since = None
        return keeper


def release(keeper: LeaseKeeper, *, linger: bool = False) -> None:
    """One user fewer; the last one stops the keeper (without blocking the caller), or with
    ``linger`` (every rank of it left in good order) leaves it up for ``LINGER`` s for the next.
    A rank whose leave failed makes the lease end when its last user goes, so that the server
    counts that rank as left then, as it would have without the linger."""
    with _lock:
        keeper.users -= 1
        keeper.dirty = keeper.dirty or not linger
        if keeper.users > 0:
            return
        if not keeper.dirty:
            keeper.idle_since = time.monotonic()
            return
        _retire(keeper)


def _retire(keeper: LeaseKeeper) -> None:
    """Stop ``keeper`` and forget it (``_lock`` held)."""
    keeper.stop()
    for where, found in list(_keepers.items()):
        if found is keeper:
            del _keepers[where]


def _retire_if_idle(keeper: LeaseKeeper, lingered: bool = False) -> None:
    """From the keeper's thread: retire it unless a rank took it up again meanwhile (with
    ``lingered``: unless its linger started again since)."""
    with _lock:
        idle = keeper.idle_since
        if keeper.users == 0 and idle is not None and (not lingered or time.monotonic() - idle >= LINGER):
            _retire(keeper)


@atexit.register
def _end_idle_leases() -> None:
    """At exit, lingering keepers end their lease in order where they can (else the sidecar
    only notices its parent gone, and the server sees a closed connection: with no ranks left
    on the lease, the same to it)."""
    with _lock:
        idle = [k for k in _keepers.values() if k.users == 0]
        for keeper in idle:
            _retire(keeper)
    for keeper in idle:
        proc = keeper._sidecar
        if proc is not None and proc.stdin is not None:
            with contextlib.suppress(OSError, ValueError):
                proc.stdin.write(leaseproc.STOP)
                proc.stdin.flush()
        else:  # heartbeats from its thread: it sends the end as it stops
            keeper.join(0.5)
