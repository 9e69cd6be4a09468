"""Dialing a peer: its local socket or TCP, retried while its listener is busy, then our hello."""

from __future__ import annotations

import asyncio
import logging
import random
import ssl as _ssl
from dataclasses import dataclass

from .. import handshake, stall, transport
from ..errors import LimitError, ProtocolError
from . import local

log = logging.getLogger("arendez.tcp")

#: The longest pause between dials of a busy peer (they double from 20 ms, with jitter: many
#: ranks whose dials were cut by one overloaded peer must not all dial it again at once).
RETRY_CAP_SECONDS = 2.0


def split_address(address: str) -> tuple[str, int]:
    """``(host, port)`` of an advertised peer address (its local socket name, if any, dropped)."""
    host, _, port = local.parse(address)[0].rpartition(":")
    return host.strip("[]"), int(port)


@dataclass(frozen=True)
class Dialer:
    """How this rank dials its peers in one round: who it says it is, with what, how long."""

    rank: int
    nonce: bytes
    token: str | None
    client_ssl: _ssl.SSLContext | None
    handshake_timeout: float
    dial_timeout: float
    errors: dict[int, str]  # the last error dialing each peer (the mesh's: written here)

    async def connect(self, peer: int, address: str, local_sockets: bool) -> transport.Connection | None:
        """Connect to ``peer`` and shake hands; ``None`` if its own dial to us wins.

        Its local socket first, if it has one in our network namespace (``local``), else TCP.
        A refusal over TCP means its listener is gone (the rank too), and a failed handshake that
        it is not the rank we want: both raise. Anything else (a saturated listener, over either
        socket, a peer whose event loop is busy for a long step) is retried until the caller's
        deadline.
        """
        tcp_address, name = local.parse(address)
        use_local = name is not None and local_sockets
        host, port = split_address(tcp_address)
        delay = 0.02
        while True:  # (bounded by connect's deadline)
            try:
                if use_local:
                    assert name is not None
                    try:
                        async with stall.patient_timeout(self.handshake_timeout):
                            conn = await local.connect(name, timeout=self.handshake_timeout * stall.PATIENCE)
                    except (OSError, TimeoutError) as exc:  # not in our namespace (another host)
                        log.debug("no local socket to rank %d (%s); dialing %s", peer, exc, tcp_address)
                        use_local = False
                        continue
                else:
                    async with stall.patient_timeout(self.handshake_timeout):
                        conn = await transport.open_connection(
                            host, port, ssl=self.client_ssl, timeout=self.handshake_timeout * stall.PATIENCE
                        )
                return await self._shake(peer, address, conn)
            except ConnectionRefusedError:
                raise
            except (LimitError, OSError) as exc:  # busy with other (maybe hostile) connections
                self.errors[peer] = (
                    str(exc) if isinstance(exc, LimitError) else f"{type(exc).__name__}: {exc}"
                )
                log.debug("dial to rank %d at %s: %s; retrying", peer, address, exc)
                await asyncio.sleep(delay * random.uniform(0.5, 1.0))
                delay = min(delay * 2, RETRY_CAP_SECONDS)

    async def _shake(
        self, peer: int, address: str, conn: transport.Connection
    ) -> transport.Connection | None:
        """Our hello on a new connection to ``peer``; the connection, or ``None`` if the peer
        keeps its own dial to us instead (a duplicate)."""
        try:
            hello = {"rank": self.rank, "round": self.nonce}
            # Once it answers it has adopted the connection: giving up before that could
            # break a connection the peer already counts as up (its own handshake
            # deadline guards it), so wait for the answer to the caller's deadline.
            await handshake.client_handshake(conn, self.token, hello, self.dial_timeout)
            answer, _ = await conn.recv(self.dial_timeout)
            if not isinstance(answer, dict) or answer.get("rank") != peer:
                raise ProtocolError(f"{address} is not rank {peer}: {answer!r:.80}")
        except BaseException:
            conn.abort()
            raise
        if answer.get("duplicate"):
            conn.close()
            return None
        return conn
