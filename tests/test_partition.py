"""A server cut off from the network: it holds its failure declarations, and the job goes on.

The server (host 0) and two ranks (hosts 1 and 2) live in network namespaces on one bridge
(``benchmarks/netns.py``). The server's link goes down for three leases: it hears no heartbeat
from anyone, which is its own isolation as likely as every rank's death, so it must not declare
the ranks failed. The ranks keep reducing between themselves; once the link is back the server
hears them again, restarts every lease, and the job ends cleanly, store calls included.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.harness import ROOT, emulated_hosts

sys.path.insert(0, str(ROOT / "benchmarks"))
from netns import Hosts, ip

LEASE = 1.5
PORT = 29471
HTTP_PORT = 29472  # (on the server's own loopback: reachable from its namespace while cut off)


class Lines:
    """Every line a process writes to ``stream``, read by a thread, waited for by substring."""

    def __init__(self, stream: object) -> None:
        self.lines: list[str] = []
        self._changed = threading.Condition()
        threading.Thread(target=self._read, args=(stream,), daemon=True).start()

    def _read(self, stream: object) -> None:
        for line in stream:  # type: ignore[attr-defined]
            with self._changed:
                self.lines.append(line)
                self._changed.notify_all()

    def wait_for(self, text: str, timeout: float) -> bool:
        with self._changed:
            return self._changed.wait_for(lambda: any(text in line for line in self.lines), timeout)

    def __str__(self) -> str:
        with self._changed:
            return "".join(self.lines)[-4000:]


@pytest.fixture
def hosts() -> Iterator[Hosts]:
    with emulated_hosts("pt", 3) as topo:
        yield topo


@pytest.mark.timeout(90)
def test_a_server_cut_off_for_three_leases_declares_no_rank_failed_and_the_job_ends_cleanly(
    hosts: Hosts, tmp_path: Path
) -> None:
    argv = ["-m", "arendez_server", "--host", "0.0.0.0", "--port", str(PORT), "--lease", str(LEASE)]
    argv += ["--http-port", str(HTTP_PORT)]
    server = hosts.run(0, [sys.executable, *argv])
    server_log = Lines(server.stderr)
    server_out = Lines(server.stdout)
    assert server_out.wait_for("listening on", 20), server_log
    url = f"arendez://{hosts.address(0)}:{PORT}/cut"
    stop = tmp_path / "stop"
    ranks = [
        hosts.run(
            host,
            [sys.executable, "-m", "tests.partition_rank", url, "2", str(host - 1), str(stop)],
            {"PYTHONPATH": str(ROOT)},
        )
        for host in (1, 2)
    ]
    outs = [Lines(proc.stdout) for proc in ranks]
    errs = [Lines(proc.stderr) for proc in ranks]
    for rank, out in enumerate(outs):
        assert out.wait_for("READY", 30), f"rank {rank} never joined:\n{errs[rank]}"
    time.sleep(1.0)  # a second of steady heartbeats

    ip("-n", hosts.ns(0), "link", "set", "eth0", "down")
    # every lease runs out, with no heartbeat heard: the server says it holds its declarations
    assert server_log.wait_for("holding failure declarations", 3 * LEASE), server_log
    said = _status_and_metrics(hosts)
    assert '"holding_declarations": true' in said and "arendez_holding_declarations 1.0" in said, said
    time.sleep(3 * LEASE)
    ip("-n", hosts.ns(0), "link", "set", "eth0", "up")
    # (the ranks' connections come back at the pace of TCP's retransmission backoff)
    assert server_log.wait_for("heard clients again", 30), server_log
    stop.touch()

    for rank, proc in enumerate(ranks):
        proc.wait(timeout=40)
        assert proc.returncode == 0, f"rank {rank} exited {proc.returncode}:\n{errs[rank]}"
        assert outs[rank].wait_for("DONE", 1), outs[rank]
    assert "declared failed" not in str(server_log), server_log
    said = _status_and_metrics(hosts)
    assert '"holding_declarations": false' in said and "arendez_holding_declarations 0.0" in said, said


def _status_and_metrics(hosts: Hosts) -> str:
    """The server's /status and /metrics, fetched from inside its namespace."""
    base = f"http://127.0.0.1:{HTTP_PORT}/"
    fetch = (
        "import urllib.request as u; "
        f"[print(u.urlopen({base!r} + page, timeout=5).read().decode()) for page in ('status', 'metrics')]"
    )
    proc = hosts.run(0, [sys.executable, "-c", fetch])
    out, err = proc.communicate(timeout=20)
    assert proc.returncode == 0, err
    return out
