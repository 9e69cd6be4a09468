"""The multi-host benchmark's topology, briefly: two emulated hosts, a shaped link, one all_reduce.

Each host is a network namespace with a private /dev/shm (``benchmarks/netns.py``); the link is
shaped with tbf. A 2-rank arendez all_reduce between them must be exact, must cross the link (the
veth counters show it) and must not use shared memory (the hosts share none).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator

import pytest

from tests.harness import ROOT, emulated_hosts

sys.path.insert(0, str(ROOT / "benchmarks"))
from netns import Hosts

NBYTES = 4 << 20


@pytest.fixture
def hosts() -> Iterator[Hosts]:
    with emulated_hosts("mt", 2) as topo:
        yield topo


@pytest.mark.timeout(60)
def test_all_reduce_between_two_shaped_hosts(hosts: Hosts) -> None:
    hosts.shape(1_000_000_000)
    qdisc = hosts.tc_show(0)
    assert "tbf" in qdisc and "1Gbit" in qdisc, qdisc
    before = [hosts.port_bytes(h) for h in range(2)]
    procs = []
    for rank in range(2):
        spec = {
            "backend": "arendez",
            "rank": rank,
            "world": 2,
            "master": f"{hosts.address(0)}:29461",
            "sizes": [NBYTES],
            "iters": 1,
            "warmup": 0,
        }
        argv = [sys.executable, str(ROOT / "benchmarks" / "multihost_rank.py"), json.dumps(spec)]
        procs.append(hosts.run(rank, argv, {"PYTHONPATH": str(ROOT)}))
    results = []
    for rank, proc in enumerate(procs):
        out, err = proc.communicate(timeout=40)
        assert proc.returncode == 0, f"rank {rank} exited {proc.returncode}:\n{err[-3000:]}"
        results.append(json.loads(out.strip().splitlines()[-1]))
    for result in results:
        assert result[str(NBYTES)]["ok"], "all_reduce result is not the exact sum"
        assert result["stats"]["received_bytes"] >= NBYTES, result["stats"]
        assert result["stats"]["shm_bytes"] == 0, "hosts must not share memory"
    for h in range(2):
        rx, tx = (now - then for now, then in zip(hosts.port_bytes(h), before[h], strict=True))
        assert rx > NBYTES and tx > NBYTES, (h, rx, tx)  # checked + timed call, half each way
