"""Connection admission: counting the server's connections (in all and per host), refusing one by
the name of the limit it hit, the open-file limit they must fit in, and the handshake deadline.

No task per connection: the handshake runs in callbacks, and one sweep (run with the lease check)
drops connections that do not finish it within ``handshake_timeout``.
"""

from __future__ import annotations

import collections
import logging
import resource
from typing import Protocol

from arendez.errors import LimitError

from .hooks import ServerHooks

log = logging.getLogger("arendez.server")

#: File descriptors kept free of connections (listener, logs, the interpreter's own).
FD_RESERVE = 64


class Admitted(Protocol):
    """A client connection as admission counts it: an arendez client's (``ServerConnection``)
    or a torch ``TCPStore`` client's (``tcpstore_front``)."""

    host: str
    deadline: float  # the handshake's

    @property
    def is_open(self) -> bool: ...

    def abort(self) -> None: ...

    async def wait_closed(self, timeout: float) -> None: ...


def raise_fd_limit() -> int:
    """Raise RLIMIT_NOFILE's soft limit to the hard one where allowed; return the soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError) as exc:  # pragma: no cover - a sandbox that forbids it
            log.warning("could not raise the open-file limit to %d: %s", want, exc)
    return soft


def fd_limit() -> int:
    """This process's open-file limit (its soft limit; a large number when unlimited)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft if soft != resource.RLIM_INFINITY else 1 << 30


class Admission:
    """The server's connections: every one counted from connect to close, refused past a limit."""

    def __init__(self, max_connections: int, max_connections_per_host: int, hooks: ServerHooks) -> None:
        self.max_connections = max_connections
        self.max_connections_per_host = max_connections_per_host
        self.hooks = hooks
        self.conns: set[Admitted] = set()
        self.handshaking: set[Admitted] = set()  # their handshake is not done yet
        self.per_host: collections.Counter[str] = collections.Counter()

    def fit_fd_limit(self, raise_limit: bool) -> None:
        """Admit no more connections than the open-file limit leaves room for (raised first if
        ``raise_limit``, as the standalone server does)."""
        asked = self.max_connections
        fds = raise_fd_limit() if raise_limit else fd_limit()
        if asked > fds - FD_RESERVE:
            self.max_connections = max(1, fds - FD_RESERVE)
            # only news when the operator asked for more (the standalone server); an embedded
            # server just fits the process it lives in
            (log.warning if raise_limit else log.debug)(
                "open-file limit %d admits %d connections, not --max-connections %d",
                fds,
                self.max_connections,
                asked,
            )

    def add(self, conn: Admitted) -> None:
        """Count a connection that was just made (``conn.host`` set)."""
        self.conns.add(conn)
        self.per_host[conn.host] += 1

    def remove(self, conn: Admitted) -> bool:
        """Stop counting a connection that closed; False if it was not counted (already removed)."""
        if conn not in self.conns:
            return False
        self.conns.discard(conn)
        self.handshaking.discard(conn)
        host = conn.host
        self.per_host[host] -= 1
        if self.per_host[host] <= 0:
            del self.per_host[host]
        return True

    def refusal(self, host: str) -> LimitError | None:
        """The error naming the limit a new connection from ``host`` is past, if any."""
        if len(self.conns) > self.max_connections:
            self.hooks.refused("max_connections")
            return LimitError(
                f"server refused the connection: it already has {self.max_connections} connections "
                "(limit: arendez-server --max-connections, and the open-file limit)"
            )
        if self.per_host[host] > self.max_connections_per_host:
            self.hooks.refused("max_connections_per_host")
            return LimitError(
                f"server refused the connection: {host} already has "
                f"{self.max_connections_per_host} connections (limit: arendez-server "
                "--max-connections-per-host)"
            )
        return None

    def sweep_handshakes(self, now: float) -> None:
        """Drop the connections whose handshake deadline (``conn.deadline``) passed."""
        late = [c for c in self.handshaking if c.deadline < now]
        for conn in late:
            self.handshaking.discard(conn)
            conn.abort()
