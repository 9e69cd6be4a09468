"""A job's key-value store: checked keys and values, counted against the job's limits.

Sans-I/O: :class:`~arendez_server.state.Job` is a store plus the job's rendezvous rounds.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from arendez.errors import LimitError, QueueEmptyError, StoreError

from .limits import StateLimits

#: Bytes each queued value counts against ``--max-bytes-per-job`` beyond its own (so that
#: empty values cannot queue up without bound).
QUEUE_ITEM_BYTES = 32
#: The most bytes of keys one ``list_keys`` answer carries, and of values one ``multi_get``
#: answer carries (clients read replies of up to 64 MiB; a small request naming one large key
#: many times must not make the server build a reply of gigabytes).
MAX_LIST_BYTES = 32 << 20


@dataclass
class Tally:
    """The bytes of keys and values every job of the server holds together; ``limit`` is
    ``--max-store-bytes`` (so many jobs within their own limits cannot exhaust the server)."""

    limit: int
    nbytes: int = 0


@dataclass
class KeyValueStore:
    """The keys and values of one job (``nbytes``: keys + values held), and its queues.

    As in torch's stores, queues (``queue_push``/``queue_pop``) are a namespace of their own:
    ``get``/``set``/``delete`` never see them, ``check``/``wait`` see a non-empty queue as a
    present key, and a queue is forgotten once empty. A queue counts as one key against
    ``--max-keys-per-job``; each queued value its bytes plus ``QUEUE_ITEM_BYTES``.
    """

    name: str
    limits: StateLimits
    kv: dict[str, bytes] = field(default_factory=dict)
    nbytes: int = 0  # keys + values held (queues included)
    tally: Tally | None = None  # the server's, shared by its jobs
    queues: dict[str, deque[bytes]] = field(default_factory=dict)

    def _check_key(self, key: object) -> str:
        if not isinstance(key, str):  # ("" is a key, as in torch's stores)
            raise StoreError(f"store key must be a string, got {key!r:.80}")
        size = len(key) if key.isascii() else len(key.encode())
        if size > self.limits.max_key:
            raise LimitError(
                f"store key of {size} bytes exceeds the server's limit of {self.limits.max_key} bytes"
            )
        return key

    def _check_value(self, value: object) -> bytes:
        if type(value) is not bytes:
            if isinstance(value, str):
                value = value.encode()
            if not isinstance(value, bytes):
                raise StoreError(f"store value must be bytes or str, got {type(value).__name__}")
        if len(value) > self.limits.max_value:
            limit = self.limits.max_value
            raise LimitError(f"store value of {len(value)} bytes exceeds the server's limit of {limit} bytes")
        return value

    def _room_for_key(self) -> None:
        if len(self.kv) + len(self.queues) >= self.limits.max_keys_per_job:
            raise LimitError(
                f"job {self.name!r} already holds {self.limits.max_keys_per_job} keys "
                "(limit: arendez-server --max-keys-per-job)"
            )

    def _grow(self, delta: int) -> None:
        """Count ``delta`` more bytes held, or refuse them past the job's or the server's limit."""
        grown = self.nbytes + delta
        if grown > self.limits.max_bytes_per_job:
            raise LimitError(
                f"job {self.name!r} would hold more than {self.limits.max_bytes_per_job} bytes "
                "(limit: arendez-server --max-bytes-per-job)"
            )
        tally = self.tally
        if tally is not None:
            if delta > 0 and tally.nbytes + delta > tally.limit:
                raise LimitError(
                    f"the server's jobs would hold more than {tally.limit} bytes of keys and values "
                    "together (limit: arendez-server --max-store-bytes)"
                )
            tally.nbytes += delta
        self.nbytes = grown

    def _put(self, key: str, value: bytes) -> None:
        old = self.kv.get(key)
        if old is None:
            self._room_for_key()
        self._grow(len(value) - (len(old) if old is not None else -len(key)))
        self.kv[key] = value

    def clear(self) -> None:
        """Forget every key, value and queue (their bytes no longer count)."""
        self._grow(-self.nbytes)
        self.kv.clear()
        self.queues.clear()

    def set(self, key: object, value: object) -> None:
        self._put(self._check_key(key), self._check_value(value))

    def get(self, key: object) -> bytes | None:
        return self.kv.get(self._check_key(key))

    def add(self, key: object, amount: object) -> int:
        name = self._check_key(key)
        if not isinstance(amount, int) or isinstance(amount, bool):
            raise StoreError(f"add amount must be an integer, got {amount!r:.80}")
        current = self.kv.get(name, b"0")
        try:
            total = int(current) + amount
        except ValueError:
            raise StoreError(f"key {name!r} does not hold an integer") from None
        if not -(2**63) <= total < 2**63:
            raise StoreError(f"add on {name!r} would leave the 64-bit integer range")
        self._put(name, str(total).encode())
        return total

    def compare_set(self, key: object, expected: object, desired: object) -> bytes:
        """Set ``desired`` if the value is ``expected`` (or missing and ``expected`` is empty)."""
        name = self._check_key(key)
        want, new = self._check_value(expected), self._check_value(desired)
        current = self.kv.get(name)
        if (current is None and want == b"") or current == want:
            self._put(name, new)
            return new
        return current if current is not None else want

    def append(self, key: object, value: object) -> None:
        """Append ``value`` to the bytes at ``key`` (created if missing)."""
        name, extra = self._check_key(key), self._check_value(value)
        old = self.kv.get(name, b"")
        size = len(old) + len(extra)
        if size > self.limits.max_value:
            raise LimitError(
                f"append to {name!r} would make a value of {size} bytes, over the server's limit "
                f"of {self.limits.max_value} bytes"
            )
        self._put(name, old + extra)

    def delete(self, key: object) -> bool:
        name = self._check_key(key)
        old = self.kv.pop(name, None)
        if old is None:
            return False
        self._grow(-(len(name) + len(old)))
        return True

    def present(self, key: str) -> bool:
        """Whether ``check``/``wait`` see ``key``: a value, or a non-empty queue."""
        return key in self.kv or key in self.queues

    def has_all(self, keys: list[str]) -> bool:
        return all(self.present(self._check_key(k)) for k in keys)

    def keys(self) -> list[str]:
        """The keys that hold values (queues are not listed, as in torch)."""
        size = sum(len(k) + 5 for k in self.kv)  # (utf-8 of non-ascii keys counted by characters)
        if size > MAX_LIST_BYTES:
            raise LimitError(
                f"list_keys: job {self.name!r} holds {len(self.kv)} keys of about {size} bytes in all, "
                f"more than one answer carries ({MAX_LIST_BYTES} bytes)"
            )
        return list(self.kv)

    def queue_push(self, key: object, value: object) -> None:
        """Append ``value`` to the queue ``key`` (created on first push)."""
        name, item = self._check_key(key), self._check_value(value)
        queue = self.queues.get(name)
        created = queue is None
        if created:
            self._room_for_key()
        self._grow(len(item) + QUEUE_ITEM_BYTES + (len(name) if created else 0))
        if queue is None:
            queue = self.queues[name] = deque()
        queue.append(item)

    def queue_pop(self, key: object) -> bytes | None:
        """The oldest value of the queue ``key``, removed; ``None`` if it is empty."""
        name = self._check_key(key)
        queue = self.queues.get(name)
        if queue is None:
            return None
        item = queue.popleft()
        self._grow(-(len(item) + QUEUE_ITEM_BYTES))
        if not queue:
            del self.queues[name]
            self._grow(-len(name))
        return item

    def queue_pop_now(self, key: object) -> bytes:
        """``queue_pop`` that raises ``QueueEmptyError`` for an empty queue."""
        item = self.queue_pop(key)
        if item is None:
            raise QueueEmptyError(f"queue {key!r:.80} is empty")
        return item

    def queue_len(self, key: object) -> int:
        queue = self.queues.get(self._check_key(key))
        return 0 if queue is None else len(queue)

    def get_all(self, keys: list[str]) -> list[bytes] | None:
        """The values of ``keys`` in order; ``None`` if any is missing."""
        kv = self.kv
        found = [kv.get(self._check_key(k)) for k in keys]
        values = [v for v in found if v is not None]
        if len(values) < len(found):
            return None
        size = sum(len(v) for v in values)
        if size > MAX_LIST_BYTES:
            raise LimitError(
                f"multi_get of {len(keys)} keys would answer {size} bytes, more than one answer "
                f"carries ({MAX_LIST_BYTES} bytes): ask for fewer keys at a time"
            )
        return values

    def set_all(self, keys: list[str], values: list[object]) -> None:
        """Set each key to the value at its position; every key and value is checked first."""
        pairs = [(self._check_key(k), self._check_value(v)) for k, v in zip(keys, values, strict=True)]
        for key, value in pairs:
            self._put(key, value)
