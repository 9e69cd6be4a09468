"""A job's key-value store: checked keys and values, counted against the job's limits.

Sans-I/O: :class:`~arendez_server.state.Job` is a store plus the job's rendezvous rounds.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from arendez.errors import LimitError, StoreError

from .limits import StateLimits


@dataclass
class KeyValueStore:
    """The keys and values of one job (``nbytes``: keys + values held)."""

    name: str
    limits: StateLimits
    kv: dict[str, bytes] = field(default_factory=dict)
    nbytes: int = 0  # keys + values held

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

    def _put(self, key: str, value: bytes) -> None:
        old = self.kv.get(key)
        if old is None and len(self.kv) >= self.limits.max_keys_per_job:
            raise LimitError(
                f"job {self.name!r} already holds {self.limits.max_keys_per_job} keys "
                "(limit: arendez-server --max-keys-per-job)"
            )
        grown = self.nbytes + len(value) - (len(old) if old is not None else -len(key))
        if grown > self.limits.max_bytes_per_job:
            raise LimitError(
                f"job {self.name!r} would hold more than {self.limits.max_bytes_per_job} bytes "
                "(limit: arendez-server --max-bytes-per-job)"
            )
        self.kv[key] = value
        self.nbytes = grown

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

    def delete(self, key: object) -> bool:
        name = self._check_key(key)
        old = self.kv.pop(name, None)
        if old is None:
            return False
        self.nbytes -= len(name) + len(old)
        return True

    def has_all(self, keys: list[str]) -> bool:
        return all(self._check_key(k) in self.kv for k in keys)

    def get_all(self, keys: list[str]) -> list[bytes] | None:
        """The values of ``keys`` in order; ``None`` if any is missing."""
        kv = self.kv
        values = [kv.get(self._check_key(k)) for k in keys]
        return None if None in values else values  # type: ignore[return-value]

    def set_all(self, keys: list[str], values: list[object]) -> None:
        """Set each key to the value at its position; every key and value is checked first."""
        pairs = [(self._check_key(k), self._check_value(v)) for k, v in zip(keys, values, strict=True)]
        for key, value in pairs:
            self._put(key, value)
