"""``init_method`` URLs -> where the store is, who hosts it, and this rank's place."""

from __future__ import annotations

import ipaddress
import os
import urllib.parse
from collections.abc import Collection, Mapping
from dataclasses import dataclass, replace

from . import validate
from .errors import RendezvousError

DEFAULT_PORT = 29400
DEFAULT_JOB = "default"


@dataclass(frozen=True)
class Plan:
    """What ``init_process_group`` must do to join."""

    world_size: int
    rank: int
    host: str = ""
    port: int = 0
    job: str = DEFAULT_JOB
    token: str | None = None
    host_server: bool = False  # tcp:// semantics: rank 0 runs the server in its own loop
    hosted_by_rank0: bool = False  # tcp:// (env://): the store is rank 0's, on every rank
    transport: str = "tcp"  # "inproc": every rank is a task of this event loop
    store_url: str = ""  # etcd://: the store is an EtcdStore for this URL
    #: Elastic worlds (``arendez.elastic``): the fewest ranks (0: a fixed-size world, whose size
    #: is ``world_size``; else ``world_size`` is the most), the settle time, the generation of
    #: the job's round this process was last in and its rank there (or its launcher slot).
    min_size: int = 0
    settle: float = 0.0
    came_from: int = -1
    hint: int = -1
    dead: tuple[int, ...] = ()  # ranks of that round this rank saw fail

    @property
    def local(self) -> bool:
        """True when no store is needed: one rank, or ranks of one event loop."""
        return not self.host


def incomplete(world_size: int, joined: Collection[int]) -> str:
    """How a round that timed out fell short, as every rendezvous backend says it: "only K of
    N ranks joined in time (missing: M rank(s): a, b, ...)" (the first 16 missing ranks)."""
    missing = sorted(set(range(world_size)) - set(joined))
    shown = ", ".join(map(str, missing[:16])) + (", ..." if len(missing) > 16 else "")
    return (
        f"only {len(joined)} of {world_size} ranks joined in time (missing: {len(missing)} rank(s): {shown})"
    )


def int_env(env: Mapping[str, str], name: str) -> int | None:
    raw = env.get(name)
    if raw is None or raw == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise RendezvousError(f"environment variable {name}={raw!r} is not an integer") from None


def _hostport(netloc: str, url: str) -> tuple[str, int, str | None]:
    parsed = urllib.parse.urlsplit(f"//{netloc}")
    if not parsed.hostname:
        raise RendezvousError(f"{url!r} names no host")
    _, colon, raw = netloc.rpartition("@")[2].rpartition("]")[2].rpartition(":")
    port = validate.port(raw, f"the port of init_method {url!r}", lowest=1) if colon and raw else DEFAULT_PORT
    token = urllib.parse.unquote(parsed.username) if parsed.username else None
    return parsed.hostname, port, token


def plan(
    init_method: str | None,
    world_size: int,
    rank: int,
    env: Mapping[str, str] | None = None,
) -> Plan:
    """Resolve ``init_method`` and the torchrun-style environment into a ``Plan``."""
    env = os.environ if env is None else env
    if init_method is None:
        env_world = int_env(env, "WORLD_SIZE")
        if world_size in (-1, 1) and (env_world in (None, 1)) and not env.get("ARENDEZ_URL"):
            if rank not in (-1, 0):
                raise RendezvousError(f"rank {rank} is impossible in a world of size 1")
            return Plan(world_size=1, rank=0, job="", transport="inproc")
        init_method = "env://"
    url = urllib.parse.urlsplit(init_method)
    token = env.get("ARENDEZ_TOKEN") or None
    if url.scheme == "env":
        world_size = world_size if world_size != -1 else (int_env(env, "WORLD_SIZE") or -1)
        if rank == -1:
            env_rank = int_env(env, "RANK")
            rank = -1 if env_rank is None else env_rank  # -1: the server assigns ranks
        if env.get("ARENDEZ_URL"):
            return plan(env["ARENDEZ_URL"], world_size, rank, env)
        addr, port = env.get("MASTER_ADDR"), int_env(env, "MASTER_PORT")
        if port is not None:
            validate.port(port, "MASTER_PORT", lowest=1)
        if not addr or port is None:
            raise RendezvousError(
                "env:// needs ARENDEZ_URL, or MASTER_ADDR and MASTER_PORT (with RANK and WORLD_SIZE)"
            )
        found = plan(f"tcp://{addr}:{port}", world_size, rank, env)
        if env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true":
            # torchrun's agent holds MASTER_PORT with its own store: meet through it (agentstore)
            return replace(found, transport="agent", host_server=False, hosted_by_rank0=False)
        return found
    if world_size < 1 and url.scheme == "tcp":
        raise RendezvousError(f"{init_method} needs world_size (argument or WORLD_SIZE)")
    if url.scheme == "tcp":
        host, port, _ = _hostport(url.netloc, init_method)
        if rank < 0:
            raise RendezvousError("tcp:// needs an explicit rank (argument or RANK): rank 0 hosts the store")
        return Plan(
            world_size, rank, host, port, DEFAULT_JOB, token, host_server=rank == 0, hosted_by_rank0=True
        )
    if url.scheme == "inproc":
        job = (url.netloc + url.path).strip("/")
        if world_size < 1 or not job:
            raise RendezvousError(f"{init_method} needs a job name (inproc://job) and world_size")
        return Plan(world_size, rank, job=job, transport="inproc")
    if url.scheme == "arendez":
        host, port, url_token = _hostport(url.netloc, init_method)
        job = url.path.strip("/") or DEFAULT_JOB
        if world_size < 1:
            raise RendezvousError(f"{init_method} needs world_size (argument or WORLD_SIZE)")
        return Plan(world_size, rank, host, port, job, url_token or token)
    if url.scheme == "file":  # torch's shared-file rendezvous (arendez.filerdzv)
        if world_size < 1 or rank < 0 or not url.path:
            raise RendezvousError(f"{init_method} needs a path (file:///path), world_size and rank")
        return Plan(world_size, rank, job=urllib.parse.unquote(url.path), token=token, transport="file")
    if url.scheme == "etcd":  # etcd backend (issue 14)
        from .etcd import parse_url

        ends, job, _ = parse_url(init_method)
        if world_size < 1:
            raise RendezvousError(f"{init_method} needs world_size (argument or WORLD_SIZE)")
        return Plan(world_size, rank, *ends.hosts[0], job, None, store_url=init_method)
    raise RendezvousError(
        f"unsupported init_method {init_method!r}: use None, env://, tcp://host:port, "
        "arendez://[token@]host:port[/job], etcd://[user:password@]host:port[,host:port...]/job, "
        "file:///path or inproc://job"
    )


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
