"""A listening socket bound in the caller's thread, for a server about to serve it.

Binding a numeric address here, not in the event loop, matters twice: a master ``TCPStore``'s
port listens from its first instant (``serverproc``), and uvloop never resolves the address on
libuv's thread pool, whose exit-time cleanup crashed (SIGSEGV) a child forked after init that
then exited normally (the peer listener, ``tcp.Mesh.listen``; QA26).
"""

from __future__ import annotations

import ipaddress
import socket


def listening_socket(host: str, port: int, backlog: int = 4096) -> socket.socket | None:
    """``host:port`` bound, listening and non-blocking; ``None`` where ``host`` is a name (it
    may stand for several addresses: the loop resolves it). An error binding is the ``OSError``."""
    try:
        address = ipaddress.ip_address(host or "0.0.0.0")
    except ValueError:
        return None
    sock = socket.socket(socket.AF_INET6 if address.version == 6 else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((str(address), port))
        sock.listen(backlog)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock
