"""The flight recorder: every rank keeps its last N collectives and dumps them as JSON.

What an operator reads first when a job hangs (torch's NCCL flight recorder is the model). Each
world has a ``Recorder``: a ring of the last ``ARENDEZ_FLIGHT_RECORDER`` collectives (default
1000; 0 turns it off), one ``Entry`` per collective with its group, sequence number and
fingerprint (op, dtype, count), the algorithm it ran, its state and times. What is costly to
know (which peers it heard from, which it still waits on, bytes and dtype) is worked out only
when a dump is taken, from what the op and the mailbox hold; the hot path is one small object
(five fields set), three clock reads and a dict store per collective.

A rank dumps (one JSON file per rank, ``arendez-flightrec-<job>-rank<R>.json`` in
``ARENDEZ_FLIGHT_RECORDER_DIR``, default the temp dir; a job name arendez made up is replaced by
its kind, ``jobnames.label``; the path is logged at WARNING) when a collective raises
``CollectiveTimeoutError`` or ``RankFailedError``, on ``SIGUSR1`` (the handler is installed only
over the default action, and dumps from the event loop), and on demand
(``dump_flight_recorder``). A dump never masks the error that caused it: its own failure is
logged and dropped. ``python -m arendez.flightrec FILES...`` merges the dumps of a job and says
which collective each rank is stuck on, and whom it waits for.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import re
import signal
import socket
import tempfile
import threading
import time
import weakref
from collections import deque
from collections.abc import Iterable, Sequence
from types import FrameType
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import burstlog, jobnames
from ..errors import CollectiveCancelledError, CollectiveTimeoutError, RankFailedError
from ..settings import env_int

if TYPE_CHECKING:
    from ..group import Op, ProcessGroup
    from ..mailbox import Key, Mailbox
    from ..world import World

log = logging.getLogger("arendez.flightrec")

#: The environment variable with the number of collectives each rank keeps (0: off).
ENV_SIZE = "ARENDEZ_FLIGHT_RECORDER"
#: The environment variable naming the directory dumps go to (default: the temp dir).
ENV_DIR = "ARENDEZ_FLIGHT_RECORDER_DIR"
DEFAULT_SIZE = 1000
MAX_SIZE = 1_000_000
#: Version of the dump's layout (bump the major on a change of meaning).
VERSION = "1.0"
#: An ended collective keeps the keys of its messages up to this many (else only their senders).
KEEP_KEYS = 16
#: Automatic dumps of one rank at most this often; a later one within it is written once after.
AUTO_DUMP_GAP = 1.0

SCHEDULED, STARTED, COMPLETED = "scheduled", "started", "completed"
FAILED, CANCELLED, TIMED_OUT = "failed", "cancelled", "timed out"

__all__ = [
    "ENV_DIR",
    "ENV_SIZE",
    "Entry",
    "Recorder",
    "dump_flight_recorder",
    "flight_recorder",
    "install_signal_handler",
]


class Entry:
    """One collective of one rank. The hot path sets five fields; the rest are copied from the
    op when it ends (until then they are read from it), the failure fields only on failure."""

    __slots__ = (
        "algorithm",
        "ended",
        "enqueued",
        "failure",
        "fp",
        "gid",
        "id",
        "keys",
        "name",
        "op",
        "seq",
        "started",
        "state",
    )

    def __init__(self, record_id: int, op: Op | None, now: int) -> None:
        self.id = record_id
        self.op = op  # while it runs (its live state is read from it)
        self.enqueued = now
        self.started = 0
        self.ended = 0
        # set when it ends: gid, seq, name, fp, state, algorithm, keys; failure: (error,
        # peers not heard from, a timeout's diagnosis) only when it failed
        self.gid: int
        self.seq: int
        self.name: str
        self.fp: str
        self.state: str
        self.algorithm: str
        self.keys: Sequence[tuple[int, ...]]  # its messages' keys (or just their senders)
        self.failure: tuple[str, list[int], dict[str, list[int]]]

    def close(self, gid: int, seq: int, name: str, fp: str, state: str, now: int) -> None:
        self.gid, self.seq, self.name, self.fp, self.state, self.ended = gid, seq, name, fp, state, now
        self.op = None


def _state_of(exc: BaseException) -> str:
    if isinstance(exc, CollectiveTimeoutError):
        return TIMED_OUT
    if isinstance(exc, CollectiveCancelledError):
        return CANCELLED
    return FAILED


def _waiting(mail: Mailbox, keys: Iterable[Key]) -> set[int]:
    """The senders of ``keys`` whose message has not arrived (a receive still posted, or one
    that was failed rather than filled)."""
    out: set[int] = set()
    for key in keys:
        slot = mail.peek(key)
        fut = slot.fut if slot is not None else None
        if fut is not None and (not fut.done() or fut.cancelled() or fut.exception() is not None):
            out.add(key[0])
    return out


@functools.lru_cache(maxsize=256)
def _describe(fp: str) -> dict[str, Any]:
    """dtype, element count and bytes, read back from a collective's fingerprint
    (``name|dtype|count|...``; ``all_to_all`` carries the group size instead of a count)."""
    parts = fp.split("|")
    out: dict[str, Any] = {"dtype": None, "count": None, "bytes": None}
    if len(parts) < 2:
        return out
    try:
        dtype = np.dtype(parts[1])
    except TypeError:
        return out
    out["dtype"] = dtype.name
    if len(parts) > 2 and parts[2].isdigit() and not parts[0].startswith("all_to_all"):
        out["count"] = int(parts[2])
        out["bytes"] = out["count"] * dtype.itemsize
    return out


def _to_json(data: dict[str, Any]) -> str:
    """The dump as JSON, one entry a line (readable, and quick to write)."""
    head = {k: v for k, v in data.items() if k != "entries"}
    lines = ",\n".join(json.dumps(e, separators=(", ", ": ")) for e in data["entries"])
    return json.dumps(head, indent=1)[:-2] + ',\n "entries": [\n' + lines + "\n ]\n}\n"


def _ms(ns: int) -> float:
    return round(ns / 1e6, 3)


class Recorder:
    """The flight recorder of one world (one rank)."""

    def __init__(self, world: World, capacity: int | None = None) -> None:
        size = env_int(ENV_SIZE, DEFAULT_SIZE, minimum=0) if capacity is None else capacity
        if not 0 <= size <= MAX_SIZE:
            raise ValueError(f"{ENV_SIZE} must be between 0 and {MAX_SIZE}, got {size}")
        self.capacity = size
        self.rank = world.rank
        self.world_size = world.world_size
        self._world = weakref.ref(world)
        self._ring: deque[Entry] = deque(maxlen=size or 1)
        self._count = 0
        self.groups: dict[int, Sequence[int]] = {}  # gid -> global ranks (kept after the world ends)
        self.completed: dict[int, int] = {}  # gid -> last seq completed here
        self.job = ""
        self.path: str | None = None  # where the last dump went
        self._last_auto = -AUTO_DUMP_GAP
        self._later: asyncio.TimerHandle | None = None
        try:
            self.loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            self.loop = None
        global _last
        _last = self
        if size:
            _live.add(self)
            if threading.current_thread() is threading.main_thread():
                install_signal_handler()

    # -- the hot path ----------------------------------------------------------------------
    def begin(self, op: Op) -> Entry | None:
        """Record collective ``op`` (None when the recorder is off)."""
        if not self.capacity:
            return None
        self._count += 1
        entry = Entry(self._count, op, time.time_ns())
        self._ring.append(entry)
        return entry

    def refused(self, group: ProcessGroup, name: str, fp: str, exc: RankFailedError) -> None:
        """Collective ``name`` could not start (a member had failed): record it under the
        sequence number it would have had, and dump."""
        if self.capacity:
            self._count += 1
            now = time.time_ns()
            entry = Entry(self._count, None, now)
            entry.close(group.gid, group.next_seq, name, fp, FAILED, now)
            entry.algorithm, entry.keys = "", ()
            entry.failure = (f"{type(exc).__name__}: {exc} (it never started)", [exc.rank], {})
            self._ring.append(entry)
        self.incident(exc)

    def end(self, entry: Entry, op: Op) -> None:
        """``op`` is over: keep what its entry needs, let go of the op. Call before its
        receives are closed (a failed op's missing peers are read from them)."""
        exc = op.error
        entry.close(op.group.gid, op.seq, op.name, op.fp, COMPLETED, time.time_ns())
        entry.algorithm = op.algorithm
        keys = op.keys  # (a large collective's thousands of keys are not kept: their senders)
        entry.keys = keys if len(keys) <= KEEP_KEYS else [(peer,) for peer in {k[0] for k in keys}]
        if exc is None:
            self.completed[entry.gid] = entry.seq
            return
        self._failed(entry, op, exc)

    # -- failures --------------------------------------------------------------------------
    def _failed(self, entry: Entry, op: Op, exc: BaseException) -> None:
        entry.state = _state_of(exc)
        try:  # (whatever goes wrong here, the collective's own error is what propagates)
            why = (
                {"missing": exc.missing, "unresponsive": exc.unresponsive}
                if isinstance(exc, CollectiveTimeoutError)
                else {}
            )
            entry.failure = (f"{type(exc).__name__}: {exc}", sorted(_waiting(op.world.mail, op.keys)), why)
        except Exception as err:
            log.warning("rank %d: flight recorder could not record a failure: %r", self.rank, err)
        if isinstance(exc, CollectiveTimeoutError | RankFailedError):
            self.incident(exc)

    def incident(self, exc: BaseException) -> None:
        """A collective failed in a way an operator should see: dump now (at most once per
        ``AUTO_DUMP_GAP``; one more dump follows a burst). Never raises."""
        if not self.capacity:
            return
        try:
            reason = f"{type(exc).__name__}: {exc}"
            now = time.monotonic()
            if now - self._last_auto >= AUTO_DUMP_GAP:
                self._last_auto = now
                self.dump(reason=reason, burst=True)
            elif self._later is None and self.loop is not None and not self.loop.is_closed():
                wait = AUTO_DUMP_GAP - (now - self._last_auto)
                self._later = self.loop.call_later(wait, self._dump_later, reason)
        except Exception as err:  # the error that got us here is what the caller must see
            log.warning("rank %d: flight recorder dump failed: %r", self.rank, err)

    def _dump_later(self, reason: str) -> None:
        self._later = None
        self._last_auto = time.monotonic()
        try:
            self.dump(reason=f"{reason} (and later failures)", burst=True)
        except Exception as err:
            log.warning("rank %d: flight recorder dump failed: %r", self.rank, err)

    # -- reading ---------------------------------------------------------------------------
    def _entry(self, e: Entry, mail: Mailbox | None, now: int) -> dict[str, Any]:
        op = e.op
        if op is not None:  # still running: its live state
            gid, seq, name, fp, algorithm = op.group.gid, op.seq, op.name, op.fp, op.algorithm
            state, error, why = (STARTED if e.started else SCHEDULED), None, {}
            if op.error is not None:
                state, error = _state_of(op.error), f"{type(op.error).__name__}: {op.error}"
            pending = sorted(_waiting(mail, op.keys)) if mail is not None else []
            keys: Sequence[tuple[int, ...]] = op.keys
        else:
            gid, seq, name, fp, algorithm, state, keys = (
                e.gid,
                e.seq,
                e.name,
                e.fp,
                e.algorithm,
                e.state,
                e.keys,
            )
            error, pending, why = getattr(e, "failure", (None, [], {}))
        heard = sorted({k[0] for k in keys}.difference(pending))
        start = e.started or e.enqueued
        out: dict[str, Any] = {
            "id": e.id,
            "group": gid,
            "seq": seq,
            "op": name,
            "fingerprint": fp,
            **_describe(fp),
            "algorithm": algorithm or None,
            "state": state,
            "peers_done": heard,
            "peers_pending": pending,
            "time_enqueued_ns": e.enqueued,
            "time_started_ns": e.started or None,
            "time_ended_ns": e.ended or None,
            "duration_ms": _ms(e.ended - start) if e.ended else None,
            "waited_ms": None if e.ended else _ms(now - start),
            "error": error,
        }
        out.update(why)
        return out

    def snapshot(self, reason: str = "on demand") -> dict[str, Any]:
        """The dump as a dict (what ``dump`` writes as JSON)."""
        world = self._world()
        now = time.time_ns()
        mail = world.mail if world is not None else None
        if world is not None and world.store is not None:
            self.job = str(getattr(world.store, "job", "") or self.job)
        groups: dict[str, Any] = {}
        for gid, ranks in sorted(self.groups.items()):
            group = world.groups.get(gid) if world is not None else None
            groups[str(gid)] = {
                "ranks": list(ranks),
                "last_completed_seq": self.completed.get(gid, -1),
                "next_seq": group.next_seq if group is not None else None,
                "running": sorted(group.active) if group is not None else [],
            }
        return {
            "version": VERSION,
            "job": self.job or os.environ.get("TORCHELASTIC_RUN_ID") or "local",
            "rank": self.rank,
            "world_size": self.world_size,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "reason": reason,
            "time_ns": now,
            "capacity": self.capacity,
            "recorded": self._count,
            "dead_ranks": {str(r): why for r, why in sorted(world.dead.items())} if world is not None else {},
            "groups": groups,
            "entries": [self._entry(e, mail, now) for e in list(self._ring)] if self.capacity else [],
        }

    def dump(
        self, path: str | os.PathLike[str] | None = None, reason: str = "on demand", *, burst: bool = False
    ) -> str:
        """Write the dump as JSON to ``path`` (default: this rank's file in the dump
        directory) and return where it went; logged at WARNING (with ``burst``, one of many
        ranks' dumps at once: the process's first is logged, the rest summarised)."""
        data = self.snapshot(reason)
        target = os.fspath(path) if path is not None else self.default_path(data["job"])
        folder = os.path.dirname(target) or "."
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".flightrec-", dir=folder)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(_to_json(data))
            os.replace(tmp, target)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        self.path = target
        line = (
            "rank %d: flight recorder dump (%s) written to %s; read it with: python -m arendez.flightrec %s"
        )
        if burst:
            _DUMPS.note(None, logging.WARNING, (self.rank, target), line, self.rank, reason, target, target)
        else:
            log.warning(line, self.rank, reason, target, target)
        return target

    def default_path(self, job: str) -> str:
        folder = os.environ.get(ENV_DIR) or tempfile.gettempdir()
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", jobnames.label(job))[:64] or "local"
        return os.path.join(folder, f"arendez-flightrec-{safe}-rank{self.rank}.json")


def _summarise_dumps(items: Sequence[tuple[int, str]]) -> str:
    folders = sorted({os.path.dirname(path) or "." for _, path in items})
    return (
        f"{len(items)} more flight recorder dump(s) written by rank(s)"
        f" {burstlog.span([rank for rank, _ in items])} of this process, to {', '.join(folders)}"
    )


#: many ranks of a process dumping at once (a failure at scale) log two lines, not one each
_DUMPS = burstlog.BurstLog(log, _summarise_dumps)


# -- the process: SIGUSR1, and the public functions -------------------------------------------
_live: weakref.WeakSet[Recorder] = weakref.WeakSet()  # recorders of this process (on)
_last: Recorder | None = None  # the newest, kept after its world is gone
_installed = False


def _on_signal(signum: int, frame: FrameType | None) -> None:
    """SIGUSR1: each world dumps from its own event loop (never from inside the handler, and
    nothing raised here reaches the code the signal interrupted)."""
    recorders: list[Recorder] = []
    for _ in range(3):  # (another thread adding a recorder changes the set under us: retry)
        with contextlib.suppress(RuntimeError):
            recorders = list(_live)
            break
    for rec in recorders:
        world = rec._world()
        if world is None or world.closed or rec.loop is None:
            continue
        with contextlib.suppress(RuntimeError):  # its loop is closed: nothing to dump from
            rec.loop.call_soon_threadsafe(_dump_quietly, rec, "SIGUSR1")


def _dump_quietly(rec: Recorder, reason: str) -> None:
    try:
        rec.dump(reason=reason, burst=True)
    except Exception as err:
        log.warning("rank %d: flight recorder dump failed: %r", rec.rank, err)


def install_signal_handler() -> bool:
    """Dump on SIGUSR1, if the process has no handler of its own for it (and this is the main
    thread); True if ours is in place."""
    global _installed
    if _installed:
        return True
    if threading.current_thread() is not threading.main_thread():
        return False
    if env_int(ENV_SIZE, DEFAULT_SIZE, minimum=0) == 0:
        return False  # the recorder is off: SIGUSR1 keeps its default action
    try:
        if signal.getsignal(signal.SIGUSR1) is not signal.SIG_DFL:
            return False
        signal.signal(signal.SIGUSR1, _on_signal)
    except (ValueError, OSError):  # pragma: no cover - not the main interpreter
        return False
    _installed = True
    return True


def _recorder() -> Recorder:
    from ..errors import NotInitializedError
    from ..registry import world_or_none

    world = world_or_none()
    if world is not None:
        return world.flight
    if _last is None:
        raise NotInitializedError("no flight recorder: call init_process_group() first")
    return _last


def flight_recorder() -> dict[str, Any]:
    """This rank's flight recorder as a dict: its last collectives (oldest first), their state
    and peers. After ``destroy_process_group`` it is the last world's."""
    return _recorder().snapshot()


def dump_flight_recorder(path: str | os.PathLike[str] | None = None) -> str:
    """Write this rank's flight recorder as JSON (default: ``ARENDEZ_FLIGHT_RECORDER_DIR`` or
    the temp dir, one file per rank) and return the path."""
    return _recorder().dump(path)
