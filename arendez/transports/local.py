"""Same-host links over Unix sockets in Linux's abstract namespace: rank to rank, and client to
store server.

A message between two processes costs about half as much CPU and latency over a Unix socket
as over loopback TCP (measured here: 8 B round trip 27-33 us vs 59-66 us; the TCP stack runs
twice per message, once for each end, in the sender's context). So each rank also listens on
an abstract Unix socket and advertises its name after its TCP address
(``host:port#local=NAME``); a dialer tries that name first and falls back to TCP.

Abstract names live in the network namespace, so a peer in another container or another
(emulated) host is simply not found there, and the TCP address serves. Nothing is left in
the filesystem, and the name dies with the socket. The connection is then authenticated
exactly as a TCP one (token and round nonce in the hello), so reaching the name proves
nothing by itself. ``ARENDEZ_LOCAL_SOCKETS=0`` turns the shortcut off (TCP only, as
``ARENDEZ_SHM=0`` turns off shared memory).

The store server takes the name ``arendez-server/IP:PORT`` (``*`` for a wildcard address); a
blocking client (``BlockingStore``, ``TCPStore``, the lease keeper) whose server address is an IP
address of this machine (or ``localhost``) tries that name, and the wildcard one, before TCP.
Host names are not resolved for this, and TLS never takes the shortcut.
"""

from __future__ import annotations

import asyncio
import encodings.idna  # noqa: F401 - loaded now: out of descriptors, a connect could not load it
import errno
import ipaddress
import os
import secrets
import socket
import sys
from collections.abc import Callable

from .. import transport, wire

#: What separates the TCP address from the local socket's name in an advertised address.
MARK = "#local="


def enabled() -> bool:
    """Whether this process offers and tries local sockets (Linux, not turned off)."""
    return sys.platform.startswith("linux") and os.environ.get("ARENDEZ_LOCAL_SOCKETS", "1") != "0"


def new_name() -> str:
    """A fresh abstract socket name (random: another rank cannot guess it to squat on it)."""
    return f"arendez-{os.getpid()}-{secrets.token_hex(8)}"


def advertise(tcp_address: str, name: str | None) -> str:
    """The address a rank publishes: its TCP address, and its local socket's name if any."""
    return f"{tcp_address}{MARK}{name}" if name else tcp_address


def parse(address: str) -> tuple[str, str | None]:
    """``(tcp_address, local name or None)`` of an advertised address."""
    tcp, mark, name = address.partition(MARK)
    return tcp, (name or None) if mark else None


async def listen(
    name: str, factory: Callable[[], asyncio.BaseProtocol], backlog: int = 1024
) -> asyncio.Server:
    """Listen on abstract socket ``name``."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind("\0" + name)
        sock.listen(backlog)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return await asyncio.get_running_loop().create_unix_server(factory, sock=sock)


async def connect(
    name: str, *, timeout: float, limits: wire.Limits = wire.DEFAULT_LIMITS
) -> transport.Connection:
    """Connect to abstract socket ``name``; ``OSError`` if nothing listens there in our
    network namespace."""
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.setblocking(False)
        async with asyncio.timeout(timeout):
            await loop.sock_connect(sock, "\0" + name)
            _, conn = await loop.create_unix_connection(lambda: transport.Connection(limits), sock=sock)
    except BaseException:
        sock.close()
        raise
    return conn


# -- the store server's local socket ----------------------------------------------------------
_WILDCARDS = ("", "0.0.0.0", "::")


def _literal_ip(host: str) -> str | None:
    """``host`` as an IP address if it is one (or ``localhost``); names are not resolved here."""
    if host == "localhost":
        return "127.0.0.1"
    try:
        return str(ipaddress.ip_address(host.strip("[]")))
    except ValueError:
        return None


def server_name(host: str, port: int) -> str | None:
    """The abstract name a store server listening on ``host:port`` also takes (None: a host
    name, which clients could not match without resolving it)."""
    if host in _WILDCARDS:
        return f"arendez-server/*:{port}"
    ip = _literal_ip(host)
    return f"arendez-server/{ip}:{port}" if ip is not None else None


def server_candidates(host: str, port: int) -> list[str]:
    """The abstract names to try before TCP for the store server at ``host:port``: none unless
    ``host`` is an address of this machine (in this network namespace)."""
    if not enabled():
        return []
    ip = _literal_ip(host)
    if ip is None or not _is_local_address(ip):
        return []
    return [f"arendez-server/{ip}:{port}", f"arendez-server/*:{port}"]


def _is_local_address(ip: str) -> bool:
    address = ipaddress.ip_address(ip)
    if address.is_loopback:
        return True
    family = socket.AF_INET6 if address.version == 6 else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.bind((ip, 0))  # (only an address of ours can be bound)
    except OSError:
        return False
    return True


def connect_blocking(name: str, timeout: float) -> socket.socket:
    """A blocking connection to abstract socket ``name``; ``OSError`` if nothing listens there."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        sock.connect("\0" + name)
    except BaseException:
        sock.close()
        raise
    return sock


def open_blocking(host: str, port: int, timeout: float, *, local_ok: bool = True) -> socket.socket:
    """A blocking connection to the store server at ``host:port``: its local socket if it is on
    this host (and ``local_ok``), else TCP with ``TCP_NODELAY``; ``OSError`` if neither answers."""
    if local_ok:
        for name in server_candidates(host, port):
            try:
                return connect_blocking(name, timeout)
            except OSError:
                continue
    sock = socket.create_connection((host, port), timeout=timeout)
    try:
        if transport.connected_to_itself(sock):
            transport.reset_on_close(sock)
            raise ConnectionRefusedError(
                errno.ECONNREFUSED, f"nothing listens on {host}:{port} (connected to itself)"
            )
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except BaseException:
        sock.close()
        raise
    return sock
