"""A process that used arendez, then forked: the child is a new process to arendez (its own loop
thread, no world, no lease, no embedded server of the parent's), and the parent's world is
untouched by it. (Before: the child's first blocking call waited forever on the parent's loop
thread, which a fork does not copy.)"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import textwrap

import pytest

from tests.harness import PY, ROOT, _env, free_port


def _spawn(code: str, *args: str) -> subprocess.Popen[str]:
    """``code`` in a process group of its own (a hung forked child goes with it)."""
    return subprocess.Popen(
        [PY, "-c", textwrap.dedent(code), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
        cwd=ROOT,
        start_new_session=True,
    )


def _end(procs: list[subprocess.Popen[str]]) -> None:
    for p in procs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()


def _run(code: str, *args: str, timeout: float = 60) -> tuple[int, str, str]:
    proc = _spawn(code, *args)
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        _end([proc])
    return proc.returncode, out, err


CHILD_INITS = """
    import os, sys, time
    import numpy as np
    import arendez.sync as dist

    dist.init_process_group(init_method="tcp://127.0.0.1:" + sys.argv[1], world_size=1, rank=0)
    x = np.ones(2)
    dist.all_reduce(x)
    dist.destroy_process_group()
    pid = os.fork()
    if pid == 0:  # a fresh world of the child's own, within its timeout (5 s)
        started = time.monotonic()
        dist.init_process_group(
            init_method="tcp://127.0.0.1:" + sys.argv[2], world_size=1, rank=0, timeout=5
        )
        y = np.full(2, 3.0)
        dist.all_reduce(y)
        dist.destroy_process_group()
        print(f"child ok {y[0]:g} in {time.monotonic() - started:.2f}s", flush=True)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    print("child status", os.waitstatus_to_exitcode(status), flush=True)
"""


@pytest.mark.timeout(60)
def test_a_forked_child_gets_its_own_loop_thread_and_world() -> None:
    code, out, err = _run(CHILD_INITS, str(free_port()), str(free_port()), timeout=30)
    assert code == 0, err[-3000:]
    assert "child ok 3 in" in out and "child status 0" in out, out + err


RANK = """
    import os, sys
    import numpy as np
    import arendez.sync as dist

    rank, port = int(sys.argv[1]), sys.argv[2]
    dist.init_process_group(init_method="tcp://127.0.0.1:" + port, world_size=2, rank=rank, timeout=30)
    x = np.ones(2)
    dist.all_reduce(x)
    if rank == 0 and os.fork() == 0:
        # as torch's: the queries answer (a DataLoader worker's seed), a call is refused by name
        print(f"child sees rank {dist.get_rank()} of {dist.get_world_size()}", flush=True)
        try:
            dist.all_reduce(np.ones(1))
        except dist.NotInitializedError as exc:
            print("child refused:", "was forked" in str(exc), flush=True)
        sys.exit(0)  # a normal exit: the child runs the atexit handlers it inherited
    if rank == 0:
        _, status = os.wait()
        print("child status", os.waitstatus_to_exitcode(status), flush=True)
    dist.barrier()  # after the child has gone: the world is as it was
    y = np.full(2, rank + 1.0)
    dist.all_reduce(y)
    dist.destroy_process_group()
    print(f"rank {rank} sum {y[0]:g}", flush=True)
"""


@pytest.mark.timeout(90)
def test_a_forked_child_that_exits_does_not_end_the_parents_world() -> None:
    """The child inherits the parent's world and its exit handlers: it must not say the parent's
    goodbye to the parent's peers, nor close the store the parent hosts; it answers the queries,
    refuses calls, and exits cleanly."""
    port = str(free_port())
    procs = [_spawn(RANK, str(r), port) for r in range(2)]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=60))
    finally:
        _end(procs)
    for rank, (p, (out, err)) in enumerate(zip(procs, outs, strict=True)):
        assert p.returncode == 0 and f"rank {rank} sum 3" in out, err[-3000:]
    child = outs[0][0]
    assert "child sees rank 0 of 2" in child and "child refused: True" in child, child
    # (QA26: uvloop's thread pool, started by resolving the peer listener's address, crashed
    # the child's normal exit with SIGSEGV)
    assert "child status 0" in child, child


MASTER_FORKS = """
    import gc, os, sys
    from arendez.sync import TCPStore

    master = TCPStore("127.0.0.1", int(sys.argv[1]), 2, True, wait_for_workers=False)
    master.set("k", "v")
    if os.fork() == 0:  # multiprocessing's fork start method does this with a master store
        client = TCPStore("127.0.0.1", int(sys.argv[1]), 2, False)
        print("child got", client.get("k").decode(), flush=True)
        gc.collect()
        sys.exit(0)
    _, status = os.waitpid(-1, 0)
    print("child status", os.waitstatus_to_exitcode(status), flush=True)
"""


@pytest.mark.timeout(60)
def test_a_child_forked_from_a_master_store_exits_without_asyncio_warnings() -> None:
    """The child inherits the parent's loop and the task that holds its store server; no thread of
    the child runs them, and collecting them must not print "Task was destroyed but it is pending!"."""
    code, out, err = _run(MASTER_FORKS, str(free_port()), timeout=30)
    assert code == 0, err[-3000:]
    assert "child got v" in out and "child status 0" in out, out + err
    assert "Task was destroyed" not in err and "Traceback" not in err, err[-3000:]
