"""How long a job's state lasts: who uses each job, and when a job nobody uses is dropped.

A job's rounds and keys stay while any client of it is connected. Once the last one has gone:

- a plain job is dropped as soon as its round is over (``ServerState.drop_if_idle``; a member's
  lease may still run after its connection went), its store kept as the standalone server's
  store always was;
- a scoped job (its clients said ``scoped`` in their hello: a rank-hosted store, a TCPStore
  master) and the TCPStore port's job once torch clients used it (on a standalone server, once
  any client used it: ``arendez.sync.TCPStore``'s too) lose their keys too, after a grace
  (``scoped_grace``, ``tcpstore_grace``), unless a client came back meanwhile: a store goes with
  the run that used it, as torch's goes with its host.
"""

from __future__ import annotations

import asyncio
import collections
from typing import Protocol

from .state import ServerState


class Client(Protocol):
    """A session, as far as job lifetimes care."""

    job: str


class JobLifetimes:
    """The sessions of each job, and the scoped jobs whose keys go with their clients."""

    def __init__(
        self,
        state: ServerState,
        tcpstore_job: str,
        scoped_grace: float,
        tcpstore_grace: float,
        tcpstore_runs: bool = False,
    ) -> None:
        self.state = state
        self.tcpstore_job = tcpstore_job
        self.tcpstore_runs = tcpstore_runs
        self.scoped_grace = scoped_grace
        self.tcpstore_grace = tcpstore_grace
        self.sessions: dict[str, set[Client]] = collections.defaultdict(set)
        #: Jobs a scoped client used: their keys go once no client has been back for the grace
        #: after the last one left (a blip is not the end of a run).
        self.scoped: set[str] = set()
        #: torch TCPStore clients connected now (``tcpstore_front``): their job's keys stay
        #: while any is.
        self.torch_clients = 0

    def came(self, session: Client, scoped: bool) -> None:
        """A session of ``session.job`` began (``scoped``: its keys go with the job's clients)."""
        if scoped or (self.tcpstore_runs and session.job == self.tcpstore_job):
            self.scoped.add(session.job)
        self.sessions[session.job].add(session)

    def went(self, session: Client) -> None:
        """A session ended: the last one of its job lets the job go."""
        peers = self.sessions.get(session.job)
        if peers is None:
            return
        peers.discard(session)
        if not peers:
            del self.sessions[session.job]
            if session.job in self.scoped:
                self._drop_later(session.job)
            else:
                self.state.drop_if_idle(session.job, 0)

    def torch_came(self) -> None:
        """A torch TCPStore client validated: its job's keys now last as long as its clients (a
        torch store goes with the run that hosts it; torchrun's c10d and gloo's init count on a
        fresh one each run), as a scoped job's."""
        self.torch_clients += 1
        self.scoped.add(self.tcpstore_job)

    def torch_went(self) -> None:
        self.torch_clients -= 1
        job = self.tcpstore_job
        if not self.torch_clients and not self.sessions.get(job):
            self._drop_later(job)

    def departed(self, jobs: set[str]) -> None:
        """Members of ``jobs`` stopped being active: a job no connection uses any more is
        forgotten once its round is over (its ranks crashed: their leases ran out after their
        connections had gone)."""
        for job in jobs:
            if not self.sessions.get(job) and job not in self.scoped:
                self.state.drop_if_idle(job, 0)

    def _drop_later(self, job: str) -> None:
        """Look at a scoped job whose last client left again after its grace (``_drop_scoped``)."""
        grace = self.tcpstore_grace if job == self.tcpstore_job else self.scoped_grace
        asyncio.get_running_loop().call_later(grace, self._drop_scoped, job)

    def _drop_scoped(self, job: str) -> None:
        """A scoped job's last client left its grace ago: unless one came back, its keys go
        (once its round is over: a member's lease may still run)."""
        torch_held = job == self.tcpstore_job and self.torch_clients
        if self.sessions.get(job) or torch_held or job not in self.scoped:
            return
        found = self.state.jobs.get(job)
        if found is not None and found.in_use:
            self._drop_later(job)
            return
        self.scoped.discard(job)
        self.state.drop_if_idle(job, 0, with_store=True)
