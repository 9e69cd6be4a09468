"""The codec of object collectives and object point-to-point: msgpack with a few extension
types, never pickle (a peer's bytes never run code here).

Besides msgpack's own values (None, bool, int, float, str, bytes, list, dict) it carries tuples,
sets, frozensets, complex numbers, numpy arrays and scalars of numeric or bool dtypes, and CPU
torch tensors, each decoded as what it was. A subclass of a built-in travels as the built-in (an
``IntEnum`` as its int, a ``namedtuple`` as a tuple, an ``OrderedDict`` as a dict). Anything else
is a ``TypeError`` naming its type.

A rank whose object cannot be encoded sends a ``failure`` in its place, so that every rank of the
collective raises ``ObjectSerializationError`` naming it, rather than waiting for bytes that
never come.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from typing import Any

import msgpack
import numpy as np

from .errors import InvalidArgumentError, ObjectSerializationError, ProtocolError

_TUPLE, _SET, _FROZENSET, _COMPLEX, _NDARRAY, _NPSCALAR, _TENSOR = range(1, 8)
_FAILED = 100
#: numpy dtype kinds an array may have: bool, signed and unsigned integers, floats, complex
_KINDS = frozenset("biufc")
_MAX_DIMS = 64

#: what the codec carries, as its refusals say
WHAT = (
    "None, bools, ints, floats, str, bytes, lists, tuples, dicts, sets, complex numbers, numpy "
    "arrays and torch tensors"
)


class Failed:
    """What a rank sent in place of an object it could not encode."""

    __slots__ = ("message",)

    def __init__(self, message: str) -> None:
        self.message = message


def encode(obj: Any) -> bytes:
    """``obj`` as bytes; ``TypeError`` naming a type the codec does not carry,
    ``InvalidArgumentError`` for an integer past 64 bits."""
    try:
        return _pack(obj)
    except OverflowError:
        raise InvalidArgumentError(
            "object collectives carry integers in -2**63..2**64-1 (send a larger one as a string)"
        ) from None
    except ValueError as exc:  # msgpack's nesting and size bounds
        raise InvalidArgumentError(f"object collectives cannot encode this object: {exc}") from None


def failure(exc: BaseException) -> bytes:
    """The bytes a rank sends in place of an object ``encode`` refused with ``exc``."""
    packed: bytes = msgpack.packb(msgpack.ExtType(_FAILED, _reason(exc).encode()))
    return packed


def refused(rank: int, collective: str, exc: BaseException) -> ObjectSerializationError:
    """The error of a rank whose own object ``encode`` refused with ``exc``."""
    return ObjectSerializationError(rank, collective, _reason(exc))


def _reason(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def encoded(obj: Any) -> tuple[bytes, BaseException | None]:
    """``encode(obj)``, or a ``failure`` and the error when it cannot be encoded."""
    try:
        return encode(obj), None
    except (TypeError, InvalidArgumentError) as exc:
        return failure(exc), exc


def decode(data: bytes | memoryview) -> Any:
    """The object ``encode`` made (a ``Failed`` for a ``failure``); ``ProtocolError`` for bytes
    that are neither."""
    try:
        return msgpack.unpackb(data, ext_hook=_restore, raw=False, strict_map_key=False)
    except ProtocolError:
        raise
    except (RecursionError, Exception) as exc:  # msgpack raises several unrelated types
        raise ProtocolError(f"undecodable object bytes: {type(exc).__name__}: {exc}") from None


def decode_all(
    parts: list[bytes], ranks: Sequence[int], collective: str, mine: BaseException | None
) -> list[Any]:
    """Every rank's object of ``parts`` (``ranks``: their global ranks); if a rank sent a
    ``failure``, ``ObjectSerializationError`` naming the first such (``mine``: this rank's own
    encoding error, the cause on the rank that failed)."""
    values = [decode(p) for p in parts]
    for rank, value in zip(ranks, values, strict=True):
        if isinstance(value, Failed):
            raise ObjectSerializationError(rank, collective, value.message) from mine
    return values


def check(value: Any, rank: int, collective: str, mine: BaseException | None = None) -> Any:
    """``value`` (what ``decode`` gave for ``rank``'s bytes), or the error a ``Failed`` stands for."""
    if isinstance(value, Failed):
        raise ObjectSerializationError(rank, collective, value.message) from mine
    return value


# -- extension types -------------------------------------------------------------------------
def _pack(obj: Any) -> bytes:
    packed: bytes = msgpack.packb(obj, default=_extend, use_bin_type=True, strict_types=True)
    return packed


def _extend(obj: Any) -> Any:
    """msgpack's hook for what it does not carry itself (with ``strict_types``, subclasses too)."""
    if isinstance(obj, tuple):
        return msgpack.ExtType(_TUPLE, _pack(list(obj)))
    if isinstance(obj, frozenset):
        return msgpack.ExtType(_FROZENSET, _pack(list(obj)))
    if isinstance(obj, set):
        return msgpack.ExtType(_SET, _pack(list(obj)))
    if isinstance(obj, np.ndarray):
        return msgpack.ExtType(_NDARRAY, _array_bytes(obj))
    if isinstance(obj, np.generic):
        return msgpack.ExtType(_NPSCALAR, _array_bytes(np.asarray(obj)))
    if isinstance(obj, int):
        return int(obj)
    if isinstance(obj, float):
        return float(obj)
    if isinstance(obj, complex):
        return msgpack.ExtType(_COMPLEX, _pack([obj.real, obj.imag]))
    if isinstance(obj, str):
        return str(obj)
    if isinstance(obj, bytes | bytearray | memoryview):
        return bytes(obj)
    if isinstance(obj, dict):
        return dict(obj)
    if isinstance(obj, list):
        return list(obj)
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor):
        return msgpack.ExtType(_TENSOR, _tensor_bytes(torch, obj))
    kind = type(obj)
    name = f"{kind.__module__}.{kind.__qualname__}"
    raise TypeError(f"object collectives carry {WHAT} (never pickle): cannot encode a {name}")


def _array_bytes(a: np.ndarray[Any, Any]) -> bytes:
    if a.dtype.kind not in _KINDS or a.dtype.fields is not None:
        raise TypeError(f"object collectives carry numpy arrays of numeric or bool dtypes, not {a.dtype}")
    return _pack([a.dtype.str, list(a.shape), np.ascontiguousarray(a).tobytes()])


def _tensor_bytes(torch: Any, t: Any) -> bytes:
    if t.device.type != "cpu":
        raise TypeError(f"object collectives carry CPU tensors, not one on {t.device}")
    if t.is_quantized:
        raise TypeError("object collectives carry dense or sparse tensors, not quantized ones")
    if t.is_sparse:
        t = t.to_dense()
    flat = t.detach().resolve_conj().resolve_neg().contiguous().reshape(-1)
    raw = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
    return _pack([str(t.dtype).removeprefix("torch."), list(t.shape), raw])


def _restore(code: int, data: bytes) -> Any:
    """msgpack's hook for the extension types ``_extend`` makes."""
    if code == _TUPLE:
        return tuple(decode(data))
    if code == _SET:
        return set(decode(data))
    if code == _FROZENSET:
        return frozenset(decode(data))
    if code == _COMPLEX:
        real, imag = decode(data)
        return complex(real, imag)
    if code == _NDARRAY:
        return _array(data)
    if code == _NPSCALAR:
        return _array(data)[()]
    if code == _TENSOR:
        return _tensor(data)
    if code == _FAILED:
        return Failed(data.decode(errors="replace"))
    raise ProtocolError(f"unknown object extension type {code}")


def _shape_and_bytes(data: bytes) -> tuple[str, tuple[int, ...], bytes]:
    dtype, shape, raw = msgpack.unpackb(data, raw=False)
    if (
        type(dtype) is not str
        or type(shape) is not list
        or len(shape) > _MAX_DIMS
        or any(type(n) is not int or n < 0 for n in shape)
        or type(raw) is not bytes
    ):
        raise ProtocolError("malformed array in object bytes")
    return dtype, tuple(shape), raw


def _array(data: bytes) -> np.ndarray[Any, Any]:
    name, shape, raw = _shape_and_bytes(data)
    dtype = np.dtype(name)
    if dtype.kind not in _KINDS or dtype.fields is not None or len(raw) != math.prod(shape) * dtype.itemsize:
        raise ProtocolError(f"malformed {name} array of shape {shape} in object bytes")
    return np.frombuffer(raw, dtype).reshape(shape).copy()


def _tensor(data: bytes) -> Any:
    name, shape, raw = _shape_and_bytes(data)
    try:
        import torch
    except ImportError:
        raise ProtocolError("a torch tensor arrived in object bytes; torch is not importable here") from None
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype) or len(raw) != math.prod(shape) * dtype.itemsize:
        raise ProtocolError(f"malformed torch.{name} tensor of shape {shape} in object bytes")
    if not raw:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape)
