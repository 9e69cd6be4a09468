"""The peer protocol: every frame two ranks exchange, as a frozen dataclass, and its codec.

On the wire a frame's header is the msgpack list ``[kind, *fields]``: ``kind`` names the class
(``Kind``), the fields follow in declaration order, and their number and types are fixed per
kind. ``decode`` checks both, so a header never means something else because of its length,
and a malformed one is a ``ProtocolError`` naming the kind and the field. Payload bytes travel
after the header (``wire``), never inside it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

from .errors import (
    ArendezError,
    AuthenticationError,
    CollectiveMismatchError,
    ProtocolError,
    RankFailedError,
)


class Kind(enum.IntEnum):
    """Frame kinds (their numbers are the protocol: never reuse one)."""

    DATA = 0
    MISMATCH = 1
    BYE = 2
    QUERY = 3
    ANSWER = 4
    P2P = 5
    SHM_HELLO = 6
    SHM_OFFER = 7
    SHM_ANSWER = 8
    SHM_FREE = 9
    SHM_DATA = 10
    ERROR = 11
    CANCEL = 12
    TIMED_OUT = 13


class Frame:
    """Base of the peer frames; ``KIND`` is the tag on the wire."""

    __slots__ = ()
    KIND: ClassVar[Kind]


@dataclass(frozen=True, slots=True)
class Data(Frame):
    """One segment of a collective's message; the payload follows the header."""

    KIND: ClassVar[Kind] = Kind.DATA
    gid: int
    seq: int
    tag: int
    seg: int
    fp: str


@dataclass(frozen=True, slots=True)
class ShmData(Frame):
    """A collective's message that lies in the sender's shared-memory segment at ``offset``."""

    KIND: ClassVar[Kind] = Kind.SHM_DATA
    gid: int
    seq: int
    tag: int
    seg: int
    fp: str
    offset: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class Mismatch(Frame):
    """Collective ``seq`` of group ``gid`` failed: ranks started different collectives."""

    KIND: ClassVar[Kind] = Kind.MISMATCH
    gid: int
    seq: int
    message: str


@dataclass(frozen=True, slots=True)
class Cancel(Frame):
    """The sender cancelled collective ``seq`` of group ``gid`` (named ``collective``): it ends
    on every member, and a member that has not started it yet fails it when it does."""

    KIND: ClassVar[Kind] = Kind.CANCEL
    gid: int
    seq: int
    collective: str


@dataclass(frozen=True, slots=True)
class TimedOut(Frame):
    """Collective ``seq`` of group ``gid`` (named ``collective``) outlived the sender's deadline
    of ``ms`` milliseconds: it ends on every member as a cancelled one does, so a late member
    does not complete it with the parts the sender had already sent."""

    KIND: ClassVar[Kind] = Kind.TIMED_OUT
    gid: int
    seq: int
    collective: str
    ms: int


@dataclass(frozen=True, slots=True)
class Bye(Frame):
    """The sender left (destroyed its process group, or its process ended); ``failed`` are the
    ranks it saw die (itself last if it ended by an exception or a signal); ``started``, by
    group id, how many collectives it had started (those before it has done its part of: a
    receiver's copy of one of them needs nothing more from it)."""

    KIND: ClassVar[Kind] = Kind.BYE
    failed: dict[int, str]
    started: dict[int, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Query(Frame):
    """How many collectives of group ``gid`` has the receiver started? (answer with ``qid``)"""

    KIND: ClassVar[Kind] = Kind.QUERY
    gid: int
    qid: int


@dataclass(frozen=True, slots=True)
class Answer(Frame):
    """The answer to query ``qid``: collectives started (-1: no such group)."""

    KIND: ClassVar[Kind] = Kind.ANSWER
    qid: int
    started: int


@dataclass(frozen=True, slots=True)
class P2P(Frame):
    """A point-to-point message of group ``gid`` with ``tag``; the payload follows."""

    KIND: ClassVar[Kind] = Kind.P2P
    gid: int
    tag: int
    fp: str


@dataclass(frozen=True, slots=True)
class ShmHello(Frame):
    """The sender's host key: a peer with the same key may share memory with it."""

    KIND: ClassVar[Kind] = Kind.SHM_HELLO
    host: str


@dataclass(frozen=True, slots=True)
class ShmOffer(Frame):
    """A segment the sender created for the receiver to map."""

    KIND: ClassVar[Kind] = Kind.SHM_OFFER
    path: str
    size: int
    cookie: bytes


@dataclass(frozen=True, slots=True)
class ShmAnswer(Frame):
    """Whether the receiver mapped the offered segment (and why not)."""

    KIND: ClassVar[Kind] = Kind.SHM_ANSWER
    accepted: bool
    why: str


@dataclass(frozen=True, slots=True)
class ShmFree(Frame):
    """Ranges of the receiver's segment (by offset) the sender has read and gives back."""

    KIND: ClassVar[Kind] = Kind.SHM_FREE
    offsets: list[int]


class ErrorCode(enum.Enum):
    """The errors a peer can report, by a stable name (never a Python class name)."""

    PROTOCOL = "protocol"
    AUTHENTICATION = "authentication"
    MISMATCH = "mismatch"
    FAILED = "failed"
    OTHER = "other"


_ERROR_CLASSES: dict[ErrorCode, type[ArendezError]] = {
    ErrorCode.PROTOCOL: ProtocolError,
    ErrorCode.AUTHENTICATION: AuthenticationError,
    ErrorCode.MISMATCH: CollectiveMismatchError,
    ErrorCode.OTHER: ArendezError,
}


@dataclass(frozen=True, slots=True)
class Error(Frame):
    """The sender is closing the connection because of an error of kind ``code``."""

    KIND: ClassVar[Kind] = Kind.ERROR
    code: str
    message: str

    @classmethod
    def of(cls, exc: BaseException) -> Error:
        """The frame that reports ``exc``."""
        code = ErrorCode.OTHER
        for candidate, klass in _ERROR_CLASSES.items():
            if candidate is not ErrorCode.OTHER and isinstance(exc, klass):
                code = candidate
        if isinstance(exc, RankFailedError):
            code = ErrorCode.FAILED
        return cls(code.value, str(exc))

    def exception(self) -> ArendezError:
        """The error this frame reports, as the class its code names."""
        try:
            code = ErrorCode(self.code)
        except ValueError:
            code = ErrorCode.OTHER
        return _ERROR_CLASSES.get(code, ArendezError)(self.message)


# -- codec -----------------------------------------------------------------------------------
_ATOMS: dict[str, tuple[type, ...]] = {"int": (int,), "str": (str,), "bool": (bool,), "bytes": (bytes,)}


def _check_map(value: Any) -> bool:
    return isinstance(value, dict) and all(
        isinstance(k, int) and isinstance(v, str) for k, v in value.items()
    )


def _check_counts(value: Any) -> bool:
    return isinstance(value, dict) and all(type(k) is int and type(v) is int for k, v in value.items())


def _check_ints(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)


def _checker(annotation: str) -> Any:
    if annotation in _ATOMS:
        types = _ATOMS[annotation]
        if annotation == "int":
            return lambda v: isinstance(v, int) and not isinstance(v, bool)
        return lambda v: isinstance(v, types)
    if annotation == "dict[int, str]":
        return _check_map
    if annotation == "dict[int, int]":
        return _check_counts
    if annotation == "list[int]":
        return _check_ints
    raise TypeError(f"frame field type {annotation!r} has no wire check")


_CLASSES: tuple[type[Frame], ...] = (
    Data,
    ShmData,
    Mismatch,
    Cancel,
    TimedOut,
    Bye,
    Query,
    Answer,
    P2P,
    ShmHello,
    ShmOffer,
    ShmAnswer,
    ShmFree,
    Error,
)
_BY_KIND: dict[int, tuple[type[Frame], tuple[str, ...], tuple[Any, ...]]] = {
    int(cls.KIND): (
        cls,
        tuple(f.name for f in fields(cls)),  # type: ignore[arg-type]
        tuple(_checker(str(f.type)) for f in fields(cls)),  # type: ignore[arg-type]
    )
    for cls in _CLASSES
}
assert len(_BY_KIND) == len(_CLASSES), "two frame classes share a kind"


_DATA = int(Kind.DATA)


def data_header(gid: int, seq: int, tag: int, seg: int, fp: str) -> list[Any]:
    """``encode(Data(gid, seq, tag, seg, fp))`` without making the frame (the hot path)."""
    return [_DATA, gid, seq, tag, seg, fp]


def encode(frame: Frame) -> list[Any]:
    """The msgpack-ready header of ``frame``: ``[kind, *fields]``."""
    _, names, _ = _BY_KIND[frame.KIND]
    return [int(frame.KIND), *(getattr(frame, name) for name in names)]


def decode(header: Any) -> Frame:
    """The frame a peer's header describes; ``ProtocolError`` if it is not a valid one."""
    if type(header) is list and len(header) == 6 and header[0] == _DATA:  # (the hot path)
        _, gid, seq, tag, seg, fp = header
        if (
            type(gid) is int
            and type(seq) is int
            and type(tag) is int
            and type(seg) is int
            and type(fp) is str
        ):
            return Data(gid, seq, tag, seg, fp)
    if isinstance(header, dict) and "error" in header:  # a transport-level refusal (handshake)
        return Error(ErrorCode.PROTOCOL.value, f"{header.get('error')}: {header.get('message')}")
    if not isinstance(header, list) or not header or type(header[0]) is not int:
        raise ProtocolError(f"a peer frame must be [kind, *fields], got {type(header).__name__}")
    entry = _BY_KIND.get(header[0])
    if entry is None:
        raise ProtocolError(f"unknown peer frame kind {header[0]}")
    cls, names, checks = entry
    values = header[1:]
    if len(values) != len(names):
        raise ProtocolError(f"{cls.__name__} frame has {len(values)} fields, expected {len(names)}")
    for name, check, value in zip(names, checks, values, strict=True):
        if not check(value):
            raise ProtocolError(f"{cls.__name__} frame: bad {name} {value!r:.60}")
    return cls(*values)
