"""Every argument of ``init_process_group`` (and friends) is checked before any I/O: a bad value
raises ValueError/TypeError at once, naming the argument, with no socket ever opened."""

from __future__ import annotations

import asyncio
import math
import socket
import time
from typing import Any
from unittest import mock

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import arendez as dist
from arendez import testing
from arendez.store import Store

URL = "tcp://127.0.0.1:29999"


def _refused(kwargs: dict[str, Any], env: dict[str, str] | None = None) -> BaseException:
    """Call init_process_group(**kwargs) with socket creation forbidden; return what it raised."""

    async def call() -> BaseException:
        with (
            mock.patch.object(socket, "socket", side_effect=AssertionError("a socket was opened")),
            mock.patch.dict("os.environ", env or {}),
        ):
            started = time.monotonic()
            try:
                await dist.init_process_group(**kwargs)
            except (ValueError, TypeError) as exc:
                assert time.monotonic() - started < 1.0
                return exc
        raise AssertionError(f"init_process_group({kwargs}) was accepted")

    return asyncio.run(call())


BAD_WORLD_SIZES = st.integers(max_value=0).filter(lambda n: n != -1)
BAD_PORTS = st.one_of(st.integers(max_value=0), st.integers(min_value=65536))
BAD_TIMEOUTS = st.one_of(
    st.floats(max_value=0), st.sampled_from([math.inf, -math.inf, math.nan]), st.integers(max_value=0)
)
NOT_INTS = st.one_of(st.floats(allow_nan=False), st.text(max_size=3), st.booleans(), st.just(None))


@settings(max_examples=40, deadline=None)
@given(BAD_WORLD_SIZES)
def test_world_size_below_one(size: int) -> None:
    exc = _refused({"init_method": URL, "world_size": size, "rank": 0})
    assert isinstance(exc, ValueError) and "world_size" in str(exc) and str(size) in str(exc)
    assert "env://" not in str(exc)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 64), st.data())
def test_rank_outside_the_world(size: int, data: st.DataObject) -> None:
    rank = data.draw(st.one_of(st.integers(min_value=size), st.integers(max_value=-2)))
    exc = _refused({"init_method": URL, "world_size": size, "rank": rank})
    assert isinstance(exc, ValueError) and "rank" in str(exc) and str(rank) in str(exc), exc


@settings(max_examples=40, deadline=None)
@given(BAD_PORTS, st.sampled_from(["tcp://127.0.0.1:{}", "arendez://127.0.0.1:{}/job", "tcp://[::1]:{}"]))
def test_port_in_the_url(port: int, template: str) -> None:
    exc = _refused({"init_method": template.format(port), "world_size": 2, "rank": 0})
    assert isinstance(exc, ValueError) and "port" in str(exc) and str(port) in str(exc), exc


@settings(max_examples=40, deadline=None)
@given(BAD_TIMEOUTS)
def test_timeout(timeout: float) -> None:
    exc = _refused({"init_method": URL, "world_size": 2, "rank": 0, "timeout": timeout})
    assert isinstance(exc, ValueError) and "timeout" in str(exc), exc


@settings(max_examples=30, deadline=None)
@given(st.text(max_size=8).filter(lambda b: b not in ("tcp", "gloo", "arendez")))
def test_backend(backend: str) -> None:
    exc = _refused({"backend": backend, "init_method": URL, "world_size": 2, "rank": 0})
    assert isinstance(exc, ValueError) and "backend" in str(exc) and repr(backend) in str(exc), exc


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(["world_size", "rank"]), NOT_INTS)
def test_non_int_sizes_and_ranks(name: str, value: Any) -> None:
    kwargs: dict[str, Any] = {"init_method": URL, "world_size": 2, "rank": 0, name: value}
    exc = _refused(kwargs)
    assert isinstance(exc, TypeError) and name in str(exc), exc


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 8), st.data())
def test_rank_from_the_environment(size: int, data: st.DataObject) -> None:
    rank = data.draw(st.integers(min_value=size, max_value=10_000))
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999", "RANK": str(rank), "WORLD_SIZE": str(size)}
    exc = _refused({"init_method": "env://"}, env)
    assert isinstance(exc, ValueError) and "RANK" in str(exc) and str(rank) in str(exc), exc


@settings(max_examples=20, deadline=None)
@given(BAD_PORTS)
def test_master_port(port: int) -> None:
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "2"}
    exc = _refused({"init_method": "env://"}, env)
    assert isinstance(exc, ValueError) and "MASTER_PORT" in str(exc), exc


@pytest.mark.parametrize(
    "kwargs,words",
    [
        ({"host": "", "port": 1}, "host must not be empty"),
        ({"host": "h", "port": 70000}, "port must be in 1-65535"),
        ({"host": "h", "port": "1"}, "port must be an int"),
        ({"host": "h", "port": 1, "job": 7}, "job must be a str"),
        ({"host": "h", "port": 1, "timeout": -1}, "timeout must be finite and > 0"),
    ],
)
def test_store_arguments(kwargs: dict[str, Any], words: str) -> None:
    async def make() -> None:
        Store(**kwargs)

    with pytest.raises((ValueError, TypeError), match=words):
        asyncio.run(make())


def test_group_and_collective_arguments() -> None:
    """new_group, the collectives and send/recv refuse bad ranks, ops and timeouts at once."""

    async def rank_fn(rank: int) -> list[str]:
        x = np.ones(4, np.float32)
        calls = [
            dist.new_group([0, 2]),
            dist.new_group([0, 0]),
            dist.new_group("01"),
            dist.new_group([0, 1], timeout=-1),
            dist.broadcast(x, src=True),
            dist.broadcast(x, src=1.0),
            dist.reduce(x, dst=5),
            dist.all_reduce(x, op="median"),
            dist.barrier(timeout=math.nan),
            dist.send(x, dst=1 - rank, tag=1 << 70),
            dist.recv(x, src="1"),
        ]
        out = []
        for call in calls:
            try:
                await call
                out.append("accepted")
            except (ValueError, TypeError) as exc:
                out.append(f"{type(exc).__name__}: {exc}")
        await dist.all_reduce(x)  # nothing above took a sequence number: the group still works
        return out

    for out in asyncio.run(testing.run_ranks(2, rank_fn)):
        assert out == [
            "ValueError: ranks must be ranks in 0..1, got 2 in [0, 2]",
            "ValueError: ranks must be distinct, got [0, 0]",
            "TypeError: ranks must be a sequence of ranks, got str '01'",
            "ValueError: timeout must be finite and > 0 seconds, got -1",
            "TypeError: src must be an int, got bool True",
            "TypeError: src must be an int, got float 1.0",
            "InvalidArgumentError: dst 5 is not in this group (ranks [0, 1])",
            "InvalidArgumentError: unknown reduce op 'median'; use one of "
            "['SUM', 'PRODUCT', 'MIN', 'MAX', 'BAND', 'BOR', 'BXOR', 'AVG']",
            "ValueError: timeout must be finite and > 0 seconds, got nan",
            f"InvalidArgumentError: tag must fit in 64 signed bits, got {1 << 70}",
            "TypeError: src must be an int, got str '1'",
        ], out
