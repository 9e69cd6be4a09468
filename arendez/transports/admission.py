"""The peer listener's bounds on connections that have not authenticated yet: a hello-sized
frame before the handshake, a handshake deadline, and counts per remote host and in total."""

from __future__ import annotations

import collections
from dataclasses import dataclass

from .. import wire
from ..errors import LimitError
from ..settings import env_int

#: The largest frame a connection may send before its handshake (a peer's hello is ~120 bytes).
HELLO_MAX = 1024
#: Frames an accepted connection may queue before its handshake is checked (its hello).
HELLO_FRAMES = 2

_HELLO_LIMITS = wire.Limits(max_header=HELLO_MAX, max_payload=0)


@dataclass(frozen=True)
class ListenerLimits:
    """Bounds on the connections a peer listener holds before they authenticate."""

    per_host: int = 64  # ARENDEZ_PEER_MAX_PENDING_PER_HOST
    total: int = 256  # ARENDEZ_PEER_MAX_PENDING
    handshake_seconds: float = 10.0  # ARENDEZ_PEER_HANDSHAKE_MS / 1000

    @classmethod
    def from_env(cls) -> ListenerLimits:
        """The defaults, each overridable by its environment variable."""
        return cls(
            per_host=env_int("ARENDEZ_PEER_MAX_PENDING_PER_HOST", cls.per_host),
            total=env_int("ARENDEZ_PEER_MAX_PENDING", cls.total),
            handshake_seconds=env_int("ARENDEZ_PEER_HANDSHAKE_MS", int(cls.handshake_seconds * 1000)) / 1000,
        )

    def refusal(self, pending: collections.Counter[str], host: str) -> LimitError | None:
        """Why a new connection from ``host`` is refused, given the ``pending`` ones by host, if it is."""
        if pending[host] >= self.per_host:
            return LimitError(
                f"peer listener: {self.per_host} connections from {host} are already "
                "waiting for their handshake (ARENDEZ_PEER_MAX_PENDING_PER_HOST)"
            )
        if pending.total() >= self.total:
            return LimitError(
                f"peer listener: {self.total} connections are already waiting for "
                "their handshake (ARENDEZ_PEER_MAX_PENDING)"
            )
        return None
