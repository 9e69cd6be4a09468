"""Emulated hosts on one machine: a network namespace per host, wired to a bridge, links shaped.

Each host is a namespace with ``eth0`` (10.77.0.<i+1>/24) whose veth peer sits on a bridge in a
"switch" namespace. ``shape(rate)`` puts a token-bucket filter (tbf; this kernel has no netem) on
both ends of every link, so a host sends and receives at most ``rate``. ``run`` starts a process
on a host inside a private mount namespace with a fresh tmpfs on /dev/shm: hosts share no shared
memory, as real ones do not. Needs root (``ip netns``, ``unshare -m``, ``mount``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Mapping, Sequence

SUBNET = "10.77.0"


def ip(*args: str) -> None:
    """Run ``ip args``; ``RuntimeError`` with its message if it fails."""
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")


def tc(namespace: str, *args: str) -> None:
    done = subprocess.run(
        ["ip", "netns", "exec", namespace, "tc", *args], capture_output=True, text=True, timeout=10
    )
    if done.returncode != 0:
        raise RuntimeError(f"tc {' '.join(args)} in {namespace}: {done.stderr.strip()}")


class Hosts:
    """``count`` emulated hosts; ``close()`` kills what ran on them and deletes the namespaces."""

    def __init__(self, prefix: str, count: int) -> None:
        self.prefix = prefix
        self.count = count
        self.namespaces: list[str] = []
        self.procs: list[subprocess.Popen[str]] = []
        self.rate_bits = 0
        try:
            self._add_namespace(self.switch)
            ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            ip("-n", self.switch, "link", "set", "br0", "up")
            for i in range(count):
                self._add_host(i)
        except BaseException:
            self.close()
            raise

    @property
    def switch(self) -> str:
        return f"{self.prefix}-sw"

    def ns(self, host: int) -> str:
        return f"{self.prefix}-h{host}"

    def address(self, host: int) -> str:
        return f"{SUBNET}.{host + 1}"

    def _add_namespace(self, name: str) -> None:
        ip("netns", "add", name)
        self.namespaces.append(name)
        ip("-n", name, "link", "set", "lo", "up")

    def _add_host(self, host: int) -> None:
        name, port = self.ns(host), f"p{host}"
        self._add_namespace(name)
        ip("link", "add", "eth0", "netns", name, "type", "veth", "peer", "name", port, "netns", self.switch)
        ip("-n", self.switch, "link", "set", port, "master", "br0", "up")
        ip("-n", name, "addr", "add", f"{self.address(host)}/24", "dev", "eth0")
        ip("-n", name, "link", "set", "eth0", "up")

    def shape(self, rate_bits: int) -> None:
        """Limit every link to ``rate_bits`` per second in each direction (tbf on both ends)."""
        burst = max(64 * 1024, rate_bits // 8 // 500)  # 2 ms of tokens: enough for the timer's tick
        spec = ["root", "tbf", "rate", f"{rate_bits}bit", "burst", str(burst), "latency", "20ms"]
        for host in range(self.count):
            tc(self.ns(host), "qdisc", "replace", "dev", "eth0", *spec)
            tc(self.switch, "qdisc", "replace", "dev", f"p{host}", *spec)
        self.rate_bits = rate_bits

    def cut(self, a: int, b: int) -> None:
        """Drop every packet the switch would forward between hosts ``a`` and ``b`` (both ways),
        as a partition between them would; their links to the other hosts stay up."""

        def nft(*args: str) -> None:
            done = subprocess.run(
                ["ip", "netns", "exec", self.switch, "nft", *args], capture_output=True, text=True, timeout=10
            )
            if done.returncode != 0:
                raise RuntimeError(f"nft {' '.join(args)} in {self.switch}: {done.stderr.strip()}")

        nft("add", "table", "bridge", "cuts")
        nft("add", "chain", "bridge", "cuts", "forward", "{ type filter hook forward priority 0; }")
        for src, dst in ((a, b), (b, a)):
            nft("add", "rule", "bridge", "cuts", "forward", "ip", "saddr", self.address(src),
                "ip", "daddr", self.address(dst), "drop")  # fmt: skip

    def tc_show(self, host: int) -> str:
        """``tc qdisc show dev eth0`` on ``host``."""
        done = subprocess.run(
            ["ip", "netns", "exec", self.ns(host), "tc", "qdisc", "show", "dev", "eth0"],
            capture_output=True,
            text=True,
            check=True,
            timeout=10,
        )
        return done.stdout

    def port_bytes(self, host: int) -> tuple[int, int]:
        """(rx, tx) bytes of ``host``'s ``eth0``."""
        out = subprocess.run(
            ["ip", "-n", self.ns(host), "-j", "-s", "link", "show", "eth0"],
            capture_output=True,
            text=True,
            check=True,
            timeout=10,
        ).stdout
        stats = json.loads(out)[0]["stats64"]
        return stats["rx"]["bytes"], stats["tx"]["bytes"]

    def run(
        self, host: int, argv: Sequence[str], env: Mapping[str, str] | None = None, shm_bytes: int = 1 << 30
    ) -> subprocess.Popen[str]:
        """Start ``argv`` on ``host`` (own session), with a private tmpfs /dev/shm of ``shm_bytes``."""
        script = f'mount -t tmpfs -o size={shm_bytes} tmpfs /dev/shm && exec "$@"'
        cmd = ["ip", "netns", "exec", self.ns(host), "unshare", "-m", "--propagation", "private"]
        cmd += ["sh", "-c", script, "host", *argv]
        proc = subprocess.Popen(
            cmd,
            env={**os.environ, **(env or {})},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        self.procs.append(proc)
        return proc

    def close_procs(self) -> None:
        """Kill (whole sessions) and reap every process started with ``run``."""
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
        self.procs.clear()

    def close(self) -> None:
        self.close_procs()
        for name in reversed(self.namespaces):  # deleting a namespace also deletes its veth ends
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=10)
        self.namespaces.clear()
