"""torch ``Store`` on an arendez server, and torch's ``arendez://`` init method.

``init_method="arendez://[token@]host:port[/job]"`` makes torch call ``arendez_rendezvous``, which
hands torch a ``ServerStore``: torch's key-value store kept in the job's namespace on that server.
"""

from __future__ import annotations

import datetime
import os
import urllib.parse
from collections.abc import Callable, Coroutine, Iterator
from typing import Any

import torch

import arendez

from . import validate
from .errors import RendezvousError
from .loop import shared
from .rendezvous import DEFAULT_PORT

_TorchStore: Any = torch._C._distributed_c10d.Store
_ALIVE: list[Any] = []  # Python stores handed to torch (see arendez_rendezvous)


def total_seconds(timeout: Any) -> float:
    """torch's ``timedelta``, or a number of seconds, as a float."""
    return timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else float(timeout)


def seconds(timeout: Any) -> float | None:
    """torch's ``timedelta`` (0 = no timeout) or seconds as a float, None for no limit."""
    if timeout is None:
        return None
    value = total_seconds(timeout)
    return value if value > 0 else None


def close_stores() -> None:
    """Close the stores handed to torch (at destroy: torch stops using them)."""
    stores, _ALIVE[:] = list(_ALIVE), []
    for store in stores:
        store.close()


class ServerStore(_TorchStore):  # type: ignore[misc]
    """A torch ``Store`` kept in a job's namespace on an arendez server (for ``arendez://``;
    ``scoped``: its keys go once no client of the job has been connected for the server's
    ``--scoped-grace``, as a TCPStore master's keys go with it, for torchrun's rendezvous)."""

    def __init__(self, url: str, timeout: float, *, scoped: bool = False) -> None:
        super().__init__()
        parsed = urllib.parse.urlsplit(url)
        if not parsed.hostname:
            raise RendezvousError(f"{url!r} names no host: arendez://[token@]host[:port][/job]")
        port = parsed.port or DEFAULT_PORT  # (as the async and blocking APIs: the server's default)
        self.url = url
        self._timeout = timeout
        token = urllib.parse.unquote(parsed.username) if parsed.username else os.environ.get("ARENDEZ_TOKEN")
        self._store: Any = shared.call(
            _open_store, parsed.hostname, port, parsed.path.strip("/") + "/torch", token, timeout, scoped
        )

    def _call(self, fn: Callable[..., Coroutine[Any, Any, Any]], *args: Any) -> Any:
        return shared.call(fn, *args)

    def set(self, key: str, value: Any) -> None:
        self._call(self._store.set, key, bytes(value) if not isinstance(value, str) else value)

    def get(self, key: str) -> bytes:
        return bytes(self._call(self._store.get, key, self._timeout))

    def add(self, key: str, amount: int) -> int:
        return int(self._call(self._store.add, key, amount))

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        return bytes(self._call(self._store.compare_set, key, bytes(expected), bytes(desired)))

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return [bytes(v) for v in self._call(self._store.multi_get, keys, self._timeout)]

    def multi_set(self, keys: list[str], values: list[Any]) -> None:
        self._call(self._store.multi_set, keys, [v if isinstance(v, str) else bytes(v) for v in values])

    def append(self, key: str, value: Any) -> None:
        self._call(self._store.append, key, value if isinstance(value, str) else bytes(value))

    def wait(self, keys: list[str], timeout: Any = None) -> None:
        self._call(self._store.wait, keys, seconds(timeout) or self._timeout)

    def check(self, keys: list[str]) -> bool:
        return bool(self._call(self._store.check, keys))

    def delete_key(self, key: str) -> bool:
        return bool(self._call(self._store.delete, key))

    def num_keys(self) -> int:
        return int(self._call(self._store.num_keys))

    def list_keys(self) -> list[str]:
        """Every key of the job that holds a value (not torch's API: arendez's own use)."""
        return list(self._call(self._store.list_keys))

    def set_timeout(self, timeout: Any) -> None:
        self._timeout = seconds(timeout) or self._timeout

    def close(self) -> None:
        """Close the connection to the server (torch stops using the store at destroy)."""
        shared.call(self._store.close)


async def _open_store(
    host: str, port: int, job: str, token: str | None, timeout: float, scoped: bool = False
) -> Any:
    store = arendez.Store(host, port, job, token=token, timeout=timeout, scoped=scoped)
    return await store.connect(timeout)


def arendez_rendezvous(
    url: str, timeout: datetime.timedelta = datetime.timedelta(minutes=30), **kwargs: Any
) -> Iterator[tuple[Any, int, int]]:
    """torch rendezvous handler for ``arendez://[token@]host:port[/job]`` (torch appends
    ``?rank=R&world_size=N`` when they are given; else ``RANK`` / ``WORLD_SIZE``)."""
    parsed = urllib.parse.urlsplit(url)
    query = dict(urllib.parse.parse_qsl(parsed.query))
    try:
        rank = int(query.get("rank", os.environ.get("RANK", "-1")))
        world_size = int(query.get("world_size", os.environ.get("WORLD_SIZE", "-1")))
    except ValueError:
        raise RendezvousError(f"{url}: rank and world_size must be integers") from None
    if rank == -1 or world_size == -1:
        raise RendezvousError(f"{url} needs rank and world_size (arguments or RANK / WORLD_SIZE)")
    validate.rank(rank, validate.world_size(world_size))  # (the checks of every other API)
    store = ServerStore(urllib.parse.urlunsplit(parsed._replace(query="")), timeout.total_seconds())
    _ALIVE.append(store)  # torch keeps only the C++ half: the Python half must outlive this frame
    yield store, rank, world_size
    raise RendezvousError("arendez:// does not re-rendezvous")
