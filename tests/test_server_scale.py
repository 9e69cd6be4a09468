"""The server at scale: thousands of simulated ranks through a real server process, O(1) per rank.

Simulated ranks are asyncio tasks in a few processes (the worker of
``benchmarks/server_bench.py``): each connects, joins with ``peers=False`` and its ring
neighbours' addresses, then stays a member for longer than the lease.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import time

import pytest

import arendez as dist
from tests.harness import PY, ROOT, _env, start_server

BENCH = str(ROOT / "benchmarks" / "server_bench.py")


def _swarm(port: int, job: str, world: int, procs: int, hold: float, timeout: float) -> list[dict]:
    per = [world // procs + (1 if i < world % procs else 0) for i in range(procs)]
    workers = [
        subprocess.Popen(
            [PY, BENCH, "--worker", "arendez-ranks", str(port), job, str(world), str(n), str(hold)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=_env(),
        )
        for n in per
    ]
    try:
        for w in workers:
            assert w.stdout is not None and w.stdout.readline().strip() == "ready"
        go = time.time() + 0.2
        results = []
        for w in workers:
            assert w.stdin is not None
            w.stdin.write(f"{go}\n")
            w.stdin.flush()
        for w in workers:
            out, _ = w.communicate(timeout=timeout)
            results.append(json.loads(out.strip().splitlines()[-1]))
        return results
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()
                w.wait()


@pytest.mark.timeout(60)
def test_2000_simulated_ranks_rendezvous_and_none_is_declared_failed():
    srv = start_server("--log-level", "INFO")  # the default lease, 2.5 s
    try:
        # the ranks stay joined for longer than the lease after the round completes
        results = _swarm(srv.port, "swarm", 2000, 2, hold=3.0, timeout=50)
    finally:
        srv.stop()  # (a summary of departures still open is written as the server exits)
    log = srv.stderr_text()
    for r in results:
        assert r["errors"] == [], r["errors"]
        assert r["end"] > 0
    failed = sorted({rank for r in results for rank in r["failed"]})
    assert failed == [], f"ranks declared failed while every rank was healthy: {failed}\n{log[-2000:]}"
    assert "no heartbeat" not in log  # nor did it declare anyone failed without telling
    # 2,000 ranks leaving: the first of each burst is a line, the rest one summary line per second
    single = re.findall(r"job 'swarm' rank \d+ left the job", log)
    summarised = sum(int(n) for n in re.findall(r"(\d+) more rank\(s\) left: job 'swarm'", log))
    assert len(single) + summarised == 2000, log[-2000:]
    assert len(single) <= 10, f"{len(single)} lines for 2,000 departures"


@pytest.mark.timeout(30)
async def test_join_without_peers_and_addresses_on_demand(arendez_server):
    stores = [
        await dist.Store("127.0.0.1", arendez_server.port, "lazy", timeout=10).connect() for _ in range(3)
    ]
    try:
        members = await asyncio.gather(
            *(s.join(3, i, f"10.0.0.{i}:1", peers=False, neighbours=[1]) for i, s in enumerate(stores))
        )
        for i, m in enumerate(members):
            assert m.peers == [] and m.addresses == {(i + 1) % 3: f"10.0.0.{(i + 1) % 3}:1"}
        assert await stores[0].addresses([2, 1]) == {2: "10.0.0.2:1", 1: "10.0.0.1:1"}
        with pytest.raises(dist.RendezvousError, match="not a member"):
            await stores[0].addresses([3])
    finally:
        for s in stores:
            await s.close()


@pytest.mark.timeout(30)
async def test_departures_reach_the_other_members_once_each(arendez_server):
    stores = [
        await dist.Store("127.0.0.1", arendez_server.port, "bye", timeout=10).connect() for _ in range(4)
    ]
    seen: list[list[dict]] = [[] for _ in stores]
    for s, box in zip(stores, seen, strict=True):
        s.on_event = box.append
    try:
        await asyncio.gather(*(s.join(4, -1, "a:1", peers=False) for s in stores))
        ranks = [s._membership.rank for s in stores]  # type: ignore[union-attr]
        await asyncio.gather(stores[0].leave(), stores[1].leave())
        for _ in range(100):
            if all(len(box) >= 2 for box in seen[2:]):
                break
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.1)  # nothing more comes
        for box in seen[2:]:
            assert sorted((e["event"], e["rank"]) for e in box) == [
                ("rank_left", ranks[0]),
                ("rank_left", ranks[1]),
            ]
    finally:
        for s in stores:
            await s.close()
