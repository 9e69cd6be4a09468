"""The key-value operations of the async store client, each one compact request
(``store_wire``), and ``PrefixStore``, a view of a store under a key prefix."""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from .store_wire import OPS, key_batches, to_bytes


class KeyValueOps:
    """set/get/add/compare_set/wait/check/delete/num_keys/multi_get/multi_set/list_keys and the
    queues, over ``_ask`` (the connection's compact request, ``Store._ask``). A key list longer
    than one request may name goes as several requests (``key_batches``) under one deadline."""

    timeout: float  # the default budget of a call, in seconds

    async def _ask(self, op: str, timeout: float | None, wait: bool, *args: Any) -> Any:
        raise NotImplementedError

    async def _batched(self, op: str, timeout: float | None, keys: list[str]) -> list[Any]:
        """``op`` on each batch of ``keys``, waiting up to what is left of ``timeout``."""
        deadline = time.monotonic() + (self.timeout if timeout is None else float(timeout))
        return [
            await self._ask(op, max(0.0, deadline - time.monotonic()), True, keys[part])
            for part in key_batches(keys)
        ]

    async def set(self, key: str, value: str | bytes, timeout: float | None = None) -> None:
        """Store ``value`` under ``key``."""
        await self._ask("set", timeout, False, key, value if type(value) is bytes else to_bytes(value))

    async def get(self, key: str, timeout: float | None = None) -> bytes:
        """The value of ``key``, waiting up to ``timeout`` for it to be set."""
        value: bytes = await self._ask("get", timeout, True, key)
        return value

    async def add(self, key: str, amount: int = 1, timeout: float | None = None) -> int:
        """Atomically add ``amount`` to the integer at ``key`` (missing = 0); return the sum."""
        total: int = await self._ask("add", timeout, False, key, int(amount))
        return total

    async def compare_set(
        self, key: str, expected: str | bytes, desired: str | bytes, timeout: float | None = None
    ) -> bytes:
        """Set ``desired`` if ``key`` holds ``expected`` (or is missing and ``expected`` is
        empty); return the value the key holds afterwards."""
        value: bytes = await self._ask(
            "compare_set", timeout, False, key, to_bytes(expected), to_bytes(desired)
        )
        return value

    async def append(self, key: str, value: str | bytes, timeout: float | None = None) -> None:
        """Append ``value`` to the bytes at ``key`` (created if missing), atomically."""
        await self._ask("append", timeout, False, key, to_bytes(value))

    async def wait(self, keys: Iterable[str], timeout: float | None = None) -> None:
        """Wait until every key in ``keys`` is set; ``StoreTimeoutError`` after ``timeout``."""
        keys = list(keys)
        if len(key_batches(keys)) == 1:
            await self._ask("wait", timeout, True, keys)
        else:
            await self._batched("wait", timeout, keys)

    async def barrier(self, key: str, count: int, timeout: float | None = None) -> None:
        """Count this caller at ``key`` and return once the counter there reaches ``count``:
        torch's ``TCPStore.barrier`` (an arrival that reaches its own count lets every caller
        waiting on the key go on; ``StoreTimeoutError`` after ``timeout``, still counted)."""
        await self._ask("barrier", timeout, True, key, int(count))

    async def check(self, keys: Iterable[str], timeout: float | None = None) -> bool:
        """True if every key in ``keys`` is set (no waiting)."""
        keys = list(keys)
        for part in key_batches(keys):
            if not await self._ask("check", timeout, False, keys[part]):
                return False
        return True

    async def delete(self, key: str, timeout: float | None = None) -> bool:
        """Delete ``key``; True if it existed."""
        existed: bool = await self._ask("delete", timeout, False, key)
        return existed

    async def num_keys(self, timeout: float | None = None) -> int:
        """How many keys the job's store holds."""
        count: int = await self._ask("num_keys", timeout, False)
        return count

    async def multi_get(self, keys: Iterable[str], timeout: float | None = None) -> list[bytes]:
        """The values of ``keys``, in order, waiting up to ``timeout`` for any not yet set."""
        keys = list(keys)
        if len(key_batches(keys)) == 1:
            values: list[bytes] = await self._ask("multi_get", timeout, True, keys)
            return values
        return [value for part in await self._batched("multi_get", timeout, keys) for value in part]

    async def multi_set(
        self, keys: Iterable[str], values: Iterable[str | bytes], timeout: float | None = None
    ) -> None:
        """Set each of ``keys`` to the value at its position in ``values``, in one request (in
        several, one after another, if they do not fit one)."""
        keys, data = list(keys), [to_bytes(v) for v in values]
        if len(keys) != len(data):
            raise ValueError(f"multi_set got {len(keys)} keys but {len(data)} values")
        for part in key_batches(keys, data):
            await self._ask("multi_set", timeout, False, keys[part], data[part])

    async def list_keys(self, timeout: float | None = None) -> list[str]:
        """Every key of the job's store that holds a value (queues are not listed)."""
        keys: list[str] = await self._ask("list_keys", timeout, False)
        return keys

    async def queue_push(self, key: str, value: str | bytes, timeout: float | None = None) -> None:
        """Append ``value`` to the queue ``key`` (queues are apart from the keys' values)."""
        await self._ask("queue_push", timeout, False, key, to_bytes(value))

    async def queue_pop(self, key: str, block: bool = True, timeout: float | None = None) -> bytes:
        """The oldest value of the queue ``key``, removed: waiting up to ``timeout`` for one
        (``StoreTimeoutError``), or with ``block=False`` ``QueueEmptyError`` at once."""
        value: bytes = await self._ask("queue_pop", timeout, True, key, bool(block))
        return value

    async def queue_len(self, key: str, timeout: float | None = None) -> int:
        """How many values the queue ``key`` holds."""
        count: int = await self._ask("queue_len", timeout, False, key)
        return count


class PrefixStore(KeyValueOps):
    """A view of ``store`` whose keys all start with ``prefix/``: every operation of the store
    (``list_keys`` lists the keys under the prefix, without it)."""

    def __init__(self, prefix: str, store: KeyValueOps) -> None:
        self.prefix = prefix
        self.store = store

    @property
    def timeout(self) -> float:  # type: ignore[override]
        """The underlying store's."""
        return self.store.timeout

    def _k(self, key: str) -> str:
        return f"{self.prefix}/{key}"

    async def _ask(self, op: str, timeout: float | None, wait: bool, *args: Any) -> Any:
        names = OPS[op]
        if names and names[0] == "key":
            args = (self._k(args[0]), *args[1:])
        elif names and names[0] == "keys":
            args = ([self._k(k) for k in args[0]], *args[1:])
        found = await self.store._ask(op, timeout, wait, *args)
        if op == "list_keys":
            start = f"{self.prefix}/"
            return [k[len(start) :] for k in found if k.startswith(start)]
        return found
