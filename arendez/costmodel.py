"""Choosing an all_reduce algorithm from a cost model of the links, not from the group size alone.

A LogP-flavoured alpha-beta model, as MPI's tuned collectives use: an algorithm costs

    rounds * latency + messages * overhead + link_bytes * byte_time * spread + reduced_bytes * reduce_time

per rank, where ``rounds`` are the dependent message exchanges on the critical path (pipelined
lanes overlap, so they count once), ``messages`` every send and receive (each costs the event
loop ``overhead`` of CPU), ``link_bytes`` what crosses this rank's link in one direction and
``reduced_bytes`` what it combines. ``spread`` > 1 charges algorithms whose traffic moves between
partners step by step (halving-doubling, recursive doubling): on a TCP link that is the limit,
their flows take turns and the link idles between them, while the ring keeps one flow per
direction busy; measured with benchmarks/multihost.py at 1 Gbit/s, 4 hosts: 0.87-0.88 of the
link for halving-doubling, 0.94-0.95 for the ring. Shared memory has no such flows (``spread``
1), so there the fewer rounds of halving-doubling win, as before.

Link parameters come from the link kind (``shm`` between ranks of one host, ``tcp`` otherwise)
and, for TCP, from ``ARENDEZ_LINK_GBIT`` (default 10) and ``ARENDEZ_LINK_LATENCY_US`` (default
50): configured, not measured.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .settings import env_int

#: Algorithms of an all_reduce the model compares.
ALL_REDUCE = ("direct", "rdb", "ring", "rhd")


@dataclass(frozen=True)
class Link:
    """Cost parameters of the links of a group (seconds, seconds per byte)."""

    latency: float  # one dependent round: the wire plus waking the receiver
    overhead: float  # CPU per message sent or received (framing, futures, the event loop)
    byte_time: float  # per byte through one rank's link, one direction
    reduce_time: float  # per byte combined by the reduction
    spread: float = 1.0  # byte-time factor for traffic that changes partner every step


#: Ranks of one host, payloads through shared memory.
SHM = Link(latency=10e-6, overhead=15e-6, byte_time=1 / 3e9, reduce_time=1 / 4e9)


def tcp_link() -> Link:
    """The TCP link: ``ARENDEZ_LINK_GBIT`` (default 10) and ``ARENDEZ_LINK_LATENCY_US`` (default 50)."""
    gbit = env_int("ARENDEZ_LINK_GBIT", 10, minimum=1)
    latency_us = env_int("ARENDEZ_LINK_LATENCY_US", 50, minimum=1)
    return Link(
        latency=latency_us * 1e-6,
        overhead=20e-6,
        byte_time=8 / (gbit * 1e9),
        reduce_time=1 / 4e9,
        spread=1.08,
    )


def link_for(kind: str) -> Link:
    """The model of a link kind (``"shm"`` or ``"tcp"``)."""
    if kind == "shm":
        return SHM
    if kind == "tcp":
        return tcp_link()
    raise ValueError(f"link kind must be 'shm' or 'tcp', got {kind!r}")


def _log2(n: int) -> int:
    return (n - 1).bit_length()


def all_reduce_cost(algorithm: str, nbytes: int, size: int, link: Link, lanes: int = 1) -> float:
    """Predicted seconds of one all_reduce of ``nbytes`` over ``size`` ranks (``lanes``: how many
    pipelined lanes ring and halving-doubling cut it into)."""
    n, s, steps = size, float(nbytes), _log2(size)
    share = s * (n - 1) / n
    if algorithm == "direct":  # everyone sends everything to everyone in one round
        rounds, messages, wire, reduced, spread = 1, 2 * (n - 1), s * (n - 1), s * (n - 1), link.spread
    elif algorithm == "rdb":  # over the largest power of two; the ranks beyond fold in and out
        core = n.bit_length() - 1
        folds = 2 if n & (n - 1) else 0
        rounds, messages = core + folds, 2 * (core + folds)
        wire, reduced, spread = s * (core + folds), s * (core + folds // 2), link.spread
    elif algorithm == "rhd":
        rounds, messages, wire, reduced, spread = 2 * steps, 4 * steps * lanes, 2 * share, share, link.spread
    elif algorithm == "ring":
        rounds, messages, wire, reduced, spread = 2 * (n - 1), 4 * (n - 1) * lanes, 2 * share, share, 1.0
    else:
        raise ValueError(f"all_reduce algorithm must be one of {', '.join(ALL_REDUCE)}, got {algorithm!r}")
    return (
        rounds * link.latency
        + messages * link.overhead
        + wire * link.byte_time * spread
        + reduced * link.reduce_time
    )


#: The largest group in which "direct" (every rank to every other) may be chosen: past it, the
#: W(W-1)/2 connections it opens cost more than the model sees.
DIRECT_MAX_RANKS = 8


def choose_all_reduce(nbytes: int, size: int, link: Link, lanes: int = 1) -> str:
    """The cheapest all_reduce algorithm for this message, group and link (halving-doubling only
    on power-of-two groups, "direct" only up to ``DIRECT_MAX_RANKS``)."""
    candidates = ["ring", "rdb"]
    if size <= DIRECT_MAX_RANKS:
        candidates.insert(0, "direct")
    if not size & (size - 1):
        candidates.append("rhd")
    costs = {a: all_reduce_cost(a, nbytes, size, link, lanes) for a in candidates}
    return min(candidates, key=costs.__getitem__)  # ties: the first, the simpler algorithm


def with_rate(link: Link, gbit: float) -> Link:
    """``link`` at another bandwidth (tests and what-if tables)."""
    return replace(link, byte_time=8 / (gbit * 1e9))
