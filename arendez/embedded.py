"""The server a ``tcp://`` (or ``env://`` with MASTER_ADDR) rank 0 hosts: a child process of
its own (``arendez.serverproc``; in its event loop with TLS or ``ARENDEZ_EMBEDDED_SERVER=loop``).

One server per process and port, started by the first ``init_process_group`` that needs it and
kept across ``destroy_process_group``/``init_process_group`` cycles, exactly as a standalone
``arendez-server`` outlives the rounds it serves. Restarting it on the same port every round left a
window in which another rank's next-round connection landed on the instance being closed, so the
ranks of one round could end up on two different servers and wait out their whole deadline; every
cycle also paid for the restart (refused connections, reconnect back-off) and alarmed the other
ranks with a lost store.

A master ``TCPStore`` (``arendez.sync``) pins the server it hosts: as torch's, the server closes
once that store and its clones are gone (closed or collected), unless a world's rank 0 hosts it too.

Otherwise the server lives until the event loop that started it ends (a holder task closes it when the loop
cancels its tasks, as ``asyncio.run`` does) or until ``shutdown()``. A later loop in the same
process (a second ``asyncio.run``) gets a fresh server on the same port.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import importlib
import logging
import os
import socket
import ssl as _ssl
from dataclasses import dataclass
from typing import Any

from .errors import HostingError
from .loop import disown_tasks
from .serverproc import ServerProcess

log = logging.getLogger("arendez")

#: Longest a new host waits for the port to be released (by a process that hosted it before).
BIND_WAIT = 5.0


@dataclass
class _Hosted:
    server: Any  # arendez_server.Server
    loop: asyncio.AbstractEventLoop
    host: str
    token: str | None
    tls: bool
    holder: asyncio.Task[None] | None = None
    pins: int = 0  # master ``TCPStore``s of this process (with their clones) serving on it
    world: bool = False  # a world's rank 0 hosts it too: it stays when the pins go


_hosted: dict[int, _Hosted] = {}  # by the port the caller asked for
_retiring: dict[int, asyncio.Task[None]] = {}  # servers closing once their last pin went


def _forget_after_fork() -> None:
    """A forked child does not host the parent's servers (nor may it close them)."""
    for entry in _hosted.values():
        disown_tasks(entry.loop)
    _hosted.clear()
    _retiring.clear()


os.register_at_fork(after_in_child=_forget_after_fork)


async def acquire(
    host: str,
    port: int,
    token: str | None,
    ssl: _ssl.SSLContext | None,
    *,
    pinned: bool = False,
    exclusive: bool = False,
    sock: socket.socket | None = None,
) -> Any:
    """The process's embedded server on ``port``: the running one, or a new one if there is none
    (or it was started by another event loop or with another host/token/TLS setting).

    ``pinned``: a master ``TCPStore`` serves on it, which ``unpin``s it when it is gone (torch's
    server lives as long as its master store); ``exclusive``: a ``StoreError`` if another master
    ``TCPStore`` of this process already serves that port (torch's ``multi_tenant=False``);
    ``sock``: the port already bound and listening, for a new server to serve (ours to close)."""
    try:
        server = await _acquire(host, port, token, ssl, pinned, exclusive, sock)
    except BaseException:
        if sock is not None:
            sock.close()
        raise
    if sock is not None and getattr(getattr(server, "config", None), "sock", None) is not sock:
        sock.close()  # (unless this loop's new server serves it: a child has its own copy)
    return server


async def _acquire(
    host: str,
    port: int,
    token: str | None,
    ssl: _ssl.SSLContext | None,
    pinned: bool,
    exclusive: bool,
    sock: socket.socket | None,
) -> Any:
    loop = asyncio.get_running_loop()
    if port and (closing := _retiring.get(port)) is not None:
        await asyncio.wait([closing])  # the port's last master is gone: its server is closing
    current = _hosted.get(port) if port else None  # port 0: always a new server, on a free port
    if current is not None:
        alive = current.holder is not None and not current.holder.done()
        same = (current.host, current.token, current.tls) == (host, token, ssl is not None)
        if alive and same and current.loop is loop:
            if exclusive and current.pins:
                raise HostingError(
                    f"a TCPStore of this process already serves port {port} (EADDRINUSE; pass "
                    "multi_tenant=True to share it, as in torch)"
                )
            current.pins += pinned
            current.world = current.world or not pinned
            return current.server
        await _retire(current, loop)
    # a master TCPStore fails at once on a port in use (as torch's); a world's rank 0 waits a
    # little for the previous host of the port to leave
    who = "TCPStore(is_master=True)" if pinned else "rank 0"
    server = await start_server(host, port, token, ssl, who=who, wait=0.0 if pinned else BIND_WAIT, sock=sock)
    port = server.port
    entry = _hosted[port] = _Hosted(server, loop, host, token, ssl is not None)
    entry.pins, entry.world = int(pinned), not pinned
    entry.holder = loop.create_task(_hold(port, entry), name=f"arendez-embedded-server-{port}")
    return server


def unpin(port: int) -> None:
    """A master ``TCPStore`` serving on ``port`` is gone (closed or collected): the server closes
    with the last of them, unless a world's rank 0 hosts it too. Called on the server's loop."""
    entry = _hosted.get(port)
    if entry is None or entry.pins == 0:
        return
    entry.pins -= 1
    if entry.pins or entry.world:
        return
    del _hosted[port]
    closing = entry.loop.create_task(_retire(entry, entry.loop), name=f"arendez-unpin-{port}")
    _retiring[port] = closing
    closing.add_done_callback(lambda task: _retiring.pop(port, None) if _retiring.get(port) is task else None)


async def release(port: int, timeout: float = 2.0) -> None:
    """Close this process's embedded server on ``port``, if any: another rank hosts it now."""
    entry = _hosted.get(port)
    if entry is not None and not entry.pins:
        await _retire(entry, asyncio.get_running_loop(), timeout)


async def shutdown(timeout: float = 2.0) -> None:
    """Close every embedded server this process hosts (connected ranks are told it shut down)."""
    loop = asyncio.get_running_loop()
    for entry in list(_hosted.values()):
        await _retire(entry, loop, timeout)


def as_child() -> bool:
    """True if the server runs as a child process (the default; ``ARENDEZ_EMBEDDED_SERVER=loop``
    runs it in the hosting rank's event loop, as TLS always does)."""
    mode = os.environ.get("ARENDEZ_EMBEDDED_SERVER", "process").strip() or "process"
    if mode not in ("process", "loop"):
        raise ValueError(f"ARENDEZ_EMBEDDED_SERVER must be 'process' or 'loop', got {mode!r}")
    return mode == "process"


async def start_server(
    host: str,
    port: int,
    token: str | None,
    ssl: _ssl.SSLContext | None,
    *,
    who: str,
    wait: float,
    sock: socket.socket | None = None,
) -> Any:
    """A new server on ``host:port`` (or on ``sock``, bound and listening there): a child
    process (``ServerProcess``), or one in this event loop with TLS,
    ``ARENDEZ_EMBEDDED_SERVER=loop`` or when no child can be started. ``RendezvousError``
    naming ``who`` if it cannot listen there."""
    if ssl is None and as_child():  # (a TLS context cannot be handed to another process)
        try:
            return await ServerProcess.start(host, port, token, wait, sock)
        except ChildProcessError as exc:
            log.warning("%s: no store process (%s); hosting the store in this event loop", who, exc)
        except OSError as exc:
            raise _cannot_host(who, port, exc) from None
    module = importlib.import_module("arendez_server")  # installed from server/
    if sock is not None and sock.fileno() == -1:  # (handed to a child that then failed)
        sock = None
    try:
        return await module.start_server(host, port, token, ssl, wait, sock=sock)
    except OSError as exc:
        raise _cannot_host(who, port, exc) from None


def _cannot_host(who: str, port: int, exc: OSError) -> HostingError:
    name = errno.errorcode.get(exc.errno or 0)
    return HostingError(f"{who} cannot host the store on port {port}: {exc}" + (f" ({name})" if name else ""))


async def _hold(port: int, entry: _Hosted) -> None:
    """Keep ``entry``'s server until this task is cancelled (by ``shutdown`` or the loop's end)."""
    try:
        await asyncio.get_running_loop().create_future()
    except asyncio.CancelledError:
        if _hosted.get(port) is entry:
            del _hosted[port]
        await entry.server.close(1.0)
        raise


async def _retire(entry: _Hosted, loop: asyncio.AbstractEventLoop, timeout: float = 2.0) -> None:
    """Close ``entry``'s server from ``loop``, whatever state the loop that runs it is in."""
    for port, held in list(_hosted.items()):
        if held is entry:
            del _hosted[port]
    holder = entry.holder
    if entry.loop is loop:
        if holder is not None and not holder.done():
            holder.cancel()
            await asyncio.wait([holder])  # (never swallows a cancel aimed at the caller)
        await entry.server.close(timeout)  # no-op if the holder closed it (it may never have run)
        return
    if entry.loop.is_running():  # another thread's loop: let it close its own server
        done = asyncio.run_coroutine_threadsafe(entry.server.close(timeout), entry.loop)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(asyncio.wrap_future(done), timeout + 1.0)
        return
    # a loop that has stopped without cancelling our holder: free the listening socket at least
    if isinstance(entry.server, ServerProcess):
        entry.server.stop_now()
        return
    listener = getattr(entry.server, "_server", None)
    if listener is not None:
        with contextlib.suppress(Exception):
            listener.close()
    log.debug("dropped the embedded server of a loop that is no longer running")
