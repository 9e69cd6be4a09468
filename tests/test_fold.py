"""``fold.Fold``: a payload reduced piece by piece as it arrives equals numpy's whole reduction,
whatever the piece boundaries (mid-element included), fed by the frame decoder as a socket would."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest

from arendez import wire
from arendez.arrays import byte_view
from arendez.fold import Fold

CASES = [
    (np.float32, np.add, 1),
    (np.float64, np.maximum, 7),
    (np.int64, np.add, 4099),
    (np.int16, np.multiply, 33333),
    (np.complex128, np.add, 20001),  # 16-byte elements
    (np.uint8, np.minimum, 70001),
]


def _arrays(dtype: Any, count: int, seed: int) -> tuple[Any, Any]:
    rng = np.random.default_rng(seed)
    a = (rng.random(count) * 100).astype(dtype)
    b = (rng.random(count) * 100).astype(dtype)
    if np.issubdtype(dtype, np.complexfloating):
        a = a + 1j * a[::-1]
    return a, b


def _feed(decoder: wire.Decoder, stream: bytes, rng: random.Random) -> list[tuple[Any, Any]]:
    """Push ``stream`` through ``decoder`` in reads of random sizes, as the kernel would."""
    frames: list[tuple[Any, Any]] = []
    pos = 0
    while pos < len(stream):
        buf = decoder.get_buffer()
        n = min(len(buf), len(stream) - pos, rng.choice([1, 3, 5, 17, 4096, 65537, 1 << 20]))
        buf[:n] = stream[pos : pos + n]
        pos += n
        frames.extend(decoder.feed(n))
    return frames


@pytest.mark.parametrize(("dtype", "ufunc", "count"), CASES)
def test_fold_through_the_decoder_equals_numpy(dtype: Any, ufunc: np.ufunc, count: int) -> None:
    mine, theirs = _arrays(dtype, count, count)
    expected = ufunc(mine, theirs)
    out = mine.copy()
    fold = Fold(out, out, ufunc, byte_view(out))
    # a small frame before and after: the payload's first bytes come with the header read
    encoded = b"".join(
        bytes(b)
        for h, p in (("before", b"xy"), ("data", byte_view(theirs)), ("after", None))
        for b in wire.encode(h, p)
    )
    decoder = wire.Decoder(sink=lambda header, nbytes: fold if header == "data" else None)
    frames = _feed(decoder, encoded, random.Random(count))
    assert [h for h, _ in frames] == ["before", "data", "after"]
    assert frames[1][1] is fold.view
    assert fold.done and fold.error is None
    np.testing.assert_array_equal(out, expected)


@pytest.mark.parametrize(("dtype", "ufunc", "count"), CASES)
def test_fold_write_in_odd_chunks_into_another_array(dtype: Any, ufunc: np.ufunc, count: int) -> None:
    src, theirs = _arrays(dtype, count, count + 1)
    before = src.copy()
    out = np.empty_like(src)
    fold = Fold(src, out, ufunc, byte_view(out))
    data = bytes(byte_view(theirs))
    rng = random.Random(7)
    pos = 0
    while pos < len(data):
        n = rng.randint(1, 3 * src.itemsize + 5)
        fold.write(memoryview(data)[pos : pos + n])
        pos += n
    assert fold.done
    np.testing.assert_array_equal(out, ufunc(before, theirs))
    np.testing.assert_array_equal(src, before)  # the source is only read


def test_a_reduction_that_raises_is_kept_and_the_stream_stays_in_step() -> None:
    out = np.full(1000, np.finfo(np.float64).max)
    fold = Fold(out, out, np.add, byte_view(out))
    theirs = out.copy()  # the sum overflows
    encoded = b"".join(
        bytes(b) for h, p in (("data", byte_view(theirs)), ("next", None)) for b in wire.encode(h, p)
    )
    decoder = wire.Decoder(sink=lambda header, nbytes: fold if header == "data" else None)
    with np.errstate(all="raise"):
        frames = _feed(decoder, encoded, random.Random(1))
    assert [h for h, _ in frames] == ["data", "next"]
    assert isinstance(fold.error, FloatingPointError)


def test_a_stream_of_the_wrong_size_is_a_protocol_error() -> None:
    out = np.zeros(10, np.int32)
    fold = Fold(out, out, np.add, byte_view(out))
    decoder = wire.Decoder(sink=lambda header, nbytes: fold)
    with pytest.raises(wire.ProtocolError, match="12 bytes for a 40-byte stream"):
        _feed(decoder, b"".join(bytes(b) for b in wire.encode("data", b"\0" * 12)), random.Random(2))


def test_shapes_or_dtypes_that_differ_or_a_strided_out_are_refused() -> None:
    with pytest.raises(ValueError, match="differ"):
        Fold(np.zeros(4, np.float32), np.zeros(4, np.float64), np.add, memoryview(b""))
    strided = np.zeros(8, np.float32)[::2]
    with pytest.raises(ValueError, match="contiguous"):
        Fold(strided, strided, np.add, memoryview(b""))
