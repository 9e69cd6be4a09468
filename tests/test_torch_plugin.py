"""Backend ``"arendez"`` reaches a plain torch script through torch's plugin entry point."""

from __future__ import annotations

import os
import signal
import socket

import pytest

from tests.harness import PY, ROOT, popen

pytest.importorskip("torch")


def test_import_torch_registers_the_backend_lazily() -> None:
    probe = (
        "import sys, torch, torch.distributed as dist; "
        "print('ARENDEZ' in dist.Backend._plugins, 'arendez.torch' in sys.modules)"
    )
    proc = popen([PY, "-c", probe])
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-2000:]
    assert out.split() == ["True", "False"]  # registered, and nothing heavy imported yet


def _torchrun(script: str) -> list[str]:
    """Run ``tests/scripts/<script>`` under torchrun with 2 workers; their "rank ..." lines."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = [
        PY,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-port",
        str(port),
        str(ROOT / "tests" / "scripts" / script),
    ]
    proc = popen(argv)  # its own session: torchrun and its workers go down together on a hang
    try:
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, err[-2000:]
    return sorted(line for line in out.splitlines() if line.startswith("rank "))


@pytest.mark.timeout(150)
def test_torchrun_script_that_never_imports_arendez() -> None:
    lines = _torchrun("plain_torch_backend.py")
    assert lines == [f"rank {r} of 2 backend arendez sum [3.0, 3.0, 3.0, 3.0]" for r in range(2)]


@pytest.mark.timeout(150)
def test_a_script_ported_by_its_import_line_runs_under_torchrun() -> None:
    """torchrun's agent holds MASTER_PORT (TORCHELASTIC_USE_AGENT_STORE): env:// meets through
    its store instead of binding the port (QA3 F6: "address already in use")."""
    lines = _torchrun("sync_under_torchrun.py")
    sums = [[3.0] * 4] * 2
    assert lines == [f"rank {r} agent store True sums {sums}" for r in range(2)]
