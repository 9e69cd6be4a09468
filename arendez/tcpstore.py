"""torch's ``TCPStore``, blocking: a client of an arendez store server (``is_master=True``
hosts an embedded one in this process, as torch's master does).

The first ``ARENDEZ_TCPSTORE_OWN_CONNECTIONS`` (16) clients alive in a process each make
``BlockingStore`` calls on a connection of their own, in the caller's thread; clients past that
share connections of the shared loop thread (``storemux``), so that a process with thousands of
them (a thread per simulated rank) does not hold thousands of connections and threads convoying
on the GIL.
"""

from __future__ import annotations

import contextlib
import datetime
import operator
import os
import socket
import threading
import time
import weakref
from collections.abc import Iterable
from typing import Any

from . import embedded, serverproc
from .blocking_store import BlockingStore
from .errors import LimitError, ListenSocketError, StoreConnectTimeoutError, StoreError, StoreTimeoutError
from .loop import shared
from .registry import seconds
from .settings import env_int
from .store_wire import MAX_KEYS, TCPSTORE_JOB, TCPSTORE_WORKERS_KEY, key_batches, store_key, to_bytes
from .storemux import SharedStoreClient
from .syncstore import DEFAULT_TIMEOUT, Store, add_amount, key_list

__all__ = ["TCPStore"]

#: The TCPStore clients of this process that have a connection of their own.
_own_connections: weakref.WeakSet[TCPStore] = weakref.WeakSet()


def _listening(fd: int | None, port: int) -> socket.socket | None:
    """The caller's listening socket ``master_listen_fd`` (torch's; a copy: the fd stays
    theirs), checked against ``port``."""
    if fd is None:
        return None
    try:
        copy = os.dup(fd)
    except OSError as exc:
        raise ListenSocketError(f"TCPStore master_listen_fd={fd} is not open: {exc}") from None
    try:
        sock = socket.socket(fileno=copy)
    except OSError as exc:
        os.close(copy)
        raise ListenSocketError(f"TCPStore master_listen_fd={fd} is not a socket: {exc}") from None
    try:
        listening = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN) == 1
        if sock.family not in (socket.AF_INET, socket.AF_INET6) or not listening:
            raise ListenSocketError(f"TCPStore master_listen_fd={fd} is not a listening TCP socket")
        bound = sock.getsockname()[1]
        if port and bound != port:
            raise ListenSocketError(f"TCPStore master_listen_fd={fd} listens on port {bound}, not {port}")
    except BaseException:
        sock.close()
        raise
    return sock


class TCPStore(Store):
    """torch's ``TCPStore``: a client of an arendez store server at ``host_name:port``;
    ``is_master`` hosts that server in this process (``port=0`` picks a free one: read ``.port``).

    As in torch, ``world_size`` counts every store user (the master included) created with
    ``wait_for_workers`` (the default): each adds itself on creation, and the master waits for
    all of them; one created with ``wait_for_workers=False`` neither counts nor waits.
    """

    def __init__(
        self,
        host_name: str,
        port: int,
        world_size: int | None = None,
        is_master: bool = False,
        timeout: datetime.timedelta = DEFAULT_TIMEOUT,
        wait_for_workers: bool = True,
        multi_tenant: bool = False,
        master_listen_fd: int | None = None,
        use_libuv: bool = True,
    ) -> None:
        if world_size is not None and (not isinstance(world_size, int) or world_size == 0 or world_size < -1):
            raise ValueError(
                f"TCPStore world_size must be positive, None or -1 (unknown), not {world_size!r:.80}"
            )
        if world_size == -1:  # (torch takes -1 as "not known", as None)
            world_size = None
        limit = seconds(timeout, 300.0)
        self._pin: _ServerPin | None = None
        if is_master:
            # the port listens from now on (clients that come meanwhile wait in its queue)
            sock = _listening(master_listen_fd, port) or serverproc.listening_socket(host_name, port)
            server = shared.call(
                embedded.acquire,
                host_name,
                port,
                None,
                None,
                pinned=True,
                exclusive=not multi_tenant,
                sock=sock,
            )
            port = int(server.port)
            self._pin = _ServerPin(port)
        self.host, self.port, self.world_size = host_name, port, world_size
        self.timeout = datetime.timedelta(seconds=limit)  # (a float given: torch's is a timedelta too)
        self._store: BlockingStore | SharedStoreClient
        if len(_own_connections) < env_int("ARENDEZ_TCPSTORE_OWN_CONNECTIONS", 16, minimum=0):
            self._store = BlockingStore(host_name, port, TCPSTORE_JOB, timeout=limit)
            _own_connections.add(self)
        else:  # many clients in this process: share connections (see the module's docstring)
            self._store = SharedStoreClient(host_name, port, TCPSTORE_JOB, timeout=limit)
        self._lock = threading.Lock()  # one request at a time on the connection (torch's too)
        self._connect(limit)
        if world_size is not None and wait_for_workers:  # (torch counts only these users)
            self._store.add(TCPSTORE_WORKERS_KEY, 1)
            if is_master:
                self._wait_for_workers(world_size, limit)

    def _connect(self, limit: float) -> None:
        """Reach the server, retrying until ``limit`` (a client may start before its master)."""
        deadline, pause = time.monotonic() + limit, 0.01
        while True:
            try:
                self._store.connect(deadline - time.monotonic())  # (an attempt ends by the deadline)
                return
            except LimitError:  # refused by a named server limit: waiting will not help
                raise
            except StoreError as exc:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise StoreConnectTimeoutError(
                        f"TCPStore could not reach the store at {self.host}:{self.port} "
                        f"within {limit:g}s: {exc}"
                    ) from None
                time.sleep(min(pause, left))  # (the last try comes at the deadline itself)
                pause = min(2 * pause, 0.5)

    def _wait_for_workers(self, world_size: int, limit: float) -> None:
        """Poll the count of store users until all ``world_size`` came (as torch's master does:
        one request per poll, so the store keeps a single key of its own)."""
        deadline, pause = time.monotonic() + limit, 0.005
        while (joined := self._store.add(TCPSTORE_WORKERS_KEY, 0)) < world_size:
            if time.monotonic() + pause >= deadline:
                self._store.close()
                raise StoreTimeoutError(
                    f"TCPStore master timed out after {limit:g}s waiting for clients: "
                    f"{joined}/{world_size} store users joined (world_size counts the master too)"
                )
            time.sleep(pause)
            pause = min(2 * pause, 0.1)

    def _batched(self, op: str, keys: list[str], limit: float) -> list[Any]:
        """``op`` on each batch of ``keys`` that fits one request, within one deadline."""
        deadline = time.monotonic() + limit
        call = getattr(self._store, op)
        return [call(keys[part], max(0.0, deadline - time.monotonic())) for part in key_batches(keys)]

    def set(self, key: str, value: str | bytes) -> None:
        with self._lock:
            self._store.set(store_key(key), value)

    def get(self, key: str) -> bytes:
        with self._lock:
            return self._store.get(store_key(key), self._limit())

    def add(self, key: str, amount: int) -> int:
        amount = add_amount(amount)
        with self._lock:
            return self._store.add(store_key(key), amount)

    def compare_set(self, key: str, expected_value: str | bytes, desired_value: str | bytes) -> bytes:
        with self._lock:
            return self._store.compare_set(store_key(key), expected_value, desired_value)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        """The values of ``keys`` (one request), waiting up to the store's timeout for any not set."""
        keys = key_list(keys)
        with self._lock:
            if len(keys) <= MAX_KEYS:
                return self._store.multi_get(keys, self._limit())
            return [value for part in self._batched("multi_get", keys, self._limit()) for value in part]

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        """Set each of ``keys`` to the value at the same position of ``values`` (one request, or
        several in turn if they do not fit one)."""
        keys, data = key_list(keys), [to_bytes(v) for v in values]
        if len(keys) != len(data):
            raise ValueError(f"multi_set got {len(keys)} keys but {len(data)} values")
        with self._lock:
            for part in key_batches(keys, data):
                self._store.multi_set(keys[part], data[part])

    def wait(self, keys: Iterable[str], timeout: datetime.timedelta | None = None) -> None:
        names = key_list(keys)
        with self._lock:
            if len(names) <= MAX_KEYS:
                self._store.wait(names, self._limit(timeout))
            else:
                self._batched("wait", names, self._limit(timeout))

    def barrier(self, key: str, world_size: int, timeout: datetime.timedelta | None = None) -> None:
        """Return once ``world_size`` callers have called ``barrier`` with ``key`` (torch's
        ``TCPStore.barrier``, kept as torch's server keeps it: each arrival adds 1 to the counter
        at ``key``, and one that brings it to its own ``world_size`` lets every caller waiting on
        the key go on; torch's own clients on ``arendez-server --tcpstore-port`` meet these in
        one barrier); ``StoreTimeoutError`` after ``timeout`` (default: the store's), the arrival
        still counted."""
        if type(world_size) is not int:
            world_size = operator.index(world_size)
        with self._lock:
            self._store.barrier(store_key(key), world_size, self._limit(timeout))

    def check(self, keys: Iterable[str]) -> bool:
        names = key_list(keys)
        with self._lock:
            return all(self._store.check(names[part]) for part in key_batches(names))

    def delete_key(self, key: str) -> bool:
        with self._lock:
            return self._store.delete(store_key(key))

    def num_keys(self) -> int:
        with self._lock:
            return self._store.num_keys()

    def list_keys(self) -> list[str]:
        with self._lock:
            return [k for k in self._store.list_keys() if k != TCPSTORE_WORKERS_KEY]

    def append(self, key: str, value: str | bytes) -> None:
        """Append ``value`` to the bytes at ``key`` (created if missing), atomically: one request,
        the server appends."""
        with self._lock:
            self._store.append(store_key(key), value)

    def queue_push(self, key: str, value: str | bytes) -> None:
        with self._lock:
            self._store.queue_push(store_key(key), value)

    def queue_pop(self, key: str, block: bool = True) -> bytes:
        with self._lock:
            return self._store.queue_pop(store_key(key), block, self._limit())

    def queue_len(self, key: str) -> int:
        with self._lock:
            return self._store.queue_len(store_key(key))

    def meeting_point(self) -> tuple[str, int, str]:
        """Where ``init_process_group(store=self)`` meets: this store's server and job."""
        return self.host, int(self.port), TCPSTORE_JOB

    @property
    def libuvBackend(self) -> bool:  # (torch's name)
        """False: the server is arendez's own (asyncio), not torch's libuv one."""
        return False

    def clone(self) -> TCPStore:
        """Another client of the same server (its own connection), as torch's ``clone``; the
        clone of a master keeps its server up as the master does."""
        other = TCPStore(self.host, self.port, None, False, self.timeout)
        other._pin = self._pin
        return other

    def close(self) -> None:
        """Close the connection to the server; a master's server closes with the last of the
        master and its clones to be closed or collected (as torch's)."""
        with self._lock:
            self._store.close()
            self._pin = None


class _ServerPin:
    """A master ``TCPStore``'s hold on the server it hosts, shared with its clones: when the last
    of them lets go (``close`` or garbage collection) the server closes, as torch's does."""

    def __init__(self, port: int) -> None:
        finalizer = weakref.finalize(self, _unpin_soon, port, os.getpid())
        finalizer.atexit = False  # (at exit the shared loop closes every server anyway)


def _unpin_soon(port: int, pid: int) -> None:
    """Tell the shared loop a master store is gone; never blocks (it may run in any thread,
    the loop's included, when the collector runs)."""
    loop = shared.running_loop()
    if loop is None or os.getpid() != pid:  # (a forked child does not host the parent's server)
        return
    with contextlib.suppress(RuntimeError):  # (the loop closed meanwhile)
        loop.call_soon_threadsafe(embedded.unpin, port)
