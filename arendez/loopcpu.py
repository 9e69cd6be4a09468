"""How the blocking callers' loop thread (``arendez.loop``) uses the CPUs: which one it keeps
to, and how long it (or the caller's own loop, for an awaited collective) polls for an answer.

Both are about waking threads. A blocking call hops to the loop thread and back, and its
collective waits for a peer's message; each hand-over wakes a thread, and when that thread's
CPU sits idle a virtual machine pays for waking the virtual CPU: on this project's VM a no-op
hop took 65-80 µs with the two threads free to run anywhere, 11 µs with both on one CPU, and an
8 B all_reduce between two blocking ranks 150 µs with the loop sleeping between messages,
75 µs with it polling.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger("arendez")

#: ``ARENDEZ_SPIN_US``'s default: how long the loop polls for a blocking call's answer.
SPIN_MICROS = 1000
#: After a poll that ran out before the answer came, the next calls do not poll: 1, then twice
#: as many after each further miss, up to this many (a host busier than it looked, a late peer).
MAX_SKIPPED = 256


#: The CPUs a pinned thread could run on before it was pinned (``keep_to_one_cpu``): what it
#: counts on a later init, and what the threads and processes it starts get back.
_home: list[int] | None = None


def usable_cpus() -> list[int]:
    """The CPUs the calling thread may run on (a pinned thread: those it had before)."""
    if _home is not None:
        return list(_home)
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # (no affinity on this platform)
        return list(range(os.cpu_count() or 1))


def release_thread() -> None:
    """Called first in a thread the pinned loop thread may have started (a thread inherits its
    creator's CPUs): run on every CPU the loop thread had, not on its one."""
    if _home is not None:
        _set_cpus(0, _home)


def release_child(pid: int) -> None:
    """The same for a process the pinned loop thread started (before it starts threads)."""
    if _home is not None:
        _set_cpus(pid, _home)


def _set_cpus(who: int, cpus: list[int]) -> bool:
    try:
        os.sched_setaffinity(who, cpus)
        return True
    except (AttributeError, OSError) as exc:  # (no affinity here, or a process that ended)
        log.debug("arendez: CPU affinity of %d unchanged: %s", who, exc)
        return False


def cpu_quota(cgroups: Path = Path("/sys/fs/cgroup"), own: Path = Path("/proc/self/cgroup")) -> float | None:
    """How many CPUs' time the process's cgroup may use (its CFS quota: a container's CPU
    limit, which the affinity mask does not show), or None if unlimited or unknown."""
    try:  # cgroup v2: "<quota> <period>" in the process's own cgroup ("max": no limit)
        where = next(line[3:] for line in own.read_text().splitlines() if line.startswith("0::"))
        for folder in (cgroups / where.lstrip("/"), cgroups):
            path = folder / "cpu.max"
            if path.exists():
                limit, every = path.read_text().split()[:2]
                return None if limit == "max" else int(limit) / int(every)
    except (OSError, ValueError, StopIteration):
        pass
    try:  # cgroup v1 (a container's own hierarchy): quota -1 is no limit
        quota = int((cgroups / "cpu" / "cpu.cfs_quota_us").read_text())
        period = int((cgroups / "cpu" / "cpu.cfs_period_us").read_text())
        return quota / period if quota > 0 and period > 0 else None
    except (OSError, ValueError):
        return None


def cpus_to_spare() -> int:
    """The CPUs the calling thread may keep busy: those it may run on, fewer if the cgroup's
    quota allows less (a rank that polls under a 2-CPU limit on a 64-core host would be
    throttled)."""
    count = len(usable_cpus())
    quota = cpu_quota()
    return max(1, min(count, int(quota))) if quota is not None else count


def keep_to_one_cpu(index: int | None) -> int | None:
    """Keep the calling thread on one of the CPUs it may use, the ``index``-th (cyclically);
    return it (None with one CPU, or where affinity cannot be set). ``None``: give it back all
    it had (``ARENDEZ_PIN_LOOP=0`` on a later init)."""
    global _home
    allowed = usable_cpus()
    if index is None:
        if _home is not None and _set_cpus(0, allowed):
            _home = None
        return None
    if len(allowed) < 2:
        return None
    cpu = allowed[index % len(allowed)]
    if not _set_cpus(0, [cpu]):  # (0: the calling thread alone)
        return None
    _home = allowed
    return cpu


def _spin_micros() -> int:
    raw = os.environ.get("ARENDEZ_SPIN_US", "")
    try:
        return int(raw) if raw else SPIN_MICROS
    except ValueError:
        log.warning("arendez: ARENDEZ_SPIN_US=%r is not an integer; using %d", raw, SPIN_MICROS)
        return SPIN_MICROS


class Spin:
    """How long a loop polls its sockets for the answer of a call that is waited on (a blocking
    caller's, on the loop thread; a collective awaited in the caller's own loop), rather than
    sleep in the kernel: the answer is read as it lands, and the peer's message need not first
    wake this thread's CPU. Only while the host's ranks have a CPU each (a rank that polls
    takes the CPU a rank sharing it needs: at 4 ranks on 2 CPUs a forced poll made an 8 B
    all_reduce 2.6x slower), and backing off after polls that ran out."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._skip = 0  # calls left that do not poll
        self._next_skip = 1
        #: what the poll waits for, each until when (one poll at a time)
        self._waiting: list[tuple[Callable[[], bool], float]] = []
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop of the poll
        self._missed_until = 0.0  # (loop time: a miss before it is part of the last one)

    def configure(self, local_ranks: int, cpus: int) -> float:
        """``ARENDEZ_SPIN_US`` (default 1000 µs) if ``local_ranks`` fit on ``cpus``, else 0."""
        micros = _spin_micros()
        self.seconds = micros / 1e6 if micros > 0 and local_ranks <= cpus else 0.0
        self._skip, self._next_skip = 0, 1
        return self.seconds

    def budget(self) -> float:
        """Seconds the next waited-on call polls (0: none); the caller's side."""
        if not self.seconds:
            return 0.0
        if self._skip > 0:
            self._skip -= 1
            return 0.0
        return self.seconds

    def start(self, done: Callable[[], bool], seconds: float) -> None:
        """Poll until ``done()``, for at most ``seconds``; on the loop's thread. Calls waited on
        at once share one poll, which lasts while one of them is pending and within its time."""
        loop = asyncio.get_running_loop()
        if self._loop is not loop:  # (a poll of a loop that has gone does not hold this one up)
            self._loop, self._waiting, self._missed_until = loop, [], 0.0
        self._waiting.append((done, loop.time() + seconds))
        if len(self._waiting) == 1:
            self._poll(loop)

    def poll_until(self, done: Callable[[], bool]) -> None:
        """``start`` with the next call's ``budget``, if any (a caller on the loop's thread)."""
        seconds = self.budget()
        if seconds:
            self.start(done, seconds)

    def _poll(self, loop: asyncio.AbstractEventLoop) -> None:
        # (one callback kept ready: the loop asks the kernel for events without sleeping)
        now = loop.time()
        pending = []
        answered = ran_out = False
        for done, until in self._waiting:
            if done():
                answered = True
            elif now < until:
                pending.append((done, until))
            else:
                ran_out = True
        self._waiting = pending
        if ran_out and now >= self._missed_until:  # back off (a burst of calls in flight that
            self._skip = self._next_skip  # run out within one budget is one miss)
            self._next_skip = min(2 * self._next_skip, MAX_SKIPPED)
            self._missed_until = now + self.seconds
        elif answered:
            self._next_skip = 1
        if pending:
            loop.call_soon(self._poll, loop)
