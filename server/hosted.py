"""The server as a rank hosts it (``tcp://``, ``env://``, a master ``TCPStore``): one job's
store, on the host's address or every address, a port in use retried while its last host leaves."""

from __future__ import annotations

import asyncio
import errno
import socket
import ssl as _ssl

from .app import Server, ServerConfig
from .limits import StateLimits

#: A server a rank hosts (tcp://, env://, a TCPStore master) serves its own job, as torch's
#: master store does, which caps no key count: 100 times the standalone server's keys per job.
HOSTED_LIMITS = StateLimits(max_keys_per_job=10_000_000, max_bytes_per_job=4 << 30, max_store_bytes=4 << 30)


async def start_server(
    host: str,
    port: int,
    token: str | None,
    ssl: _ssl.SSLContext | None = None,
    wait: float = 0.0,
    sock: socket.socket | None = None,
) -> Server:
    """A started server on ``host`` (else on every address) and ``port`` (0: a free one), as a
    rank hosts it: a port in use is retried for ``wait`` s (the last host may be leaving); any
    other failure to listen is the ``OSError``. ``sock``: serve this listening socket instead."""
    if sock is not None:
        server = Server(
            ServerConfig(
                host=host, port=sock.getsockname()[1], token=token, ssl=ssl, sock=sock, limits=HOSTED_LIMITS
            )
        )
        await server.start()
        return server
    loop = asyncio.get_running_loop()
    until = loop.time() + wait
    while True:
        error: OSError | None = None
        for bind in (host, "0.0.0.0"):  # (every address where the host is none of this machine's)
            server = Server(ServerConfig(host=bind, port=port, token=token, ssl=ssl, limits=HOSTED_LIMITS))
            try:
                await server.start()
                return server
            except OSError as exc:
                error = error or exc  # (the host's own error is the one to name)
                if exc.errno == errno.EADDRINUSE:
                    break
        assert error is not None
        if error.errno != errno.EADDRINUSE or loop.time() >= until:
            raise error
        await asyncio.sleep(0.05)
