"""The example scripts print what the documentation shows."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.harness import ROOT, _env


def _run(name: str) -> str:
    proc = subprocess.run(
        [sys.executable, f"examples/{name}.py"],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.timeout(70)
@pytest.mark.parametrize("name", ["init_destroy", "init_destroy_sync"])
def test_init_destroy(name):
    assert _run(name).splitlines() == ["Group initialized: True", "Group destroyed; initialized: False"]


@pytest.mark.timeout(70)
@pytest.mark.parametrize("name", ["subgroup_destroy", "subgroup_destroy_sync"])
def test_subgroup_destroy(name):
    out = _run(name)
    for rank in (0, 1):
        assert f"rank {rank}: subgroup sum 3; subgroup destroyed; default group alive: True" in out
        assert f"rank {rank}: all destroyed; initialized: False" in out


@pytest.mark.timeout(70)
@pytest.mark.parametrize("name", ["destroy_then_error", "destroy_then_error_sync"])
def test_destroy_then_error(name):
    out = _run(name)
    for rank in (0, 1):
        assert f"rank {rank}: after all_reduce [3. 3. 3.]" in out
        assert f"rank {rank}: error after destroy: NotInitializedError" in out
    assert "init_process_group" in out


@pytest.mark.timeout(70)
def test_allreduce_demo_against_standalone_server():
    out = _run("allreduce_demo")
    assert "arendez-server listening on arendez://" in out
    for rank in range(4):
        assert f"rank {rank}/4: all_reduce -> [0.0, 10.0, 20.0, 30.0] [ok]" in out
    assert out.rstrip().endswith("demo succeeded")
