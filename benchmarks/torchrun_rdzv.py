"""A torchrun node lost: ``--rdzv-backend arendez`` against ``c10d``, side by side in one run.

A third configuration, ``c10d-server``, runs torch's own ``c10d`` backend with an
``arendez-server --tcpstore-port`` as its endpoint: the rendezvous store (and the store the workers
share) is then the server, not the first agent.

    python benchmarks/torchrun_rdzv.py                  # 3 trials each (~2 minutes)
    python benchmarks/torchrun_rdzv.py --trials 5

Each trial starts two torchrun agents of one worker each (``--nnodes 1:2 --max-restarts 1``,
torch's heartbeats shortened: ``keep_alive_interval=1,keep_alive_max_attempt=2,
last_call_timeout=2``), whose workers all_reduce every 50 ms (``tests/scripts/torchrun_steps.py``,
torch backend ``arendez`` under both: only the rendezvous differs). Once both run, the first agent (under
c10d the one that hosts the rendezvous store) and its worker are killed with SIGKILL, as a node
that vanishes. Reported per backend: the time from launch to both workers running, whether the
other agent went on (its worker restarted in a world of 1 and finished: exit 0), and the time
from the kill to its restarted worker running. One host: one clock.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
SCRIPT = str(ROOT / "tests" / "scripts" / "torchrun_steps.py")
QUICK = "keep_alive_interval=1,keep_alive_max_attempt=2,last_call_timeout=2,read_timeout=20"
START = re.compile(r"start rank \d+ of (\d+) restart (\d+) pid (\d+)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _agent(backend: str, endpoint: str, run_id: str, env: dict[str, str]) -> subprocess.Popen[str]:
    argv = [PY, "-m", "torch.distributed.run", "--nnodes", "1:2", "--nproc-per-node", "1"]
    argv += ["--max-restarts", "1", "--rdzv-backend", backend, "--rdzv-endpoint", endpoint]
    argv += ["--rdzv-id", run_id, "--rdzv-conf", QUICK, SCRIPT]
    return subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env, start_new_session=True
    )


def _kill_all(agents: list[subprocess.Popen[str]], pids_file: str) -> None:
    for agent in agents:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(agent.pid, signal.SIGKILL)
        agent.wait()
    with contextlib.suppress(FileNotFoundError), open(pids_file) as pids:
        for pid in pids.read().split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)


def trial(backend: str, endpoint: str, run_id: str, folder: str) -> dict[str, Any]:
    """One trial: both agents up, the first one's node killed, the other followed to its end."""
    pids = os.path.join(folder, f"pids-{run_id}")
    env = dict(os.environ, STEPS="200", STEP_SECONDS="0.05", WORKER_PIDS=pids)
    env["PYTHONPATH"] = str(ROOT)
    launched = time.time()
    doomed = _agent(backend, endpoint, run_id, env)
    time.sleep(1.0)  # (under c10d the first agent binds the endpoint: it hosts the store)
    survivor = _agent(backend, endpoint, run_id, env)
    agents = [doomed, survivor]
    try:
        assert doomed.stdout is not None and survivor.stdout is not None
        first = START.search(doomed.stdout.readline())
        running = START.search(survivor.stdout.readline())
        if first is None or running is None or first[1] != "2":
            return {"error": "the agents did not form a world of 2"}
        both_running = time.time() - launched
        os.killpg(doomed.pid, signal.SIGKILL)  # the node vanishes: its agent and its worker
        os.kill(int(first[3]), signal.SIGKILL)
        killed = time.time()
        restarted: float | None = None
        for line in survivor.stdout:
            found = START.search(line)
            if found is not None and restarted is None:
                restarted = time.time() - killed
        code = survivor.wait(timeout=120)
        return {"both_running": both_running, "went_on": code == 0, "restarted": restarted, "exit": code}
    finally:
        _kill_all(agents, pids)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--trials", type=int, default=3)
    args = parser.parse_args()
    rows: dict[str, list[dict[str, Any]]] = {"arendez": [], "c10d": [], "c10d-server": []}
    with tempfile.TemporaryDirectory() as folder:
        server_port, tcpstore_port = _free_port(), _free_port()
        argv = [PY, "-m", "arendez_server", "--port", str(server_port), "--log-level", "ERROR"]
        server = subprocess.Popen(
            [*argv, "--tcpstore-port", str(tcpstore_port)],
            stdout=subprocess.PIPE,
            text=True,
            env=dict(os.environ, PYTHONPATH=str(ROOT)),
        )
        assert server.stdout is not None
        server.stdout.readline()
        try:
            for n in range(args.trials):  # (alternating, so both see the same load)
                for label in rows:
                    port = {"arendez": server_port, "c10d-server": tcpstore_port}.get(label) or _free_port()
                    backend = label.split("-")[0]
                    got = trial(backend, f"127.0.0.1:{port}", f"t{n}-{label}", folder)
                    print(label, n, got, flush=True)
                    rows[label].append(got)
        finally:
            server.terminate()
            server.wait(10)
    print(
        "\n| backend | trials | both workers running (median) | other agent went on "
        "| kill -> restarted worker running (median) |"
    )
    print("|---|---|---|---|---|")
    for backend, results in rows.items():
        ok = [r for r in results if "error" not in r]
        start = statistics.median(r["both_running"] for r in ok) if ok else float("nan")
        went = sum(r["went_on"] for r in ok)
        times = [r["restarted"] for r in ok if r["went_on"] and r["restarted"] is not None]
        back = f"{statistics.median(times):.2f} s" if times else "-"
        print(f"| {backend} | {len(results)} | {start:.2f} s | {went} of {len(results)} | {back} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
