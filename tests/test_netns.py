"""The docker-compose topology on network namespaces: a server and 4 ranks, each on its own host.

A "switch" namespace holds a bridge; the server (198.18.0.1) and ranks 0..3 (198.18.0.11..14) each
live in their own namespace, wired to the bridge by a veth pair. In its own namespace 127.0.0.1 is
nobody else's, so the job only completes if every rank advertises its 198.18 address (the local
address of its store connection) and the peers dial each other through the bridge, which the veth
byte counters must show.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.harness import popen

WORLD = 4
SERVER_IP = "198.18.0.1"
PORT = 29400
FEATURES, STEPS = 16384, 20  # 128 KiB of gradient per step and rank: the traffic shows on the counters


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")


@dataclass
class Topology:
    prefix: str
    hosts: dict[str, str] = field(default_factory=dict)  # node name -> its address
    namespaces: list[str] = field(default_factory=list)
    procs: list[subprocess.Popen[str]] = field(default_factory=list)

    @property
    def switch(self) -> str:
        return f"{self.prefix}-sw"

    def ns(self, node: str) -> str:
        return f"{self.prefix}-{node}"

    def add_namespace(self, name: str) -> None:
        _ip("netns", "add", name)
        self.namespaces.append(name)
        _ip("-n", name, "link", "set", "lo", "up")

    def add_host(self, node: str, address: str) -> None:
        """A namespace with ``eth0`` = ``address``/15, its veth peer ``p-<node>`` on the bridge."""
        name, port = self.ns(node), f"p-{node}"
        self.add_namespace(name)
        _ip("link", "add", "eth0", "netns", name, "type", "veth", "peer", "name", port, "netns", self.switch)
        _ip("-n", self.switch, "link", "set", port, "master", "br0", "up")
        _ip("-n", name, "addr", "add", f"{address}/15", "dev", "eth0")
        _ip("-n", name, "link", "set", "eth0", "up")
        self.hosts[node] = address

    def port_bytes(self, node: str) -> tuple[int, int]:
        """(rx, tx) bytes of ``node``'s ``eth0``."""
        out = subprocess.run(
            ["ip", "-n", self.ns(node), "-j", "-s", "link", "show", "eth0"],
            capture_output=True,
            text=True,
            check=True,
            timeout=10,
        ).stdout
        stats = json.loads(out)[0]["stats64"]
        return stats["rx"]["bytes"], stats["tx"]["bytes"]

    def run(self, node: str, *argv: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
        proc = popen(["ip", "netns", "exec", self.ns(node), *argv], env)
        self.procs.append(proc)
        return proc

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
        for name in reversed(self.namespaces):  # deleting a namespace also deletes its veth ends
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=10)


@pytest.fixture
def topology() -> Iterator[Topology]:
    topo = Topology(f"arz{os.getpid()}")
    try:
        try:
            topo.add_namespace(topo.switch)
        except (RuntimeError, OSError) as exc:  # no ip(8), not root, or the kernel refuses
            pytest.skip(f"cannot create a network namespace: {exc}")
        _ip("-n", topo.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", topo.switch, "link", "set", "br0", "up")
        topo.add_host("srv", SERVER_IP)
        for rank in range(WORLD):
            topo.add_host(f"r{rank}", f"198.18.0.{11 + rank}")
        yield topo
    finally:
        topo.close()
        left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert topo.prefix not in left, f"namespaces left behind: {left}"


def _own_dir(path: Path) -> Path:
    path.mkdir()
    return path


@pytest.mark.timeout(60)
def test_compose_topology_on_network_namespaces(topology: Topology, tmp_path: Path) -> None:
    server = topology.run(
        "srv", sys.executable, "-m", "arendez_server", "--host", SERVER_IP, "--port", str(PORT)
    )
    assert server.stdout is not None
    line = server.stdout.readline()
    assert f"listening on arendez://{SERVER_IP}:{PORT}" in line, (
        line,
        server.stderr and server.stderr.read(),
    )
    before = {node: topology.port_bytes(node) for node in topology.hosts}
    ranks = [
        topology.run(
            f"r{rank}",
            sys.executable,
            "examples/train_sgd.py",
            "--features",
            str(FEATURES),
            "--steps",
            str(STEPS),
            "--lr",
            "0.001",
            env={
                "ARENDEZ_URL": f"arendez://{SERVER_IP}:{PORT}/sgd",
                "RANK": str(rank),
                "WORLD_SIZE": str(WORLD),
                # namespaces share /dev/shm, hosts do not: a directory of its own per "host"
                # makes every shared-memory offer fail, so the gradients must cross the bridge
                "ARENDEZ_SHM_DIR": str(_own_dir(tmp_path / f"shm{rank}")),
            },
        )
        for rank in range(WORLD)
    ]
    deadline = time.monotonic() + 40  # one budget for all ranks, inside the test's timeout
    outputs = []
    for rank, proc in enumerate(ranks):
        try:
            outputs.append(proc.communicate(timeout=max(0.1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            pytest.fail(f"rank {rank} hung: peers could not reach each other across the bridge")
    for rank, (proc, (out, err)) in enumerate(zip(ranks, outputs, strict=True)):
        assert proc.returncode == 0, f"rank {rank} exited {proc.returncode}:\n{out}\n{err[-3000:]}"
        assert f"rank {rank}/{WORLD} loss=" in out
    assert "rank 0: final loss " in outputs[0][0]
    assert f"weights identical on all {WORLD} ranks" in outputs[0][0]

    payload = FEATURES * 8 * STEPS  # what one rank contributes to the all_reduces, in bytes
    for node in topology.hosts:
        rx, tx = (now - then for now, then in zip(topology.port_bytes(node), before[node], strict=True))
        if node == "srv":
            # The server only brokers the rendezvous: the gradients went from peer to peer.
            assert rx + tx < payload / 4, (node, rx, tx)
        else:
            assert rx > payload and tx > payload, (node, rx, tx)

    server.send_signal(signal.SIGTERM)
    assert server.wait(timeout=10) == 0
