"""Turning user buffers into flat numpy views, and the reduction operators."""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any, Protocol, cast

import numpy as np

from .errors import InvalidArgumentError


class ReduceOp(enum.Enum):
    SUM = "sum"
    PRODUCT = "product"
    MIN = "min"
    MAX = "max"
    BAND = "band"
    BOR = "bor"
    BXOR = "bxor"
    AVG = "avg"

    # torch spells a few of them differently; accept both
    @classmethod
    def parse(cls, op: Any) -> ReduceOp:
        if isinstance(op, ReduceOp):
            return op
        name = getattr(op, "name", None) or str(op).rsplit(".", 1)[-1]
        try:
            return cls[name.upper()]
        except KeyError:
            raise InvalidArgumentError(
                f"unknown reduce op {op!r}; use one of {[m.name for m in cls]}"
            ) from None


_UFUNCS: dict[ReduceOp, np.ufunc] = {
    ReduceOp.SUM: np.add,
    ReduceOp.AVG: np.add,
    ReduceOp.PRODUCT: np.multiply,
    ReduceOp.MIN: np.minimum,
    ReduceOp.MAX: np.maximum,
    ReduceOp.BAND: np.bitwise_and,
    ReduceOp.BOR: np.bitwise_or,
    ReduceOp.BXOR: np.bitwise_xor,
}


class Combine(Protocol):
    """``out = a (op) b``, element by element: a reduction's step (a numpy ufunc, or one quieted)."""

    def __call__(self, a: Any, b: Any, /, *, out: Any) -> Any: ...


_CHECKED: dict[tuple[ReduceOp, np.dtype[Any]], Combine] = {}


def ufunc_for(op: ReduceOp, dtype: np.dtype[Any]) -> Combine:
    """The numpy ufunc that combines two contributions, after checking it fits ``dtype``. For
    floating point it runs without numpy's warnings: a sum that overflows is ``inf`` silently,
    as gloo's and MPI's, not a ``RuntimeWarning`` printed from the library's code."""
    found = _CHECKED.get((op, dtype))
    if found is not None:
        return found
    ufunc: Combine = _check_ufunc(op, dtype)
    if dtype.kind in "fc" and op in (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.PRODUCT):
        ufunc = _quietly(ufunc)
    if len(_CHECKED) < 1024:
        _CHECKED[(op, dtype)] = ufunc
    return ufunc


def _quiet_state() -> tuple[Any, Any] | None:
    """numpy's (2.x) context variable of floating-point error handling, and its state with every
    warning off; ``None`` where numpy keeps it elsewhere (``np.errstate`` then, a few us slower)."""
    try:
        from numpy._core import _ufunc_config as config

        var, make = getattr(config, "_extobj_contextvar"), getattr(config, "_make_extobj")  # noqa: B009
        return var, make(all="ignore")
    except (ImportError, AttributeError, TypeError):
        return None


_QUIET = _quiet_state()


def _quietly(ufunc: Combine) -> Combine:
    if _QUIET is None:

        def combine_in_errstate(a: Any, b: Any, /, *, out: Any) -> Any:
            with np.errstate(all="ignore"):
                return ufunc(a, b, out=out)

        return combine_in_errstate
    var, quiet = _QUIET
    set_state: Callable[[Any], Any] = var.set
    reset_state: Callable[[Any], None] = var.reset

    def combine(a: Any, b: Any, /, *, out: Any) -> Any:
        token = set_state(quiet)  # (the caller's own state comes back below, whatever happens)
        try:
            return ufunc(a, b, out=out)
        finally:
            reset_state(token)

    return combine


def check_reducible(op: ReduceOp, kind: str, dtype: object) -> None:
    """``InvalidArgumentError`` naming ``dtype`` if ``op`` is undefined for arrays of numpy's
    dtype ``kind`` ("b", "i", "u", "f", "c"; the torch backend maps its dtypes onto them)."""
    if op in (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR) and kind not in "iub":
        raise InvalidArgumentError(f"ReduceOp.{op.name} needs an integer or bool array, got {dtype}")
    if op is ReduceOp.AVG and kind not in "fc":
        raise InvalidArgumentError(f"ReduceOp.AVG needs a floating-point array, got {dtype}")
    if op in (ReduceOp.MIN, ReduceOp.MAX) and kind == "c":
        raise InvalidArgumentError(f"ReduceOp.{op.name} is undefined for complex arrays")
    if kind not in "biufc":
        raise InvalidArgumentError(f"cannot reduce arrays of dtype {dtype}")


def _check_ufunc(op: ReduceOp, dtype: np.dtype[Any]) -> Combine:
    check_reducible(op, dtype.kind, dtype)
    return _UFUNCS[op]


def _torch_numpy(obj: Any) -> np.ndarray[Any, Any] | None:
    module = type(obj).__module__
    if not module.startswith("torch"):
        return None
    if getattr(obj, "device", None) is not None and obj.device.type != "cpu":
        raise InvalidArgumentError(f"only CPU tensors are supported, got a tensor on {obj.device}")
    if not obj.is_contiguous():  # (sparse tensors land here too)
        if obj.is_sparse or obj.is_sparse_csr:
            raise InvalidArgumentError(
                f"{obj.layout} tensors are not supported here (the torch backend reduces sparse COO tensors)"
            )
        raise InvalidArgumentError("tensor is not contiguous; call .contiguous() first")
    if obj.is_conj() or obj.is_neg():
        raise InvalidArgumentError("tensor has its conjugate or negative bit set; call .resolve_conj() first")
    typestr = _numpy_typestr(obj.dtype)
    numel = obj.numel()
    if numel == 0:
        return np.empty(0, typestr)
    # a flat view of the tensor's memory that holds the tensor (its base). Not
    # ``Tensor.numpy()``, which marks the storage as never to be resized again: FSDP frees and
    # regrows its flat parameters' storage between the collectives on them (torch: "Trying to
    # resize storage that is not resizable")
    return np.asarray(_TensorMemory(obj, numel, typestr))


class _TensorMemory:
    """A tensor's memory as numpy's array interface; the array viewing it keeps this (and so
    the tensor) alive."""

    __slots__ = ("__array_interface__", "tensor")

    def __init__(self, tensor: Any, numel: int, typestr: str) -> None:
        self.tensor = tensor
        self.__array_interface__ = {
            "version": 3,
            "shape": (numel,),
            "typestr": typestr,
            "data": (tensor.data_ptr(), False),
        }


_NUMPY_TYPESTRS: dict[Any, str] = {}


def _numpy_typestr(torch_dtype: Any) -> str:
    """numpy's type string for a torch dtype (``TypeError`` for those numpy lacks, as torch's)."""
    found = _NUMPY_TYPESTRS.get(torch_dtype)
    if found is None:
        import torch

        try:
            found = torch.empty(0, dtype=torch_dtype).numpy().dtype.str  # (a throwaway tensor)
        except TypeError as exc:  # (bfloat16, float8 ...: no numpy dtype to reduce them as)
            carried = torch_dtype == torch.bfloat16  # (through float32 stand-ins)
            raise TypeError(
                f"{exc}: the async API takes tensors of the dtypes numpy has"
                + ("; arendez.sync and the torch backend carry bfloat16" if carried else "")
            ) from None
        _NUMPY_TYPESTRS[torch_dtype] = found
    return found


def as_array(obj: Any, *, writable: bool = True, what: str = "tensor") -> np.ndarray[Any, Any]:
    """A flat numpy view of ``obj`` sharing its memory (never a copy).

    Accepts numpy arrays, CPU torch tensors and C-contiguous buffers. Non-contiguous or
    (when ``writable``) read-only input is a ``ValueError``.
    """
    array = obj if isinstance(obj, np.ndarray) else _torch_numpy(obj)
    if array is None:
        try:
            view = memoryview(obj)
        except TypeError:
            raise TypeError(
                f"{what} must be a numpy array, CPU torch tensor or buffer, not {type(obj).__name__}"
            ) from None
        if not view.c_contiguous:
            raise InvalidArgumentError(f"{what} is not C-contiguous")
        array = np.asarray(view)
    if not array.flags.c_contiguous:
        raise InvalidArgumentError(f"{what} is not C-contiguous; pass np.ascontiguousarray(...) explicitly")
    if writable and not array.flags.writeable:
        raise InvalidArgumentError(f"{what} is read-only; collectives write their result in place")
    return array.reshape(-1)


def as_bytes(array: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """The same memory as a flat uint8 array."""
    return array.view(np.uint8) if array.size else np.empty(0, np.uint8)


def byte_view(array: np.ndarray[Any, Any]) -> memoryview:
    """A flat byte memoryview of ``array``'s memory (empty arrays give an empty view)."""
    if not array.size:
        return memoryview(bytearray(0))
    return memoryview(cast(Any, array.view(np.uint8)))


#: ``ReduceOp.AVG``'s last step, ``out = sum / n``, as quiet as the sum before it.
average = _quietly(np.divide)
