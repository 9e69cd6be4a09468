"""Thousands of thread-ranks on ``TCPStore``: torch's own vs ``arendez.sync.TCPStore``, one run.

The plain way to simulate ranks against a store: rank 0's process holds the master ``TCPStore``
(``is_master=True``, which hosts the server, as under torchrun), and the other N ranks are threads
spread over ``--procs`` processes, each process starting its threads one after another in a loop.
Each rank makes its own client ``TCPStore``, ``add`` s itself to a counter, ``set`` s its address,
the last one ``set`` s ``done``; every rank then ``wait`` s for ``done`` and ``get`` s its right
neighbour's address. The time runs from the start signal (every process has imported its module and made its
threads) to the last rank's end.

torch and arendez run the same code (only the import differs), alternating run by run. A third
backend, ``torch-client``, runs torch's own C++ client against ``arendez-server --tcpstore-port``
(the server speaks torch's TCPStore protocol there; ``--backends torch arendez torch-client``).
Run it in
a private network namespace (TCPStore reverse-resolves its peers and stalls on the resolver
otherwise): ``--netns`` re-executes the script under ``unshare -n`` with loopback up.

    python benchmarks/tcpstore_threads.py --netns --worlds 1024 4096 10000 --repeat 2
    python benchmarks/tcpstore_threads.py --netns --barrier    # then TCPStore.barrier of all
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta
from typing import Any

import bench_common

PY = sys.executable
#: Each backend's client module: torch's client on torch's server, arendez's on arendez-server, and
#: torch's client on arendez-server's TCPStore port.
MODULES = {"torch": "torch.distributed", "arendez": "arendez.sync", "torch-client": "torch.distributed"}
LABELS = {
    "torch": "torch TCPStore",
    "arendez": "arendez.sync.TCPStore",
    "torch-client": "torch's client on arendez-server",
}
MASTER = """
import sys, time
from datetime import timedelta
from {module} import TCPStore
store = TCPStore("127.0.0.1", int(sys.argv[1]), 1, True, timeout=timedelta(seconds=600),
                 wait_for_workers=False)
print("up", flush=True)
sys.stdin.read()  # until the benchmark closes our stdin
"""


def _ranks(
    module: str,
    port: int,
    world: int,
    first: int,
    last: int,
    timeout: float,
    ops: int,
    appends: int,
    barrier: bool,
    out: Any,
    go: Any,
) -> None:
    """One process: threads for ranks ``first``..``last - 1``, started in a loop on ``go``."""
    store_type = __import__(module, fromlist=["TCPStore"]).TCPStore
    errors: list[str] = []

    def rank(r: int) -> None:
        try:
            store = store_type("127.0.0.1", port, world, False, timeout=timedelta(seconds=timeout))
            if store.add("count", 1) == world:
                store.set("done", "1")
            store.set(f"addr/{r}", f"10.0.{r // 256}.{r % 256}:29500")
            store.wait(["done"])
            store.get(f"addr/{(r + 1) % world}")
            for i in range(ops):  # (--ops: then some traffic per rank, one op in flight each)
                store.set(f"step/{r}", str(i))
                store.add("steps", 1)
            for _ in range(appends):  # (--appends: every rank appends to one key, contended)
                store.append("log", f"{r};")
            if barrier:  # (--barrier: then every rank meets in TCPStore.barrier)
                store.barrier("meet", world)
        except Exception as exc:
            errors.append(f"rank {r}: {exc!r}")

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(first, last)]
    out.put("ready")
    go.wait()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out.put({"end": time.time(), "errors": len(errors), "first_error": errors[:1]})


def run_case(
    backend: str,
    world: int,
    procs: int,
    timeout: float,
    ops: int = 0,
    appends: int = 0,
    barrier: bool = False,
) -> dict[str, Any]:
    """One rendezvous of ``world`` thread-ranks on ``backend``'s TCPStore."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    module = MODULES[backend]
    if backend == "torch-client":  # (the server, not a master TCPStore: it serves until stdin ends)
        argv = [PY, "-m", "arendez_server", "--port", "0", "--tcpstore-port", str(port)]
        argv += ["--log-level", "WARNING"]
    else:
        argv = [PY, "-c", MASTER.format(module=module), str(port)]
    master = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert master.stdout is not None
        while (line := master.stdout.readline().strip()) != "up" and "TCPStore clients on" not in line:
            assert line, "the store server did not start"
        ctx = mp.get_context("spawn")  # (a fresh interpreter per process: no inherited threads)
        out, go = ctx.Queue(), ctx.Event()
        per = -(-world // procs)
        spans = [(k * per, min(world, (k + 1) * per)) for k in range(procs) if k * per < world]
        workers = [
            ctx.Process(
                target=_ranks,
                args=(module, port, world, lo, hi, timeout, ops, appends, barrier, out, go),
            )
            for lo, hi in spans
        ]
        for w in workers:
            w.start()
        for _ in workers:  # (imports done, threads made: the time starts at the go)
            assert out.get(timeout=120) == "ready"
        start = time.time()
        go.set()
        results = [out.get(timeout=timeout + 60) for _ in workers]
        for w in workers:
            w.join(30)
        errors = sum(r["errors"] for r in results)
        first = next((r["first_error"][0] for r in results if r["first_error"]), "")
        return {
            "backend": backend,
            "world": world,
            "seconds": max(r["end"] for r in results) - start,
            "errors": errors,
            "first_error": first,
        }
    finally:
        if master.stdin is not None:
            master.stdin.close()
        if backend == "torch-client":
            master.terminate()
        try:
            master.wait(10)
        except subprocess.TimeoutExpired:
            master.kill()
            master.wait()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--netns", action="store_true", help="re-run inside unshare -n with loopback up")
    p.add_argument("--worlds", type=int, nargs="+", default=[1024, 4096, 10000])
    p.add_argument("--procs", type=int, default=8, help="processes the thread-ranks are spread over")
    p.add_argument("--repeat", type=int, default=2, help="runs per world size, alternating backends")
    p.add_argument("--backends", nargs="+", default=["torch", "arendez"], choices=sorted(MODULES))
    p.add_argument("--ops", type=int, default=0, help="then set + add this many times per rank")
    p.add_argument(
        "--appends", type=int, default=0, help="then append to one shared key this many times per rank"
    )
    p.add_argument("--barrier", action="store_true", help="then every rank calls TCPStore.barrier")
    p.add_argument("--timeout", type=float, default=120.0, help="each rank's store timeout (s)")
    p.add_argument("--json", default="", help="write the results here as JSON")
    args = p.parse_args()
    if args.netns and (status := bench_common.rerun_in_netns(__file__, torch=True)) is not None:
        return status
    rows = []
    for world in args.worlds:
        for run in range(1, args.repeat + 1):
            order = args.backends if run % 2 else list(reversed(args.backends))
            for backend in order:
                r = run_case(backend, world, args.procs, args.timeout, args.ops, args.appends, args.barrier)
                r["run"] = run
                rows.append(r)
                print(
                    f"{backend} N={world} run {run}: {r['seconds']:.2f} s, errors {r['errors']} "
                    f"{r['first_error']}",
                    file=sys.stderr,
                    flush=True,
                )
    others = [b for b in args.backends if b != "torch"]
    head = ["N", "run", LABELS["torch"]]
    for b in others:
        head += [LABELS[b], "torch/that"]
    print("| " + " | ".join([*head, "errors (" + " / ".join(["torch", *others]) + ")"]) + " |")
    print("|" + "---|" * (len(head) + 1))
    fmt = lambda r: f"{r['seconds'] * 1000:,.0f} ms" if r else "—"  # noqa: E731
    for world in args.worlds:
        for run in range(1, args.repeat + 1):
            by = {r["backend"]: r for r in rows if r["world"] == world and r["run"] == run}
            t = by.get("torch")
            cells = [str(world), str(run), fmt(t)]
            for b in others:
                a = by.get(b)
                cells += [fmt(a), f"{t['seconds'] / a['seconds']:.2f}x" if t and a else "—"]
            cells.append(" / ".join(str(by[b]["errors"]) if b in by else "—" for b in ["torch", *others]))
            print("| " + " | ".join(cells) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0 if all(r["errors"] == 0 for r in rows if r["backend"] != "torch") else 1


if __name__ == "__main__":
    sys.exit(main())
