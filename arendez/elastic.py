"""Elastic worlds: a job of ``min``..``max`` ranks that re-forms when ranks die or arrive.

``init_process_group(world_size=(min, max))`` (or ``WORLD_SIZE`` with ``ARENDEZ_MIN_WORLD_SIZE``
in the environment, as ``arendez-run --min-nproc`` sets them) joins an elastic round on a
standalone server: it closes with ``max`` ranks, or with ``min`` or more once no rank arrived for
the settle time (``ARENDEZ_ELASTIC_SETTLE``, default 0.25 s). The server assigns ranks: the ranks
of the job's latest round first, in their old order, then the newcomers.

``reform()`` destroys the current (usually broken) world and joins the next round with whoever
is alive and whoever arrives. ``share_state()`` then hands the training state of rank 0 (the
lowest surviving old rank) to every rank: numpy arrays and msgpack values, never pickle.
``joiners_waiting()`` is the server's word that ranks wait to join: a running world re-forms
at a step boundary to take them in.
"""

from __future__ import annotations

import asyncio
import datetime
import os
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from .errors import RendezvousError

#: Seconds an elastic round with at least ``min`` ranks waits for more (each arrival restarts it).
DEFAULT_SETTLE = 0.25
#: Of ``reform``'s timeout, the most that destroying the broken world may take.
DESTROY_BUDGET = 2.0


@dataclass(frozen=True)
class Bounds:
    """An elastic world's size range."""

    min_size: int
    max_size: int


def _size(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be at least 1, got {value}")
    return value


def bounds(world_size: object, env: Mapping[str, str] | None = None) -> Bounds | None:
    """The elastic range asked for: ``world_size=(min, max)``, or, when ``world_size`` is -1,
    ``ARENDEZ_MIN_WORLD_SIZE`` with ``WORLD_SIZE`` as the max; None for a fixed-size world."""
    if isinstance(world_size, (tuple, list)):
        if len(world_size) != 2:
            raise ValueError(f"world_size=(min, max) needs two ints, got {world_size!r}")
        low, high = _size(world_size[0], "world_size min"), _size(world_size[1], "world_size max")
        if low > high:
            raise ValueError(f"world_size=(min, max) needs min <= max, got ({low}, {high})")
        return Bounds(low, high)
    env = os.environ if env is None else env
    raw = env.get("ARENDEZ_MIN_WORLD_SIZE")
    if world_size != -1 or not raw:
        return None
    low = _env_int(env, "ARENDEZ_MIN_WORLD_SIZE")
    if not env.get("WORLD_SIZE"):
        raise RendezvousError("ARENDEZ_MIN_WORLD_SIZE needs WORLD_SIZE (the max) in the environment too")
    high = _env_int(env, "WORLD_SIZE")
    if not 1 <= low <= high:
        raise RendezvousError(f"ARENDEZ_MIN_WORLD_SIZE={low} must be in 1..WORLD_SIZE={high}")
    return Bounds(low, high)


def _env_int(env: Mapping[str, str], name: str) -> int:
    try:
        return int(env[name])
    except ValueError:
        raise RendezvousError(f"environment variable {name}={env[name]!r} is not an integer") from None


def settle_seconds(env: Mapping[str, str] | None = None) -> float:
    """``ARENDEZ_ELASTIC_SETTLE`` (seconds, 0..60) or the default."""
    raw = (os.environ if env is None else env).get("ARENDEZ_ELASTIC_SETTLE")
    if not raw:
        return DEFAULT_SETTLE
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 <= value <= 60:
        raise RendezvousError(f"ARENDEZ_ELASTIC_SETTLE={raw!r} must be a number of seconds in 0..60")
    return value


# -- what this process remembers between rounds -----------------------------------------------
@dataclass
class _Info:
    generation: int
    survivors: int


@dataclass(frozen=True)
class Config:
    """How the elastic world was joined: ``reform`` joins the next round the same way."""

    plan: Any  # rendezvous.Plan
    timeout: float


_worlds: weakref.WeakKeyDictionary[Any, _Info] = weakref.WeakKeyDictionary()
_config: Config | None = None
_last: tuple[int, int] = (-1, -1)  # (generation, rank) of the last elastic world of this process


def remember(config: Config, world: Any, generation: int, survivors: int) -> None:
    """Record an elastic world ``init_process_group`` just built."""
    global _config, _last
    _config = config
    _worlds[world] = _Info(generation, survivors)
    _last = (generation, world.rank)


def is_elastic(world: Any) -> bool:
    return world in _worlds


def _current() -> tuple[Any, _Info]:
    from .registry import current_world

    world = current_world()
    info = _worlds.get(world)
    if info is None:
        raise RendezvousError("this world is not elastic: init_process_group(world_size=(min, max))")
    return world, info


def joiners_waiting() -> int:
    """How many ranks wait to join the job's next round (the server's latest word; 0 if none).

    Ranks learn it at slightly different times: fold it into a collective (e.g. one more element
    of the gradient all_reduce) so that every rank decides to ``reform`` at the same step."""
    world, _ = _current()  # (an elastic world always has an arendez Store and a mesh)
    return int(world.store.joining.get(world.mesh.nonce, 0))  # (kept by round: Store.joining)


def survivors() -> int:
    """How many ranks of this world (ranks ``0..survivors-1``) came from the job's previous
    round; the others are new (replacements, scale-up, or a rank that fell behind)."""
    return _current()[1].survivors


def generation() -> int:
    """The job's number of this world's round (0 for the first)."""
    return _current()[1].generation


async def reform(timeout: float | datetime.timedelta | None = None) -> tuple[int, int]:
    """Destroy the current world (if any) and join the job's next round; return
    ``(rank, world_size)`` in the new world.

    Call it on every rank after a ``RankFailedError`` (or at any step, e.g. when
    ``joiners_waiting()`` says ranks wait). Within ``timeout`` (default: the world's timeout)
    the broken world is destroyed (at most 2 s of it) and the next round joined: ranks that
    come from the current round keep their relative order and come first. Subgroups are gone:
    re-create them. ``RendezvousError`` if fewer than ``min`` ranks join in time.
    """
    from . import lifecycle, teardown
    from .registry import seconds, world_or_none

    config = _config
    if config is None:
        raise RendezvousError("reform() needs an elastic world: init_process_group(world_size=(min, max))")
    limit = seconds(timeout, config.timeout)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limit
    world = world_or_none()
    came_from, hint = _last
    dead: tuple[int, ...] = ()
    if world is not None:
        info = _worlds.get(world)
        if info is not None:  # (ranks that merely left are re-forming too: not dead)
            came_from, hint, dead = info.generation, world.rank, tuple(sorted(world.failed))
        await teardown.destroy_process_group(timeout=min(DESTROY_BUDGET, limit))
    plan = replace(config.plan, came_from=came_from, hint=hint, dead=dead)
    left = max(0.001, deadline - loop.time())
    await lifecycle.init_elastic(plan, config.timeout, left)
    new = world_or_none()
    assert new is not None
    return new.rank, new.world_size


# -- state hand-off ---------------------------------------------------------------------------
def _split(state: Mapping[str, Any]) -> tuple[dict[str, Any], list[tuple[str, np.ndarray[Any, Any]]]]:
    values: dict[str, Any] = {}
    arrays: list[tuple[str, np.ndarray[Any, Any]]] = []
    for key, value in state.items():
        if not isinstance(key, str):
            raise TypeError(f"state keys must be str, got {type(key).__name__} {key!r:.40}")
        if isinstance(value, np.ndarray):
            if value.dtype.hasobject or value.dtype.fields is not None:
                raise TypeError(f"state[{key!r}]: arrays of plain numeric dtype only, got {value.dtype}")
            arrays.append((key, value))
        else:
            values[key] = value
    return values, arrays


async def share_state(state: Mapping[str, Any] | None, src: int = 0) -> dict[str, Any]:
    """Every rank gets rank ``src``'s ``state``: a dict of str to numpy arrays and
    msgpack-serialisable values (never pickle). Collective: every rank of the default group
    calls it; only ``src``'s ``state`` is read (the others may pass None).

    After ``reform`` rank 0 is the lowest surviving old rank (``survivors() > 0``), or a new
    rank when none survived; every rank, survivors included, takes its state, so the world
    agrees even when a failure left the survivors split over whether the last step completed.
    Arrays come back as fresh arrays of the same dtype and shape.
    """
    from .collectives import broadcast
    from .objects import broadcast_object_list
    from .registry import current_world

    world = current_world()
    header: list[Any] = [None]
    buffer: np.ndarray[Any, Any]
    if world.rank == src:
        if state is None:
            raise ValueError(f"share_state: rank {src} is the source and must pass its state, got None")
        values, arrays = _split(state)
        header[0] = {"values": values, "arrays": [[k, a.dtype.str, list(a.shape)] for k, a in arrays]}
        buffer = np.concatenate(
            [np.ascontiguousarray(a).reshape(-1).view(np.uint8) for _, a in arrays] or [np.zeros(0, np.uint8)]
        )
    await broadcast_object_list(header, src=src)
    meta = header[0]
    layout = [(str(k), np.dtype(d), tuple(int(n) for n in shape)) for k, d, shape in meta["arrays"]]
    total = sum(dt.itemsize * int(np.prod(shape, dtype=np.int64)) for _, dt, shape in layout)
    if world.rank != src:
        buffer = np.empty(total, np.uint8)
    if total:
        await broadcast(buffer, src=src)
    out: dict[str, Any] = dict(meta["values"])
    at = 0
    for key, dtype, shape in layout:
        n = dtype.itemsize * int(np.prod(shape, dtype=np.int64))
        out[key] = buffer[at : at + n].view(dtype).reshape(shape).copy()
        at += n
    return out


__all__ = ["generation", "joiners_waiting", "reform", "share_state", "survivors"]
