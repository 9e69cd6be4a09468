"""arendez-server vs torch's TCPStore (libuv backend), side by side in one run.

Two measurements, each run against both servers in turn:

- store ops/s with 1, 8 and 32 clients: each client loops over ``set`` of its own key, ``get``
  of it and ``add`` on a shared counter, with one op in flight, or (arendez's async ``Store``)
  ``--depth`` ops in flight; TCPStore's Python client (blocking, one thread per client) has one
  op in flight, and so has arendez's ``BlockingStore`` (the like-for-like comparison);
- rendezvous with address exchange at N simulated ranks (asyncio tasks for arendez, threads
  for TCPStore, spread over ``--procs`` processes): from a common start, every rank connects,
  joins, and learns the addresses of its two ring neighbours. arendez: ``Store.connect``,
  ``join(peers=False, neighbours=[-1, 1])`` (the answer carries them); TCPStore: ``add`` for
  the rank, ``set`` of the address, the last rank ``set`` s ``done``, ``wait(done)``, ``wait``
  + ``multi_get`` of the neighbours. The same TCPStore code also runs with
  ``arendez.sync.TCPStore`` against arendez-server (a torch script ported by its import).
  The arendez ranks then hold their membership for ``--hold`` s and count every failure event
  the server sent (must be 0: all ranks are healthy).

arendez clients on the server's host reach it over a Unix socket (``arendez.transports.local``);
the ``BlockingStore, TCP only`` and ``arendez, TCP only`` columns run the same clients with
``ARENDEZ_LOCAL_SOCKETS=0``: loopback TCP, as TCPStore's clients use, and what a client on
another host pays.

Run it in a private network namespace (TCPStore reverse-resolves its peers and stalls on the
resolver otherwise): ``--netns`` re-executes the script under ``unshare -n`` with loopback up.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import bench_common

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable


# -- workers (run in child processes) --------------------------------------------------------
def _wait_go() -> float:
    print("ready", flush=True)
    return float(sys.stdin.readline())


def _arendez_ranks(port: int, job: str, world: int, count: int, hold: float) -> dict[str, Any]:
    from arendez import loop
    from arendez.store import Store

    go = _wait_go()
    failed: set[Any] = set()  # ranks some member was told had failed
    errors: list[str] = []

    async def one(i: int, stores: list[Store]) -> float:
        await asyncio.sleep(max(0.0, go - time.time()))
        st = Store("127.0.0.1", port, job, timeout=120)
        stores.append(st)
        await st.connect()
        st.on_event = lambda ev: failed.add(ev.get("rank")) if ev.get("event") == "rank_failed" else None
        m = await st.join(
            world, -1, f"10.0.{i // 250}.{i % 250}:{29500 + i}", peers=False, neighbours=[-1, 1]
        )
        assert len(m.addresses) == min(2, world - 1) or world <= 2
        return time.time()

    async def main() -> dict[str, Any]:
        stores: list[Store] = []
        results = await asyncio.gather(*(one(i, stores) for i in range(count)), return_exceptions=True)
        ends = [r for r in results if isinstance(r, float)]
        errors.extend(f"{type(r).__name__}: {r}" for r in results if isinstance(r, BaseException))
        await asyncio.sleep(hold)
        await asyncio.gather(*(s.leave(5.0) for s in stores), return_exceptions=True)
        await asyncio.gather(*(s.close() for s in stores), return_exceptions=True)
        return {"end": max(ends, default=0.0), "failed": sorted(failed), "errors": errors[:5]}

    return loop.run(main())


def _tcpstore_ranks(port: int, job: str, world: int, count: int, hold: float) -> dict[str, Any]:
    from torch.distributed import TCPStore

    return _store_idiom_ranks(TCPStore, port, job, world, count)


def _synctcp_ranks(port: int, job: str, world: int, count: int, hold: float) -> dict[str, Any]:
    """The same torch code with ``arendez.sync.TCPStore`` (a script ported by its import)."""
    from arendez.sync import TCPStore

    return _store_idiom_ranks(TCPStore, port, job, world, count)


def _store_idiom_ranks(store_class: Any, port: int, job: str, world: int, count: int) -> dict[str, Any]:
    go = _wait_go()
    ends: list[float] = []
    errors: list[str] = []

    def one(i: int) -> None:
        try:
            time.sleep(max(0.0, go - time.time()))
            s = store_class(
                "127.0.0.1", port, is_master=False, timeout=timedelta(seconds=120), use_libuv=True
            )
            rank = s.add(f"{job}/count", 1) - 1
            s.set(f"{job}/addr/{rank}", f"10.0.{i // 250}.{i % 250}:{29500 + i}")
            if rank == world - 1:
                s.set(f"{job}/done", "1")
            s.wait([f"{job}/done"])
            keys = [f"{job}/addr/{(rank - 1) % world}", f"{job}/addr/{(rank + 1) % world}"]
            s.wait(keys)
            s.multi_get(keys)
            ends.append(time.time())
        except Exception as exc:
            errors.append(f"{type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"end": max(ends, default=0.0), "failed": [], "errors": errors[:5]}


def _arendez_ops(port: int, job: str, clients: int, depth: int, seconds: float, base: int) -> dict[str, Any]:
    from arendez import loop
    from arendez.store import Store

    go = _wait_go()

    async def client(c: int, stop: float) -> int:
        st = await Store("127.0.0.1", port, job, timeout=60).connect()
        own = f"k{base + c}"
        await asyncio.sleep(max(0.0, go - time.time()))
        ops = 0

        async def lane(lane_id: int) -> int:
            n = 0
            key = f"{own}-{lane_id}"
            while time.time() < stop:
                await st.set(key, b"v" * 32)
                await st.get(key)
                await st.add("shared", 1)
                n += 3
            return n

        ops = sum(await asyncio.gather(*(lane(i) for i in range(depth))))
        await st.close()
        return ops

    async def main() -> dict[str, Any]:
        stop = go + seconds
        counts = await asyncio.gather(*(client(c, stop) for c in range(clients)))
        loop_kind = type(asyncio.get_running_loop()).__module__.split(".")[0]
        return {"ops": sum(counts), "seconds": seconds, "loop": loop_kind}

    return loop.run(main())


def _blocking_ops(port: int, job: str, clients: int, depth: int, seconds: float, base: int) -> dict[str, Any]:
    """arendez's blocking client, one thread per client, like TCPStore's."""
    from arendez.blocking_store import BlockingStore

    go = _wait_go()
    counts: list[int] = []

    def client(c: int) -> None:
        s = BlockingStore("127.0.0.1", port, job, timeout=60).connect()
        key = f"k{base + c}"
        time.sleep(max(0.0, go - time.time()))
        stop = go + seconds
        n = 0
        while time.time() < stop:
            s.set(key, b"v" * 32)
            s.get(key)
            s.add("shared", 1)
            n += 3
        s.close()
        counts.append(n)

    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"ops": sum(counts), "seconds": seconds}


def _tcpstore_ops(port: int, job: str, clients: int, depth: int, seconds: float, base: int) -> dict[str, Any]:
    from torch.distributed import TCPStore

    go = _wait_go()
    counts: list[int] = []

    def client(c: int) -> None:
        s = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60), use_libuv=True)
        key = f"{job}/k{base + c}"
        time.sleep(max(0.0, go - time.time()))
        stop = go + seconds
        n = 0
        while time.time() < stop:
            s.set(key, b"v" * 32)
            s.get(key)
            s.add(f"{job}/shared", 1)
            n += 3
        counts.append(n)

    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"ops": sum(counts), "seconds": seconds}


WORKERS = {
    "arendez-ranks": _arendez_ranks,
    "tcpstore-ranks": _tcpstore_ranks,
    "synctcp-ranks": _synctcp_ranks,
    "arendez-ops": _arendez_ops,
    "blocking-ops": _blocking_ops,
    "tcpstore-ops": _tcpstore_ops,
}


# -- servers ---------------------------------------------------------------------------------
_TCPSTORE_SERVER = """
import sys, time
from datetime import timedelta
from torch.distributed import TCPStore
s = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
             timeout=timedelta(seconds=300), use_libuv=True)
print("port", s.port, flush=True)
sys.stdin.readline()
"""


class Servers:
    """Both servers, each in its own process, for the whole run."""

    def __init__(self) -> None:
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        self.arendez = subprocess.Popen(
            [PY, "-m", "arendez_server", "--port", "0", "--log-level", "WARNING"],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        assert self.arendez.stdout is not None
        line = self.arendez.stdout.readline()
        self.arendez_port = int(line.strip().rsplit(":", 1)[1])
        self.tcpstore = subprocess.Popen(
            [PY, "-c", _TCPSTORE_SERVER], stdout=subprocess.PIPE, stdin=subprocess.PIPE, text=True, env=env
        )
        assert self.tcpstore.stdout is not None
        self.tcpstore_port = int(self.tcpstore.stdout.readline().split()[1])

    def port(self, backend: str) -> int:
        return self.tcpstore_port if backend == "tcpstore" else self.arendez_port

    def stop(self) -> None:
        self.arendez.terminate()
        self.tcpstore.kill()
        for p in (self.arendez, self.tcpstore):
            p.wait(10)


#: Cases that run another case's worker over TCP only (``ARENDEZ_LOCAL_SOCKETS=0``): what the
#: server costs a client on another host, and a like-for-like wire with TCPStore's.
TCP_ONLY = {"blocking-tcp": "blocking", "arendez-tcp": "arendez"}


def _spawn(kind: str, *args: Any) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    backend, _, role = kind.rpartition("-")
    if backend in TCP_ONLY:
        kind = f"{TCP_ONLY[backend]}-{role}"
        env["ARENDEZ_LOCAL_SOCKETS"] = "0"
    return subprocess.Popen(
        [PY, __file__, "--worker", kind, *map(str, args)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )


def _run_workers(procs: list[subprocess.Popen[str]], timeout: float) -> tuple[float, list[dict[str, Any]]]:
    for p in procs:
        assert p.stdout is not None
        if p.stdout.readline().strip() != "ready":
            raise RuntimeError("a worker did not start")
    go = time.time() + 0.3
    for p in procs:
        assert p.stdin is not None
        p.stdin.write(f"{go}\n")
        p.stdin.flush()
    results = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=timeout)
            results.append(json.loads(out.strip().splitlines()[-1]))
        except (subprocess.TimeoutExpired, IndexError, json.JSONDecodeError):
            p.kill()
            p.wait()
            results.append({"end": 0.0, "ops": 0, "seconds": 1, "failed": [], "errors": ["timed out"]})
    return go, results


def rendezvous(
    servers: Servers, backend: str, world: int, procs: int, hold: float, timeout: float
) -> dict[str, Any]:
    job = f"rdzv-{backend}-{world}-{time.monotonic_ns()}"
    per = [world // procs + (1 if i < world % procs else 0) for i in range(procs)]
    workers = [
        _spawn(f"{backend}-ranks", servers.port(backend), job, world, n, hold if backend != "tcpstore" else 0)
        for n in per
        if n
    ]
    go, results = _run_workers(workers, timeout)
    errors = [e for r in results for e in r["errors"]]
    ok = not errors and all(r["end"] for r in results)
    return {
        "backend": backend,
        "world": world,
        "seconds": max(r["end"] for r in results) - go if ok else None,
        "declared_failed": len({r for res in results for r in res["failed"]}),
        "errors": errors[:3],
    }


def ops(
    servers: Servers, backend: str, clients: int, depth: int, seconds: float, procs: int
) -> dict[str, Any]:
    job = f"ops-{backend}-{clients}-{depth}-{time.monotonic_ns()}"
    nproc = min(clients, procs) if procs > 0 else clients
    per = [clients // nproc + (1 if i < clients % nproc else 0) for i in range(nproc)]
    workers = [
        _spawn(f"{backend}-ops", servers.port(backend), job, n, depth, seconds, sum(per[:i]))
        for i, n in enumerate(per)
    ]
    _, results = _run_workers(workers, seconds + 60)
    return {
        "backend": backend,
        "clients": clients,
        "depth": depth,
        "ops_per_s": sum(r["ops"] for r in results) / seconds,
        "loops": sorted({r["loop"] for r in results if "loop" in r}),
    }


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a and b else "—"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--netns", action="store_true", help="re-run inside unshare -n with loopback up")
    p.add_argument("--worlds", type=int, nargs="*", default=[64, 256, 1024, 2048, 4096, 10000])
    p.add_argument("--clients", type=int, nargs="*", default=[1, 8, 32])
    p.add_argument("--depth", type=int, default=16, help="arendez ops in flight per client when pipelined")
    p.add_argument("--seconds", type=float, default=2.0, help="timed seconds per ops case")
    p.add_argument("--repeat", type=int, default=1, help="runs of the ops cases, alternating servers")
    p.add_argument("--procs", type=int, default=8, help="processes the simulated ranks are spread over")
    p.add_argument("--ops-procs", type=int, default=0, help="client processes for ops (0: one per client)")
    p.add_argument("--hold", type=float, default=3.0, help="s the arendez ranks stay joined (> lease)")
    p.add_argument("--tcpstore-max-world", type=int, default=10000, help="largest N run on TCPStore")
    p.add_argument("--case-timeout", type=float, default=120.0)
    p.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "server.json"))
    p.add_argument("--worker", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        kind, *rest = args.worker
        conv = [int(rest[0]), rest[1], *[float(x) if "." in x else int(x) for x in rest[2:]]]
        print(json.dumps(WORKERS[kind](*conv)), flush=True)
        return 0
    if args.netns and (status := bench_common.rerun_in_netns(__file__, torch=True)) is not None:
        return status
    servers = Servers()
    rows: dict[str, Any] = {"ops": [], "rendezvous": []}
    try:
        for run in range(1, args.repeat + 1):
            for clients in args.clients:
                for depth in (1, args.depth):
                    for backend in ("tcpstore", "blocking", "blocking-tcp", "arendez"):
                        if backend != "arendez" and depth != 1:
                            continue
                        r = ops(servers, backend, clients, depth, args.seconds, args.ops_procs)
                        r["run"] = run
                        rows["ops"].append(r)
                        print(
                            f"ops run {run} {backend} clients={clients} depth={depth}: "
                            f"{r['ops_per_s']:.0f}/s {r['loops']}",
                            file=sys.stderr,
                        )
        for world in args.worlds:
            for backend in ("arendez", "arendez-tcp", "synctcp", "tcpstore"):
                if backend in ("tcpstore", "synctcp") and world > args.tcpstore_max_world:
                    continue
                r = rendezvous(servers, backend, world, args.procs, args.hold, args.case_timeout)
                rows["rendezvous"].append(r)
                print(f"rendezvous {backend} N={world}: {r}", file=sys.stderr)
    finally:
        servers.stop()
    print(table(rows))
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


def table(rows: dict[str, Any]) -> str:
    out = [
        "| clients | run | TCPStore ops/s | arendez BlockingStore | ratio | BlockingStore, TCP only | ratio "
        "| arendez async (1 in flight) | ratio | arendez async (pipelined) | ratio |"
    ]
    out.append("|---|---|---|---|---|---|---|---|---|---|---|")
    by = {(r["backend"], r["clients"], r["depth"], r.get("run", 1)): r["ops_per_s"] for r in rows["ops"]}
    for clients, run in sorted({(r["clients"], r.get("run", 1)) for r in rows["ops"]}):
        t = by.get(("tcpstore", clients, 1, run))
        a1 = by.get(("arendez", clients, 1, run))
        ap = next(
            (v for (b, c, d, n), v in by.items() if b == "arendez" and c == clients and d > 1 and n == run),
            None,
        )
        b1 = by.get(("blocking", clients, 1, run))
        bt = by.get(("blocking-tcp", clients, 1, run))
        cells = [f"{t or 0:,.0f}", f"{b1 or 0:,.0f}", _ratio(b1, t), f"{bt or 0:,.0f}", _ratio(bt, t)]
        cells += [f"{a1 or 0:,.0f}", _ratio(a1, t)]
        cells += [f"{ap or 0:,.0f}", _ratio(ap, t)]
        out.append(f"| {clients} | {run} | " + " | ".join(cells) + " |")
    if not rows["rendezvous"]:
        return "\n".join(out)
    out.append("")
    out.append(
        "| N | TCPStore | arendez | TCPStore/arendez | arendez, TCP only | TCPStore/that "
        "| TCPStore code on arendez.sync.TCPStore | TCPStore/that | arendez ranks declared failed |"
    )
    out.append("|---|---|---|---|---|---|---|---|---|")
    rz = {(r["backend"], r["world"]): r for r in rows["rendezvous"]}
    for world in sorted({r["world"] for r in rows["rendezvous"]}):
        t, a, at = rz.get(("tcpstore", world)), rz.get(("arendez", world)), rz.get(("arendez-tcp", world))
        sy = rz.get(("synctcp", world))
        sys_ = sy["seconds"] if sy else None
        ts = t["seconds"] if t else None
        as_ = a["seconds"] if a else None
        ats = at["seconds"] if at else None
        fmt = lambda s: f"{s * 1000:,.0f} ms" if s else "failed/not run"  # noqa: E731
        declared = "—" if a is None else str(a["declared_failed"] + (at["declared_failed"] if at else 0))
        out.append(
            f"| {world} | {fmt(ts)} | {fmt(as_)} | {_ratio(ts, as_)} | {fmt(ats)} | {_ratio(ts, ats)} "
            f"| {fmt(sys_)} | {_ratio(ts, sys_)} | {declared} |"
        )
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
