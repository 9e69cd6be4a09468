"""The API on a one-process world (no server, no socket) and its argument checks."""

from __future__ import annotations

import datetime

import numpy as np
import pytest

import arendez as dist
import arendez.sync as sdist
from arendez.settings import env_int, env_seconds


@pytest.fixture(autouse=True)
async def _clean():
    yield
    await dist.destroy_process_group()


@pytest.mark.timeout(10)
async def test_single_process_world_needs_nothing():
    assert not dist.is_initialized()
    await dist.destroy_process_group()  # quiet when nothing is initialized
    await dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=5))
    assert dist.is_initialized() and dist.get_rank() == 0 and dist.get_world_size() == 1
    x = np.arange(5.0)
    await dist.all_reduce(x, op=dist.ReduceOp.MAX)
    assert x.tolist() == [0, 1, 2, 3, 4]
    objs = [None]
    await dist.all_gather_object(objs, {"a": 1})
    assert objs == [{"a": 1}]
    await dist.barrier()
    await dist.destroy_process_group()
    await dist.destroy_process_group()  # and after a destroy
    assert not dist.is_initialized()


@pytest.mark.timeout(10)
async def test_collective_before_init_names_init_process_group():
    with pytest.raises(dist.NotInitializedError, match="init_process_group") as info:
        await dist.all_reduce(np.ones(3))
    assert isinstance(info.value, RuntimeError) and isinstance(info.value, dist.ArendezError)


@pytest.mark.timeout(10)
async def test_bad_arrays_are_clear_value_errors():
    await dist.init_process_group(world_size=1)
    with pytest.raises(ValueError, match="C-contiguous"):
        await dist.all_reduce(np.ones((4, 4))[:, 1])
    ro = np.ones(3)
    ro.setflags(write=False)
    with pytest.raises(ValueError, match="read-only"):
        await dist.all_reduce(ro)
    with pytest.raises(ValueError, match="integer"):
        await dist.all_reduce(np.ones(3), op=dist.ReduceOp.BXOR)
    with pytest.raises(ValueError, match="floating"):
        await dist.all_reduce(np.ones(3, np.int32), op=dist.ReduceOp.AVG)
    with pytest.raises(TypeError, match="numpy array"):
        await dist.all_reduce([1, 2, 3])
    with pytest.raises(ValueError, match="backend"):
        await dist.init_process_group("nccl")
    with pytest.raises(ValueError, match="algorithm must be one of direct, rdb, ring, rhd, got 'tree'"):
        await dist.all_reduce(np.ones(3), algorithm="tree")


@pytest.mark.timeout(10)
async def test_bad_tuning_variables_are_named(monkeypatch):
    monkeypatch.setenv("ARENDEZ_ALGORITHM", "fastest")
    with pytest.raises(ValueError, match=r"ARENDEZ_ALGORITHM must be one of .* got 'fastest'"):
        await dist.init_process_group(world_size=1)
    assert not dist.is_initialized()
    monkeypatch.setenv("ARENDEZ_SHM_BYTES", "lots")
    with pytest.raises(ValueError, match="ARENDEZ_SHM_BYTES must be an integer, got 'lots'"):
        env_int("ARENDEZ_SHM_BYTES", 1 << 20)
    monkeypatch.setenv("ARENDEZ_LANES_IN_FLIGHT", "0")
    with pytest.raises(ValueError, match="ARENDEZ_LANES_IN_FLIGHT must be at least 1, got 0"):
        env_int("ARENDEZ_LANES_IN_FLIGHT", 4)
    monkeypatch.setenv("ARENDEZ_LANES_IN_FLIGHT", "")
    assert env_int("ARENDEZ_LANES_IN_FLIGHT", 4) == 4
    for bad in ("soon", "-1", "nan", "inf"):
        monkeypatch.setenv("ARENDEZ_LINK_TIMEOUT", bad)
        with pytest.raises(
            ValueError, match=f"ARENDEZ_LINK_TIMEOUT must be a .*number of seconds.*got '{bad}'"
        ):
            env_seconds("ARENDEZ_LINK_TIMEOUT", 20.0)
    monkeypatch.setenv("ARENDEZ_LINK_TIMEOUT", "2.5")
    assert env_seconds("ARENDEZ_LINK_TIMEOUT", 20.0) == 2.5


@pytest.mark.timeout(10)
async def test_process_group_context_always_destroys():
    with pytest.raises(KeyError):
        async with dist.process_group(world_size=1) as pg:
            x = np.ones(2)
            await pg.all_reduce(x)
            raise KeyError("boom")
    assert not dist.is_initialized()


@pytest.mark.timeout(10)
def test_sync_facade_same_names_blocking():
    sdist.init_process_group("gloo", None, world_size=1, rank=0)
    try:
        x = np.ones(4)
        sdist.all_reduce(x)
        work = sdist.all_reduce(x, async_op=True)
        work.wait()
        assert work.is_completed()
        failing = sdist.all_reduce(np.ones(2), op="NOPE", async_op=True)
        with pytest.raises(ValueError, match="NOPE"):  # wait() re-raises the collective's error
            failing.wait()
        assert sdist.get_world_size() == 1 and sdist.is_initialized()
    finally:
        sdist.destroy_process_group()
    assert not sdist.is_initialized()


@pytest.mark.timeout(10)
def test_init_method_urls_are_validated():
    from arendez.rendezvous import plan

    assert plan(None, -1, -1, {}).local
    p = plan("arendez://tok%40en@10.0.0.1:1234/job-a", 4, -1, {})
    assert (p.host, p.port, p.job, p.token, p.rank) == ("10.0.0.1", 1234, "job-a", "tok@en", -1)
    p = plan("env://", -1, -1, {"MASTER_ADDR": "h", "MASTER_PORT": "29500", "RANK": "0", "WORLD_SIZE": "2"})
    assert (p.host, p.port, p.rank, p.world_size, p.host_server) == ("h", 29500, 0, 2, True)
    p = plan(None, -1, -1, {"ARENDEZ_URL": "arendez://s:1/j", "WORLD_SIZE": "3"})
    assert (p.host, p.job, p.world_size, p.rank) == ("s", "j", 3, -1)
    with pytest.raises(dist.RendezvousError, match="MASTER_ADDR"):
        plan("env://", 2, 0, {})
    with pytest.raises(dist.RendezvousError, match="explicit rank"):
        plan("tcp://h:1", 2, -1, {})
    with pytest.raises(dist.RendezvousError, match="unsupported init_method"):
        plan("udp://h:1", 2, 0, {})
    p = plan("file:///tmp/x", 2, 0, {})  # (issue 17: the shared-file rendezvous)
    assert (p.transport, p.job, p.rank, p.world_size) == ("file", "/tmp/x", 0, 2)
    with pytest.raises(dist.RendezvousError, match="RANK"):
        plan("env://", -1, -1, {"MASTER_ADDR": "h", "MASTER_PORT": "1", "RANK": "x", "WORLD_SIZE": "2"})


@pytest.mark.timeout(10)
async def test_object_collectives_refuse_what_the_codec_cannot_carry_by_name() -> None:
    await dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=5))
    objs: list[object] = [None]
    with pytest.raises(dist.ObjectSerializationError, match=r"rank 0 .*integers in -2\*\*63\.\.2\*\*64-1"):
        await dist.all_gather_object(objs, {"big": 2**70})
    with pytest.raises(TypeError, match=r"never pickle.*cannot encode a builtins\.object"):
        await dist.all_gather_object(objs, object())
    await dist.all_gather_object(objs, ("a", 1))  # a tuple comes back as a tuple
    assert objs == [("a", 1)]


async def test_a_receive_from_this_rank_itself_is_refused_at_once() -> None:
    """No rank sends to itself: gloo raises at once, and so must arendez (not wait the timeout)."""
    import numpy as np

    import arendez as dist
    from arendez.testing import run_ranks

    async def rank(r: int) -> str:
        try:
            await dist.recv(np.zeros(2), src=r)
        except dist.InvalidArgumentError as exc:
            return str(exc)
        return "received"

    got = await run_ranks(2, rank, timeout=5)
    assert all("cannot receive from itself" in g for g in got), got


async def test_a_tensor_numpy_cannot_hold_names_the_dtype_and_where_it_goes() -> None:
    """(QA26: torch's bare "Got unsupported ScalarType BFloat16".)"""
    torch = pytest.importorskip("torch")
    await dist.init_process_group(world_size=1)
    try:
        with pytest.raises(
            TypeError, match=r"dtypes numpy has; arendez\.sync and the torch backend carry bfloat16"
        ):
            await dist.all_reduce(torch.ones(2, dtype=torch.bfloat16))
    finally:
        await dist.destroy_process_group()
