"""The arendez error hierarchy: everything raised on purpose is an ``ArendezError``."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any


class ArendezError(RuntimeError):
    """Base of every error arendez raises on purpose."""

    _init_args: tuple[Any, ...] | None = None  # set by subclasses whose __init__ takes others

    def __reduce__(self) -> Any:
        """Pickle with the constructor's own arguments (``multiprocessing``, ``concurrent.futures``
        and torch's elastic agent carry errors between processes)."""
        if self._init_args is None:
            return super().__reduce__()
        return (self.__class__, self._init_args, {**self.__dict__, "args": self.args})


class InvalidArgumentError(ArendezError, ValueError):
    """A call's arguments are wrong (sizes, dtypes, ranks, ops): a ``ValueError``, and a
    ``RuntimeError`` as torch's backends raise for the same mistakes."""


class ProtocolError(ArendezError):
    """A peer or server sent bytes that break the wire protocol."""


class StoreError(ArendezError):
    """A key-value store operation failed (server unreachable, deadline passed, bad request)."""


class StoreTimeoutError(StoreError, TimeoutError):
    """A store ``get``/``wait`` did not see its keys before the deadline."""


class NetworkError(ArendezError):
    """A connection failed: the store could not be reached or was lost, or a peer rank was lost
    (torch's ``DistNetworkError``)."""


class StoreConnectionError(StoreError, NetworkError):
    """The store server could not be reached, or the connection to it was lost mid-call."""


class StoreConnectTimeoutError(StoreConnectionError, StoreTimeoutError):
    """The store server could not be reached before the deadline (it was retried until then)."""


class QueueEmptyError(StoreError):
    """``queue_pop(key, block=False)`` found the queue empty (torch's ``QueueEmptyError``)."""


class RendezvousError(ArendezError):
    """Joining a job failed: bad URL, full job, inconsistent world size, deadline passed."""

    #: ranks of the round just formed that could not be reached (they died or stopped
    #: meanwhile; those that failed first, then those that left); empty for other causes
    unreachable: tuple[int, ...] = ()
    #: the rank whose loss failed the join (the first of ``unreachable``), or None
    rank: int | None = None


class HostingError(RendezvousError, NetworkError):
    """This process could not host the store on its port (in use, or not an address of this
    host): a ``NetworkError`` as torch's ``DistNetworkError`` for a master ``TCPStore``."""


class ListenSocketError(StoreError, ValueError):
    """A master ``TCPStore``'s ``master_listen_fd`` is no listening TCP socket on its port: a
    ``StoreError`` as torch's ``DistStoreError`` for it, and a ``ValueError``."""


class AlreadyInitializedError(RendezvousError, ValueError):
    """``init_process_group`` while the default group is up, or forming (a ``ValueError``, as
    torch's)."""


class AuthenticationError(ArendezError):
    """The other side did not prove it knows the job's token (or we could not)."""


class LimitError(StoreError):
    """A listener (the server, or a rank's peer listener) refused a connection or request because
    one of its limits was reached; the message names the limit and its setting. A ``StoreError``
    so that code catching store failures sees the server's refusals; retrying later may succeed."""


class NotInitializedError(ArendezError, ValueError):
    """A collective was called with no process group initialized (a ``ValueError``, as torch's)."""


class GroupDestroyedError(ArendezError):
    """The group was destroyed (or is being destroyed) while the collective was pending."""


class CollectiveMismatchError(ArendezError):
    """Ranks started different collectives (op, dtype or count) at the same sequence number."""


class ObjectSerializationError(ArendezError, TypeError):
    """A rank's object in an object collective (or ``send_object_list``) could not be encoded
    (``objcodec``: never pickle). Raised on every rank the collective reaches, so none waits for
    bytes that never come; ``rank`` is the (global) rank whose object it was."""

    def __init__(self, rank: int, collective: str, reason: str) -> None:
        self._init_args = (rank, collective, reason)
        self.rank = rank
        self.collective = collective
        self.reason = reason
        super().__init__(f"{collective}: rank {rank} could not encode its object ({reason})")


class CollectiveCancelledError(ArendezError):
    """Another rank cancelled the collective (its task was cancelled), or it outlived that
    rank's deadline (``why``: "timed out after 3s in"): it ended on every rank.

    ``rank`` is the (global) rank that cancelled, ``collective`` its name, ``seq`` the group's
    sequence number of it. The group stays usable: the next collectives match as before.
    """

    def __init__(self, rank: int, collective: str, seq: int = -1, why: str = "cancelled") -> None:
        self._init_args = (rank, collective, seq, why)
        self.rank = rank
        self.collective = collective
        self.seq = seq
        where = f" (seq {seq})" if seq >= 0 else ""
        super().__init__(f"rank {rank} {why} {collective}{where}")


class RankFailedError(NetworkError):
    """A rank the collective depends on died, left or lost its connection."""

    #: later failures the message tells with their reasons (the rest are counted)
    TOLD = 8

    def __init__(self, rank: int, collective: str, reason: str) -> None:
        self._init_args = (rank, collective, reason)
        self.rank = rank
        self.collective = collective
        self.reason = reason
        self.also: list[tuple[int, str]] = []  # later failures seen before this was raised
        self._named: set[int] = set()
        super().__init__(f"rank {rank} failed during {collective}: {reason}")

    @classmethod
    def naming(cls, collective: str, failures: Sequence[tuple[int, str]]) -> RankFailedError:
        """The error of ``collective`` naming ``failures`` (rank, reason; at least one), the
        first failure first."""
        (rank, reason), *later = failures
        exc = cls(rank, collective, reason)
        for other, why in later:
            exc.add(other, why)
        return exc

    @property
    def ranks(self) -> list[int]:
        """Every failed rank this error names, the first failure first."""
        return [self.rank, *(r for r, _ in self.also)]

    def during(self, collective: str) -> RankFailedError:
        """The same failure, told of ``collective`` (a call built of smaller steps names the
        call, not its step)."""
        told = RankFailedError(self.rank, collective, self.reason)
        for rank, reason in self.also:
            told.add(rank, reason)
        return told

    def add(self, rank: int, reason: str) -> None:
        """Name one more failed rank (after the first), e.g. the messenger that died later.
        The message tells the first ``TOLD`` of them with their reasons and counts the rest
        (a failure at scale); ``ranks`` has them all."""
        if rank == self.rank or rank in self._named:
            return
        self._named.add(rank)
        self.also.append((rank, reason))
        later = "; ".join(f"rank {r}: {why}" for r, why in self.also[: self.TOLD])
        more = len(self.also) - self.TOLD
        if more > 0:  # (O(1) per rank added: a failure at scale adds thousands)
            shown = ", ".join(str(r) for r, _ in self.also[self.TOLD : self.TOLD + 16])
            later += f"; and {more} more rank(s): {shown}{', ...' if more > 16 else ''} (all in .ranks)"
        self.args = (f"rank {self.rank} failed during {self.collective}: {self.reason}; then {later}",)


class WaitTimeoutError(ArendezError, TimeoutError):
    """``Work.wait(timeout)`` returned before the call finished. The call goes on (as with
    torch's gloo): wait again for its result; destroying the group ends it."""

    def __init__(self, what: str, timeout: float) -> None:
        self._init_args = (what, timeout)
        self.timeout = timeout
        super().__init__(
            f"{what} did not finish within {timeout:g}s; it goes on (wait again for its result, "
            "or destroy the group to end it)"
        )


class CallCancelledError(ArendezError):
    """A blocking call's coroutine was cancelled on the loop thread (the process is shutting
    down, or the loop was stopped) before it finished."""


class RendezvousTimeoutError(RendezvousError, StoreTimeoutError):
    """A rendezvous round did not fill before the deadline (etcd backend): a ``RendezvousError``
    as the arendez server's, and the ``StoreTimeoutError`` it was before."""


class CollectiveTimeoutError(ArendezError, TimeoutError):
    """A collective did not finish before its deadline; names the ranks that never arrived."""

    def __init__(
        self,
        collective: str,
        timeout: float,
        missing: Iterable[int] = (),
        unresponsive: Iterable[int] = (),
    ) -> None:
        self._init_args = (collective, timeout, list(missing), list(unresponsive))
        self.collective = collective
        self.timeout = timeout
        self.missing = sorted(self._init_args[2])
        self.unresponsive = sorted(self._init_args[3])
        parts = [f"{collective} timed out after {timeout:.3g}s"]
        if self.missing:
            parts.append(f"ranks that never arrived: {self.missing}")
        if self.unresponsive:
            parts.append(f"ranks that did not answer: {self.unresponsive}")
        if not self.missing and not self.unresponsive:
            parts.append(
                "every rank had started it (a slow peer or network, or ranks that disagree on "
                "its root or sizes so that no data showed the mismatch)"
            )
        super().__init__("; ".join(parts))


def received_from(call: Any) -> int:
    """``Work.source_rank()`` of either API's work (``call``: a finished receive's future, whose
    result is the sender's rank); torch's ``RuntimeError`` words otherwise."""
    if not call.done():
        raise ArendezError("source_rank() of an irecv that has not finished")
    source = call.result()
    if type(source) is not int:
        raise ArendezError(
            "source_rank() may only be called on work objects that correspond to a recv or recv-from-any call"
        )
    return source


__all__ = [
    "AlreadyInitializedError",
    "ArendezError",
    "AuthenticationError",
    "CallCancelledError",
    "CollectiveCancelledError",
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "GroupDestroyedError",
    "HostingError",
    "InvalidArgumentError",
    "LimitError",
    "ListenSocketError",
    "NetworkError",
    "NotInitializedError",
    "ObjectSerializationError",
    "ProtocolError",
    "QueueEmptyError",
    "RankFailedError",
    "RendezvousError",
    "RendezvousTimeoutError",
    "StoreConnectTimeoutError",
    "StoreConnectionError",
    "StoreError",
    "StoreTimeoutError",
    "WaitTimeoutError",
]


def earlier_set_error(key: str, error: BaseException) -> StoreError:
    """What a store client's later call raises for a ``set`` it sent without waiting and the
    server refused: the refusal's own class (``LimitError``, say), its message naming the key."""
    cls = type(error) if isinstance(error, StoreError) else StoreError
    message = f"an earlier set of {key!r:.80} failed: {error}"
    try:
        return cls(message)
    except TypeError:  # (a class that takes other arguments)
        return StoreError(message)
