"""torch's store classes, blocking: ``TCPStore``, ``HashStore``, ``PrefixStore`` (and ``FileStore``,
which arendez does not provide).

``TCPStore`` is a client of an arendez store server (``is_master=True`` hosts an embedded one in
this process, as torch's master does). The first ``ARENDEZ_TCPSTORE_OWN_CONNECTIONS`` (16) clients
alive in a process each make ``BlockingStore`` calls on a connection of their own, in the caller's
thread; clients past that share connections of the shared loop thread (``storemux``), so that a
process with thousands of them (a thread per simulated rank) does not hold thousands of
connections and threads convoying on the GIL.
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import numbers
import os
import socket
import threading
import time
import weakref
from collections.abc import Iterable
from typing import Any

from . import embedded, serverproc
from .blocking_store import BlockingStore
from .errors import (
    ArendezError,
    LimitError,
    QueueEmptyError,
    StoreConnectTimeoutError,
    StoreError,
    StoreTimeoutError,
)
from .loop import shared
from .registry import seconds
from .settings import env_int
from .store_wire import MAX_KEYS, key_batches
from .storemux import SharedStoreClient

__all__ = ["FileStore", "HashStore", "PrefixStore", "Store", "TCPStore"]

DEFAULT_TIMEOUT = datetime.timedelta(seconds=300)
#: TCPStore's one key of its own (torch's has one too: its count of store users), not listed
_WORKERS = "__arendez_tcpstore/workers"
#: the server job every TCPStore client uses (one server, one key space, as torch's)
_JOB = "tcpstore"
#: Rounds of compare_set an ``append`` tries before it gives up (each lost one means another
#: writer's append landed).
_APPEND_TRIES = 10_000
#: The TCPStore clients of this process that have a connection of their own.
_own_connections: weakref.WeakSet[TCPStore] = weakref.WeakSet()


def _bytes(value: str | bytes) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


def _amount(amount: int) -> int:
    """``add``'s amount: an integer (a float would be truncated without a word), as torch's."""
    if not isinstance(amount, numbers.Integral):
        raise TypeError(f"store add amount must be an integer, got {type(amount).__name__} {amount!r:.40}")
    return int(amount)


class Store:
    """Base of the blocking stores (torch's ``Store``): every method is a store operation."""

    timeout = DEFAULT_TIMEOUT

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        """The deadline of ``get`` and ``wait`` without an explicit timeout."""
        self.timeout = timeout

    def _limit(self, timeout: datetime.timedelta | None = None) -> float:
        """Seconds a call may wait: ``timeout`` or the store's; zero (torch's "don't wait") too."""
        chosen = timeout if timeout is not None else self.timeout
        if isinstance(chosen, datetime.timedelta) and chosen == datetime.timedelta(0):
            return 0.0
        return seconds(chosen, 300.0)

    def set(self, key: str, value: str | bytes) -> None:
        raise NotImplementedError

    def get(self, key: str) -> bytes:
        raise NotImplementedError

    def add(self, key: str, amount: int) -> int:
        raise NotImplementedError

    def compare_set(self, key: str, expected_value: str | bytes, desired_value: str | bytes) -> bytes:
        raise NotImplementedError

    def wait(self, keys: Iterable[str], timeout: datetime.timedelta | None = None) -> None:
        raise NotImplementedError

    def check(self, keys: Iterable[str]) -> bool:
        raise NotImplementedError

    def delete_key(self, key: str) -> bool:
        raise NotImplementedError

    def num_keys(self) -> int:
        raise NotImplementedError

    def append(self, key: str, value: str | bytes) -> None:
        """Append ``value`` to the bytes at ``key`` (created if missing), atomically (here a
        ``compare_set`` loop, so concurrent appends all land; the stores do it in one step)."""
        extra = _bytes(value)
        current = self.get(key) if self.check([key]) else b""
        for _ in range(_APPEND_TRIES):
            desired = current + extra
            now = self.compare_set(key, current, desired)
            if now == desired:
                return
            current = now  # another writer came first: append to what it left
        raise StoreError(f"append to {key!r} lost {_APPEND_TRIES} races with other writers")

    def barrier(self, key: str, world_size: int, timeout: datetime.timedelta | None = None) -> None:
        """Return once ``world_size`` callers have called ``barrier`` with ``key`` (torch's
        ``Store.barrier``; its keys are ``key/num_members``, counting the arrivals, and
        ``key/last_member``, which the last sets: torch 2.13 keeps a single counter at ``key``);
        ``StoreTimeoutError`` after ``timeout`` (default: the store's)."""
        if world_size < 1:
            raise ValueError(f"barrier {key!r} needs world_size >= 1, got {world_size}")
        if self.add(f"{key}/num_members", 1) == world_size:
            self.set(f"{key}/last_member", b"1")
        self.wait([f"{key}/last_member"], timeout)

    def has_extended_api(self) -> bool:
        """torch's flag for ``append``, ``multi_get`` and ``multi_set``: all present."""
        return True

    def multi_get(self, keys: list[str]) -> list[bytes]:
        """The values of ``keys``, in order (one ``get`` each unless a store does better)."""
        return [self.get(key) for key in keys]

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        """Set each of ``keys`` to its value in ``values`` (one ``set`` each unless a store does better)."""
        if len(keys) != len(values):
            raise ValueError(f"multi_set got {len(keys)} keys but {len(values)} values")
        for key, value in zip(keys, values, strict=True):
            self.set(key, value)

    def list_keys(self) -> list[str]:
        """Every key that holds a value (queues are not listed)."""
        raise NotImplementedError

    def queue_push(self, key: str, value: str | bytes) -> None:
        """Append ``value`` to the queue ``key``: queues are apart from the keys' values, and
        ``check``/``wait`` see a non-empty queue as a present key."""
        raise NotImplementedError

    def queue_pop(self, key: str, block: bool = True) -> bytes:
        """The oldest value of the queue ``key``, removed: waiting up to the store's timeout for
        one (``StoreTimeoutError``), or with ``block=False`` ``QueueEmptyError`` at once."""
        raise NotImplementedError

    def queue_len(self, key: str) -> int:
        """How many values the queue ``key`` holds."""
        raise NotImplementedError


def _listening(fd: int | None, port: int) -> socket.socket | None:
    """The caller's listening socket ``master_listen_fd`` (torch's; a copy: the fd stays
    theirs), checked against ``port``."""
    if fd is None:
        return None
    try:
        copy = os.dup(fd)
    except OSError as exc:
        raise ValueError(f"TCPStore master_listen_fd={fd} is not open: {exc}") from None
    try:
        sock = socket.socket(fileno=copy)
    except OSError as exc:
        os.close(copy)
        raise ValueError(f"TCPStore master_listen_fd={fd} is not a socket: {exc}") from None
    try:
        listening = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN) == 1
        if sock.family not in (socket.AF_INET, socket.AF_INET6) or not listening:
            raise ValueError(f"TCPStore master_listen_fd={fd} is not a listening TCP socket")
        bound = sock.getsockname()[1]
        if port and bound != port:
            raise ValueError(f"TCPStore master_listen_fd={fd} listens on port {bound}, not {port}")
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
        self.host, self.port, self.world_size, self.timeout = host_name, port, world_size, timeout
        self._store: BlockingStore | SharedStoreClient
        if len(_own_connections) < env_int("ARENDEZ_TCPSTORE_OWN_CONNECTIONS", 16, minimum=0):
            self._store = BlockingStore(host_name, port, _JOB, timeout=limit)
            _own_connections.add(self)
        else:  # many clients in this process: share connections (see the module's docstring)
            self._store = SharedStoreClient(host_name, port, _JOB, timeout=limit)
        self._lock = threading.Lock()  # one request at a time on the connection (torch's too)
        self._connect(limit)
        if world_size is not None and wait_for_workers:  # (torch counts only these users)
            self._store.add(_WORKERS, 1)
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
        while (joined := self._store.add(_WORKERS, 0)) < world_size:
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
            self._store.set(key, value)

    def get(self, key: str) -> bytes:
        with self._lock:
            return self._store.get(key, self._limit())

    def add(self, key: str, amount: int) -> int:
        amount = _amount(amount)
        with self._lock:
            return self._store.add(key, amount)

    def compare_set(self, key: str, expected_value: str | bytes, desired_value: str | bytes) -> bytes:
        with self._lock:
            return self._store.compare_set(key, expected_value, desired_value)

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
        keys, data = key_list(keys), [_bytes(v) for v in values]
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

    def check(self, keys: Iterable[str]) -> bool:
        names = key_list(keys)
        with self._lock:
            return all(self._store.check(names[part]) for part in key_batches(names))

    def delete_key(self, key: str) -> bool:
        with self._lock:
            return self._store.delete(key)

    def num_keys(self) -> int:
        with self._lock:
            return self._store.num_keys()

    def list_keys(self) -> list[str]:
        with self._lock:
            return [k for k in self._store.list_keys() if k != _WORKERS]

    def append(self, key: str, value: str | bytes) -> None:
        """Append ``value`` to the bytes at ``key`` (created if missing), atomically: one request,
        the server appends."""
        with self._lock:
            self._store.append(key, value)

    def queue_push(self, key: str, value: str | bytes) -> None:
        with self._lock:
            self._store.queue_push(key, value)

    def queue_pop(self, key: str, block: bool = True) -> bytes:
        with self._lock:
            return self._store.queue_pop(key, block, self._limit())

    def queue_len(self, key: str) -> int:
        with self._lock:
            return self._store.queue_len(key)

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


def key_list(keys: Iterable[str]) -> list[str]:
    """``keys`` as a list; one string is a ``TypeError`` (as torch's), not a list of its letters."""
    if isinstance(keys, str | bytes):
        raise TypeError(f"keys must be a list of strings, got the string {keys!r:.80}")
    return list(keys)


class HashStore(Store):
    """torch's ``HashStore``: a store inside this process, shared by its threads."""

    def __init__(self) -> None:
        self._data: dict[str, bytes] = {}
        self._queues: dict[str, collections.deque[bytes]] = {}
        self._changed = threading.Condition()

    def set(self, key: str, value: str | bytes) -> None:
        with self._changed:
            self._data[key] = _bytes(value)
            self._changed.notify_all()

    def _present(self, key: str) -> bool:
        return key in self._data or key in self._queues

    def _wait_for(self, keys: list[str], timeout: datetime.timedelta | None, values: bool = False) -> None:
        """Wait until every key is present (``values``: holds a value, not only a queue)."""
        limit = self._limit(timeout)
        end = time.monotonic() + limit
        present = self._data.__contains__ if values else self._present
        while not all(present(k) for k in keys):
            left = end - time.monotonic()
            if left <= 0:
                missing = [k for k in keys if not present(k)]
                raise StoreTimeoutError(f"keys {missing} were not set within {limit:.3g}s")
            self._changed.wait(left)

    def get(self, key: str) -> bytes:
        with self._changed:
            self._wait_for([key], None, values=True)
            return self._data[key]

    def add(self, key: str, amount: int) -> int:
        amount = _amount(amount)
        with self._changed:
            total = int(self._data.get(key, b"0")) + amount
            self._data[key] = str(total).encode()
            self._changed.notify_all()
            return total

    def compare_set(self, key: str, expected_value: str | bytes, desired_value: str | bytes) -> bytes:
        with self._changed:
            current = self._data.get(key)
            if (current is None and not _bytes(expected_value)) or current == _bytes(expected_value):
                self._data[key] = current = _bytes(desired_value)
                self._changed.notify_all()
            return current if current is not None else _bytes(expected_value)

    def append(self, key: str, value: str | bytes) -> None:
        with self._changed:
            self._data[key] = self._data.get(key, b"") + _bytes(value)
            self._changed.notify_all()

    def wait(self, keys: Iterable[str], timeout: datetime.timedelta | None = None) -> None:
        with self._changed:
            self._wait_for(key_list(keys), timeout)

    def check(self, keys: Iterable[str]) -> bool:
        with self._changed:
            return all(self._present(k) for k in key_list(keys))

    def delete_key(self, key: str) -> bool:
        with self._changed:
            return self._data.pop(key, None) is not None

    def num_keys(self) -> int:
        with self._changed:
            return len(self._data)

    def list_keys(self) -> list[str]:
        with self._changed:
            return list(self._data)

    def queue_push(self, key: str, value: str | bytes) -> None:
        with self._changed:
            self._queues.setdefault(key, collections.deque()).append(_bytes(value))
            self._changed.notify_all()

    def queue_pop(self, key: str, block: bool = True) -> bytes:
        with self._changed:
            if block:
                self._wait_for_queue(key)
            queue = self._queues.get(key)
            if not queue:
                raise QueueEmptyError(f"queue {key!r:.80} is empty")
            item = queue.popleft()
            if not queue:
                del self._queues[key]
            return item

    def _wait_for_queue(self, key: str) -> None:
        limit = self._limit()
        end = time.monotonic() + limit
        while key not in self._queues:
            left = end - time.monotonic()
            if left <= 0:
                raise StoreTimeoutError(f"queue_pop({key!r:.80}) found no value within {limit:.3g}s")
            self._changed.wait(left)

    def queue_len(self, key: str) -> int:
        with self._changed:
            return len(self._queues.get(key, ()))


class PrefixStore(Store):
    """torch's ``PrefixStore``: a view of ``store`` whose keys all start with ``prefix/``."""

    def __init__(self, prefix: str, store: Store) -> None:
        self.prefix, self.underlying_store = prefix, store

    @property  # (torch's: the timeout is the underlying store's, and setting it sets that)
    def timeout(self) -> datetime.timedelta:  # type: ignore[override]
        return self.underlying_store.timeout

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self.underlying_store.set_timeout(timeout)

    def meeting_point(self) -> tuple[str, int, str]:
        """The underlying ``TCPStore``'s, in a job of this prefix (a world per prefix)."""
        host, port, job = meeting_point(self.underlying_store)
        return host, port, f"{job}/{self.prefix}"

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return self.underlying_store.multi_get([self._k(k) for k in keys])

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        self.underlying_store.multi_set([self._k(k) for k in keys], values)

    def _k(self, key: str) -> str:
        return f"{self.prefix}/{key}"

    def set(self, key: str, value: str | bytes) -> None:
        self.underlying_store.set(self._k(key), value)

    def get(self, key: str) -> bytes:
        return self.underlying_store.get(self._k(key))

    def add(self, key: str, amount: int) -> int:
        return self.underlying_store.add(self._k(key), amount)

    def compare_set(self, key: str, expected_value: str | bytes, desired_value: str | bytes) -> bytes:
        return self.underlying_store.compare_set(self._k(key), expected_value, desired_value)

    def wait(self, keys: Iterable[str], timeout: datetime.timedelta | None = None) -> None:
        self.underlying_store.wait([self._k(k) for k in key_list(keys)], timeout)

    def check(self, keys: Iterable[str]) -> bool:
        return self.underlying_store.check([self._k(k) for k in key_list(keys)])

    def delete_key(self, key: str) -> bool:
        return self.underlying_store.delete_key(self._k(key))

    def num_keys(self) -> int:
        return self.underlying_store.num_keys()

    def list_keys(self) -> list[str]:
        """The keys under this prefix, without it (as torch's)."""
        start = f"{self.prefix}/"
        return [k[len(start) :] for k in self.underlying_store.list_keys() if k.startswith(start)]

    def append(self, key: str, value: str | bytes) -> None:
        self.underlying_store.append(self._k(key), value)

    def queue_push(self, key: str, value: str | bytes) -> None:
        self.underlying_store.queue_push(self._k(key), value)

    def queue_pop(self, key: str, block: bool = True) -> bytes:
        return self.underlying_store.queue_pop(self._k(key), block)

    def queue_len(self, key: str) -> int:
        return self.underlying_store.queue_len(self._k(key))


def meeting_point(store: Store) -> tuple[str, int, str]:
    """Where ``init_process_group(store=store)`` meets: the server and job of a ``TCPStore``
    (or a ``PrefixStore`` over one); a ``TypeError`` for stores of one process."""
    if isinstance(store, TCPStore):
        return store.host, int(store.port), _JOB
    if isinstance(store, PrefixStore):
        return store.meeting_point()
    raise TypeError(
        f"init_process_group(store=...) takes an arendez.sync.TCPStore (or a PrefixStore over one), "
        f"got {type(store).__name__}: its ranks meet on that store's server"
    )


class FileStore(Store):
    """torch's ``FileStore`` is not provided: use ``HashStore`` (one process) or ``TCPStore``."""

    def __init__(self, file_name: str, world_size: int = -1) -> None:
        raise ArendezError(
            "FileStore is not supported by arendez (a store over a shared file): use HashStore "
            "within one process or TCPStore (an arendez store server) across processes"
        )
