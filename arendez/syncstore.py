"""torch's store shapes, blocking: the ``Store`` base, ``HashStore`` (one process),
``PrefixStore`` (keys under a prefix, over any store), and ``FileStore``, which arendez does not
provide. ``TCPStore``, a client of an arendez store server, is ``arendez.tcpstore``'s.
"""

from __future__ import annotations

import collections
import datetime
import numbers
import threading
import time
from collections.abc import Iterable

from .errors import ArendezError, QueueEmptyError, StoreError, StoreTimeoutError
from .registry import seconds
from .store_wire import store_key, to_bytes

__all__ = [
    "FileStore",
    "HashStore",
    "PrefixStore",
    "Store",
    "add_amount",
    "key_list",
    "store_key",
    "meeting_point",
]

DEFAULT_TIMEOUT = datetime.timedelta(seconds=300)
#: Rounds of compare_set an ``append`` tries before it gives up (each lost one means another
#: writer's append landed).
_APPEND_TRIES = 10_000


def add_amount(amount: int) -> int:
    """``add``'s amount: an integer (a float would be truncated without a word), as torch's."""
    if not isinstance(amount, numbers.Integral):
        raise TypeError(f"store add amount must be an integer, got {type(amount).__name__} {amount!r:.40}")
    return int(amount)


class Store:
    """Base of the blocking stores (torch's ``Store``): every method is a store operation."""

    timeout = DEFAULT_TIMEOUT

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        """The deadline of ``get`` and ``wait`` without an explicit timeout."""
        self.timeout = (
            timeout if isinstance(timeout, datetime.timedelta) else datetime.timedelta(seconds=timeout)
        )

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
        extra = to_bytes(value)
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
        generic ``Store.barrier``, as its ``PrefixStore`` keeps it: ``key/num_members`` counts
        the arrivals and the last sets ``key/last_member``; ``TCPStore`` has the server's own);
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


def key_list(keys: Iterable[str]) -> list[str]:
    """``keys`` as a list; one string is a ``TypeError`` (as torch's), not a list of its letters."""
    if isinstance(keys, str | bytes):
        raise TypeError(f"keys must be a list of strings, got the string {keys!r:.80}")
    return [store_key(key) for key in keys]


class HashStore(Store):
    """torch's ``HashStore``: a store inside this process, shared by its threads."""

    def __init__(self) -> None:
        self._data: dict[str, bytes] = {}
        self._queues: dict[str, collections.deque[bytes]] = {}
        self._changed = threading.Condition()

    def set(self, key: str, value: str | bytes) -> None:
        with self._changed:
            self._data[key] = to_bytes(value)
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
        amount = add_amount(amount)
        with self._changed:
            total = int(self._data.get(key, b"0")) + amount
            self._data[key] = str(total).encode()
            self._changed.notify_all()
            return total

    def compare_set(self, key: str, expected_value: str | bytes, desired_value: str | bytes) -> bytes:
        with self._changed:
            current = self._data.get(key)
            if (current is None and not to_bytes(expected_value)) or current == to_bytes(expected_value):
                self._data[key] = current = to_bytes(desired_value)
                self._changed.notify_all()
            return current if current is not None else to_bytes(expected_value)

    def append(self, key: str, value: str | bytes) -> None:
        with self._changed:
            self._data[key] = self._data.get(key, b"") + to_bytes(value)
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
            self._queues.setdefault(key, collections.deque()).append(to_bytes(value))
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

    def clone(self) -> PrefixStore:
        """A view of the same prefix on a clone of the underlying store, as torch's."""
        clone = getattr(self.underlying_store, "clone", None)
        if clone is None:
            raise ArendezError(f"{type(self.underlying_store).__name__} has no clone()")
        return PrefixStore(self.prefix, clone())

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
    meets = getattr(store, "meeting_point", None)
    if meets is None:
        raise TypeError(
            f"init_process_group(store=...) takes an arendez.sync.TCPStore (or a PrefixStore over "
            f"one), got {type(store).__name__}: its ranks meet on that store's server"
        )
    point: tuple[str, int, str] = meets()
    return point


class FileStore(Store):
    """torch's ``FileStore`` is not provided: use ``HashStore`` (one process) or ``TCPStore``."""

    def __init__(self, file_name: str, world_size: int = -1) -> None:
        raise ArendezError(
            "FileStore is not supported by arendez (a store over a shared file): use HashStore "
            "within one process or TCPStore (an arendez store server) across processes"
        )
