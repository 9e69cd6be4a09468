"""The codec of object collectives and object point-to-point: msgpack with a few extension
types, never pickle (a peer's bytes never run code here).

Besides msgpack's own values (None, bool, int, float, str, bytes, list, dict) it carries tuples,
sets, frozensets, complex numbers, numpy arrays and scalars of numeric or bool dtypes, and CPU
torch tensors (detached: ``requires_grad`` and ``Parameter`` do not travel), each decoded as what
it was. A subclass of a built-in travels as the built-in (an ``IntEnum`` as its int, a
``namedtuple`` as a tuple, an ``OrderedDict`` as a dict, ``np.str_`` as a str), a subclass of
``ndarray`` as an ``ndarray`` (a masked array is refused: its mask would be lost). Anything else
is a ``TypeError`` naming its type.

A tuple or set is a msgpack array whose first element is a tag: msgpack decodes every level in
one pass, without recursion, so nesting is bounded by msgpack's own limits (a refusal, never a
crash). Arrays and tensors are leaves: a tag-free header and their bytes.

A rank whose object cannot be encoded sends a note of the failure in its place, so that every rank
of the collective raises ``ObjectSerializationError`` naming it, rather than waiting for bytes
that never come or pairing its next call with this one.
"""

from __future__ import annotations

import math
import struct
import sys
from collections.abc import Sequence
from typing import Any

import msgpack
import numpy as np

from .errors import InvalidArgumentError, ObjectSerializationError, ProtocolError

_TUPLE, _SET, _FROZENSET, _COMPLEX, _NDARRAY, _NPSCALAR, _TENSOR = range(1, 8)
_FAILED = 100
_TAGS = {code: msgpack.ExtType(code, b"") for code in (_TUPLE, _SET, _FROZENSET)}
_BUILD = {_TUPLE: tuple, _SET: set, _FROZENSET: frozenset}
#: numpy dtype kinds an array may have: bool, signed and unsigned integers, floats, complex
_KINDS = frozenset("biufc")
_MAX_DIMS = 64
_COMPLEX_PAIR = struct.Struct("<dd")

_CARRIED = (
    "None, bools, ints, floats, str, bytes, lists, tuples, dicts, sets, complex numbers, numpy "
    "arrays and torch tensors"
)


class Failed:
    """What a rank sent in place of an object it could not encode."""

    __slots__ = ("message",)

    def __init__(self, message: str) -> None:
        self.message = message


# -- encoding ----------------------------------------------------------------------------------
def encode(obj: Any) -> bytes:
    """``obj`` as bytes; ``TypeError`` naming a type the codec does not carry,
    ``InvalidArgumentError`` for an integer past 64 bits or nesting past msgpack's depth."""
    try:
        packed: bytes = msgpack.packb(obj, default=_extend, use_bin_type=True, strict_types=True)
        return packed
    except OverflowError:
        raise InvalidArgumentError(
            "object collectives carry integers in -2**63..2**64-1 (send a larger one as a string)"
        ) from None
    except (ValueError, RecursionError) as exc:  # msgpack's nesting and size bounds
        raise InvalidArgumentError(f"object collectives cannot encode this object: {exc}") from None


def encode_or_note(obj: Any) -> tuple[bytes, Exception | None]:
    """``encode(obj)``, or a note of the failure (and the error) when it cannot be encoded:
    whatever the error, the rank still takes its part in the collective."""
    try:
        return encode(obj), None
    except Exception as exc:  # (a tensor's own refusal, say: any error must become a note)
        return note(exc), exc


def encode_each(objs: Sequence[Any]) -> tuple[list[bytes], Exception | None]:
    """Every object of ``objs`` encoded, or, if one cannot be, its note in every place (a scatter
    or a send of several objects fails as a whole) and the first error."""
    parts = []
    for obj in objs:
        data, failed = encode_or_note(obj)
        if failed is not None:
            return [data] * len(objs), failed
        parts.append(data)
    return parts, None


def note(exc: BaseException) -> bytes:
    """The bytes a rank sends in place of an object that ``encode`` refused with ``exc``."""
    packed: bytes = msgpack.packb(msgpack.ExtType(_FAILED, _reason(exc).encode()))
    return packed


def own_error(rank: int, collective: str, exc: BaseException) -> ObjectSerializationError:
    """The error of the rank whose own object ``encode`` refused with ``exc``."""
    return ObjectSerializationError(rank, collective, _reason(exc))


def _reason(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _extend(obj: Any) -> Any:
    """msgpack's hook for what it does not carry itself (with ``strict_types``, subclasses too)."""
    if isinstance(obj, tuple):
        return [_TAGS[_TUPLE], *obj]
    if isinstance(obj, frozenset):
        return [_TAGS[_FROZENSET], *obj]
    if isinstance(obj, set):
        return [_TAGS[_SET], *obj]
    if isinstance(obj, str):  # (before np.generic: np.str_ is both)
        return str(obj)
    if isinstance(obj, bytes | bytearray | memoryview):
        return bytes(obj)
    if isinstance(obj, np.ndarray):
        if isinstance(obj, np.ma.MaskedArray):
            raise TypeError(
                "object collectives carry plain numpy arrays, not masked ones (the mask would be lost)"
            )
        return msgpack.ExtType(_NDARRAY, _array_bytes(np.asarray(obj)))
    if isinstance(obj, np.generic):
        return msgpack.ExtType(_NPSCALAR, _array_bytes(np.asarray(obj)))
    if isinstance(obj, int):
        return int(obj)
    if isinstance(obj, float):
        return float(obj)
    if isinstance(obj, complex):
        return msgpack.ExtType(_COMPLEX, _COMPLEX_PAIR.pack(obj.real, obj.imag))
    if isinstance(obj, dict):
        return dict(obj)
    if isinstance(obj, list):
        return list(obj)
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor):
        return msgpack.ExtType(_TENSOR, _tensor_bytes(torch, obj))
    kind = type(obj)
    name = f"{kind.__module__}.{kind.__qualname__}"
    raise TypeError(f"object collectives carry {_CARRIED} (never pickle): cannot encode a {name}")


def _header(dtype: str, shape: Sequence[int], raw: bytes) -> bytes:
    packed: bytes = msgpack.packb([dtype, list(shape), raw], use_bin_type=True)
    return packed


def _array_bytes(a: np.ndarray[Any, Any]) -> bytes:
    if a.dtype.kind not in _KINDS or a.dtype.fields is not None:
        raise TypeError(f"object collectives carry numpy arrays of numeric or bool dtypes, not {a.dtype}")
    return _header(a.dtype.str, a.shape, np.ascontiguousarray(a).tobytes())


def _tensor_bytes(torch: Any, t: Any) -> bytes:
    if t.device.type != "cpu":
        raise TypeError(f"object collectives carry CPU tensors, not one on {t.device}")
    if t.layout not in (torch.strided, torch.sparse_coo) or t.is_quantized:
        raise TypeError(f"object collectives carry dense or sparse COO tensors, not {t.layout} or quantized")
    if t.is_sparse:
        t = t.to_dense()
    flat = t.detach().resolve_conj().resolve_neg().contiguous().reshape(-1)
    raw = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
    return _header(str(t.dtype).removeprefix("torch."), t.shape, raw)


# -- decoding ----------------------------------------------------------------------------------
def decode(data: bytes | memoryview) -> Any:
    """The object ``encode`` made (a ``Failed`` for a ``note``); ``ProtocolError`` for bytes
    that are neither."""
    try:
        return msgpack.unpackb(
            data, ext_hook=_leaf, list_hook=_container, raw=False, strict_map_key=False, use_list=True
        )
    except (ProtocolError, MemoryError):
        raise
    except Exception as exc:  # msgpack raises several unrelated types
        raise ProtocolError(f"undecodable object bytes: {type(exc).__name__}: {exc}") from None


def decode_all(
    parts: list[bytes], ranks: Sequence[int], collective: str, mine: BaseException | None
) -> list[Any]:
    """Every rank's object of ``parts`` (``ranks``: their global ranks); if a rank sent a note,
    ``ObjectSerializationError`` naming the first such (``mine``: this rank's own encoding error,
    the cause on the rank that failed)."""
    values = [decode(p) for p in parts]
    for rank, value in zip(ranks, values, strict=True):
        raise_if_note(value, rank, collective, mine)
    return values


def raise_if_note(value: Any, rank: int, collective: str, mine: BaseException | None = None) -> Any:
    """``value`` (what ``decode`` gave for ``rank``'s bytes), or the error its note stands for."""
    if isinstance(value, Failed):
        raise ObjectSerializationError(rank, collective, value.message) from mine
    return value


def _container(items: list[Any]) -> Any:
    """msgpack's hook for each decoded array: a tagged one is a tuple or set."""
    if items and type(first := items[0]) is msgpack.ExtType and not first.data:
        build = _BUILD.get(first.code)
        if build is not None:
            return build(items[1:])
    return items


def _leaf(code: int, data: bytes) -> Any:
    """msgpack's hook for the extension types that are values (a tag stays a tag)."""
    if code in _BUILD and not data:
        return msgpack.ExtType(code, data)  # (``_container`` makes its array a tuple or set)
    if code == _COMPLEX and len(data) == _COMPLEX_PAIR.size:
        return complex(*_COMPLEX_PAIR.unpack(data))
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
