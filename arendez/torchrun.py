"""torchrun's rendezvous on an arendez server: ``torchrun --rdzv-backend arendez``.

::

    arendez-server --port 29400 &                                 # anywhere every node reaches
    torchrun --nnodes 1:4 --nproc-per-node 8 --max-restarts 3 \\
        --rdzv-backend arendez --rdzv-endpoint server-host:29400 --rdzv-id job7 train.py

torch's own dynamic rendezvous (joining, waiting for the last call, re-forming after a failure,
its heartbeats) runs unchanged; what arendez provides is where its state and store live: the
job's namespace (``--rdzv-id``) on a standalone ``arendez-server``, not a TCPStore hosted by
one of the agents (with ``c10d``, the job's rendezvous dies with that agent's node; here any
node may go, and the rest re-form). The agents' store is a torch ``Store``
(``torchstore.ServerStore``); the workers' store is torch's, as with ``c10d`` (the rank-0
agent hosts it; ``TORCHELASTIC_USE_AGENT_STORE``).

torch finds this handler through the ``torchrun.handlers`` entry point of the installed
package. ``--rdzv-endpoint`` is ``[token@]host[:port]`` (port: the server's default, 29400;
token: else ``ARENDEZ_TOKEN``); ``--rdzv-conf read_timeout=S`` bounds each store call (60 s).
"""

from __future__ import annotations

import os
import urllib.parse
from collections.abc import Callable
from typing import Any

from torch.distributed.elastic.rendezvous import (
    RendezvousConnectionError,
    RendezvousHandler,
    RendezvousParameters,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler as dynamic_handler

from .errors import ArendezError, RendezvousError
from .rendezvous import DEFAULT_PORT
from .torchstore import ServerStore

#: The key of torch's rendezvous state in the job's namespace.
STATE_KEY = "torchrun/state"


def endpoint_url(endpoint: str, run_id: str) -> str:
    """The ``arendez://`` URL of ``--rdzv-endpoint`` ``[token@]host[:port]`` and the job
    ``run_id`` (``RendezvousError`` naming what is wrong)."""
    if not endpoint:
        raise RendezvousError(
            "--rdzv-backend arendez needs --rdzv-endpoint [token@]host[:port] of an arendez-server"
        )
    if not run_id:
        raise RendezvousError("--rdzv-backend arendez needs --rdzv-id (the job's name on the server)")
    if "/" in run_id or "?" in run_id or "#" in run_id:
        raise RendezvousError(f"--rdzv-id {run_id!r} may not hold '/', '?' or '#'")
    token, _, hostport = endpoint.rpartition("@")
    parsed = urllib.parse.urlsplit(f"//{hostport}")
    try:
        port = parsed.port or DEFAULT_PORT
    except ValueError:
        raise RendezvousError(f"--rdzv-endpoint {endpoint!r}: the port is not a number in 1-65535") from None
    if not parsed.hostname:
        raise RendezvousError(f"--rdzv-endpoint {endpoint!r} names no host: [token@]host[:port]")
    token = token or os.environ.get("ARENDEZ_TOKEN", "")
    who = f"{urllib.parse.quote(token, safe='')}@" if token else ""
    host = f"[{parsed.hostname}]" if ":" in parsed.hostname else parsed.hostname
    return f"arendez://{who}{host}:{port}/torchrun-{urllib.parse.quote(run_id, safe='')}"


def create_handler(params: RendezvousParameters) -> RendezvousHandler:
    """torch's dynamic rendezvous handler, its state and store on the arendez server that
    ``params.endpoint`` names, in the job ``params.run_id``."""
    read_timeout = params.get_as_int("read_timeout", 60)
    if read_timeout is None or read_timeout <= 0:
        raise RendezvousError(
            f"--rdzv-conf read_timeout must be a positive number of seconds, not {read_timeout}"
        )
    url = endpoint_url(params.endpoint, params.run_id)
    try:
        store = ServerStore(url, float(read_timeout))
    except ArendezError as exc:
        host = url.rpartition("@")[2].removeprefix("arendez://").partition("/")[0]
        raise RendezvousConnectionError(
            f"torchrun's rendezvous could not reach the arendez-server at {host} "
            f"(--rdzv-endpoint {params.endpoint}; is it running?): {exc}"
        ) from None
    return dynamic_handler(store, ServerStateBackend(store), params)


class ServerStateBackend(RendezvousBackend):
    """torch's ``RendezvousBackend`` on an arendez store: the state is one key, changed with
    ``compare_set`` (the token of a state is its bytes, as with torch's ``c10d`` backend;
    an empty value is no state)."""

    def __init__(self, store: Any) -> None:
        self._store = store

    @property
    def name(self) -> str:
        return "arendez"

    def _call(self, op: Callable[..., bytes], *args: Any) -> bytes:
        try:
            return op(*args)
        except ArendezError as exc:
            raise RendezvousConnectionError(
                f"the arendez store of torchrun's rendezvous failed: {exc}"
            ) from exc

    def get_state(self) -> tuple[bytes, Any] | None:
        """The state and its token, or None if there is none yet."""
        state = self._call(self._store.compare_set, STATE_KEY, b"", b"")  # (no waiting for the key)
        return (state, state) if state else None

    def set_state(self, state: bytes, token: Any = None) -> tuple[bytes, Any, bool] | None:
        """Write ``state`` if the stored one is still ``token``'s; the state now stored, its
        token, and whether it is ours."""
        expected = token if isinstance(token, bytes) else b""
        if token and not isinstance(token, bytes):  # (not one of ours: it cannot match)
            found = self.get_state()
            return None if found is None else (*found, False)
        stored = self._call(self._store.compare_set, STATE_KEY, expected, state)
        return (stored, stored, stored == state) if stored else None


def handler_factory() -> Callable[[RendezvousParameters], RendezvousHandler]:
    """The ``torchrun.handlers`` entry point: torch calls it for the handler's creator."""
    return create_handler


__all__ = ["ServerStateBackend", "create_handler", "endpoint_url", "handler_factory"]
