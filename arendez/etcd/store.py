"""``EtcdStore``: the arendez store and rendezvous on etcd v3, with ``Store``'s interface.

Keys of job ``J`` live under ``/arendez/J/``:

* ``kv/<key>``: the store (set/get/add/compare_set/wait/check/delete/num_keys);
* ``rdzv/round``: the number ``n`` of the round being formed;
* ``rdzv/<n>/world_size``: the size every joiner of round ``n`` must ask for;
* ``rdzv/<n>/rank/<r>``: rank ``r``'s address, bound to that rank's lease (so it disappears
  when the rank leaves or its lease expires), claimed by a transaction that also checks
  ``rdzv/round`` still says ``n``;
* ``rdzv/<n>/done``: the nonce and peers of round ``n``, written once by the joiner that sees
  the round full (the same transaction moves ``rdzv/round`` on to ``n + 1``);
* ``rdzv/<n>/left/<r>``: written with the delete of ``rank/<r>`` when a rank leaves cleanly.

Every member watches ``rdzv/<n>/``: the delete of ``rank/<r>`` without ``left/<r>`` means its
lease expired, delivered as the ``rank_failed`` event the arendez server sends. The last rank
to leave deletes the whole job prefix, unless a rank of another round holds a key there.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import random
from collections.abc import Callable
from typing import Any

from ..errors import RendezvousError, RendezvousTimeoutError, StoreError
from ..rendezvous import incomplete
from ..store import Membership
from ..store_wire import MAX_REASON
from .client import LeaseKeeper
from .codec import prefix_end, unb64
from .kv import EtcdKV, _count, _delete, _kvs, _put, _range, _revision, _same
from .url import DEFAULT_LEASE, Endpoints, parse_url

log = logging.getLogger("arendez.etcd")
#: The longest leaving a round may take (etcd unreachable: a destroy is not held for its timeout).
LEAVE_SECONDS = 2.0

EventHandler = Callable[[dict[str, Any]], None]
_Ranks = set[int]  # (``EtcdStore.set`` shadows the builtin inside the class)


class EtcdStore(EtcdKV):
    """One job's store and rendezvous on an etcd v3 cluster; the interface of ``Store``."""

    def __init__(
        self,
        endpoints: Endpoints,
        job: str,
        *,
        lease: int = DEFAULT_LEASE,
        timeout: float = 300.0,
    ) -> None:
        super().__init__(endpoints, job, lease=lease, timeout=timeout)
        self.on_event: EventHandler | None = None
        self._membership: Membership | None = None
        self._round = -1
        self._lease_id = 0
        self._keeper: LeaseKeeper | None = None
        self._watch_task: asyncio.Task[None] | None = None

    async def close(self) -> None:
        """Stop the failure watch and the lease keeper; close the HTTP connections."""
        await self._stop_watch()
        self._stop_keeper()
        await super().close()

    # -- rendezvous ------------------------------------------------------------------------------
    def _r(self, n: int, rest: str = "") -> bytes:
        return self._root + f"rdzv/{n}/{rest}".encode()

    @staticmethod
    def _int_value(response: dict[str, Any]) -> int | None:
        kvs = _kvs(response)
        return int(unb64(kvs[0].get("value"))) if kvs else None

    async def _claim(
        self, world_size: int, rank: int, address: str, deadline: float
    ) -> tuple[int, int, int, int]:
        """Take a rank slot of the round being formed, in one transaction that also checks the
        round is still open and its world size; returns (round, rank, ranks in, revision)."""
        round_key = self._root + b"rdzv/round"
        size = str(world_size).encode()
        n = max(0, self._round + 1)
        taken: _Ranks = set()
        while True:
            if rank >= 0:
                r = rank
            else:
                free = [x for x in range(world_size) if x not in taken]
                if not free:  # our guesses are stale: read who holds which slot
                    taken = await self._taken(n, deadline)
                    free = [x for x in range(world_size) if x not in taken]
                    if not free:  # full but not closed yet: the closer is on its way
                        await asyncio.sleep(0.02)
                        continue
                r = random.choice(free)
            ws_key, slot, ranks = self._r(n, "world_size"), self._r(n, f"rank/{r}"), self._r(n, "rank/")
            ok, responses, revision = await self._txn(
                [
                    _same(round_key, "VALUE", str(n).encode()),
                    _same(ws_key, "VALUE", size),
                    _same(slot, "CREATE", 0),
                ],
                [
                    _put(slot, address.encode(), self._lease_id),
                    _put(self._root + b"rdzv/touched", b""),
                    _range(ranks, prefix_end(ranks), count_only=True),
                ],
                [_range(round_key), _range(ws_key), _range(slot, count_only=True)],
                deadline,
            )
            if ok:
                return n, r, _count(responses[2]), revision
            current, forming = self._int_value(responses[0]), self._int_value(responses[1])
            if current is None:  # a new job: open round 0
                await self._txn([_same(round_key, "CREATE", 0)], [_put(round_key, b"0")], [], deadline)
            elif current != n:  # that round completed meanwhile: join the one being formed
                n, taken = current, set()
            elif forming is None:  # the first joiner of round n sets its size
                await self._txn([_same(ws_key, "CREATE", 0)], [_put(ws_key, size)], [], deadline)
            elif forming != world_size:
                if await self._reopen_if_empty(n, deadline):
                    continue  # (nobody was in it: its size is this joiner's to set)
                raise RendezvousError(
                    f"job {self.job!r} is forming a world of {forming}, this rank asked for {world_size}"
                )
            elif rank >= 0:
                raise RendezvousError(f"rank {rank} of job {self.job!r} has already joined")
            else:
                taken.add(r)

    async def _reopen_if_empty(self, n: int, deadline: float) -> bool:
        """Forget the size of round ``n`` if no rank holds a slot of it (its joiners timed out,
        or their leases expired): the next joiner sets it again (the arendez server forgets a
        forming round whose joiners are gone the same way). True if nobody held a slot."""
        ranks, touched = self._r(n, "rank/"), self._root + b"rdzv/touched"
        _, seen, _ = await self._txn(
            [], [_range(ranks, prefix_end(ranks), count_only=True), _range(touched)], [], deadline
        )
        if _count(seen[0]) > 0:
            return False
        kvs = _kvs(seen[1])
        claimed = int(kvs[0]["mod_revision"]) if kvs else 0
        await self._txn(  # (unless a rank claimed a slot since, or the round closed)
            [_same(touched, "MOD", claimed), _same(self._r(n, "done"), "CREATE", 0)],
            [_delete(self._r(n, "world_size"))],
            [],
            deadline,
        )
        return True

    async def _taken(self, n: int, deadline: float) -> _Ranks:
        ranks = self._r(n, "rank/")
        body = await self._call(
            "kv/range", {**_range(ranks, prefix_end(ranks))["request_range"], "keys_only": True}, deadline
        )
        return {int(unb64(kv["key"]).rsplit(b"/", 1)[1]) for kv in _kvs(body)}

    async def _close_round(self, n: int, world_size: int, deadline: float) -> dict[str, Any] | None:
        """If round ``n`` is full, write its nonce and peers and open round ``n + 1``."""
        prefix = self._r(n, "rank/")
        body = await self._call("kv/range", _range(prefix, prefix_end(prefix))["request_range"], deadline)
        kvs = _kvs(body)
        if len(kvs) < world_size:
            return None
        peers = [""] * world_size
        for kv in kvs:
            peers[int(unb64(kv["key"]).rsplit(b"/", 1)[1])] = unb64(kv.get("value")).decode()
        record = {"nonce": os.urandom(16).hex(), "peers": peers, "revision": _revision(body)}
        done = self._r(n, "done")
        ok, responses, _ = await self._txn(
            [_same(done, "CREATE", 0)],
            [_put(done, json.dumps(record).encode()), _put(self._root + b"rdzv/round", str(n + 1).encode())],
            [_range(done)],
            deadline,
        )
        if ok:
            return record
        return self._record(_kvs(responses[0]))

    @staticmethod
    def _record(kvs: list[dict[str, Any]]) -> dict[str, Any] | None:
        if not kvs:
            return None
        record: dict[str, Any] = json.loads(unb64(kvs[0].get("value")))
        return record

    async def _await_round(
        self, n: int, world_size: int, count: int, after: int, deadline: float
    ) -> dict[str, Any]:
        """The record of round ``n``: written by us if our claim filled it, else watched for
        (it cannot exist before our claim at revision ``after``: the claim saw the round open)."""
        if count >= world_size:
            record = await self._close_round(n, world_size, deadline)
            if record is not None:
                return record
        done = self._r(n, "done")
        watch = self._client.watch(done, b"", after + 1)
        try:
            async with asyncio.timeout_at(deadline):
                async for _, events in watch:
                    record = self._record([ev["kv"] for ev in events if ev.get("type", "PUT") == "PUT"])
                    if record is not None:
                        return record
        finally:
            await watch.aclose()
        raise StoreError("the watch of the round ended")  # not reached: watches do not end

    async def join(
        self, world_size: int, rank: int, address: str, timeout: float | None = None
    ) -> Membership:
        """Join the job's rendezvous round; returns once all ``world_size`` ranks are in."""
        if not isinstance(world_size, int) or not 1 <= world_size <= 65_536:
            raise RendezvousError(f"world_size must be in 1..65536, got {world_size!r}")
        if not isinstance(rank, int) or not -1 <= rank < world_size:
            raise RendezvousError(f"rank {rank!r} is outside 0..{world_size - 1} (or -1: assigned)")
        deadline = self._deadline(timeout, None)
        grant = await self._call("lease/grant", {"TTL": str(self.lease_ttl)}, deadline)
        self._lease_id = int(grant["ID"])
        self._keeper = LeaseKeeper(self.ends, self._lease_id, int(grant.get("TTL", self.lease_ttl)))
        self._keeper.start()
        n = r = -1
        try:
            n, r, count, revision = await self._claim(world_size, rank, address, deadline)
            record = await self._await_round(n, world_size, count, revision, deadline)
        except BaseException as exc:
            joined = await self._who_joined(n) if isinstance(exc, TimeoutError) and n >= 0 else None
            await self._withdraw(n, r)
            if isinstance(exc, TimeoutError) and not isinstance(exc, StoreError):
                # (no duration: init passes what is left of its own timeout, which is the one
                # the user knows)
                counted = (
                    incomplete(world_size, joined) if joined is not None else "not all ranks joined in time"
                )
                raise RendezvousTimeoutError(
                    f"rendezvous of job {self.job!r} on etcd {self.ends} incomplete: {counted}"
                ) from None
            raise
        self._round = n
        m = self._membership = Membership(
            r, world_size, list(record["peers"]), bytes.fromhex(record["nonce"])
        )
        self._watch_task = asyncio.get_running_loop().create_task(
            self._watch_members(n, int(record["revision"]))
        )
        return m

    async def _who_joined(self, n: int) -> _Ranks | None:
        """The ranks holding slots of round ``n`` now (None if etcd does not say within 1 s)."""
        try:
            return await self._taken(n, asyncio.get_running_loop().time() + 1.0)
        except (StoreError, TimeoutError, OSError):
            return None

    async def _withdraw(self, n: int, r: int) -> None:
        """Give up a slot of a round that did not complete (best effort) and drop the lease."""
        self._stop_keeper()
        with contextlib.suppress(Exception):
            deadline = self._deadline(2.0)
            if n >= 0:
                await self._txn(
                    [_same(self._r(n, "done"), "CREATE", 0)], [_delete(self._r(n, f"rank/{r}"))], [], deadline
                )
            await self._revoke(deadline)

    async def _revoke(self, deadline: float) -> None:
        if self._lease_id:
            lease, self._lease_id = self._lease_id, 0
            await self._call("lease/revoke", {"ID": str(lease)}, deadline)

    def _stop_keeper(self) -> None:
        if self._keeper is not None:
            self._keeper.stop()
            self._keeper = None

    async def _stop_watch(self) -> None:
        task, self._watch_task = self._watch_task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    async def _watch_members(self, n: int, after: int) -> None:
        """Tell ``on_event`` about every member of round ``n`` whose key goes away."""
        me = self._membership.rank if self._membership is not None else -1
        prefix = self._r(n)
        left: dict[int, str] = {}  # rank -> why it failed on its way out ("": a clean leave)
        try:
            async for _, events in self._client.watch(prefix, prefix_end(prefix), after + 1):
                for ev in events:
                    key = unb64(ev["kv"]["key"])[len(prefix) :].decode()
                    kind, _, tail = key.partition("/")
                    if not tail.isdigit():
                        continue
                    r = int(tail)
                    if kind == "left" and ev.get("type", "PUT") == "PUT":
                        left[r] = unb64(ev["kv"].get("value", "")).decode(errors="replace")
                    elif kind == "rank" and ev.get("type") == "DELETE" and r != me:
                        why = left.get(r)
                        event: dict[str, Any]
                        if why == "":
                            event = {"event": "rank_left", "rank": r, "reason": "left the job"}
                        elif why is not None:  # it said why it failed as it left
                            event = {"event": "rank_failed", "rank": r, "reason": why, "said": True}
                        else:
                            expired = f"its etcd lease expired (no keepalive for {self.lease_ttl}s)"
                            event = {"event": "rank_failed", "rank": r, "reason": expired}
                        (log.info if why == "" else log.warning)(
                            "job %r rank %d %s", self.job, r, event["reason"]
                        )
                        if self.on_event is not None:
                            self.on_event(event)
        except StoreError as exc:
            log.warning("job %r: watching the members on etcd %s stopped: %s", self.job, self.ends, exc)

    async def leave(self, timeout: float = LEAVE_SECONDS, failed: str | None = None) -> None:
        """Leave the round (best effort, within ``LEAVE_SECONDS`` at most: etcd down must not
        hold a destroy for its whole timeout); the last rank out deletes the job's keys.
        ``failed``: why, when the process is ending by a failure (the others are told of a
        failure, not a leave)."""
        m, self._membership = self._membership, None
        if m is None or self._etcd is None:
            return
        await self._stop_watch()
        self._stop_keeper()
        deadline = self._deadline(min(timeout, LEAVE_SECONDS))
        n = self._round
        try:
            await self._txn(
                [],
                [
                    _put(self._r(n, f"left/{m.rank}"), (failed or "").encode()[:MAX_REASON]),
                    _delete(self._r(n, f"rank/{m.rank}")),
                ],
                [],
                deadline,
            )
            await self._revoke(deadline)
            await self._cleanup(deadline)
        except (StoreError, TimeoutError) as exc:
            log.warning(
                "job %r: could not leave its round on etcd %s (%s): its keys stay until this "
                "rank's lease expires (%ds), the job's own until a later job of that name ends",
                self.job,
                self.ends,
                exc,
                self.lease_ttl,
            )

    async def _cleanup(self, deadline: float) -> None:
        """Delete the job's prefix if no rank of any round still holds a key."""
        rdzv = self._root + b"rdzv/"
        body = await self._call(
            "kv/range", {**_range(rdzv, prefix_end(rdzv))["request_range"], "keys_only": True}, deadline
        )
        touched = 0
        for kv in _kvs(body):
            key = unb64(kv["key"])[len(rdzv) :]
            if b"/rank/" in key:
                return  # a member of some round is still alive
            if key == b"touched":
                touched = int(kv.get("mod_revision", 0))
        ok, _, _ = await self._txn(
            [_same(rdzv + b"touched", "MOD", touched)],
            [_delete(self._root, prefix_end(self._root))],
            [],
            deadline,
        )
        if ok:
            log.info("job %r finished: deleted its keys from etcd %s", self.job, self.ends)


__all__ = ["EtcdStore", "parse_url"]
