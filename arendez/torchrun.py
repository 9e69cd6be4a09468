"""torchrun's rendezvous on an arendez server: ``torchrun --rdzv-backend arendez``.

::

    arendez-server --port 29400 &                                 # anywhere every node reaches
    torchrun --nnodes 1:4 --nproc-per-node 8 --max-restarts 3 \\
        --rdzv-backend arendez --rdzv-endpoint server-host:29400 --rdzv-id job7 train.py

torch's own dynamic rendezvous (joining, waiting for the last call, re-forming after a failure,
its heartbeats) runs unchanged; what arendez provides is where its state and store live: the
job's namespace (``--rdzv-id``) on a standalone ``arendez-server``, not a TCPStore hosted by
one of the agents (with ``c10d``, the job's rendezvous dies with that agent's node; here it
survives any node; torch's re-forming itself has limits of its own, see the README). The
agents' store is a torch ``Store`` (``torchstore.ServerStore``, scoped: its keys go with the
run's last agent); the workers' store is torch's, as with ``c10d`` (the rank-0 agent hosts it;
``TORCHELASTIC_USE_AGENT_STORE``).

torch finds this handler through the ``torchrun.handlers`` entry point of the installed
package. ``--rdzv-endpoint`` is ``[token@]host[:port]`` (port: the server's default, 29400;
token: else ``ARENDEZ_TOKEN``); ``--rdzv-conf read_timeout=S`` bounds each store call (60 s).
"""

from __future__ import annotations

import datetime
import logging
import os
import pickle
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

from .errors import ArendezError, AuthenticationError, RendezvousError
from .rendezvous import DEFAULT_PORT
from .torchstore import ServerStore

log = logging.getLogger("arendez.torchrun")

#: The key of torch's rendezvous state in the job's namespace.
STATE_KEY = "torchrun/state"
#: The longest ``--rdzv-id``, URL-encoded: the server's job names hold 256 characters.
MAX_RUN_ID = 200


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
    job = urllib.parse.quote(run_id, safe="")
    if len(job) > MAX_RUN_ID:
        raise RendezvousError(
            f"--rdzv-id is {len(job)} characters long once URL-encoded; at most {MAX_RUN_ID} are allowed"
        )
    token, _, hostport = endpoint.rpartition("@")
    parsed = urllib.parse.urlsplit(f"//{hostport}")
    try:
        given = parsed.port
    except ValueError:
        given = 0
    if given == 0:
        raise RendezvousError(f"--rdzv-endpoint {endpoint!r}: the port is not a number in 1-65535")
    port = DEFAULT_PORT if given is None else given
    if not parsed.hostname:
        raise RendezvousError(f"--rdzv-endpoint {endpoint!r} names no host: [token@]host[:port]")
    token = token or os.environ.get("ARENDEZ_TOKEN", "")
    who = f"{urllib.parse.quote(token, safe='')}@" if token else ""
    host = f"[{parsed.hostname}]" if ":" in parsed.hostname else parsed.hostname
    return f"arendez://{who}{host}:{port}/torchrun-{job}"


def create_handler(params: RendezvousParameters) -> RendezvousHandler:
    """torch's dynamic rendezvous handler, its state and store on the arendez server that
    ``params.endpoint`` names, in the job ``params.run_id``."""
    read_timeout = params.get_as_int("read_timeout", 60)
    if read_timeout is None or read_timeout <= 0:
        raise RendezvousError(
            f"--rdzv-conf read_timeout must be a positive number of seconds, not {read_timeout}"
        )
    url = endpoint_url(params.endpoint, params.run_id)
    host = url.rpartition("@")[2].removeprefix("arendez://").partition("/")[0]  # (no token shown)
    try:
        store = ServerStore(url, float(read_timeout), scoped=True)  # (gone with the last agent)
    except AuthenticationError as exc:
        raise RendezvousConnectionError(
            f"the arendez-server at {host} refused torchrun's rendezvous: {exc} "
            "(the token: ARENDEZ_TOKEN, or --rdzv-endpoint token@host:port)"
        ) from None
    except ArendezError as exc:
        raise RendezvousConnectionError(
            f"torchrun's rendezvous could not reach the arendez-server at {host} (is it running?): {exc}"
        ) from None
    interval = params.get_as_int("keep_alive_interval", 5) or 5  # (torch's defaults)
    attempts = params.get_as_int("keep_alive_max_attempt", 3) or 3
    backend = ServerStateBackend(store, datetime.timedelta(seconds=interval * attempts), params.run_id)
    handler = dynamic_handler(store, backend, params)
    shutdown = handler.shutdown

    def shutdown_and_leave() -> bool:
        """torch's shutdown (it closes the rendezvous), then this node's heartbeat taken out
        of the state: once every node of a closed run has left, the next run starts afresh.
        Never raises (torch calls it in a ``finally``: the run's own outcome stands)."""
        closed = shutdown()
        try:
            backend.leave(handler._this_node)
        except Exception as exc:  # (the server gone at the end of the run: say so, go on)
            log.warning("torchrun's rendezvous could not record this node's leaving: %s", exc)
        return closed

    handler.shutdown = shutdown_and_leave  # type: ignore[method-assign]
    return handler


class ServerStateBackend(RendezvousBackend):
    """torch's ``RendezvousBackend`` on an arendez store: the state is one key, changed with
    ``compare_set`` (the token of a state is its bytes, as with torch's ``c10d`` backend;
    an empty value is no state).

    The server keeps the state after the run (unlike ``c10d``'s store, which dies with its
    agent): a closed one whose nodes are all gone, by torch's own rule (no heartbeat within
    ``stale_after``; a node that shut down took its heartbeat out), is no state, so the next
    run with the same ``--rdzv-id`` starts afresh rather than meeting a closed rendezvous."""

    def __init__(
        self, store: Any, stale_after: datetime.timedelta = datetime.timedelta(seconds=15), run_id: str = ""
    ) -> None:
        self._store = store
        self._stale_after = stale_after
        #: the keys torch's handler writes for the rounds of this run (its store's prefix)
        self._rounds = f"torch.rendezvous.{run_id}."

    @property
    def name(self) -> str:
        return "arendez"

    def _call(self, op: Callable[..., Any], *args: Any) -> Any:
        try:
            return op(*args)
        except ArendezError as exc:
            raise RendezvousConnectionError(
                f"the arendez store of torchrun's rendezvous failed: {exc}"
            ) from exc

    def _read(self) -> bytes:
        """The stored state (empty: none), without waiting for the key to be set."""
        state: bytes = self._call(self._store.compare_set, STATE_KEY, b"", b"")
        return state

    @staticmethod
    def _decoded(state: bytes) -> Any:
        """torch's state object, as its handler reads it (None if it is not one torch wrote)."""
        try:
            return pickle.loads(state)
        except Exception:
            return None

    def get_state(self) -> tuple[bytes, Any] | None:
        """The state and its token, or None if there is none (or only a finished run's)."""
        state = self._read()
        if state and self._finished(state):  # (cleared only if no node changed it meanwhile)
            state = self._call(self._store.compare_set, STATE_KEY, state, b"")
            if not state:  # the finished run's round keys go too (round 0 again: its exit barrier's
                self._forget_rounds()  # last_member, its MASTER_PORT would be met by the new run)
        return (state, state) if state else None

    def _forget_rounds(self) -> None:
        """Delete the keys of a finished run's rounds (before this node takes part in any)."""
        for key in self._call(self._store.list_keys):
            if key.startswith(self._rounds):
                self._call(self._store.delete_key, key)

    def _finished(self, state: bytes) -> bool:
        """A closed rendezvous none of whose nodes is alive (torch's state, as its handler reads it)."""
        found = self._decoded(state)  # (not one torch wrote: not ours to clear)
        if not getattr(found, "closed", False):
            return False
        expired = datetime.datetime.now(datetime.UTC) - self._stale_after
        return all(beat < expired for beat in getattr(found, "last_heartbeats", {}).values())

    def leave(self, node: Any) -> None:
        """Take ``node``'s heartbeat out of the state (it shut down: the run is over for it)."""
        for _ in range(100):  # (compare-and-set: retried while other nodes change the state)
            state = self._read()
            found = self._decoded(state) if state else None
            beats = getattr(found, "last_heartbeats", None)
            if not isinstance(beats, dict) or node not in beats:
                return
            del beats[node]
            changed = pickle.dumps(found)
            if self._call(self._store.compare_set, STATE_KEY, state, changed) == changed:
                return

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
