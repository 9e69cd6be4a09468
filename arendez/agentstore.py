"""``env://`` under torchrun, whose agent already serves the store on ``MASTER_PORT``.

torchrun (torch >= 2.4) hosts a ``TCPStore`` in its agent on ``MASTER_ADDR:MASTER_PORT`` and
tells its workers so with ``TORCHELASTIC_USE_AGENT_STORE=True``: rank 0 cannot bind that port,
as ``tcp://`` semantics would have it. So rank 0 hosts its embedded arendez server on a free
port instead and publishes ``arendez://token@host:port`` in the agent's store (torch's own
client); every other rank reads it there, then joins as over ``tcp://``. The key names the
torchrun run, its restart and the k-th init of the job, so a re-init never reads a stale one.
"""

from __future__ import annotations

import asyncio
import datetime
import os
import secrets
import socket
from dataclasses import replace
from typing import Any

from . import embedded
from .errors import RendezvousError
from .rendezvous import DEFAULT_JOB, Plan, is_loopback


def _client(host: str, port: int, timeout: float) -> Any:
    try:
        import torch.distributed as torch_dist
    except ImportError:
        raise RendezvousError(
            "TORCHELASTIC_USE_AGENT_STORE is set (torchrun's agent holds MASTER_PORT) but torch "
            "cannot be imported to reach its store"
        ) from None
    return torch_dist.TCPStore(host, port, None, False, datetime.timedelta(seconds=timeout))  # type: ignore[attr-defined]


def _facing(host: str, port: int) -> str:
    """This host's address on the route to ``host`` (what peers elsewhere can dial)."""
    explicit = os.environ.get("ARENDEZ_ADVERTISE_ADDR")
    if explicit:
        return explicit
    if is_loopback(host):
        return "127.0.0.1"
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:  # (no packet is sent)
        probe.connect((host, port))
        return str(probe.getsockname()[0])


async def resolve(where: Plan, timeout: float) -> Plan:
    """The tcp ``Plan`` the agent's store names (published there by rank 0, this rank if 0)."""
    env = os.environ
    run = f"{env.get('TORCHELASTIC_RUN_ID', 'none')}/{env.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    prefix = f"arendez/{run}"
    try:
        store = await asyncio.to_thread(_client, where.host, where.port, timeout)
        joins = int(await asyncio.to_thread(store.add, f"{prefix}/joins", 1))
    except RendezvousError:
        raise
    except Exception as exc:  # (torch's DistNetworkError, DistStoreError, ...)
        raise RendezvousError(
            f"torchrun's agent store at {where.host}:{where.port} unreachable: {exc}"
        ) from None
    key = f"{prefix}/url/{(joins - 1) // where.world_size}"  # every rank counts itself in
    if where.rank == 0:
        host = _facing(where.host, where.port)
        token = where.token or secrets.token_hex(16)
        server = await embedded.acquire(host, 0, token, None)
        await asyncio.to_thread(store.set, key, f"{host}|{server.port}|{token}")
        return replace(
            where, host=host, port=int(server.port), token=token, transport="tcp", host_server=True
        )
    try:
        await asyncio.to_thread(store.wait, [key], datetime.timedelta(seconds=timeout))
        published = (await asyncio.to_thread(store.get, key)).decode()
    except Exception as exc:
        raise RendezvousError(
            f"rank 0 did not publish its arendez server in torchrun's agent store within {timeout:g}s: {exc}"
        ) from None
    host, port_text, token = published.split("|")
    return replace(where, host=host, port=int(port_text), token=token, transport="tcp", job=DEFAULT_JOB)
