"""Reduce a payload into an array while it arrives (``Fold``), piece by piece.

A large ring step receives a block and combines it with the block it holds: ``out = src op
received``. Landing the whole block in a scratch buffer and reducing it afterwards writes the
block to memory and reads it back, the block being larger than the cache. A ``Fold`` instead
is a ``wire.Stream``: the connection's decoder hands the kernel a small scratch (``wire.
PIECE_BYTES``, inside the L2 cache), and each piece that lands there is reduced into ``out`` at
once, while it is still in cache, with no task, future or frame of its own.

Pieces need not end on element boundaries (the kernel returns what it has): the bytes of a
partial element are carried to the front of the next piece.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .arrays import Combine

Array = np.ndarray[Any, Any]


class Fold:
    """``out = ufunc(src, payload)`` element by element, as the payload's bytes arrive.

    ``src`` and ``out`` have the same shape and dtype (``out`` may be ``src``). A reduction
    that raises (a ``np.seterr`` that makes overflow raise, say) stops folding and is kept in
    ``error``: the receive fails with it, the connection it came on does not.
    """

    __slots__ = (
        "_carry",
        "_dtype",
        "_itemsize",
        "_landed",
        "_out",
        "_pos",
        "_scratch",
        "_src",
        "_ufunc",
        "error",
        "view",
    )

    def __init__(self, src: Array, out: Array, ufunc: Combine, view: memoryview) -> None:
        if src.shape != out.shape or src.dtype != out.dtype:
            raise ValueError(f"fold: src {src.dtype}{src.shape} and out {out.dtype}{out.shape} differ")
        if not out.flags.c_contiguous:  # (a flat view of it would be a copy)
            raise ValueError("fold: out must be contiguous")
        self._src = src.reshape(-1)
        self._out = out.reshape(-1)
        self._ufunc = ufunc
        self._dtype = out.dtype
        self._itemsize = max(1, out.dtype.itemsize)
        self._pos = 0  # elements reduced so far
        self._carry = b""  # the first bytes of a partial element
        self._scratch: memoryview | None = None  # the piece scratch last landed in, and
        self._landed: Array | None = None  # ... its elements (typed once, not per piece)
        self.error: BaseException | None = None
        #: ``out``'s bytes: what the frame completes with (the mailbox knows the receive by it)
        self.view = view

    @property
    def nbytes(self) -> int:
        return self.view.nbytes

    def landing(self, scratch: memoryview, left: int) -> memoryview:
        """Where the next at most ``left`` payload bytes go: ``scratch``, after the carried bytes
        of a partial element (put at its front, so the piece starts on an element)."""
        carried = len(self._carry)
        if carried:
            scratch[:carried] = self._carry
        return scratch[carried : carried + min(left, len(scratch) - carried)]

    def absorb(self, scratch: memoryview, nbytes: int) -> None:
        """``nbytes`` landed where ``landing(scratch, ...)`` said: reduce them."""
        if self._carry or nbytes % self._itemsize:  # (a partial element on either side)
            whole = len(self._carry) + nbytes
            self._carry = b""
            self.write(scratch[:whole])
            return
        if scratch is not self._scratch:
            usable = len(scratch) - len(scratch) % self._itemsize
            self._scratch, self._landed = scratch, np.frombuffer(scratch[:usable], self._dtype)
        assert self._landed is not None
        self._fold(self._landed[: nbytes // self._itemsize])

    def write(self, data: memoryview) -> None:
        """Reduce bytes that arrived elsewhere (a header read, a whole payload) into ``out``."""
        if self._carry:
            need = self._itemsize - len(self._carry)
            head, data = self._carry + bytes(data[:need]), data[need:]
            self._carry = b""
            if len(head) < self._itemsize:
                self._carry = head
                return
            self._reduce(memoryview(head))
        whole = len(data) - len(data) % self._itemsize
        if whole:
            self._reduce(data[:whole])
        if whole < len(data):
            self._carry = bytes(data[whole:])

    def _reduce(self, data: memoryview) -> None:
        self._fold(np.frombuffer(data, self._dtype))

    def _fold(self, incoming: Array) -> None:
        """The next ``incoming.size`` elements: ``out = ufunc(src, incoming)``."""
        lo = self._pos
        hi = self._pos = lo + incoming.size
        if self.error is None:
            try:
                self._ufunc(self._src[lo:hi], incoming, out=self._out[lo:hi])
            except Exception as exc:  # kept for the receive; the stream goes on
                self.error = exc

    @property
    def done(self) -> bool:
        """Every element was reduced."""
        return self._pos == self._out.size and not self._carry
