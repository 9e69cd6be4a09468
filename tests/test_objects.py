"""Object collectives: what the codec carries (never pickle), and an object that cannot be
encoded failing the collective on every rank it reaches, at once, naming the rank (QA20-3: the
other ranks waited out the group's timeout, or blamed a mismatch)."""

from __future__ import annotations

import collections
import enum
from typing import Any

import msgpack
import numpy as np
import pytest

import arendez
from arendez import objcodec
from arendez.errors import ObjectSerializationError, ProtocolError
from arendez.testing import run_ranks

#: longer than each test's own timeout: a rank that waited for bytes that never come fails the test
GROUP_TIMEOUT = 60.0


class Colour(enum.IntEnum):
    RED = 2


Point = collections.namedtuple("Point", "x y")


def _rich() -> list[Any]:
    return [
        None,
        True,
        -(2**63),
        2**64 - 1,
        1.5,
        "text",
        b"\x00\xff",
        (1, (2, "b"), []),
        {1, "a"},
        frozenset({3}),
        3 - 4j,
        {"k": [1, {"n": (None,)}], 7: b"x"},
        np.arange(6, dtype=np.int8).reshape(2, 3),
        np.array([True, False]),
        np.zeros((0, 4), np.float32),
        np.array([1 + 2j], np.complex64),
        np.arange(12, dtype=np.float64).reshape(3, 4).T,  # not contiguous
        np.float32(2.5),
        np.int64(-7),
        {(1, 2): "tuple key", frozenset({3}): [{(4,)}]},
    ]


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, np.ndarray | np.generic):
        same_kind = type(a) is type(b) and a.dtype == b.dtype
        return same_kind and np.shape(a) == np.shape(b) and bool(np.array_equal(a, b))
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return type(a) is type(b) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return type(a) is type(b) and bool(a == b)


@pytest.mark.timeout(10)
def test_the_codec_carries_what_scripts_send_and_each_comes_back_as_what_it_was() -> None:
    for value in _rich():
        assert _same(objcodec.decode(objcodec.encode(value)), value), value
    # subclasses of built-ins travel as the built-in
    assert objcodec.decode(objcodec.encode(Colour.RED)) == 2
    assert type(objcodec.decode(objcodec.encode(Colour.RED))) is int
    assert objcodec.decode(objcodec.encode(Point(1, 2))) == (1, 2)
    assert type(objcodec.decode(objcodec.encode(collections.OrderedDict(a=1)))) is dict
    assert type(objcodec.decode(objcodec.encode(np.array(["ab"])[0]))) is str  # np.str_
    nested: Any = 0
    for _ in range(300):  # deeper than msgpack's C stack would take recursively (QA20 review)
        nested = (nested,)
    assert objcodec.decode(objcodec.encode(nested)) == nested


@pytest.mark.timeout(20)
def test_nesting_past_msgpacks_bounds_is_refused_not_a_crash() -> None:
    """Deep nesting is msgpack's to bound, in one pass (a nested decode per tuple level overflowed
    the C stack at ~200 levels: SIGSEGV on every receiver)."""
    nested: Any = 0
    for _ in range(5000):
        nested = (nested,)
    with pytest.raises(ValueError, match="cannot encode this object"):
        objcodec.encode(nested)
    _, failed = objcodec.encode_or_note(nested)
    assert isinstance(failed, ValueError)
    tuple_tag = b"\xc7\x00\x01"  # (ext 8, type 1, no data: what a tuple's array starts with)
    for forged in (b"\x91" * 100_000 + b"\xc0", (b"\x92" + tuple_tag) * 100_000 + b"\xc0"):
        with pytest.raises(ProtocolError, match="undecodable"):
            objcodec.decode(forged)


@pytest.mark.timeout(10)
def test_the_codec_carries_torch_tensors_of_every_dtype_and_layout() -> None:
    torch = pytest.importorskip("torch")
    tensors = [
        torch.arange(6, dtype=torch.float32).reshape(2, 3),
        torch.tensor([1.5, -2.0], dtype=torch.bfloat16),
        torch.tensor([True, False]),
        torch.ones(4, 2)[:, 0],  # not contiguous
        torch.ones(3, requires_grad=True) * 2,  # (travels detached)
        torch.tensor(5, dtype=torch.int64),  # 0-d
        torch.empty(0, 3, dtype=torch.float16),
        torch.tensor([1 + 2j], dtype=torch.complex64).conj(),  # a lazy conjugate: resolved
    ]
    for t in tensors:
        back = objcodec.decode(objcodec.encode({"t": t}))["t"]
        assert isinstance(back, torch.Tensor) and back.dtype == t.dtype and back.shape == t.shape
        assert torch.equal(back, t.detach().resolve_conj()), t
        if t.dtype != torch.bool:
            back.add_(1)  # writable: it owns its memory


@pytest.mark.timeout(10)
def test_the_codec_refuses_what_it_does_not_carry_by_type_and_bad_bytes_as_protocol_errors() -> None:
    class Custom:
        pass

    with pytest.raises(TypeError, match=r"never pickle\): cannot encode a .*Custom"):
        objcodec.encode([1, Custom()])
    with pytest.raises(TypeError, match="numeric or bool dtypes, not object"):
        objcodec.encode(np.array([None]))
    with pytest.raises(ValueError, match=r"integers in -2\*\*63"):
        objcodec.encode(2**64)
    forged_dtype = msgpack.packb(msgpack.ExtType(5, msgpack.packb(["|O8", [1], b"\0" * 8])))
    with pytest.raises(ProtocolError, match="malformed"):
        objcodec.decode(forged_dtype)
    short = msgpack.packb(msgpack.ExtType(5, msgpack.packb(["<f8", [4], b"\0" * 8])))
    with pytest.raises(ProtocolError, match="malformed"):
        objcodec.decode(short)
    with pytest.raises(ProtocolError, match="unknown object extension type 42"):
        objcodec.decode(msgpack.packb(msgpack.ExtType(42, b"")))
    with pytest.raises(ProtocolError, match="undecodable"):
        objcodec.decode(b"\xc1")
    with pytest.raises(TypeError, match="not masked ones"):
        objcodec.encode(np.ma.masked_array([1, 2], mask=[0, 1]))


@pytest.mark.timeout(30)
async def test_object_collectives_carry_rich_values_between_ranks() -> None:
    async def rank(r: int) -> Any:
        gathered: list[Any] = [None] * 3
        await arendez.all_gather_object(gathered, (r, {r}, np.full(2, r, np.int16)))
        objs = _rich() if r == 1 else [None] * len(_rich())
        await arendez.broadcast_object_list(objs, src=1)
        out: list[Any] = [None]
        await arendez.scatter_object_list(out, [(i, 1j * i) for i in range(3)] if r == 2 else None, src=2)
        at_root: list[Any] | None = [None] * 3 if r == 0 else None
        await arendez.gather_object(frozenset({r}), at_root, dst=0)
        return gathered, objs, out, at_root

    results = await run_ranks(3, rank, timeout=GROUP_TIMEOUT)
    for r, (gathered, objs, out, at_root) in enumerate(results):
        assert _same(gathered, [(i, {i}, np.full(2, i, np.int16)) for i in range(3)])
        assert _same(objs, _rich())
        assert _same(out, [(r, 1j * r)])
        assert at_root == ([frozenset({0}), frozenset({1}), frozenset({2})] if r == 0 else None)


@pytest.mark.timeout(30)
async def test_an_object_one_rank_cannot_encode_fails_the_collective_on_every_rank_naming_it() -> None:
    """all_gather_object from any rank, broadcast_object_list from the source, scatter_object_list
    with one bad entry: every rank raises ``ObjectSerializationError`` naming the rank, and the
    group goes on with its next collectives."""

    async def rank(r: int) -> Any:
        caught: list[tuple[str, int]] = []
        gathered: list[Any] = [None] * 3
        with pytest.raises(ObjectSerializationError, match=r"all_gather_object: rank 1 .*cannot encode") as e:
            await arendez.all_gather_object(gathered, object() if r == 1 else r)
        caught.append((e.value.collective, e.value.rank))
        objs: list[Any] = [object(), 1] if r == 2 else [None, None]
        with pytest.raises(ObjectSerializationError, match=r"broadcast_object_list: rank 2") as e:
            await arendez.broadcast_object_list(objs, src=2)
        caught.append((e.value.collective, e.value.rank))
        out: list[Any] = [None]
        with pytest.raises(ObjectSerializationError, match=r"scatter_object_list: rank 0") as e:
            await arendez.scatter_object_list(out, [1, 2, object()] if r == 0 else None, src=0)
        caught.append((e.value.collective, e.value.rank))
        x = np.full(2, float(r))
        await arendez.all_reduce(x)  # the group goes on
        await arendez.all_gather_object(gathered, r)
        return caught, x.tolist(), gathered

    for caught, total, gathered in await run_ranks(3, rank, timeout=GROUP_TIMEOUT):
        assert caught == [("all_gather_object", 1), ("broadcast_object_list", 2), ("scatter_object_list", 0)]
        assert total == [3.0, 3.0] and gathered == [0, 1, 2]


@pytest.mark.timeout(30)
async def test_a_gather_of_an_object_that_cannot_be_encoded_fails_at_the_root_and_its_rank() -> None:
    async def rank(r: int) -> str:
        at_root: list[Any] | None = [None] * 3 if r == 0 else None
        try:
            await arendez.gather_object(object() if r == 2 else r, at_root, dst=0)
        except ObjectSerializationError as exc:
            assert exc.rank == 2
            return "raised"
        return "returned"

    assert await run_ranks(3, rank, timeout=GROUP_TIMEOUT) == ["raised", "returned", "raised"]


class _Unlistable(list[int]):
    def __iter__(self) -> Any:
        raise RuntimeError("this list cannot be read")


@pytest.mark.timeout(30)
async def test_any_encoding_error_fails_every_rank_and_keeps_the_next_calls_in_step() -> None:
    """Not only a TypeError: any error while encoding (a list that cannot be read, nesting past
    msgpack's depth) is a note, so the peers' next object call is not paired with this one
    (QA20 review: ranks got rank 1's second object as its first)."""
    nested: Any = 0
    for _ in range(5000):
        nested = (nested,)

    async def rank(r: int) -> Any:
        seen = []
        for bad in (_Unlistable([1]), nested):
            out: list[Any] = [None] * 3
            with pytest.raises(ObjectSerializationError, match="rank 1 could not encode") as e:
                await arendez.all_gather_object(out, bad if r == 1 else f"r{r}-first")
            seen.append(e.value.reason.split(":")[0])
            await arendez.all_gather_object(out, f"r{r}-second")
            seen.append(out)
        return seen

    for seen in await run_ranks(3, rank, timeout=GROUP_TIMEOUT):
        second = ["r0-second", "r1-second", "r2-second"]
        assert seen == ["RuntimeError", second, "InvalidArgumentError", second]


@pytest.mark.timeout(60)
async def test_a_failure_note_travels_the_trees_of_a_large_group() -> None:
    """Past ``DIRECT_MAX_RANKS`` object collectives run on binomial trees: a note still reaches
    every rank."""
    from arendez.costmodel import DIRECT_MAX_RANKS

    size = DIRECT_MAX_RANKS + 2

    async def rank(r: int) -> list[int]:
        ranks = []
        out: list[Any] = [None] * size
        with pytest.raises(ObjectSerializationError) as e:
            await arendez.all_gather_object(out, object() if r == size - 2 else r)
        ranks.append(e.value.rank)
        objs: list[Any] = [object()] if r == 3 else [None]
        with pytest.raises(ObjectSerializationError) as e:
            await arendez.broadcast_object_list(objs, src=3)
        ranks.append(e.value.rank)
        await arendez.all_gather_object(out, r)
        assert out == list(range(size))
        return ranks

    assert await run_ranks(size, rank, timeout=GROUP_TIMEOUT) == [[size - 2, 3]] * size


@pytest.mark.timeout(30)
async def test_malformed_object_sizes_are_a_protocol_error() -> None:
    async def rank(r: int) -> None:
        if r == 0:
            await arendez.send(np.array([1, -5], np.int64), 1)
        else:
            with pytest.raises(ProtocolError, match=r"malformed object sizes \[1, -5\]"):
                await arendez.recv_object_list([None, None], src=0)

    await run_ranks(2, rank, timeout=GROUP_TIMEOUT)
