"""Collectives as pure algorithms over point-to-point messages.

Every function takes a ``Comm`` (the ranks of one group and tagged send/receive within one
collective) and numpy arrays. Nothing here knows about sockets, so the algorithms run as well
over an in-memory transport in unit tests as over TCP.

Latency-bound sizes use direct exchange (every rank talks to every other in one round) or
recursive doubling; bandwidth-bound sizes a ring (or, for all_reduce on a power-of-two group,
recursive halving-doubling: the ring's bytes in fewer steps). Over TCP links (a comm's optional
``link_kind()``) an all_reduce takes the cheapest of these by the cost model of ``costmodel``: the
ring where the link is the limit. Bandwidth-bound messages are cut into *lanes* that run
concurrently so the reduction of one lane overlaps the transfer of the next. Reductions combine contributions
in a fixed order, so every rank ends with bit-identical results.

This module is their public face; the parts are ``algo_comm`` (the ``Comm`` protocol, waiting,
lanes), ``algo_choice`` (which algorithm runs), ``algo_reduce`` (reductions) and ``algo_move``
(data movement). The tuning constants (``LANE_BYTES``, ``SMALL_BYTES``, ...) are not repeated
here: they are read where they live, so patch them there.
"""

from __future__ import annotations

from .algo_choice import Chooser, check_algorithm, choose, chose, forced_algorithm
from .algo_comm import Array, Comm, link_kind, others, wait_all
from .algo_comm import _lanes as _lanes  # (tests size a message's lanes through this module)
from .algo_move import all_gather, all_to_all, binomial_tree, broadcast, gather, scatter, tree_broadcast
from .algo_reduce import all_reduce, recv_reduce, reduce, reduce_scatter

__all__ = [
    "Array",
    "Chooser",
    "Comm",
    "all_gather",
    "all_reduce",
    "all_to_all",
    "binomial_tree",
    "broadcast",
    "check_algorithm",
    "choose",
    "chose",
    "forced_algorithm",
    "gather",
    "link_kind",
    "others",
    "recv_reduce",
    "reduce",
    "reduce_scatter",
    "scatter",
    "tree_broadcast",
    "wait_all",
]
