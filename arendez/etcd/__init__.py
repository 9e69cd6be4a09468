"""Rendezvous and store on etcd v3: ``init_method="etcd://[user:password@]host:port[,...]/job"``.

Needs the optional dependency ``aiohttp`` (``pip install 'arendez[etcd]'``); ``client.py`` says
why the client talks to etcd's JSON gateway.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import RendezvousError
from .url import Endpoints, parse_url

if TYPE_CHECKING:
    from .store import EtcdStore


def open_store(url: str, timeout: float = 300.0) -> EtcdStore:
    """An (unconnected) ``EtcdStore`` for ``url``; a clear error when ``aiohttp`` is missing."""
    try:
        from .store import EtcdStore
    except ImportError as exc:
        raise RendezvousError(f"etcd:// needs aiohttp ({exc}): pip install 'arendez[etcd]'") from None
    return EtcdStore.from_url(url, timeout)


__all__ = ["Endpoints", "open_store", "parse_url"]
