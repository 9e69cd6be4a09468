"""Which algorithm a collective runs: the size rule, the cost model over TCP links, and
``ARENDEZ_ALGORITHM``."""

from __future__ import annotations

import os

from . import algo_comm, costmodel
from .algo_comm import Comm, _lanes

#: What ``ARENDEZ_ALGORITHM`` may force.
ALGORITHMS = ("direct", "rdb", "ring", "rhd")
#: Arrays up to this many bytes take the latency-bound path.
SMALL_BYTES = 64 * 1024


def check_algorithm(name: str | None, what: str = "algorithm") -> str | None:
    """``name`` if it is an algorithm ``choose`` knows (or None); a clear error otherwise."""
    if name is not None and name not in ALGORITHMS:
        raise ValueError(f"{what} must be one of {', '.join(ALGORITHMS)}, got {name!r}")
    return name


def forced_algorithm() -> str | None:
    """The algorithm ``ARENDEZ_ALGORITHM`` forces, if any."""
    return check_algorithm(os.environ.get("ARENDEZ_ALGORITHM") or None, "ARENDEZ_ALGORITHM")


def choose(collective: str, nbytes: int, size: int, link: str | None = None) -> str:
    """Pick the algorithm (``ARENDEZ_ALGORITHM`` overrides).

    An all_reduce over TCP links (``link == "tcp"``) takes the cheapest by the cost model
    (``costmodel``); shared-memory links and the other collectives keep the measured size rule.
    """
    forced = forced_algorithm()
    tcp = costmodel.tcp_link() if not forced and link == "tcp" else None
    return _rule(collective, nbytes, size, link, forced, tcp)


def _rule(
    collective: str, nbytes: int, size: int, link: str | None, forced: str | None, tcp: costmodel.Link | None
) -> str:
    if forced:
        return forced
    if collective == "all_reduce" and link == "tcp" and size > 1 and tcp is not None:
        lanes = len(_lanes(max(1, nbytes // 4), 4, size, lane_bytes=algo_comm.TCP_LANE_BYTES))
        return costmodel.choose_all_reduce(nbytes, size, tcp, lanes)
    power_of_two = not size & (size - 1)
    if nbytes <= SMALL_BYTES or (size == 2 and collective == "broadcast"):
        if size > costmodel.DIRECT_MAX_RANKS:  # (direct would connect every pair)
            if collective == "all_reduce":
                return "rdb"
            if collective in ("all_gather", "reduce_scatter"):
                return "ring"
            if collective == "broadcast":
                return "tree"  # (the root would connect every rank)
        return "direct"
    if collective == "all_reduce" and size > 2 and power_of_two:
        return "rhd"
    return "ring"


class Chooser:
    """``choose`` for one world: the tuning variables read once (at init), choices remembered
    (a collective in a training loop asks the same question every step)."""

    MEMO = 4096

    def __init__(self) -> None:
        self.forced = forced_algorithm()
        self.tcp = costmodel.tcp_link()
        self._memo: dict[tuple[str, int, int, str | None], str] = {}

    def __call__(self, collective: str, nbytes: int, size: int, link: str | None = None) -> str:
        key = (collective, nbytes, size, link)
        found = self._memo.get(key)
        if found is None:
            if len(self._memo) >= self.MEMO:
                self._memo.clear()
            found = self._memo[key] = _rule(collective, nbytes, size, link, self.forced, self.tcp)
        return found


def _choose_for(comm: Comm, collective: str, nbytes: int, size: int, link: str | None = None) -> str:
    """``choose`` through ``comm``'s world when it has one (``Comm.choose``), else from the
    environment now."""
    chooser = getattr(comm, "choose", None)
    if chooser is not None:
        return str(chooser(collective, nbytes, size, link))
    return choose(collective, nbytes, size, link)


def chose(comm: Comm, algorithm: str) -> str:
    """Tell ``comm`` which algorithm runs (the flight recorder shows it); return it."""
    if hasattr(comm, "algorithm"):
        setattr(comm, "algorithm", algorithm)  # noqa: B010 - not part of the Comm protocol
    return algorithm
