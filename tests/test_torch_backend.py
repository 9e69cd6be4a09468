"""torch.distributed backend "arendez" with real rank processes (see ``tests/torch_ranks.py``)."""

from __future__ import annotations

import json
import os
import signal
import time
import traceback
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from tests.harness import PY, RankResult, collect, free_port, popen_torch, wait_for_files  # noqa: E402
from tests.torch_ranks import batch, mlp, train_step  # noqa: E402


def _spawn(name: str, ws: int, init: str, *args: Any, env: dict[str, str] | None = None) -> list[Any]:
    procs = []
    for rank in range(ws):
        extra = dict(env or {})
        if init == "env://":
            extra.update(RANK=str(rank), WORLD_SIZE=str(ws))
        argv = [PY, "-m", "tests.torch_ranks", name, str(rank), str(ws), init, json.dumps(list(args))]
        procs.append(popen_torch(argv, extra))
    return procs


def _run(name: str, ws: int, init: str, *args: Any, env: dict[str, str] | None = None) -> list[Any]:
    results = collect(_spawn(name, ws, init, *args, env=env), 90)
    for res in results:
        assert res.returncode == 0, f"rank {res.rank} exited {res.returncode}:\n{res.stderr[-4000:]}"
    return [res.value for res in results]


def _reference(ws: int, steps: int) -> list[list[float]]:
    """One process training on the ranks' batches concatenated."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(steps):
        xs, ys = zip(*(batch(step, r) for r in range(ws)), strict=True)
        train_step(model, opt, torch.cat(xs), torch.cat(ys))
    return [p.detach().reshape(-1).tolist() for p in model.parameters()]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("ws", [2, 4])
def test_ddp_matches_single_process_reference(ws: int) -> None:
    steps = 4
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    # small buckets, so a step runs several all_reduces in flight from DDP's autograd hooks
    results = _run("ddp", ws, "env://", steps, 0.01, env=env)
    params = [r["params"] for r in results]
    for other in params[1:]:
        assert other == params[0], "ranks ended with different parameters"
    want = _reference(ws, steps)
    for got, ref in zip(params[0], want, strict=True):
        assert torch.allclose(torch.tensor(got), torch.tensor(ref), rtol=1e-4, atol=1e-6)


@pytest.mark.timeout(120)
def test_every_collective_matches_numpy_including_a_subgroup() -> None:
    ws = 3
    done = _run("collectives", ws, f"tcp://127.0.0.1:{free_port()}")
    every = [
        "all_reduce", "async_work_and_future", "all_reduce_coalesced", "all_gather_coalesced", "broadcast",
        "reduce",
        "all_gather", "all_gather_into_tensor", "gather", "scatter", "reduce_scatter",
        "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "barrier", "send_recv",
        "object_collectives",
    ]  # fmt: skip
    assert done[1] == every  # rank 1 is not in the subgroup [0, 2]
    for rank in (0, 2):
        assert done[rank] == every + [f"sub:{name}" for name in every]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("init", ["arendez", "store"])
def test_init_through_an_arendez_server_or_a_torch_store(init: str, arendez_server: Any) -> None:
    """``arendez://host:port/job`` joins a standalone server; a passed TCPStore gets an embedded one."""
    if init == "arendez":
        method, env = f"{arendez_server.url}/torch-{os.getpid()}", None
    else:
        method, env = "store", {"TEST_STORE_PORT": str(free_port())}
    results = _run("ddp", 2, method, 2, 25.0, env=env)
    assert results[0]["params"] == results[1]["params"]
    want = _reference(2, 2)
    assert torch.allclose(torch.tensor(results[0]["params"][0]), torch.tensor(want[0]), rtol=1e-4, atol=1e-6)


@pytest.mark.timeout(120)
def test_future_callbacks_may_make_collectives_and_powersgd_matches_gloo() -> None:
    """A future's callbacks run where they may block on further collectives, as on gloo's worker
    threads: a ``then`` callback that all_reduces, one that waits on another call's future, and
    DDP with the PowerSGD comm hook (whose callbacks do that) end as gloo's run does."""
    ws = 2
    ours = _run("callbacks_that_call", ws, f"tcp://127.0.0.1:{free_port()}", "arendez")
    # gloo's ranks report, then may die at exit after a PowerSGD run ("terminate called without
    # an active exception", torch 2.13): its values are the reference, its exit status is not ours
    gloo = [
        r.value
        for r in collect(_spawn("callbacks_that_call", ws, f"tcp://127.0.0.1:{free_port()}", "gloo"), 90)
    ]
    assert [r["blocking"] for r in ours] == [[3.0, 3.0]] * ws
    assert [r["nested"] for r in ours] == [[7.0, 7.0]] * ws
    assert ours[0]["params"] == ours[1]["params"]
    for got, want in zip(ours[0]["params"], gloo[0]["params"], strict=True):
        assert torch.allclose(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(120)
def test_ddp_join_with_uneven_inputs_and_unused_parameters_matches_gloo() -> None:
    ws = 2
    ours = _run("ddp_join_uneven", ws, f"tcp://127.0.0.1:{free_port()}", "arendez")
    gloo = _run("ddp_join_uneven", ws, f"tcp://127.0.0.1:{free_port()}", "gloo")
    assert [r["overloads"] for r in ours] == [[[float(ws)] * 3, [float(ws - 1)] * 2]] * ws
    assert ours[0]["params"] == ours[1]["params"]
    for got, want in zip(ours[0]["params"], gloo[0]["params"], strict=True):
        assert torch.allclose(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(90)
def test_a_subgroups_own_timeout_ends_its_collective() -> None:
    """``new_group(timeout=2s)``: its collective fails after 2 s naming the late rank, not after
    the default group's 60 s; the subgroup then refuses further calls with the same error."""
    results = _run("subgroup_timeout", 2, f"tcp://127.0.0.1:{free_port()}")
    got = results[0]
    assert got["error"] == "CollectiveTimeoutError", got
    assert "all_reduce on subgroup [0, 1] timed out after 2s" in got["message"]
    assert "never arrived: [1]" in got["message"]
    assert got["after"] < 7, got  # the subgroup's 2 s, well before rank 1 comes at 8 s
    assert got["again"] == "CollectiveTimeoutError"
    late = results[1]  # its first call took rank 0's part (a correct sum); its next one refuses
    assert late["late"] == [2.0] * 4, late
    assert late["late again"] == (
        "CollectiveCancelledError: rank 0 timed out of an earlier call on subgroup [0, 1], "
        "which then refuses all_reduce"
    ), late


@pytest.mark.timeout(120)
def test_subgroups_of_one_their_point_to_point_a_shared_mistake_and_no_grad_as_gloo() -> None:
    """A one-member subgroup's collectives work (they raised on an empty set of messages); a
    subgroup's send/recv are apart from the world's of the same tag, and its receive from any
    source takes no non-member's message; a size mistake both members make fails on both and
    leaves no message behind; parameters are written under the caller's no_grad."""
    results = _run("subgroup_edges", 3, f"tcp://127.0.0.1:{free_port()}")
    assert [r["single"] for r in results] == [[float(r + 1)] * 3 for r in range(3)]
    assert results[1]["p2p"] == [[2.0, 2.0], [1.0, 1.0]]
    assert results[1]["any"] == [0, [7.0, 7.0], [9.0, 9.0], 2]
    for got in results[:2]:
        assert got["mistake"] == "InvalidArgumentError", got
        assert got["after"] == [2.0, 20.0, 200.0], got
        assert got["no_grad"] == {"bf16": 4.5, "fp32 on the pair": 3.0}, got
        assert got["after gather"] == [6.0] * 3, got  # (no member's part left for this call)
    assert results[0]["a2a"] == [0.0, 10.0, 0.0, 10.0] and results[1]["a2a"] == [1.0, 11.0, 1.0, 11.0]
    assert results[0]["gather"] == "InvalidArgumentError" and results[1]["gather"] == "no error"


@pytest.mark.timeout(120)
def test_subgroup_members_that_disagree_on_dtype_op_or_collective_get_a_mismatch_error() -> None:
    """As gloo under TORCH_DISTRIBUTED_DEBUG=DETAIL (plain gloo returns garbage or hangs): each
    subgroup message names its collective, dtype and op, and a member that receives another
    call's part raises CollectiveMismatchError; that subgroup then refuses further calls."""
    results = _run("subgroup_mismatches", 3, f"tcp://127.0.0.1:{free_port()}")
    for rank, got in enumerate(results[:2]):
        for case in ("dtype", "op"):
            assert got[case].startswith("CollectiveMismatchError"), (rank, case, got[case])
            assert got[case + " then"] == "CollectiveMismatchError", (rank, case, got)
    assert "where this rank runs 'all_reduce float32 SUM'" in results[0]["op"], results[0]["op"]
    assert "'all_reduce int32 SUM'" in results[0]["dtype"], results[0]["dtype"]
    # the broadcast's root sends only: it cannot see the mismatch; the other member can
    assert results[1]["kind"].startswith("CollectiveMismatchError"), results[1]["kind"]
    assert "'broadcast float32'" in results[1]["kind"], results[1]["kind"]
    assert results[2] == {}


@pytest.mark.timeout(90)
def test_reinit_after_destroy_with_the_same_store() -> None:
    """Each init through one store gets its own embedded server, never the last round's URL."""
    ws, rounds = 2, 3
    results = _run("reinit_with_one_store", ws, "store", rounds, env={"TEST_STORE_PORT": str(free_port())})
    want = [float(sum(r + i for r in range(ws))) for i in range(rounds)]
    assert results == [want] * ws


@pytest.mark.timeout(90)
@pytest.mark.parametrize("victim", [1, 0])
def test_kill_9_during_ddp_fails_every_survivor_within_3s(tmp_path: Any, victim: int) -> None:
    """Rank 0 too: with ``tcp://`` it hosts the store (in a child process that goes with it)."""
    ws = 3
    procs = _spawn("ddp_until_failure", ws, f"tcp://127.0.0.1:{free_port()}", str(tmp_path))
    try:
        wait_for_files(tmp_path, "ready-*", ws, timeout=60)
        os.kill(procs[victim].pid, signal.SIGKILL)
        killed_at = time.time()
        survivors: list[RankResult] = collect([p for r, p in enumerate(procs) if r != victim], 30)
    finally:
        procs[victim].kill()
        procs[victim].wait()
    for res in survivors:
        assert res.returncode == 0, res.stderr[-3000:]
        out = res.value
        assert out["at"] is not None, out
        assert out["runtime"], out  # a RuntimeError (subclass) through torch's reducer
        assert f"rank {victim}" in out["message"], out
        assert "algo_comm" not in out["message"], (
            out
        )  # (torch quotes a traceback: not arendez's inner frames)
        assert out["at"] - killed_at < 3.0, f"detected after {out['at'] - killed_at:.2f}s: {out}"


@pytest.mark.timeout(90)
def test_sigstop_of_rank_0_during_ddp_fails_the_survivors_soon(tmp_path: Any) -> None:
    """Rank 0 hosts the store server as a child process, which a stop of rank 0 leaves serving:
    the server declares the stopped rank failed (no lease renewal for 2.5 s), not the group's
    timeout (torch's default: 30 minutes) some time later."""
    ws = 2
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    procs = _spawn("ddp_until_failure", ws, "env://", str(tmp_path), env=env)
    try:
        wait_for_files(tmp_path, "ready-*", ws, timeout=60)
        os.kill(procs[0].pid, signal.SIGSTOP)
        stopped_at = time.time()
        (res,) = collect(procs[1:], 30)
    finally:
        procs[0].kill()
        procs[0].wait()
    assert res.returncode == 0, res.stderr[-3000:]
    out = res.value
    assert "rank 0" in out["message"] and "declared failed by the server" in out["message"], out
    assert out["at"] - stopped_at < 8.0, f"detected after {out['at'] - stopped_at:.2f}s: {out}"


@pytest.mark.timeout(90)
def test_kill_9_in_a_subgroup_names_the_rank_and_the_collective(tmp_path: Any) -> None:
    """A subgroup's collectives run as sends and receives; the error names the call, not its step."""
    procs = _spawn("subgroup_until_failure", 3, f"tcp://127.0.0.1:{free_port()}", str(tmp_path))
    try:
        wait_for_files(tmp_path, "ready-*", 3, timeout=60)
        os.kill(procs[1].pid, signal.SIGKILL)
        killed_at = time.time()
        (survivor,) = collect(procs[:1], 30)
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    assert survivor.returncode == 0, survivor.stderr[-3000:]
    out = survivor.value
    assert out["type"] == "RankFailedError" and out["message"].startswith(
        "rank 1 failed during all_reduce: "
    ), out
    assert out["at"] - killed_at < 3.0, out


@pytest.mark.timeout(90)
def test_a_death_fails_its_subgroup_and_leaves_a_disjoint_one_working(tmp_path: Any) -> None:
    """(QA21: any death in the world failed every subgroup's next call, as if it were a member.)"""
    procs = _spawn("disjoint_subgroup_outlives_a_death", 4, _tcp(), str(tmp_path))
    try:
        wait_for_files(tmp_path, "ready-*", 4, timeout=60)
        os.kill(procs[3].pid, signal.SIGKILL)
        results = collect(procs[:3], 60)
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    for res in results:
        assert res.returncode == 0, res.stderr[-3000:]
    zero, one, two = (res.value for res in results)
    assert zero == one == {"type": None, "message": "finished"}
    assert two["type"] == "RankFailedError", two
    assert two["message"].startswith("rank 3 failed during all_reduce"), two


def _tcp() -> str:
    return f"tcp://127.0.0.1:{free_port()}"


@pytest.mark.timeout(90)
def test_device_mesh_and_dtensor_ops_on_named_groups() -> None:
    """torch finds groups by name (init_device_mesh, DTensor); each group carries the name torch gave it."""
    ws = 2
    results = _run("device_mesh_dtensor", ws, _tcp())
    full = torch.arange(4.0 * ws * 3).reshape(4 * ws, 3)
    for rank, out in enumerate(results):
        world, mesh_group, sub = out["names"]
        assert world and mesh_group == world and sub and sub != world, out["names"]
        assert out["desc"] == "default_pg"
        assert out["local"] == full[4 * rank : 4 * rank + 4].tolist()
        assert out["full"] == full.tolist()
        assert out["sum"] == float(full.sum())
        assert out["partial_to_replicate"] == [float(sum(range(1, ws + 1)))] * 3


@pytest.mark.timeout(90)
def test_fsdp2_training_matches_single_process_reference() -> None:
    ws, steps = 2, 2
    results = _run("fsdp2", ws, _tcp(), steps)
    assert results[0] == results[1], "ranks ended with different full parameters"
    for got, ref in zip(results[0], _reference(ws, steps), strict=True):
        assert torch.allclose(torch.tensor(got), torch.tensor(ref), rtol=1e-4, atol=1e-6)


@pytest.mark.timeout(60)
def test_the_group_objects_short_overloads_give_gloos_results() -> None:
    """(QA21: ``pg.allgather(outs, t)`` and ``pg.reduce_scatter(t, list, op)`` gave wrong results,
    the rooted short forms and calls without options raised.) Expected values are gloo's."""
    zero, one = _run("group_method_short_forms", 2, _tcp())
    assert zero["allgather"] == one["allgather"] == [[0.0, 0.0], [1.0, 1.0]]
    assert (zero["reduce_scatter"], one["reduce_scatter"]) == ([1.0, 1.0], [3.0, 3.0])
    assert (zero["reduce"], one["reduce"]) == ([2.0, 2.0], [2.0, 2.0])  # (MAX; rank 1's left as is)
    assert (zero["gather"], one["gather"]) == ([[0.0, 0.0], [1.0, 1.0]], [])
    assert (zero["scatter"], one["scatter"]) == ([0.0, 0.0], [1.0, 1.0])
    assert zero["broadcast"] == one["broadcast"] == [0.0, 0.0]
    assert (zero["reduce_scatter_base"], one["reduce_scatter_base"]) == ([1.0, 3.0], [5.0, 7.0])
    assert zero["late"].startswith("CollectiveTimeoutError: barrier (seq ")
    assert zero["late"].endswith("timed out after 0.5s; ranks that never arrived: [1]"), zero
    assert one["late"].startswith("CollectiveCancelledError: rank 0 timed out after 0.5s in barrier"), one


@pytest.mark.timeout(60)
def test_monitored_barrier_keeps_its_own_timeout_on_a_subgroup_and_zero_is_at_once() -> None:
    """(QA26, torch's own distributed suite: on a subgroup the call waited for the subgroup's
    timeout, and ``timedelta(0)`` meant no limit; gloo's raise at the call's timeout, 0 at once.)"""
    zero, _ = _run("monitored_barrier_limits", 2, _tcp())
    assert zero["sub"] == zero["zero"] == "CollectiveTimeoutError", zero
    assert zero["sub_took"] < 3.5 and zero["zero_took"] < 3.5, zero  # (before rank 1 came, 4 s late)


@pytest.mark.timeout(60)
def test_a_reduction_undefined_for_the_dtype_is_refused_on_every_rank_of_any_group() -> None:
    """(QA21: on a subgroup bfloat16 BAND named float32, and int64 AVG raised on the root only.)"""
    band = "InvalidArgumentError: ReduceOp.BAND needs an integer or bool array, got bfloat16"
    avg = "InvalidArgumentError: ReduceOp.AVG needs a floating-point array, got int64"
    for said in _run("refused_reductions", 2, _tcp()):
        assert said == [band, avg, band, avg, "sum 2"], said


@pytest.mark.timeout(60)
def test_bad_arguments_raise_what_gloo_raises_naming_them() -> None:
    """Out-of-range dst/src: a ValueError as torch's own checks raise, and a RuntimeError as gloo's
    "invalid root rank"; sizes and ops arendez refuses: RuntimeError (``InvalidArgumentError``),
    as gloo's."""
    ws = 2
    for out in _run("bad_rank_args", ws, _tcp()):
        errors = out["errors"]
        for name, arg, value in [
            ("send", "dst", 5),
            ("irecv", "src", 9),
            ("broadcast", "src", 2),
            ("reduce", "dst", 7),
        ]:
            assert (
                errors[name]
                == f"ValueError+RuntimeError: {arg}={value} is not a rank of this group: it must be in [0, 1]"
            )
        wrong = out["wrong"]
        assert wrong["all_gather_into_tensor"].startswith("RuntimeError: output_tensor must be"), wrong
        assert wrong["all_reduce AVG int64"].startswith(
            "RuntimeError: ReduceOp.AVG needs a floating-point"
        ), wrong
        assert out["after"] == [2.0, 2.0]  # the group still works


@pytest.mark.timeout(90)
def test_non_contiguous_and_bfloat16_give_gloos_results() -> None:
    """Each call on the arendez default group and an arendez subgroup equals gloo's on the same ranks."""
    results = _run("strided_and_bf16", 2, _tcp())
    for rank, out in enumerate(results):
        names = sorted({key.split("/")[0] for key in out})
        assert len(names) == 13, names
        # gloo refuses a non-contiguous send/recv ("input tensor has to be contiguous"); arendez copies
        sent = [[0.0, 3.0], [1.0, 4.0], [2.0, 5.0]] if rank == 1 else None
        assert out["send_recv/arendez"] == out["send_recv/arendez_sub"] == sent
        for name in names:
            if name == "send_recv":
                continue
            want = out[f"{name}/gloo"]
            assert not isinstance(want, str), f"gloo failed {name}: {want}"
            assert out[f"{name}/arendez"] == want, (rank, name, out[f"{name}/arendez"], want)
            assert out[f"{name}/arendez_sub"] == want, (rank, name, out[f"{name}/arendez_sub"], want)
        # transposed 3x2 of rank r is [[10r, 10r+3], [10r+1, 10r+4], [10r+2, 10r+5]]; the sum over 2 ranks:
        assert out["all_reduce/arendez"] == [[10.0, 16.0], [12.0, 18.0], [14.0, 20.0]]
        assert out["bf16_sum/arendez"] == [True, [4.5, 5.0, 5.5, 6.0]]


@pytest.mark.timeout(60)
def test_work_wait_timeout_raises_and_the_call_goes_on() -> None:
    results = _run("wait_timeout_then_result", 2, _tcp())
    assert results[0]["raised"] == {"runtime": True, "timeout": True}
    for out in results:
        assert out["t"] == [3.0, 3.0, 3.0]
        assert out["after"] == [2.0]


@pytest.mark.timeout(90)
def test_abort_fails_the_calls_in_flight_at_once_and_destroy_within_the_group_timeout(tmp_path: Path) -> None:
    """torch's ``_abort_process_group`` ends the world without draining (QA25: it was
    ``shutdown``, which drains within the group's timeout as gloo's ``destroy_process_group``)."""
    for how in ("abort", "destroy"):
        done = tmp_path / how
        results = _run("end_with_a_call_in_flight", 2, _tcp(), how, env={"TEST_DONE_FILE": str(done)})
        assert results[0]["work"] != "completed", results[0]
        took = results[0]["seconds"]
        if how == "abort":  # (the group's timeout is 5 s)
            assert took < 3, f"abort took {took:.1f}s with a call in flight"
        else:
            assert 4.5 < took < 25, f"destroy took {took:.1f}s: not the group's 5 s timeout"


@pytest.mark.timeout(30)
def test_arendez_url_arguments_are_checked_as_the_other_apis_check_them(arendez_server: Any) -> None:
    """world_size 0 and an out-of-range rank name the argument (as the async and blocking APIs
    do); a URL without a host is refused by name; a good one reaches the server's store."""
    from arendez.errors import RendezvousError
    from arendez.torchstore import ServerStore, arendez_rendezvous

    with pytest.raises(
        ValueError, match=r"world_size must be at least 1 \(or -1 to take it from the environment\), got 0"
    ):
        next(arendez_rendezvous("arendez://127.0.0.1:1/j?rank=0&world_size=0"))
    with pytest.raises(ValueError, match=r"rank must be in 0\.\.1 for world_size 2, got 2"):
        next(arendez_rendezvous("arendez://127.0.0.1:1/j?rank=2&world_size=2"))
    with pytest.raises(RendezvousError, match="names no host"):
        ServerStore("arendez:///j", 1.0)
    store = ServerStore(f"arendez://127.0.0.1:{arendez_server.port}/ports", 10.0)
    store.set("k", "v")
    assert store.get("k") == b"v"
    store.close()


@pytest.mark.timeout(120)
def test_torch_features_beyond_the_collectives_as_on_gloo() -> None:
    """Found by QA, each failing on arendez while gloo ran it: a tensor's storage left not
    resizable after a collective (FSDP1 failed in its first backward), a group without device
    types (DCP's async save, broadcast_from_rank0 state dicts), sparse gradients, copy-backs
    into inference tensors, float8 data, torch.compile of a DDP model."""
    results = _run("torch_features", 2, f"tcp://127.0.0.1:{free_port()}")
    for got in results:
        # (gloo's group serves CUDA too; its all_reduce of a strided tensor is wrong, README)
        names = {key.split("/")[0] for key in got} - {"devices", "inference"}
        for name in sorted(names):
            assert got[f"{name}/arendez"] == got[f"{name}/gloo"], (
                name,
                got[f"{name}/arendez"],
                got[f"{name}/gloo"],
            )
        assert got["devices/arendez"] == ["cpu", "cpu"]
        assert got["resize/arendez"] == [64, 0]
        assert got["inference/arendez"] == [[3.0, 3.0], [3.0, 3.0]]
        assert got["inference/gloo"][0] == [3.0, 3.0]


@pytest.mark.timeout(30)
def test_a_failed_works_future_quotes_no_inner_frames_and_its_error_keeps_them() -> None:
    """torch quotes the traceback of what a future's callback raises (DDP's message shows it):
    the future gets the error without arendez's frames, while ``wait()`` and ``exception()``
    keep the original, traceback and all."""
    from arendez.errors import RankFailedError
    from arendez.torchwork import start

    async def deep_inside() -> None:
        raise RankFailedError(1, "all_reduce", "connection lost (closed)")

    work = start(None, deep_inside)
    with pytest.raises(RuntimeError) as quoted:
        work.get_future().wait()
    message = str(quoted.value)
    assert "RankFailedError: rank 1 failed during all_reduce: connection lost (closed)" in message
    assert "deep_inside" not in message, message
    with pytest.raises(RankFailedError) as kept:
        work.wait()
    assert kept.value is work.exception() and kept.value.rank == 1
    assert "deep_inside" in "".join(traceback.format_tb(kept.value.__traceback__))
