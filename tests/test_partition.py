"""Network cuts between emulated hosts: what each side sees, and how soon.

The server (host 0) and the ranks (hosts 1, 2, ...) live in network namespaces on one bridge
(``benchmarks/netns.py``).

- The server's link goes down for three leases: it hears no heartbeat from anyone, which is its
  own isolation as likely as every rank's death, so it must not declare the ranks failed. The
  ranks keep reducing between themselves; once the link is back the server hears them again,
  restarts every lease, and the job ends cleanly, store calls included.
- A rank's host is cut off for good: the server declares it failed to the others within a lease,
  and the rank itself, which hears neither, raises once its peer links go unacknowledged for
  ``ARENDEZ_LINK_TIMEOUT`` (``arendez/linkwatch.py``), not at its collective's timeout.
- The link between two ranks' hosts is cut while the server hears both: no lease runs out, and
  both raise, naming the cut, after ``ARENDEZ_LINK_TIMEOUT``.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.harness import ROOT, Lines, emulated_hosts, failed_after, start_cut_job

sys.path.insert(0, str(ROOT / "benchmarks"))
from netns import Hosts, ip

LEASE = 1.5
LINK_TIMEOUT = 3.0
PORT = 29471
HTTP_PORT = 29472  # (on the server's own loopback: reachable from its namespace while cut off)


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


@pytest.mark.timeout(90)
def test_a_rank_whose_host_is_cut_off_raises_after_the_link_timeout_and_the_other_at_the_lease(
    hosts: Hosts,
) -> None:
    _, procs, outs, errs = start_cut_job(hosts, 2, "hostcut", PORT, LEASE, LINK_TIMEOUT)
    cut_at = time.time()
    ip("-n", hosts.switch, "link", "set", "p2", "down")  # (rank 1's cable, pulled at the switch)

    _, error = failed_after(outs[0], errs[0], cut_at, 5 * LEASE)
    assert error.startswith("RankFailedError: rank 1 failed during all_reduce: declared failed by the"), error
    # the cut-off rank hears neither the server nor rank 0: its link to rank 0 goes unanswered
    _, error = failed_after(outs[1], errs[1], cut_at, 4 * LINK_TIMEOUT + 10)
    assert error.startswith("RankFailedError: rank 0 failed during all_reduce: connection lost (its"), error
    assert "stopped acknowledging what it was sent" in error and "the network to it is cut" in error, error
    for proc in procs:
        assert proc.wait(timeout=20) == 3


@pytest.mark.timeout(90)
def test_a_cut_between_two_ranks_the_server_hears_ends_both_collectives_naming_the_cut(hosts: Hosts) -> None:
    server_log, procs, outs, errs = start_cut_job(hosts, 2, "paircut", PORT, LEASE, LINK_TIMEOUT)
    cut_at = time.time()
    hosts.cut(1, 2)

    for rank, other in ((0, 1), (1, 0)):
        _, error = failed_after(outs[rank], errs[rank], cut_at, 4 * LINK_TIMEOUT + 10)
        expected = f"RankFailedError: rank {other} failed during all_reduce: connection lost (its host"
        assert error.startswith(expected) and "stopped acknowledging" in error, error
    for proc in procs:
        assert proc.wait(timeout=20) == 3
    assert "declared failed" not in str(server_log), server_log  # (it heard both all along)
