"""Rendezvous time and store ops/s: the etcd backend vs arendez-server vs torch's TCPStore.

One run, side by side, on this machine:

* rendezvous of N simulated ranks (clients in this one process, all joining at once, explicit
  ranks): etcd = ``EtcdStore.join``; arendez = ``Store.join`` on an ``arendez-server``
  process; TCPStore = what torch's ``env://`` does with it (each rank ``set`` its address,
  ``add`` a counter, ``wait`` for every address), with one thread per simulated rank;
* store ops/s of one client issuing ``set``, ``get`` and ``add`` back to back.

``python benchmarks/etcd_bench.py [--ranks 64 256 1024] [--ops 500] [--data-dir DIR]``
prints a markdown table (stdout) and progress (stderr). etcd's data dir is on disk unless
``--data-dir`` says otherwise (etcd fsyncs every write).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from arendez.etcd import open_store
from arendez.store import Store

PY = sys.executable


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_etcd(data: Path) -> tuple[subprocess.Popen[bytes], int]:
    etcd = shutil.which("etcd")
    if etcd is None:
        raise SystemExit("etcd is not installed (apt-get install etcd-server)")
    client, peer = _free_port(), _free_port()
    c, p = f"http://127.0.0.1:{client}", f"http://127.0.0.1:{peer}"
    argv = [etcd, "--name", "b", "--data-dir", str(data / "etcd"), "--listen-client-urls", c]
    argv += ["--advertise-client-urls", c, "--listen-peer-urls", p, "--initial-advertise-peer-urls", p]
    argv += ["--initial-cluster", f"b={p}", "--max-txn-ops", "128"]
    log = open(data / "etcd.log", "wb")  # noqa: SIM115 - the process owns it
    proc = subprocess.Popen(argv, stdout=log, stderr=log, start_new_session=True)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{c}/health", timeout=1) as resp:
                if json.loads(resp.read()).get("health") == "true":
                    return proc, client
        except (OSError, ValueError):
            time.sleep(0.1)
    proc.kill()
    raise SystemExit("etcd did not become healthy within 30 s")


def start_server() -> tuple[subprocess.Popen[str], int]:
    proc = subprocess.Popen(
        [PY, "-m", "arendez_server", "--port", "0", "--log-level", "WARNING", "--lease", "60"],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if "listening on" not in line:
        proc.kill()
        raise SystemExit(f"arendez-server did not start: {line!r}")
    return proc, int(line.strip().rsplit(":", 1)[1])


def _stop(proc: subprocess.Popen[Any]) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()


# -- rendezvous ------------------------------------------------------------------------------------
async def rdzv_etcd(port: int, n: int, job: str) -> float:
    url = f"etcd://127.0.0.1:{port}/{job}?lease=60"  # keepalives every 15 s: not what is measured
    stores = [open_store(url, timeout=120) for _ in range(n)]
    await asyncio.gather(*(s.connect() for s in stores))
    start = time.perf_counter()
    await asyncio.gather(*(s.join(n, r, f"127.0.0.1:{10000 + r}") for r, s in enumerate(stores)))
    took = time.perf_counter() - start
    await asyncio.gather(*(s.leave(10) for s in stores))
    await asyncio.gather(*(s.close() for s in stores))
    return took


async def rdzv_arendez(port: int, n: int, job: str) -> float:
    # heartbeats every 15 s against the server's 60 s lease, as etcd's keepalives (lease=60)
    stores = [Store("127.0.0.1", port, job, timeout=120, heartbeat_interval=15.0) for _ in range(n)]
    await asyncio.gather(*(s.connect() for s in stores))
    start = time.perf_counter()
    await asyncio.gather(*(s.join(n, r, f"127.0.0.1:{10000 + r}") for r, s in enumerate(stores)))
    took = time.perf_counter() - start
    await asyncio.gather(*(s.leave() for s in stores))
    await asyncio.gather(*(s.close() for s in stores))
    return took


def rdzv_tcpstore(n: int) -> float:
    import datetime

    from torch.distributed import TCPStore

    port = _free_port()
    master = TCPStore(
        "127.0.0.1", port, n, True, timeout=datetime.timedelta(seconds=120), wait_for_workers=False
    )
    clients: list[Any] = [master] + [
        TCPStore("127.0.0.1", port, n, False, timeout=datetime.timedelta(seconds=120)) for _ in range(n - 1)
    ]
    go = threading.Barrier(n + 1)
    keys = [f"addr/{r}" for r in range(n)]

    def rank(r: int) -> None:
        go.wait()
        clients[r].set(f"addr/{r}", f"127.0.0.1:{10000 + r}")
        clients[r].add("joined", 1)
        clients[r].wait(keys)
        [clients[r].get(k) for k in (keys if r == 0 else keys[:0])]  # rank 0 reads the peers

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    start = time.perf_counter()
    go.wait()
    for t in threads:
        t.join()
    took = time.perf_counter() - start
    del master
    clients.clear()
    return took


# -- store ops ----------------------------------------------------------------------------------
async def _ops(n: int, op: Callable[[int], Awaitable[Any]]) -> float:
    start = time.perf_counter()
    for i in range(n):
        await op(i)
    return n / (time.perf_counter() - start)


async def ops_async(store: Any, n: int) -> dict[str, float]:
    await store.set("k", b"x" * 64)
    return {
        "set": await _ops(n, lambda i: store.set(f"k{i % 16}", b"x" * 64)),
        "get": await _ops(n, lambda i: store.get("k")),
        "add": await _ops(n, lambda i: store.add("counter", 1)),
    }


def ops_tcpstore(n: int) -> dict[str, float]:
    import datetime

    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", _free_port(), 1, True, timeout=datetime.timedelta(seconds=30))
    store.set("k", b"x" * 64)
    out = {}
    for name, fn in [
        ("set", lambda i: store.set(f"k{i % 16}", b"x" * 64)),
        ("get", lambda i: store.get("k")),
        ("add", lambda i: store.add("counter", 1)),
    ]:
        start = time.perf_counter()
        for i in range(n):
            fn(i)
        out[name] = n / (time.perf_counter() - start)
    return out


async def store_ops(etcd_port: int, server_port: int, n: int) -> dict[str, dict[str, float]]:
    etcd = await open_store(f"etcd://127.0.0.1:{etcd_port}/ops", timeout=60).connect()
    server = await Store("127.0.0.1", server_port, "ops", timeout=60).connect()
    try:
        return {
            "etcd": await ops_async(etcd, n),
            "arendez": await ops_async(server, n),
            "tcpstore": ops_tcpstore(n),
        }
    finally:
        await etcd.close()
        await server.close()


def _rendezvous(name: str, n: int, etcd_port: int, server_port: int) -> float:
    if name == "etcd":
        return asyncio.run(rdzv_etcd(etcd_port, n, f"rdzv{n}"))
    if name == "arendez":
        return asyncio.run(rdzv_arendez(server_port, n, f"rdzv{n}"))
    return rdzv_tcpstore(n)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, nargs="+", default=[64, 256, 1024])
    ap.add_argument("--ops", type=int, default=500)
    ap.add_argument("--data-dir", type=Path, default=None)
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the finally below stops what we started
    tmp = Path(tempfile.mkdtemp(prefix="arendez-etcd-bench-", dir=args.data_dir))
    etcd, etcd_port = start_etcd(tmp)
    server, server_port = start_server()
    rows = []
    try:
        for n in args.ranks:
            row: dict[str, Any] = {"ranks": n}
            for name in ("etcd", "arendez", "tcpstore"):
                try:
                    row[name] = _rendezvous(name, n, etcd_port, server_port)
                except Exception as exc:  # one failing backend does not hide the others' numbers
                    _log(f"{name} rendezvous of {n} failed: {type(exc).__name__}: {exc}")
                    row[name] = None
                _log(f"rendezvous {n:5d} ranks {name:9s}: {row[name]}")
            rows.append(row)
        ops = asyncio.run(store_ops(etcd_port, server_port, args.ops))
        _log(f"store ops: {ops}")
    finally:
        _stop(server)
        _stop(etcd)
        shutil.rmtree(tmp, ignore_errors=True)

    def sec(v: float | None) -> str:
        return "failed" if v is None else f"{v:.2f} s"

    def ratio(a: float | None, b: float | None) -> str:
        return "—" if not a or not b else f"{a / b:.1f}x"

    print("| ranks | etcd | arendez-server | TCPStore | etcd / server | etcd / TCPStore |")
    print("|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['ranks']} | {sec(r['etcd'])} | {sec(r['arendez'])} | {sec(r['tcpstore'])} "
            f"| {ratio(r['etcd'], r['arendez'])} | {ratio(r['etcd'], r['tcpstore'])} |"
        )
    print()
    print(
        "| store op (1 client) | etcd ops/s | arendez-server ops/s | TCPStore ops/s | etcd / server |", end=""
    )
    print(" etcd / TCPStore |")
    print("|---|---:|---:|---:|---:|---:|")
    for op in ("set", "get", "add"):
        e, a, t = ops["etcd"][op], ops["arendez"][op], ops["tcpstore"][op]
        print(f"| {op} | {e:.0f} | {a:.0f} | {t:.0f} | {e / a:.2f} | {e / t:.2f} |")


if __name__ == "__main__":
    main()
