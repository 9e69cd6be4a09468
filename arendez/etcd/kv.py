"""``EtcdKV``: one job's key-value store on etcd v3 (set/get/add/compare_set/append/wait/
check/delete/num_keys under ``/arendez/<job>/kv/``), the connection it runs on, and etcd transaction pieces.
``EtcdStore`` (store.py) adds the rendezvous.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
from collections.abc import Callable, Iterable
from typing import Any, Self

from ..errors import StoreError, StoreTimeoutError
from ..store_wire import to_bytes
from .client import AsyncEtcd
from .codec import b64, prefix_end, unb64
from .url import DEFAULT_LEASE, Endpoints, parse_url

MAX_KEY = 4096
MAX_VALUE = 1 << 20  # etcd refuses requests over 1.5 MiB by default
_CALL_TIMEOUT = 30.0
_TXN_OPS = 100  # etcd's default --max-txn-ops is 128


# -- transaction building blocks ------------------------------------------------------------------
def _put(key: bytes, value: bytes, lease: int = 0) -> dict[str, Any]:
    req: dict[str, Any] = {"key": b64(key), "value": b64(value)}
    if lease:
        req["lease"] = str(lease)
    return {"request_put": req}


def _range(key: bytes, end: bytes | None = None, *, count_only: bool = False) -> dict[str, Any]:
    req: dict[str, Any] = {"key": b64(key)}
    if end is not None:
        req["range_end"] = b64(end)
    if count_only:
        req["count_only"] = True
    return {"request_range": req}


def _delete(key: bytes, end: bytes | None = None) -> dict[str, Any]:
    req: dict[str, Any] = {"key": b64(key)}
    if end is not None:
        req["range_end"] = b64(end)
    return {"request_delete_range": req}


def _same(key: bytes, target: str, value: int | bytes) -> dict[str, Any]:
    """Compare ``target`` (CREATE, MOD or VALUE) of ``key`` for equality (missing key = 0)."""
    field = {"CREATE": "create_revision", "MOD": "mod_revision", "VALUE": "value"}[target]
    raw = b64(value) if isinstance(value, bytes) else str(value)
    return {"key": b64(key), "target": target, "result": "EQUAL", field: raw}


def _kvs(response: dict[str, Any]) -> list[dict[str, Any]]:
    kvs: list[dict[str, Any]] = (response.get("response_range") or response).get("kvs") or []
    return kvs


def _count(response: dict[str, Any]) -> int:
    return int((response.get("response_range") or response).get("count", 0))


def _revision(body: dict[str, Any]) -> int:
    return int(body.get("header", {}).get("revision", 0))


class EtcdKV:
    """One job's key-value store on an etcd v3 cluster (``Store``'s store operations)."""

    def __init__(
        self,
        endpoints: Endpoints,
        job: str,
        *,
        lease: int = DEFAULT_LEASE,
        timeout: float = 300.0,
    ) -> None:
        self.ends = endpoints
        self.host, self.port = endpoints.hosts[0]
        self.job = job
        self.timeout = timeout
        self.lease_ttl = lease
        self._root = f"/arendez/{job}/".encode()
        self._etcd: AsyncEtcd | None = None
        self._closed = False
        self._updating: dict[bytes, asyncio.Lock] = {}

    @classmethod
    def from_url(cls, url: str, timeout: float = 300.0) -> Self:
        ends, job, lease = parse_url(url)
        return cls(ends, job, lease=lease, timeout=timeout)

    # -- connection ------------------------------------------------------------------------------
    async def connect(self, timeout: float | None = None) -> Self:
        """Reach a member of the cluster (retrying until ``timeout``) and authenticate now
        (otherwise the first call does, within its own timeout)."""
        loop = asyncio.get_running_loop()
        self._closed = False
        try:
            await self._client.call(
                "kv/range", {"key": b64(self._root + b"rdzv/round")}, loop.time() + (timeout or self.timeout)
            )
        except BaseException:
            await self.close()
            raise
        return self

    async def __aenter__(self) -> Self:
        return await self.connect()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def _client(self) -> AsyncEtcd:
        """The cluster's client, made on first use (as ``Store`` connects on its first call)."""
        if self._etcd is None:
            if self._closed:
                raise StoreError(f"the etcd store of job {self.job!r} was closed")
            self._etcd = AsyncEtcd(self.ends)
        return self._etcd

    async def close(self) -> None:
        """Close the HTTP connections (a later call raises ``StoreError``; ``connect`` reopens)."""
        self._closed = True
        if self._etcd is not None:
            etcd, self._etcd = self._etcd, None
            with contextlib.suppress(Exception):
                await etcd.aclose()

    def sockname(self) -> Any:
        """The local address that routes to the first etcd endpoint (what peers should dial)."""
        with socket.socket(socket.AF_INET6 if ":" in self.host else socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                s.connect((self.host, self.port))
                return s.getsockname()
            except OSError:
                return None

    def _deadline(self, timeout: float | None, cap: float | None = _CALL_TIMEOUT) -> float:
        budget = self.timeout if timeout is None else float(timeout)
        if cap is not None:
            budget = min(budget, cap)
        return asyncio.get_running_loop().time() + budget

    async def _call(self, path: str, body: dict[str, Any], deadline: float) -> dict[str, Any]:
        return await self._client.call(path, body, deadline)

    async def _txn(
        self,
        compare: list[dict[str, Any]],
        success: list[dict[str, Any]],
        failure: list[dict[str, Any]],
        deadline: float,
    ) -> tuple[bool, list[dict[str, Any]], int]:
        body = await self._call(
            "kv/txn", {"compare": compare, "success": success, "failure": failure}, deadline
        )
        return bool(body.get("succeeded")), body.get("responses") or [], _revision(body)

    def _kv(self, key: object) -> bytes:
        if not isinstance(key, str) or not key:
            raise StoreError(f"store key must be a non-empty string, got {key!r:.80}")
        raw = key.encode()
        if len(raw) > MAX_KEY:
            raise StoreError(f"store key of {len(raw)} bytes exceeds {MAX_KEY}")
        return self._root + b"kv/" + raw

    @staticmethod
    def _value(value: str | bytes) -> bytes:
        data = to_bytes(value)
        if len(data) > MAX_VALUE:
            raise StoreError(f"store value of {len(data)} bytes exceeds {MAX_VALUE}")
        return data

    async def _until_changed(self, key: bytes, end: bytes | None, after: int, deadline: float) -> None:
        """Return at the first change to ``key`` (or the range up to ``end``) after revision
        ``after``; ``TimeoutError`` at ``deadline``."""
        watch = self._client.watch(key, end if end is not None else b"", after + 1)
        try:
            async with asyncio.timeout_at(deadline):
                async for _ in watch:
                    return
        finally:
            await watch.aclose()

    # -- store -----------------------------------------------------------------------------------
    async def set(self, key: str, value: str | bytes, timeout: float | None = None) -> None:
        """Store ``value`` under ``key``."""
        await self._call(
            "kv/put", _put(self._kv(key), self._value(value))["request_put"], self._deadline(timeout)
        )

    async def get(self, key: str, timeout: float | None = None) -> bytes:
        """The value of ``key``, waiting up to ``timeout`` for it to be set."""
        name = self._kv(key)
        deadline = self._deadline(timeout, None)
        while True:
            body = await self._call("kv/range", {"key": b64(name)}, deadline)
            kvs = _kvs(body)
            if kvs:
                return unb64(kvs[0].get("value"))
            try:
                await self._until_changed(name, None, _revision(body), deadline)
            except TimeoutError:
                raise StoreTimeoutError(
                    f"get of {key!r} timed out: not satisfied within {self._budget(timeout):g}s"
                ) from None

    def _budget(self, timeout: float | None) -> float:
        return self.timeout if timeout is None else float(timeout)

    async def _update(
        self, name: bytes, change: Callable[[bytes | None], bytes | None], deadline: float
    ) -> bytes | None:
        """Compare-and-swap loop: write ``change(current)`` (None: leave it) if nobody wrote
        ``name`` in between; return what the key holds afterwards."""
        lock = self._updating.setdefault(name, asyncio.Lock())
        try:
            async with asyncio.timeout_at(deadline):
                async with lock:  # our own concurrent updates of one key queue rather than race
                    return await self._swap(name, change, deadline)
        except TimeoutError:
            what = name[len(self._root) + 3 :].decode()
            raise StoreTimeoutError(f"update of {what!r} lost every race until its deadline") from None
        finally:
            if not lock.locked() and self._updating.get(name) is lock:
                del self._updating[name]

    async def _swap(
        self, name: bytes, change: Callable[[bytes | None], bytes | None], deadline: float
    ) -> bytes | None:
        body = await self._call("kv/range", {"key": b64(name)}, deadline)
        attempt = 0
        while True:
            kvs = _kvs(body)
            current = unb64(kvs[0].get("value")) if kvs else None
            mod = int(kvs[0].get("mod_revision", 0)) if kvs else 0
            new = change(current)
            if new is None:
                return current
            ok, responses, _ = await self._txn(
                [_same(name, "MOD", mod)], [_put(name, new)], [_range(name)], deadline
            )
            if ok:
                return new
            body = responses[0]
            attempt += 1  # lost a race: back off a little, randomly, so the racers spread out
            await asyncio.sleep(random.uniform(0, min(0.05, 0.001 * 2**attempt)))

    async def add(self, key: str, amount: int = 1, timeout: float | None = None) -> int:
        """Atomically add ``amount`` to the integer at ``key`` (missing = 0); return the sum."""
        if not isinstance(amount, int) or isinstance(amount, bool):
            raise StoreError(f"add amount must be an integer, got {amount!r:.80}")

        def plus(current: bytes | None) -> bytes:
            try:
                total = int(current or b"0") + amount
            except ValueError:
                raise StoreError(f"key {key!r} does not hold an integer") from None
            if not -(2**63) <= total < 2**63:
                raise StoreError(f"add on {key!r} would leave the 64-bit integer range")
            return str(total).encode()

        result = await self._update(self._kv(key), plus, self._deadline(timeout))
        return int(result or b"0")

    async def compare_set(
        self, key: str, expected: str | bytes, desired: str | bytes, timeout: float | None = None
    ) -> bytes:
        """Set ``desired`` if ``key`` holds ``expected`` (or is missing and ``expected`` is
        empty); return the value the key holds afterwards."""
        want, new = self._value(expected), self._value(desired)

        def swap(current: bytes | None) -> bytes | None:
            return new if (current is None and want == b"") or current == want else None

        result = await self._update(self._kv(key), swap, self._deadline(timeout))
        return want if result is None else result

    async def append(self, key: str, value: str | bytes, timeout: float | None = None) -> None:
        """Append ``value`` to the bytes at ``key`` (created if missing), atomically."""
        extra = self._value(value)
        await self._update(self._kv(key), lambda current: (current or b"") + extra, self._deadline(timeout))

    async def _missing(self, names: list[bytes], deadline: float) -> tuple[list[bytes], int]:
        missing: list[bytes] = []
        revision = 0
        for i in range(0, len(names), _TXN_OPS):
            batch = names[i : i + _TXN_OPS]
            _, responses, rev = await self._txn([], [_range(n, count_only=True) for n in batch], [], deadline)
            revision = revision or rev
            missing += [n for n, r in zip(batch, responses, strict=True) if _count(r) == 0]
        return missing, revision

    async def wait(self, keys: Iterable[str], timeout: float | None = None) -> None:
        """Wait until every key in ``keys`` is set; ``StoreTimeoutError`` after ``timeout``."""
        names = [self._kv(k) for k in keys]
        deadline = self._deadline(timeout, None)
        while True:
            names, revision = await self._missing(names, deadline)
            if not names:
                return
            try:
                kv = self._root + b"kv/"
                await self._until_changed(kv, prefix_end(kv), revision, deadline)
            except TimeoutError:
                shown = [n[len(self._root) + 3 :].decode() for n in names[:5]]
                raise StoreTimeoutError(
                    f"wait for {shown} timed out: not satisfied within {self._budget(timeout):g}s"
                ) from None

    async def check(self, keys: Iterable[str], timeout: float | None = None) -> bool:
        """True if every key in ``keys`` is set (no waiting)."""
        missing, _ = await self._missing([self._kv(k) for k in keys], self._deadline(timeout))
        return not missing

    async def delete(self, key: str, timeout: float | None = None) -> bool:
        """Delete ``key``; True if it existed."""
        body = await self._call("kv/deleterange", {"key": b64(self._kv(key))}, self._deadline(timeout))
        return int(body.get("deleted", 0)) > 0

    async def num_keys(self, timeout: float | None = None) -> int:
        """How many keys the job's store holds."""
        kv = self._root + b"kv/"
        body = await self._call(
            "kv/range", _range(kv, prefix_end(kv), count_only=True)["request_range"], self._deadline(timeout)
        )
        return _count(body)

    async def status(self) -> dict[str, Any]:
        """The cluster member we talk to, as etcd reports it."""
        return await self._call("maintenance/status", {}, self._deadline(None))
