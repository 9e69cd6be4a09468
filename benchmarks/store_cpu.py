"""Where the CPU of one store op goes: server and clients, TCPStore vs arendez, one op in flight.

::

    python benchmarks/store_cpu.py --netns [--clients 32] [--seconds 3] [--kinds tcpstore blocking ...]

Each client is a process looping over ``set`` of its own key, ``get`` of it and ``add`` on a
shared counter for ``--seconds``, from a common start. The clients of one kind run against their
own server (TCPStore's libuv server, or ``arendez-server``); the server's CPU comes from
``/proc`` over the timed window, each client's from ``os.times`` around its loop. Kinds:

- ``tcpstore``: torch's TCPStore client (C++);
- ``torch-client``: the same client against ``arendez-server --tcpstore-port`` (the server's
  cost for torch's protocol, with torch's client);
- ``blocking``: arendez's ``BlockingStore``;
- ``raw``: the floor of a Python client: the same connection, ready-made request frames,
  ``sendall`` + ``recv_into`` and nothing else (no encoding, no checks);
- ``encoded``: ``raw`` plus msgpack encoding of each request and decoding of each reply.

Reported per op: ops/s, the server's user and system CPU, the clients' user and system CPU (µs).
Run it in a private network namespace (``--netns``), as ``server_bench.py``: TCPStore
reverse-resolves its peers and stalls on the resolver otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import bench_common

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
KINDS = ("tcpstore", "torch-client", "blocking", "raw", "encoded")


def _connect(kind: str, port: int, index: int) -> tuple[Any, str, str]:
    """One client's store, its own key and the shared one."""
    store: Any
    if kind in ("tcpstore", "torch-client"):
        from torch.distributed import TCPStore

        store = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60), use_libuv=True)
        key, shared = f"cpu/k{index}", "cpu/shared"
    else:
        from arendez.blocking_store import BlockingStore

        blocking = BlockingStore("127.0.0.1", port, "cpu", timeout=60).connect()
        key, shared = f"k{index}", "shared"
        store = blocking if kind == "blocking" else _Bare(blocking, kind == "encoded")
    return store, key, shared


def _client(store: Any, key: str, shared: str, go: float, seconds: float) -> dict[str, Any]:
    """Loop until ``go + seconds``; the op count and this process's CPU meanwhile."""
    time.sleep(max(0.0, go - time.time()))
    stop, ops, value = go + seconds, 0, b"v" * 32
    before = os.times()
    while time.time() < stop:
        store.set(key, value)
        store.get(key)
        store.add(shared, 1)
        ops += 3
    after = os.times()
    return {"ops": ops, "user": after.user - before.user, "sys": after.system - before.system}


class _Bare:
    """The same connection as a ``BlockingStore``'s, driven with the least Python per op."""

    def __init__(self, blocking: Any, encode: bool) -> None:
        import msgpack

        from arendez.store_wire import frame

        assert blocking._sock is not None
        self._sock, self._frame, self._encode = blocking._sock, frame, encode
        self._pack, self._unpack = msgpack.Packer(use_bin_type=True).pack, msgpack.unpackb
        self._buf = memoryview(bytearray(4096))
        self._made = {
            "set": frame(self._pack(["set", 1, "", b"v" * 32])),
            "get": frame(self._pack(["get", 2, "", 30.0])),
            "add": frame(self._pack(["add", 3, "", 1])),
        }
        self._rid = 0

    def _op(self, request: list[Any]) -> Any:
        if not self._encode:
            self._sock.sendall(self._made[request[0]])
            self._sock.recv_into(self._buf)
            return None
        self._rid += 1
        request[1] = self._rid
        self._sock.sendall(self._frame(self._pack(request)))
        n = self._sock.recv_into(self._buf)
        return self._unpack(self._buf[12:n])[1]

    def set(self, key: str, value: bytes) -> None:
        self._op(["set", 0, key, value])

    def get(self, key: str) -> Any:
        return self._op(["get", 0, key, 30.0])

    def add(self, key: str, amount: int) -> Any:
        return self._op(["add", 0, key, amount])


_TCPSTORE_SERVER = """
import sys
from datetime import timedelta
from torch.distributed import TCPStore
s = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
             timeout=timedelta(seconds=300), use_libuv=True)
print("port", s.port, flush=True)
sys.stdin.readline()
"""


def _cpu(pid: int) -> tuple[float, float]:
    """User and system CPU seconds of process ``pid`` so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def measure(kind: str, clients: int, seconds: float) -> dict[str, Any]:
    """One kind: its server and ``clients`` client processes; the per-op figures."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    if kind == "tcpstore":
        server = subprocess.Popen(
            [PY, "-c", _TCPSTORE_SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
        )
        assert server.stdout is not None
        port = int(server.stdout.readline().split()[1])
    else:
        extra = ["--tcpstore-port", "0"] if kind == "torch-client" else []
        server = subprocess.Popen(
            [PY, "-m", "arendez_server", "--port", "0", "--log-level", "WARNING", *extra],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        assert server.stdout is not None
        port = int(server.stdout.readline().strip().rsplit(":", 1)[1])
        if extra:  # (its second line: the TCPStore port)
            port = int(server.stdout.readline().strip().rsplit(":", 1)[1])
    try:
        procs = [
            subprocess.Popen(
                [PY, __file__, "--client", kind, str(port), str(i)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                env=env,
            )
            for i in range(clients)
        ]
        for p in procs:  # every client imported and connected before the clock starts
            assert p.stdout is not None
            if p.stdout.readline().strip() != "ready":
                raise RuntimeError(f"a {kind} client did not start")
        go = time.time() + 0.5
        for p in procs:
            assert p.stdin is not None
            p.stdin.write(f"{go} {seconds}\n")
            p.stdin.flush()
        time.sleep(max(0.0, go - time.time()))
        before = _cpu(server.pid)
        results = [json.loads(p.communicate(timeout=seconds + 60)[0].strip().splitlines()[-1]) for p in procs]
        after = _cpu(server.pid)
    finally:
        server.kill()
        server.wait()
    ops = sum(r["ops"] for r in results)
    per_op = 1e6 / max(ops, 1)
    return {
        "kind": kind,
        "clients": clients,
        "ops_per_s": ops / seconds,
        "server_user_us": (after[0] - before[0]) * per_op,
        "server_sys_us": (after[1] - before[1]) * per_op,
        "client_user_us": sum(r["user"] for r in results) * per_op,
        "client_sys_us": sum(r["sys"] for r in results) * per_op,
    }


def _client_main(kind: str, port: int, index: int) -> None:
    store, key, shared = _connect(kind, port, index)  # (imported and connected before "ready")
    print("ready", flush=True)
    go, seconds = (float(v) for v in sys.stdin.readline().split())
    print(json.dumps(_client(store, key, shared, go, seconds)), flush=True)


def main() -> int:
    if sys.argv[1:2] == ["--client"]:
        _client_main(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
        return 0
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--netns", action="store_true", help="re-run inside unshare -n with loopback up")
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    p.add_argument("--repeat", type=int, default=2, help="rounds over the kinds, alternating")
    args = p.parse_args()
    if args.netns and (status := bench_common.rerun_in_netns(__file__, torch=True)) is not None:
        return status
    header = ["kind", "clients", "round", "ops/s", "server user µs/op", "server sys"]
    header += ["clients user µs/op", "clients sys"]
    print("| " + " | ".join(header) + " |")
    print("|---|---|---|---|---|---|---|---|")
    for round_ in range(1, args.repeat + 1):
        for kind in args.kinds:
            r = measure(kind, args.clients, args.seconds)
            print(
                f"| {kind} | {r['clients']} | {round_} | {r['ops_per_s']:,.0f} | {r['server_user_us']:.1f} | "
                f"{r['server_sys_us']:.1f} | {r['client_user_us']:.1f} | {r['client_sys_us']:.1f} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
