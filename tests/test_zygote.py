"""The suite's torch rank processes are forked from a zygote (``tests/zygote.py``): each must
behave as the ``python -m`` process it stands for."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

pytest.importorskip("torch")

from tests.harness import PY, ROOT, popen_torch


@pytest.mark.timeout(60)
def test_a_forked_rank_is_what_python_dash_m_would_have_been() -> None:
    argv = [PY, "-m", "tests.zygote_probe"]
    ok, failing, stopped = (popen_torch([*argv, how], {"PROBE": how}) for how in ("3", "raise", "sleep"))
    out, err = ok.communicate(timeout=30)
    seen = json.loads(out)
    assert ok.returncode == 3 and err == ""
    assert seen == {
        "argv": ["3"],
        "probe": "3",
        "autoload": None,  # (the zygote's own setting is not the rank's)
        "cwd": str(ROOT),
        "arendez_imported": False,  # (it reads settings from the environment when imported)
        "own_session": True,
        "main": "__main__",
    }
    out, err = failing.communicate(timeout=30)
    assert failing.returncode == 1
    assert err.rstrip().endswith("RuntimeError: the probe fails as asked")
    assert stopped.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        stopped.communicate(timeout=0.5)
    stopped.kill()
    out, _ = stopped.communicate(timeout=30)
    assert stopped.returncode == -signal.SIGKILL
    assert json.loads(out)["argv"] == ["sleep"]


@pytest.mark.timeout(60)
def test_children_die_with_the_zygote_and_the_next_spawn_gets_a_new_one() -> None:
    from tests import zygote

    argv = [PY, "-m", "tests.zygote_probe"]
    orphan = popen_torch([*argv, "sleep"])
    assert zygote._zygote is not None
    zygote._zygote.proc.kill()
    assert orphan.wait(30) == -signal.SIGKILL
    for _ in range(100):  # (its death is the kernel's: PR_SET_PDEATHSIG)
        try:
            os.kill(orphan.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        raise AssertionError(f"pid {orphan.pid} outlived its zygote")
    again = popen_torch([*argv, "0"])
    out, _ = again.communicate(timeout=30)
    assert again.returncode == 0 and json.loads(out)["argv"] == ["0"]
