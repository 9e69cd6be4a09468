"""The server's request handlers: plain functions of the server, the session, the job and the request.

Two request forms (``arendez.store_wire``): the compact ``[op, id, *args]`` of the key-value
operations, answered at once by the ``COMPACT`` handlers when they can be (a ``get`` of a present
key, a ``wait`` on present keys), and the map form ``{"op", "id", ...}`` of every request
(``HANDLERS``). A handler that cannot answer yet returns ``BLOCK``: a ``get``/``wait``/
``multi_get`` then waits for its keys (``park``, no task), a ``queue_pop`` continues in a task
(``BLOCKING``); a ``join`` waits for its round (``start_join``), a ``barrier`` for its
other callers (``start_barrier``). Handlers raise
``ArendezError`` s, sent back as the request's error.
"""

from __future__ import annotations

import functools
import math
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from arendez.errors import LimitError, RendezvousError, StoreError
from arendez.store_wire import MAX_KEYS, MAX_REASON, OPS

from . import barriers
from .barriers import BarrierCall
from .joins import JoinWait, check_neighbours
from .rounds import Lease, Member
from .state import Job
from .waits import KeyWait

if TYPE_CHECKING:
    from .app import Server
    from .connection import Session

#: Seconds an elastic round with at least its minimum of ranks waits for more (each arrival
#: restarts it) unless the joiners ask for another value.
ELASTIC_SETTLE = 0.25
#: The longest a blocking request may wait.
MAX_WAIT = 7 * 24 * 3600.0
#: Longest machine tag a joiner may name (``arendez.shm.host_key`` is about 60 characters).
MACHINE_MAX = 256
#: A handler's "cannot answer yet": the request continues in a task.
BLOCK: Any = object()


Handler = Callable[["Server", "Session", Job, Any], Any]


def _set(server: Server, s: Session, job: Job, h: dict[str, Any]) -> None:
    key = h.get("key", "")
    job.set(key, h.get("value"))
    server.waits.changed(s.job, key)


def _add(server: Server, s: Session, job: Job, h: dict[str, Any]) -> int:
    key = h.get("key", "")
    total = job.add(key, h.get("amount", 1))
    server.waits.changed(s.job, key)
    return total


def _compare_set(server: Server, s: Session, job: Job, h: dict[str, Any]) -> bytes:
    key = h.get("key", "")
    value = job.compare_set(key, h.get("expected", b""), h.get("desired"))
    server.waits.changed(s.job, key)
    return value


def _append(server: Server, s: Session, job: Job, h: dict[str, Any]) -> None:
    key = h.get("key", "")
    job.append(key, h.get("value"))
    server.waits.changed(s.job, key)


def _delete(server: Server, s: Session, job: Job, h: dict[str, Any]) -> bool:
    return job.delete(h.get("key"))


def _num_keys(server: Server, s: Session, job: Job, h: dict[str, Any]) -> int:
    return len(job.kv)


def _list_keys(server: Server, s: Session, job: Job, h: dict[str, Any]) -> list[str]:
    return job.keys()


def _queue_push(server: Server, s: Session, job: Job, h: dict[str, Any]) -> None:
    key = h.get("key", "")
    job.queue_push(key, h.get("value"))
    server.waits.changed(s.job, key)


def _queue_len(server: Server, s: Session, job: Job, h: dict[str, Any]) -> int:
    return job.queue_len(h.get("key", ""))


def _queue_pop_now(server: Server, s: Session, job: Job, h: dict[str, Any]) -> Any:
    key = h.get("key", "")
    if not h.get("block", True):
        return job.queue_pop_now(key)
    item = job.queue_pop(key)
    return BLOCK if item is None else item


async def _queue_pop(server: Server, s: Session, job: Job, h: dict[str, Any]) -> bytes:
    key, timeout = h.get("key", ""), h.get("timeout")
    deadline = _deadline(timeout)
    job.queue_len(key)  # checks the key
    what = _timed_out(f"queue_pop({key!r:.80})", timeout)
    while True:  # (another popper may take the value that woke this one)
        await server.waits.until(s.job, key, lambda: key in job.queues, deadline, what)
        item = job.queue_pop(key)
        if item is not None:
            return item


def _check(server: Server, s: Session, job: Job, h: dict[str, Any]) -> bool:
    return job.has_all(_keys(h))


def _get_now(server: Server, s: Session, job: Job, h: dict[str, Any]) -> Any:
    value = job.get(h.get("key"))
    return BLOCK if value is None else value


def _wait_now(server: Server, s: Session, job: Job, h: dict[str, Any]) -> Any:
    return None if job.has_all(_keys(h)) else BLOCK


def _barrier_later(server: Server, s: Session, job: Job, h: Any) -> Any:
    return BLOCK  # (the arrival is counted by ``start_barrier``, once the request may wait)


def start_barrier(server: Server, s: Session, job: Job, rid: Any, h: dict[str, Any], compact: bool) -> None:
    """``TCPStore.barrier``: count this arrival on the key's counter; answered now if that
    reaches the request's count, else when the barrier passes (``barriers``) or at the deadline."""
    key, count, timeout = h.get("key", ""), h.get("count"), h.get("timeout")
    if not isinstance(count, int) or isinstance(count, bool) or not -(2**63) <= count < 2**63:
        raise StoreError(f"barrier count must be a 64-bit integer, got {count!r:.40}")
    deadline = _deadline(timeout)
    job.get(key)  # checks the key (before it names a barrier)
    found = barriers.barrier(server, s.job, key)
    if found.arrive(job, count):
        if compact:
            s.reply_value(rid, None)
        else:
            s.reply(rid, None)
        return
    what = _timed_out(f"barrier({key!r:.80}, {count})", timeout)
    BarrierCall(s, rid, compact, found, deadline, what)


def _lease(server: Server, s: Session, job: Job | None, h: dict[str, Any]) -> None:
    """Make this connection the keeper of the client process's lease ``key``."""
    now = time.monotonic()
    server.keepers.keep(s, server.state.lease(h.get("key"), now), now)


def _heartbeat(server: Server, s: Session, job: Job | None, h: dict[str, Any]) -> None:
    now = time.monotonic()
    server.keepers.heard(now)
    if s.lease is not None:
        s.lease.renew(now)
    if s.round is not None and s.rank is not None and job is not None:
        job.heartbeat(s.round, s.rank, now)


def _lease_end(server: Server, s: Session, job: Job | None, h: dict[str, Any]) -> None:
    """The client process ended its lease in order (every rank of it released it after its
    leave): its members still active here left, even if their leaves never arrived."""
    lease = server.keepers.let_go(s)
    if lease is not None:
        server.depart(server.state.end_lease(lease))


def _lease_of(server: Server, h: dict[str, Any]) -> Lease | None:
    key = h.get("lease")
    return None if key is None else server.state.lease(key, time.monotonic())


def _attach(server: Server, s: Session, job: Job, h: dict[str, Any]) -> None:
    rank, world_size = h.get("rank"), h.get("world_size")
    nonce, address = h.get("nonce"), h.get("address", "")
    if not isinstance(rank, int) or not isinstance(world_size, int) or not isinstance(nonce, bytes):
        raise RendezvousError("attach needs an integer rank, world_size and a nonce")
    round_ = job.attach(rank, world_size, nonce, str(address), time.monotonic(), _lease_of(server, h))
    server.members.unbind(s)
    server.members.bind(s, round_, rank)


def _leave(server: Server, s: Session, job: Job, h: dict[str, Any]) -> None:
    failed = h.get("failed")
    if failed is not None and (type(failed) is not str or len(failed) > MAX_REASON):
        raise RendezvousError(f"leave: failed must be a reason of at most {MAX_REASON} characters")
    if s.round is None or s.rank is None:
        return
    gone = job.leave(s.round, s.rank, failed)
    server.members.unbind(s)
    s.rank = s.round = None
    if gone is not None:
        server.members.depart([gone])


def _status(server: Server, s: Session, job: Job, h: dict[str, Any]) -> dict[str, Any]:
    round_ = s.round
    if round_ is None:
        return {"world_size": 0, "members": {}}
    return {
        "world_size": round_.world_size,
        "members": {m.rank: m.state.value for m in round_.members.values()},
    }


def _addresses(server: Server, s: Session, job: Job, h: dict[str, Any]) -> dict[int, str]:
    """The addresses of the given ranks of this connection's round (fetched as needed)."""
    round_ = s.round
    if round_ is None or not round_.complete:
        raise RendezvousError("addresses: this connection is not a member of a complete round")
    return round_.addresses(h.get("ranks"))


def _keys(h: dict[str, Any]) -> list[str]:
    return _key_list(h.get("keys"))


def _key_list(keys: Any) -> list[str]:
    if not isinstance(keys, list):
        raise StoreError(f"keys must be a list of strings, got {type(keys).__name__}")
    if len(keys) > MAX_KEYS:
        raise LimitError(
            f"a request names {len(keys)} keys, over the server's limit of {MAX_KEYS} keys per "
            "request (arendez clients split longer lists)"
        )
    return keys


def _deadline(timeout: Any) -> float:
    if timeout is None:
        timeout = MAX_WAIT
    if not isinstance(timeout, (int, float)) or not math.isfinite(timeout) or timeout < 0:
        raise StoreError(f"timeout must be a non-negative number, got {timeout!r:.40}")
    return time.monotonic() + min(float(timeout), MAX_WAIT)


def _timed_out(what: str, timeout: Any) -> str:
    return f"{what} timed out: not satisfied within {timeout if timeout is not None else MAX_WAIT:g}s"


def park(server: Server, s: Session, job: Job, rid: Any, h: dict[str, Any], compact: bool) -> None:
    """A ``get``/``wait``/``multi_get`` whose keys are not all there: answered by the change
    that completes it, or its deadline (``waits.KeyWait``: no task)."""
    op, timeout = h["op"], h.get("timeout")
    deadline = _deadline(timeout)
    has_value: Callable[[str], bool] = job.kv.__contains__
    result: Callable[[], Any]
    if op == "get":
        key = h.get("key", "")
        job.get(key)  # checks the key
        keys, ready, result = [key], has_value, functools.partial(job.get, key)
        what = _timed_out(f"get({key!r:.80})", timeout)
    else:
        keys = _keys(h)
        job.has_all(keys)  # checks the keys
        what = _timed_out(f"{op}({keys!r:.80})", timeout)
        if op == "wait":  # (a non-empty queue counts, as in torch)
            ready, result = job.present, _none
        else:
            ready, result = has_value, functools.partial(job.get_all, keys)
    wait = KeyWait(
        server.waits, s, job, (op, rid, compact), keys, ready, result, deadline, what, server.config.hooks
    )
    wait.wake()


def _none() -> None:
    return None


#: What ``park`` answers: requests that wait for keys without a task.
PARKED = frozenset({"get", "wait", "multi_get"})


def _multi_get_now(server: Server, s: Session, job: Job, h: dict[str, Any]) -> Any:
    values = job.get_all(_keys(h))
    return BLOCK if values is None else values


def _multi_set(server: Server, s: Session, job: Job, h: dict[str, Any]) -> None:
    keys, values = _keys(h), h.get("values")
    if not isinstance(values, list) or len(values) != len(keys):
        raise StoreError(f"multi_set needs as many values as keys ({len(keys)})")
    job.set_all(keys, values)
    for key in keys:
        server.waits.changed(s.job, key)


def start_join(server: Server, s: Session, job: Job, rid: Any, h: dict[str, Any]) -> None:
    """Join the job's round; answered when the round completes (``joins.JoinWait``), or at once
    with an error for a request that cannot join."""
    if s.round is not None:
        raise RendezvousError("this connection already joined the job")
    check_neighbours(h.get("neighbours"))
    machine = h.get("machine", "")
    if not isinstance(machine, str) or len(machine) > MACHINE_MAX:
        raise RendezvousError(f"machine must be a string of at most {MACHINE_MAX} characters")
    machine = sys.intern(machine)  # (one string per machine, however many ranks name it)
    deadline = _deadline(h.get("timeout"))
    member: Member | None = None
    settle = ELASTIC_SETTLE
    if h.get("min_size") is not None:  # elastic: min_size..world_size ranks, assigned at the close
        settle = h.get("settle", ELASTIC_SETTLE)
        if not isinstance(settle, (int, float)) or not 0 <= settle <= 60:
            raise RendezvousError(f"settle must be a number of seconds in 0..60, got {settle!r:.40}")
        round_, member, gone = job.join_elastic(
            h["min_size"],
            h.get("world_size", 0),
            str(h.get("address", "")),
            time.monotonic(),
            _lease_of(server, h),
            came_from=h.get("came_from", -1),
            hint=h.get("hint", -1),
            dead=h.get("dead", ()),
            machine=machine,
        )
        server.members.depart(gone)
        rank = member.rank
    else:
        round_, rank = job.join(
            h.get("rank", -1),
            h.get("world_size", 0),
            str(h.get("address", "")),
            time.monotonic(),
            _lease_of(server, h),
            machine,
        )
    s.round, s.rank = round_, rank
    join = JoinWait(server, s, job, rid, h, round_, rank, member, deadline)
    server.members.wait_for(round_, join)
    if round_.complete:
        server.members.round_closed(round_)
    elif member is not None:
        server.members.elastic_joined(job, round_, float(settle))


HANDLERS: dict[str, Any] = {
    "set": _set,
    "add": _add,
    "compare_set": _compare_set,
    "append": _append,
    "delete": _delete,
    "num_keys": _num_keys,
    "check": _check,
    "get": _get_now,
    "wait": _wait_now,
    "lease": _lease,
    "heartbeat": _heartbeat,
    "lease_end": _lease_end,
    "attach": _attach,
    "leave": _leave,
    "status": _status,
    "addresses": _addresses,
    "multi_get": _multi_get_now,
    "multi_set": _multi_set,
    "list_keys": _list_keys,
    "queue_push": _queue_push,
    "queue_pop": _queue_pop_now,
    "queue_len": _queue_len,
    "barrier": _barrier_later,
}
#: Requests that need no job (the handler gets the session's job if it exists, else None).
JOBLESS = frozenset({"lease", "heartbeat", "lease_end"})
#: Requests that wait in a task when they cannot be answered at once.
BLOCKING: dict[str, Any] = {
    "queue_pop": _queue_pop,
}


# -- the compact form: ``[op, id, *args]`` (arguments checked by number before the handler) ----
def _c_set(server: Server, s: Session, job: Job, r: list[Any]) -> None:
    job.set(r[2], r[3])
    server.waits.changed(s.job, r[2])


def _c_get(server: Server, s: Session, job: Job, r: list[Any]) -> Any:
    value = job.get(r[2])
    return BLOCK if value is None else value


def _c_add(server: Server, s: Session, job: Job, r: list[Any]) -> int:
    total = job.add(r[2], r[3])
    server.waits.changed(s.job, r[2])
    return total


def _c_compare_set(server: Server, s: Session, job: Job, r: list[Any]) -> bytes:
    value = job.compare_set(r[2], r[3], r[4])
    server.waits.changed(s.job, r[2])
    return value


def _c_append(server: Server, s: Session, job: Job, r: list[Any]) -> None:
    job.append(r[2], r[3])
    server.waits.changed(s.job, r[2])


def _c_delete(server: Server, s: Session, job: Job, r: list[Any]) -> bool:
    return job.delete(r[2])


def _c_num_keys(server: Server, s: Session, job: Job, r: list[Any]) -> int:
    return len(job.kv)


def _c_check(server: Server, s: Session, job: Job, r: list[Any]) -> bool:
    return job.has_all(_key_list(r[2]))


def _c_wait(server: Server, s: Session, job: Job, r: list[Any]) -> Any:
    return None if job.has_all(_key_list(r[2])) else BLOCK


def _c_multi_get(server: Server, s: Session, job: Job, r: list[Any]) -> Any:
    values = job.get_all(_key_list(r[2]))
    return BLOCK if values is None else values


def _c_multi_set(server: Server, s: Session, job: Job, r: list[Any]) -> None:
    return _multi_set(server, s, job, {"keys": r[2], "values": r[3]})


def _c_list_keys(server: Server, s: Session, job: Job, r: list[Any]) -> list[str]:
    return job.keys()


def _c_queue_push(server: Server, s: Session, job: Job, r: list[Any]) -> None:
    return _queue_push(server, s, job, {"key": r[2], "value": r[3]})


def _c_queue_pop(server: Server, s: Session, job: Job, r: list[Any]) -> Any:
    return _queue_pop_now(server, s, job, {"key": r[2], "block": r[3]})


def _c_queue_len(server: Server, s: Session, job: Job, r: list[Any]) -> int:
    return job.queue_len(r[2])


#: op -> (handler, the request's length); ``OPS`` names the arguments.
COMPACT: dict[str, tuple[Handler, int]] = {
    op: (handler, 2 + len(OPS[op]))
    for op, handler in {
        "set": _c_set,
        "get": _c_get,
        "add": _c_add,
        "compare_set": _c_compare_set,
        "append": _c_append,
        "delete": _c_delete,
        "num_keys": _c_num_keys,
        "check": _c_check,
        "wait": _c_wait,
        "multi_get": _c_multi_get,
        "multi_set": _c_multi_set,
        "list_keys": _c_list_keys,
        "queue_push": _c_queue_push,
        "queue_pop": _c_queue_pop,
        "queue_len": _c_queue_len,
        "barrier": _barrier_later,
    }.items()
}


def as_map(request: list[Any]) -> dict[str, Any]:
    """The map form of a compact request (what a request that waits continues with)."""
    return dict(zip(("op", "id", *OPS[request[0]]), request, strict=True))
