"""The tensors the torch backend (``arendez.torch``) hands arendez for torch's.

arendez carries contiguous tensors of dtypes numpy knows. A non-contiguous tensor travels as a
contiguous copy; in a reduction, bfloat16 (which numpy cannot reduce) travels as a float32 copy;
bfloat16 that is only moved travels as its int16 bits. Copies that a call writes are copied back
into the caller's tensors when the call succeeds, so torch's in-place semantics hold.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

import torch

from .errors import InvalidArgumentError

# dtypes numpy lacks travel as their bits (an integer dtype of their size)...
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32}
_RAW = {
    dtype: _BITS[dtype.itemsize]
    for name in (
        "bfloat16", "complex32", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2",
        "float8_e5m2fnuz", "float8_e8m0fnu", "float4_e2m1fn_x2", "bits8", "bits16",
    )
    if isinstance(dtype := getattr(torch, name, None), torch.dtype) and dtype.itemsize in _BITS
}  # fmt: skip
_WIDEN = (torch.bfloat16,)  # ... and bfloat16 is reduced as float32; the others not at all


def stand_in_needed(t: torch.Tensor) -> bool:
    """True if arendez cannot carry ``t`` as it is (a dtype numpy lacks, or non-contiguous)."""
    return t.dtype in _RAW or not t.is_contiguous()


def writing(t: torch.Tensor) -> contextlib.AbstractContextManager[Any]:
    """The mode to write the caller's ``t`` in from the loop thread, where the caller's modes do
    not hold: an inference tensor only in inference mode, any other without autograd."""
    return torch.inference_mode() if t.is_inference() else torch.no_grad()


def raw(t: torch.Tensor) -> torch.Tensor:
    """A view arendez can carry without reducing (bfloat16 travels as int16 bits, float8 as
    uint8...)."""
    return t.view(_RAW[t.dtype]) if t.dtype in _RAW else t


class Stage:
    """Stand-ins arendez can carry for the caller's tensors of one call.

    ``widen``: the call reduces, so bfloat16 is carried as a float32 copy. Stand-ins for outputs
    are copied back into the caller's tensors by ``run`` when the call succeeds.
    """

    __slots__ = ("back", "widen", "widened")

    def __init__(self, widen: bool = False) -> None:
        self.widen = widen
        self.widened = False  # a bfloat16 tensor travels as float32 in this call
        self.back: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __call__(self, t: torch.Tensor, out: bool = True) -> torch.Tensor:
        """The tensor to hand arendez for ``t`` (``out``: the call writes it)."""
        carried = t
        if self.widen and t.dtype in _RAW and t.dtype not in _WIDEN:
            raise InvalidArgumentError(
                f"cannot reduce {t.dtype} tensors (they can be sent, gathered, broadcast)"
            )
        if self.widen and t.dtype in _WIDEN:
            carried = t.to(torch.float32, memory_format=torch.contiguous_format)
            self.widened = True
        elif not t.is_contiguous():
            carried = t.contiguous()
        if out and carried is not t:
            self.back.append((t, carried))
        return raw(carried)

    def all(self, ts: Sequence[torch.Tensor], out: bool = True) -> list[torch.Tensor]:
        """The tensors to hand arendez for each of ``ts``."""
        return [self(t, out) for t in ts]

    async def run(self, fn: Callable[..., Coroutine[Any, Any, Any]], *args: Any) -> Any:
        """Await ``fn(*args)``, then copy the written stand-ins back into the caller's tensors."""
        try:
            result = await fn(*args)
        except InvalidArgumentError as exc:  # name the caller's dtype, not the stand-in's
            if self.widened and str(exc).endswith("got float32"):
                raise InvalidArgumentError(f"{str(exc)[: -len('float32')]}bfloat16") from None
            raise
        for t, carried in self.back:
            with writing(t):
                if _overlaps(t):
                    if torch.equal(t, carried.to(t.dtype)):
                        continue  # an expanded tensor that was only read (a broadcast's source)
                    t, carried = _distinct(t, carried)  # (written once per memory location)
                t.copy_(carried)
        return result


def _overlaps(t: torch.Tensor) -> bool:
    """True if elements of ``t`` share memory (an ``expand``ed tensor): it cannot be written."""
    return any(stride == 0 and size > 1 for stride, size in zip(t.stride(), t.shape, strict=True))


def _distinct(t: torch.Tensor, carried: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``t`` and ``carried`` narrowed to the first index of each of ``t``'s expanded (stride 0)
    dimensions: the elements of ``t`` that do not share memory, as gloo writes them."""
    for dim, (stride, size) in enumerate(zip(t.stride(), t.shape, strict=True)):
        if stride == 0 and size > 1:
            t, carried = t.narrow(dim, 0, 1), carried.narrow(dim, 0, 1)
    return t, carried


def split_rows(t: torch.Tensor, sizes: list[int], n: int) -> list[torch.Tensor]:
    """``t`` cut into ``n`` flat parts along its first dimension (``sizes`` rows each; even if
    empty), as ``all_to_all_single`` splits it."""
    rows = t.shape[0] if t.dim() else t.numel()
    sizes = sizes or [rows // n] * n
    if len(sizes) != n or sum(sizes) != rows:
        raise InvalidArgumentError(f"split sizes {sizes} must be {n} numbers summing to {rows}")
    parts: tuple[torch.Tensor, ...] = torch.split(t, sizes)
    return [p.reshape(-1) for p in parts]
