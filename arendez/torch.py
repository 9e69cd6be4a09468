"""torch.distributed backend ``"arendez"``: ``import arendez.torch`` registers it.

Then ``torch.distributed.init_process_group(backend="arendez", init_method=...)`` runs every
CPU collective and DDP on arendez. How it is wired:

- The backend is a Python subclass of torch's ``ProcessGroup`` (the C++ class has a pybind
  trampoline that dispatches its virtual collectives to Python): ``arendez.torchgroup``. This
  module creates it for torch and registers it. torch's ``Backend`` class has no
  Python constructor in torch 2.13, so the registered creator returns the ``ProcessGroup``
  itself; torch then uses it as the group object, and DDP's C++ reducer calls its ``allreduce``.
- Every call is started on arendez's one loop thread (``arendez.loop.shared``) with one
  ``call_soon_threadsafe``; it returns a ``Work`` (``arendez.torchwork``) whose ``wait()`` blocks
  on a lock (the GIL is released) and whose ``get_future()`` is a ``torch.futures.Future``
  completed on a callback thread (``arendez.callbacks``). Calls are started in the order
  torch's threads make them, which is what arendez matches collectives by.
- Rendezvous: torch builds its store from ``env://``/``tcp://`` (or takes the ``store=`` you
  pass). Rank 0 then starts an arendez server (a child process, as ``tcp://``'s, so a stopped
  rank 0 is still declared failed; kept for later inits, each a job of its own) on the store's
  host and publishes ``arendez://token@host:port/job`` in that store; every rank joins through it (leases,
  failure detection, peer addresses). ``init_method="arendez://host:port/job"`` joins a
  standalone ``arendez-server`` directly; torch's own store is then kept on that server too.
- Subgroups (``new_group(..., backend="arendez")``): torch calls the creator on members only,
  while arendez's ``new_group`` must be entered by every rank of the world, so subgroup
  collectives run over arendez point-to-point messages (``arendez.torchsub``: direct exchange,
  one message per pair; fine for the small control groups subgroups usually are).
- Group names: torch keeps a group's name on its C++ backends, which a Python group has none of,
  so the group keeps the name itself; device meshes (DTensor, FSDP2) look groups up by name.
- Tensors arendez cannot carry as they are (non-contiguous; bfloat16 in a reduction) travel as
  contiguous (float32) copies that are copied back into the caller's tensors
  (``arendez.torchstage``).
- ``arendez://`` init and the torch ``Store`` kept on an arendez server: ``arendez.torchstore``.
- ``destroy_process_group()`` calls ``shutdown()``, which destroys the arendez world (drain, then
  close); the hosting rank's server stays up for the others to leave, and for its next init.
"""

from __future__ import annotations

import datetime
import hashlib
import importlib
import os
import secrets
from typing import Any

import torch
import torch.distributed as dist

import arendez

from . import embedded, farewell, jobnames
from .errors import RendezvousError
from .loop import shared
from .torchgroup import BACKEND, ProcessGroupArendez
from .torchstore import ServerStore, arendez_rendezvous, seconds
from .torchwork import Work

_PrefixStore: Any = torch._C._distributed_c10d.PrefixStore
_URL_KEY = "arendez/url"


def _unwrap(store: Any) -> Any:
    """The store under torch's ``PrefixStore`` layers."""
    while isinstance(store, _PrefixStore):
        store = store.underlying_store
    return store


def _host_of(store: Any) -> str:
    """Where the embedded server should listen: the torch store's host when it has one."""
    explicit = os.environ.get("ARENDEZ_SERVER_HOST")
    if explicit:
        return explicit
    host = getattr(_unwrap(store), "host", None)
    if isinstance(host, str) and host:
        return host
    return os.environ.get("MASTER_ADDR") or "127.0.0.1"


def meeting_url(store: Any, rank: int, size: int, timeout: float) -> str:
    """Where the ranks meeting through torch ``store`` form their arendez world: the URL rank 0
    publishes in it for a job on the store server it hosts (an ``arendez://`` store's own)."""
    base = _unwrap(store)
    if isinstance(base, ServerStore):
        return base.url
    # A store passed in again after destroy still holds the previous URL: every rank counts
    # itself in, and init k (all its ranks count before any can finish it) reads round k's key.
    key = f"{_URL_KEY}/{(int(store.add(_URL_KEY + '/joins', 1)) - 1) // size}"
    if rank == 0:
        url: str = shared.call(_host, _host_of(store))
        store.set(key, url)
        return url
    store.wait([key], datetime.timedelta(seconds=timeout))
    return str(store.get(key).decode())


def _create(opts: Any, backend_options: Any = None) -> ProcessGroupArendez:
    """torch's creator: the default group joins (or hosts) an arendez world; subgroups map onto it."""
    store, rank, size = opts.store, opts.group_rank, opts.group_size
    timeout = seconds(opts.timeout) or 1800.0
    ranks = list(opts.global_ranks_in_group)
    if ranks:  # a subgroup: torch calls this on its members only
        if not arendez.is_initialized():
            raise RendezvousError("an arendez subgroup needs the default group on the arendez backend")
        tag = (1 << 40) + int(hashlib.sha1(f"{opts.group_id}|{ranks}".encode()).hexdigest()[:8], 16)
        return ProcessGroupArendez(rank, size, ranks, tag, timeout)
    pg = ProcessGroupArendez(rank, size, None, 0)
    url = meeting_url(store, rank, size, timeout)
    farewell.install_sigterm_handler()  # (from torch's thread: the loop thread cannot)
    shared.call(arendez.init_process_group, "tcp", url, world_size=size, rank=rank, timeout=timeout)
    return pg


#: The store server this process hosts for the worlds it forms as rank 0 through a torch store,
#: by host: a child process, as ``tcp://``'s (``arendez.embedded``), so a stopped rank 0 does not
#: stop the server that declares it failed. Started once and kept: each init is a job of its own
#: on it, so a destroy need not wait for the others to leave before closing it.
_hosted: dict[str, tuple[Any, str]] = {}


def _serving(server: Any) -> bool:
    proc = getattr(server, "proc", None)  # (a ServerProcess; an in-loop server lives with the loop)
    return proc is None or proc.poll() is None


async def _host(host: str) -> str:
    """The join URL of a new job on this process's store server for ``host`` (started if needed)."""
    entry = _hosted.get(host)
    if entry is None or not _serving(entry[0]):
        token = secrets.token_hex(16)
        server = await embedded.start_server(host, 0, token, None, who="rank 0", wait=0.0)
        entry = _hosted[host] = (server, token)
    server, token = entry
    where = f"[{host}]" if ":" in host else host
    return f"arendez://{token}@{where}:{server.port}/{jobnames.for_torch()}"


os.register_at_fork(after_in_child=_hosted.clear)  # (a forked child hosts none of them)


def register() -> None:
    """Register backend ``"arendez"`` (CPU) and the ``arendez://`` init method with torch."""
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu"])
    rendezvous: Any = importlib.import_module("torch.distributed.rendezvous")
    if BACKEND not in getattr(rendezvous, "_rendezvous_handlers", {}):  # (torch_plugin may have)
        rendezvous.register_rendezvous_handler(BACKEND, arendez_rendezvous)


register()

__all__ = ["BACKEND", "ProcessGroupArendez", "ServerStore", "Work", "register"]
