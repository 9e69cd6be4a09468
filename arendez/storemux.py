"""Many blocking store clients of one process over a few shared connections.

A process that makes many ``TCPStore`` clients, one per thread (thousands of simulated ranks,
or many jobs' stores in one agent), would otherwise hold a connection and a blocked thread per
client, each operation releasing and re-taking the GIL around a send and a receive: thousands
of threads then convoy on the GIL and the kernel switches between them more than it moves
bytes. ``SharedStoreClient`` has the blocking client's methods, but its requests travel on a
connection of the shared loop thread (``loop.shared``) that up to ``CLIENTS_PER_CONNECTION``
clients share: the caller hands its request to the loop without waiting for it, and blocks on
one lock, without the GIL, until the loop thread hands back the reply. The loop writes the
requests of one turn together and reads many replies per wake-up, so the server sees a few
connections per process rather than one per thread.

A shared connection is cheap to join but costs each call a hand-off to the loop thread and back:
a client that keeps calling (``PROMOTE_AFTER`` calls) opens a connection of its own, a
``BlockingStore``, and uses it from then on, as the process's first clients do. Simulated ranks
that only meet (a handful of calls each) stay on the shared connections; a rank that then works
the store hard gets the direct path. Where no connection can be opened (the process is out of
file descriptors, or the server refuses it by a limit) the client stays on the shared one, and
the process stops trying.

A call's outcome is the blocking client's: the server's error, ``StoreTimeoutError`` when no
answer comes in time, ``StoreConnectionError`` when the connection drops with the request in
flight, and soon for a call made while it is down: that call has the loop thread try to
reconnect at once, and fails if the attempt does (a call after the server is back succeeds).
"""

from __future__ import annotations

import _thread
import collections
import contextlib
import functools
import itertools
import os
import threading
import weakref
from collections.abc import Iterable
from typing import Any

from .blocking_store import LONG_KEY, MAX_UNACKED_BYTES, WAITING_READS, BlockingStore
from .errors import StoreError, StoreTimeoutError, earlier_set_error
from .loop import shared
from .settings import env_int
from .store import Store
from .store_requests import CALL_TIMEOUT
from .store_wire import to_bytes

#: Clients per shared connection: each has at most one request in flight, so a connection
#: holds at most this many waiting ones (the server bounds them per connection).
CLIENTS_PER_CONNECTION = 128
#: How long past a call's own deadline a caller waits for the loop thread before it gives up
#: (the loop answers every request by its deadline; this only guards against a stopped loop).
_LOOP_SLACK = 10.0
#: ``set``s of one client that may wait for their answers at once (then a set waits for all)
_MAX_UNACKED = 256
#: Calls a client makes over a shared connection before it opens one of its own (0: never).
PROMOTE_AFTER = env_int("ARENDEZ_TCPSTORE_PROMOTE_AFTER", 32, minimum=0)
_PROMOTE_CONNECT = 2.0  # (a server slow to accept: the call goes on over the shared connection)
#: At most this many clients of a process get a connection of their own that way: past a few
#: hundred busy threads, connections of their own convoy on the GIL (each call takes it twice)
#: and the shared ones do better.
MAX_PROMOTED = env_int("ARENDEZ_TCPSTORE_MAX_PROMOTED", 240, minimum=0)


class _Connection:
    """One shared ``Store`` and the seats of its clients (counters, so that taking a seat needs
    no lock: ``next`` on an ``itertools.count`` is atomic)."""

    __slots__ = ("gone", "ready", "seats", "store")

    def __init__(self, store: Store) -> None:
        self.store = store
        self.seats = itertools.count()  # seats handed out (past CLIENTS_PER_CONNECTION: full)
        self.gone = itertools.count(1)  # clients that left
        self.ready = threading.Event()  # set once its connect has ended (either way)

    def take_seat(self) -> bool:
        return next(self.seats) < CLIENTS_PER_CONNECTION


class _Pool:
    """The shared connections of this process: per server address and job, the one that new
    clients join until it is full; a full one closes once the last of its clients has left."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.current: dict[tuple[str, int, str], _Connection] = {}

    def attach(self, host: str, port: int, job: str, timeout: float) -> _Connection:
        """A seat on the current connection (a new connection when it is full)."""
        key = (host, port, job)
        conn = self.current.get(key)
        if conn is not None and conn.take_seat():  # the usual case: no lock
            return conn
        with self.lock:
            conn = self.current.get(key)
            if conn is not None and conn.take_seat():
                return conn
            store = Store(host, port, job, timeout=timeout)
            store.fail_while_away = True  # (as torch's TCPStore: a call fails while the server is away)
            conn = _Connection(store)
            conn.take_seat()
            self.current[key] = conn
        try:  # (outside the lock: clients of other connections go on meanwhile)
            shared.call(conn.store.connect, timeout)
        except BaseException:
            with self.lock:
                if self.current.get(key) is conn:
                    del self.current[key]
            raise
        finally:
            conn.ready.set()
        return conn

    def detach(self, conn: _Connection) -> None:
        """One client fewer: the last client of a full connection closes it."""
        if next(conn.gone) < CLIENTS_PER_CONNECTION:
            return
        loop = shared.running_loop()
        if loop is not None:
            store = conn.store
            with contextlib.suppress(RuntimeError):  # (the loop closed meanwhile)
                loop.call_soon_threadsafe(lambda: loop.create_task(store.close()))


_pool = _Pool()
_generation = 0  # bumped in a forked child: the parent's connections did not come along
_promotions = True  # False once opening a connection of a client's own failed in this process
_promoted = itertools.count()  # promotions this process has begun (past MAX_PROMOTED: no more)


def _forget_after_fork() -> None:
    global _pool, _generation, _promotions, _promoted, _wakeups
    _pool = _Pool()
    _wakeups = _Wakeups()  # (its lock may have been held by a thread that did not come along)
    _generation += 1
    _promotions, _promoted = True, itertools.count()


os.register_at_fork(after_in_child=_forget_after_fork)


class _Wakeups:
    """Callers whose answers came, woken one at a time: the loop thread wakes the first, and each
    caller, once it runs again, wakes the next. Woken all at once (hundreds of threads of one
    process), they all waited for the GIL together, each waking every switch interval to try:
    most of the clients' CPU went to that (futex calls and context switches, by ``perf``)."""

    def __init__(self) -> None:
        self._mutex = _thread.allocate_lock()
        self._ready: collections.deque[_Reply] = collections.deque()
        self._running = False  # a woken caller has yet to pass the turn on

    def finished(self, reply: _Reply) -> bool:
        """On the loop thread: ``reply``'s caller may run (now, or after the ones before it);
        False if it left (timed out, interrupted)."""
        with self._mutex:
            if reply.abandoned:  # (its caller timed out and left)
                return False
            if self._running:
                self._ready.append(reply)
                return True
            self._running = True
        reply.lock.release()
        return True

    def pass_on(self) -> None:
        """On a woken caller's thread: wake the next caller waiting for its turn, if any."""
        with self._mutex:
            ready = self._ready
            while ready and ready[0].abandoned:  # (withdraw removes them; kept safe regardless)
                ready.popleft()
            if not ready:
                self._running = False
                return
            nxt = ready.popleft()
        nxt.lock.release()

    def wait(self, reply: _Reply, limit: float) -> bool:
        """On a caller's thread: block until ``reply``'s turn (then pass it on), at most
        ``limit`` seconds; False if it did not come (the caller withdrew)."""
        try:
            woken = reply.lock.acquire(timeout=limit)
        except BaseException:  # (interrupted while waiting)
            if self.withdraw(reply):
                self.pass_on()
            raise
        if woken or self.withdraw(reply):
            self.pass_on()
            return True
        return False

    def withdraw(self, reply: _Reply) -> bool:
        """A caller that gave up waiting: True if its turn came meanwhile (pass it on)."""
        with self._mutex:
            with contextlib.suppress(ValueError):
                self._ready.remove(reply)
            reply.abandoned = True
        return reply.lock.acquire(blocking=False)


_wakeups = _Wakeups()


class _Reply:
    """The answer one caller waits for: a pre-acquired lock released when its turn comes."""

    __slots__ = ("abandoned", "answered", "error", "lock", "value")

    def __init__(self) -> None:
        self.lock = _thread.allocate_lock()
        self.lock.acquire()
        self.value: Any = None
        self.error: BaseException | None = None
        self.abandoned = False
        self.answered = False  # (on the loop thread: a second answer is ignored)

    def finish(self, value: Any, error: BaseException | None) -> bool:
        """On the loop thread: the answer (the first one; False if it came too late)."""
        if self.answered:
            return False
        self.answered = True
        self.value, self.error = value, error
        return _wakeups.finished(self)


def _release(conn: _Connection, generation: int) -> None:
    if generation == _generation:
        _pool.detach(conn)


class SharedStoreClient:
    """``BlockingStore``'s operations over a shared connection of this process."""

    def __init__(self, host: str, port: int, job: str = "", *, timeout: float = 300.0) -> None:
        self.host, self.port, self.job, self.timeout = host, port, job, timeout
        self._conn: _Connection | None = None
        self._generation = -1
        self._finalizer: weakref.finalize[Any, Any] | None = None
        self._calls = 0  # over the shared connection
        self._direct: BlockingStore | None = None  # the client's own connection, once it has one
        self._promotion_tried = False
        # ``set``s handed to the loop thread whose answers have not come (counted under the
        # mutex: the loop thread takes them off), and the first error one of them got
        self._mutex = _thread.allocate_lock()
        self._unacked = 0
        self._set_error: StoreError | None = None
        #: the answer a call that only waits for keys (``WAITING_READS``) is waiting for: a
        #: refused ``set`` is raised through it at once (its key may never come)
        self._reading: _Reply | None = None

    def connect(self, timeout: float | None = None) -> SharedStoreClient:
        """Attach to a shared connection (opening one, retrying until the store's timeout, if
        needed; ``timeout`` is for ``BlockingStore``'s signature: the shared one has its own)."""
        self._ensure()
        return self

    def _ensure(self) -> _Connection:
        conn = self._conn
        if conn is not None and self._generation == _generation:
            return conn
        self._direct, self._calls = None, 0  # (a forked child's copy of the parent's: forget it)
        conn = _pool.attach(self.host, self.port, self.job, self.timeout)
        if not conn.ready.is_set() and not conn.ready.wait(self.timeout):
            raise StoreError(f"the store at {self.host}:{self.port} did not answer within {self.timeout:g}s")
        if conn.store._fatal is not None or conn.store._closed:  # (its connect failed)
            _pool.detach(conn)
            raise StoreError(f"could not reach the store at {self.host}:{self.port}")
        link = conn.store._conn
        if link is None or not link.is_open:  # the server went away: wait for it, as torch's
            try:  # constructor does (QA20: it returned at once, and the first call failed)
                shared.call(conn.store.reconnected, self.timeout)
            except BaseException:
                _pool.detach(conn)
                raise
        self._conn, self._generation = conn, _generation
        self._finalizer = weakref.finalize(self, _release, conn, _generation)
        return conn

    def close(self) -> None:
        """Leave the shared connection, and close the client's own (a later call attaches again)."""
        self._leave_shared()
        direct, self._direct, self._calls = self._direct, None, 0
        if direct is not None and self._generation == _generation:
            direct.close()

    def _leave_shared(self) -> None:
        finalizer, self._finalizer, self._conn = self._finalizer, None, None
        if finalizer is not None:
            finalizer()

    def _promote(self) -> BlockingStore | None:
        """Open a connection of this client's own and leave the shared one (None if it cannot:
        then the process stops trying)."""
        global _promotions
        if next(_promoted) >= MAX_PROMOTED:
            _promotions = False
            return None
        direct = BlockingStore(
            self.host, self.port, self.job, timeout=self.timeout, connect_timeout=_PROMOTE_CONNECT
        )
        try:
            direct.connect()
        except StoreError:  # (out of descriptors, a connection limit, the server away)
            _promotions = False
            return None
        self._leave_shared()
        self._direct = direct
        return direct

    def _call(self, op: str, timeout: float | None, wait: bool, *args: Any) -> Any:
        direct = self._direct
        if direct is not None and self._generation == _generation:
            return getattr(direct, op)(*args, timeout)
        if self._set_error is not None:
            self._raise_set_error()
        self._calls += 1
        # (with a set still on the shared connection, a call on its own would overtake it: this
        # call waits on the shared one, and the set's answer comes before its own)
        if self._calls >= PROMOTE_AFTER and self._promotion_due() and self._unacked == 0:
            self._promotion_tried = True
            direct = self._promote()
            if direct is not None:
                return getattr(direct, op)(*args, timeout)
        store = self._ensure().store
        budget = self.timeout if timeout is None else float(timeout)
        reply = _Reply()
        if op in WAITING_READS:
            with self._mutex:  # (a refusal that came since the check above is raised now)
                if self._set_error is not None:
                    error, self._set_error = self._set_error, None
                    raise error
                if self._unacked:
                    self._reading = reply
        loop = shared.loop()
        loop.call_soon_threadsafe(store.ask_soon, op, budget, wait, args, reply.finish)
        limit = (budget if wait else min(budget, CALL_TIMEOUT)) + _LOOP_SLACK
        try:
            woken = _wakeups.wait(reply, limit)
        finally:
            self._reading = None
        if not woken:
            raise StoreTimeoutError(
                f"store {op} got no answer within {limit:g}s (is the arendez loop thread stuck?)"
            )
        if reply.error is not None:
            raise reply.error
        return reply.value

    # -- operations (as ``BlockingStore``'s) ---------------------------------------------------
    def set(self, key: str, value: str | bytes, timeout: float | None = None) -> None:
        """Store ``value`` under ``key``. Returns once written to the connection, as torch's
        ``set`` waits for no answer; an error in the answer is raised by this client's first call
        that starts after the answer came.
        (Later calls go the same way, in order, so they see the value.)"""
        value = value if type(value) is bytes else to_bytes(value)
        direct = self._direct
        if direct is not None and self._generation == _generation:
            direct.set(key, value, timeout)
            return
        if self._set_error is not None:
            self._raise_set_error()
        if (
            self._unacked >= _MAX_UNACKED  # (its answer comes after theirs: it waits for all)
            or len(value) > MAX_UNACKED_BYTES  # (a value past the size limit: raised now)
            or len(key) > LONG_KEY  # (a key the server may refuse: raised now)
            or (self._calls + 1 >= PROMOTE_AFTER and self._promotion_due())
        ):
            self._call("set", timeout, False, key, value)
            return
        self._calls += 1
        store = self._ensure().store
        budget = self.timeout if timeout is None else float(timeout)
        with self._mutex:
            self._unacked += 1
        # it returns once its request is written: then its bytes are the kernel's, so a process
        # that exits at once (``os._exit``, a kill) does not lose it, as with torch's ``set``
        # (QA20: 10 of 10 lost); ``done`` releases it instead if it ended first (the server away)
        sent = _Reply()
        done = functools.partial(self._set_done, key, sent)
        written = functools.partial(sent.finish, None, None)
        shared.loop().call_soon_threadsafe(store.ask_soon, "set", budget, False, (key, value), done, written)
        _wakeups.wait(sent, budget + _LOOP_SLACK)

    def _promotion_due(self) -> bool:
        """A promotion may be tried (once the calls reach ``PROMOTE_AFTER``)."""
        return not self._promotion_tried and _promotions and self._generation == _generation

    def _set_done(self, key: str, sent: _Reply, value: Any, error: BaseException | None) -> None:
        with self._mutex:
            self._unacked -= 1
            if error is not None and self._set_error is None:
                refused = earlier_set_error(key, error)
                reading = self._reading
                if reading is None or not reading.finish(None, refused):
                    self._set_error = refused
        sent.finish(None, None)  # (ended before it was written: the connection was down)

    def _raise_set_error(self) -> None:
        with self._mutex:
            error, self._set_error = self._set_error, None
        if error is not None:
            raise error

    def get(self, key: str, timeout: float | None = None) -> bytes:
        """The value of ``key``, waiting up to ``timeout`` for it to be set."""
        value: bytes = self._call("get", timeout, True, key)
        return value

    def add(self, key: str, amount: int = 1, timeout: float | None = None) -> int:
        """Atomically add ``amount`` to the integer at ``key`` (missing = 0); return the sum."""
        total: int = self._call("add", timeout, False, key, int(amount))
        return total

    def compare_set(
        self, key: str, expected: str | bytes, desired: str | bytes, timeout: float | None = None
    ) -> bytes:
        """Set ``desired`` if ``key`` holds ``expected`` (or is missing and ``expected`` is
        empty); return the value the key holds afterwards."""
        value: bytes = self._call("compare_set", timeout, False, key, to_bytes(expected), to_bytes(desired))
        return value

    def wait(self, keys: Iterable[str], timeout: float | None = None) -> None:
        """Wait until every key in ``keys`` is set; ``StoreTimeoutError`` after ``timeout``."""
        self._call("wait", timeout, True, list(keys))

    def check(self, keys: Iterable[str], timeout: float | None = None) -> bool:
        """True if every key in ``keys`` is set (no waiting)."""
        found: bool = self._call("check", timeout, False, list(keys))
        return found

    def delete(self, key: str, timeout: float | None = None) -> bool:
        """Delete ``key``; True if it existed."""
        existed: bool = self._call("delete", timeout, False, key)
        return existed

    def num_keys(self, timeout: float | None = None) -> int:
        """How many keys the job's store holds."""
        count: int = self._call("num_keys", timeout, False)
        return count

    def barrier(self, key: str, count: int, timeout: float | None = None) -> None:
        """Count this caller at ``key``; return once the counter there reaches ``count``."""
        self._call("barrier", timeout, True, key, int(count))

    def multi_get(self, keys: Iterable[str], timeout: float | None = None) -> list[bytes]:
        """The values of ``keys``, in order, waiting up to ``timeout`` for any not yet set."""
        values: list[bytes] = self._call("multi_get", timeout, True, list(keys))
        return values

    def multi_set(
        self, keys: Iterable[str], values: Iterable[str | bytes], timeout: float | None = None
    ) -> None:
        """Set each of ``keys`` to the value at its position in ``values``, in one request."""
        keys, data = list(keys), [to_bytes(v) for v in values]
        if len(keys) != len(data):
            raise ValueError(f"multi_set got {len(keys)} keys but {len(data)} values")
        self._call("multi_set", timeout, False, keys, data)

    def list_keys(self, timeout: float | None = None) -> list[str]:
        """Every key of the job's store that holds a value (queues are not listed)."""
        keys: list[str] = self._call("list_keys", timeout, False)
        return keys

    def append(self, key: str, value: str | bytes, timeout: float | None = None) -> None:
        """Append ``value`` to the bytes at ``key`` (created if missing), atomically."""
        self._call("append", timeout, False, key, to_bytes(value))

    def queue_push(self, key: str, value: str | bytes, timeout: float | None = None) -> None:
        """Append ``value`` to the queue ``key``."""
        self._call("queue_push", timeout, False, key, to_bytes(value))

    def queue_pop(self, key: str, block: bool = True, timeout: float | None = None) -> bytes:
        """The oldest value of the queue ``key``, removed (see ``BlockingStore.queue_pop``)."""
        value: bytes = self._call("queue_pop", timeout, True, key, bool(block))
        return value

    def queue_len(self, key: str, timeout: float | None = None) -> int:
        """How many values the queue ``key`` holds."""
        count: int = self._call("queue_len", timeout, False, key)
        return count


__all__ = ["CLIENTS_PER_CONNECTION", "PROMOTE_AFTER", "SharedStoreClient"]
