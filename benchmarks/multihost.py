"""all_reduce between emulated hosts: arendez vs gloo over shaped links, one rank per host.

    sudo .venv/bin/python benchmarks/multihost.py                 # 1 Gbit/s links, W = 2 and 4
    sudo .venv/bin/python benchmarks/multihost.py --rate-gbit 4

Hosts are network namespaces on a bridge (``netns.py``), each rank in its own mount namespace
with a private /dev/shm, so no shared memory crosses hosts; every link is shaped to R with tbf at
both ends. First a plain-TCP stream between two hosts shows what the link gives; then, per world
size, each backend runs in turn (same hosts, same links). Reports busbw (nccl-tests bus bytes per
second) as a fraction of R/8, and the CPU seconds (user + system, getrusage) one all_reduce costs
a rank, with arendez/gloo ratios. Markdown to stdout, JSON to ``--json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench_common import HERE, ROOT, bus_bytes, fmt_size, parse_size
from netns import Hosts

#: backend name -> (rank backend, extra environment)
BACKENDS: dict[str, tuple[str, dict[str, str]]] = {
    "arendez": ("arendez", {}),
    "arendez-ring": ("arendez", {"ARENDEZ_ALGORITHM": "ring"}),
    "arendez-rhd": ("arendez", {"ARENDEZ_ALGORITHM": "rhd"}),
    "arendez-nolowat": ("arendez", {"ARENDEZ_RCVLOWAT": "0"}),  # a read per arrival, no SO_RCVLOWAT
    "gloo": ("gloo", {"GLOO_SOCKET_IFNAME": "eth0"}),  # (by default gloo binds to the hostname's address)
}

_SINK = """
import socket, sys, time
s = socket.socket(); s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(1)
print("ready", flush=True)
c, _ = s.accept(); buf = bytearray(1 << 20); n = 0; t0 = None
while True:
    k = c.recv_into(buf)
    if not k: break
    if t0 is None: t0 = time.perf_counter()
    n += k
print(n / (time.perf_counter() - t0), flush=True)
"""

_SOURCE = """
import socket, sys, time
c = socket.create_connection((sys.argv[1], int(sys.argv[2]))); buf = bytes(1 << 20)
end = time.perf_counter() + float(sys.argv[3])
while time.perf_counter() < end: c.sendall(buf)
c.close()
"""


def link_check(hosts: Hosts, seconds: float) -> float:
    """Bytes per second one plain TCP stream gets from host 0 to host 1."""
    sink = hosts.run(1, [sys.executable, "-c", _SINK, hosts.address(1), "29390"])
    assert sink.stdout is not None
    if sink.stdout.readline().strip() != "ready":
        raise RuntimeError(f"link check sink failed: {sink.communicate()[1]}")
    source = hosts.run(0, [sys.executable, "-c", _SOURCE, hosts.address(1), "29390", str(seconds)])
    source.communicate(timeout=seconds + 30)
    out, err = sink.communicate(timeout=30)
    if sink.returncode:
        raise RuntimeError(f"link check failed: {err}")
    return float(out.strip())


def run_config(
    hosts: Hosts,
    backend: str,
    world: int,
    sizes: list[int],
    iters: int,
    warmup: int,
    port: int,
    timeout: float,
) -> dict[str, Any]:
    """Run one backend on hosts 0..world-1; per size, the ranks' raw measurements."""
    kind, env = BACKENDS[backend]
    env = {**env, "PYTHONPATH": str(ROOT)}
    procs = []
    for rank in range(world):
        spec = {
            "backend": kind,
            "rank": rank,
            "world": world,
            "master": f"{hosts.address(0)}:{port}",
            "sizes": sizes,
            "iters": iters,
            "warmup": warmup,
        }
        argv = [sys.executable, str(HERE / "multihost_rank.py"), json.dumps(spec)]
        procs.append(hosts.run(rank, argv, env))
    deadline = time.monotonic() + timeout
    results = []
    for rank, proc in enumerate(procs):
        try:
            out, err = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            hosts.close_procs()
            raise RuntimeError(f"{backend} W={world}: rank {rank} did not finish in {timeout:g}s") from None
        if proc.returncode:
            hosts.close_procs()
            raise RuntimeError(f"{backend} W={world}: rank {rank} exited {proc.returncode}:\n{err[-2000:]}")
        results.append(json.loads(out.strip().splitlines()[-1]))
    hosts.close_procs()
    return {str(n): [r[str(n)] for r in results] for n in sizes} | {
        "stats": [r.get("stats") for r in results]
    }


def summarize(ranks: list[dict[str, Any]], nbytes: int, world: int, link_bytes_s: float) -> dict[str, Any]:
    """Per-call time = slowest rank; CPU per all_reduce = mean over ranks and calls."""
    times = [max(per) for per in zip(*(r["times"] for r in ranks), strict=True)]
    cpu = statistics.fmean(c for r in ranks for c in r["cpu"])
    user = statistics.fmean(c for r in ranks for c in r["user"])
    median = statistics.median(times)
    busbw = bus_bytes("all_reduce", nbytes, world) / median
    return {
        "ok": all(r["ok"] for r in ranks),
        "median_s": median,
        "min_s": min(times),
        "max_s": max(times),
        "busbw_Bps": busbw,
        "link_fraction": busbw / link_bytes_s,
        "cpu_s": cpu,
        "user_s": user,
    }


def table(rows: list[dict[str, Any]], rate_gbit: float, plain: float | None) -> str:
    lines = [
        f"R = {rate_gbit:g} Gbit/s per link (tbf both ends)"
        + (f"; plain TCP stream: {plain:.3f} of R" if plain is not None else ""),
        "",
        "| W | size | backend | time (median, range) | busbw / link | CPU s per all_reduce (user) "
        "| CPU vs gloo |",
        "|---|---|---|---|---|---|---|",
    ]
    gloo = {(r["world"], r["size"]): r for r in rows if r["backend"] == "gloo"}
    for r in rows:
        g = gloo.get((r["world"], r["size"]))
        ratio = f"{r['cpu_s'] / g['cpu_s']:.2f}x" if g and g["cpu_s"] > 0 else "—"
        flag = "" if r["ok"] else " WRONG"
        lines.append(
            f"| {r['world']} | {fmt_size(r['size'])} | {r['backend']}{flag} | {r['median_s'] * 1e3:.0f} ms "
            f"({r['min_s'] * 1e3:.0f}-{r['max_s'] * 1e3:.0f}) | {r['link_fraction']:.3f} "
            f"| {r['cpu_s']:.3f} ({r['user_s']:.3f}) | {ratio} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rate-gbit", type=float, default=1.0, help="link rate R in Gbit/s (default 1)")
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    p.add_argument("--sizes", type=parse_size, nargs="+", default=[16 << 20, 64 << 20])
    p.add_argument(
        "--backends", nargs="+", choices=list(BACKENDS), default=["arendez", "arendez-ring", "gloo"]
    )
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=3)  # (the receive buffers grow over the first calls)
    p.add_argument("--link-seconds", type=float, default=2.0, help="plain TCP check (0: skip)")
    p.add_argument("--timeout", type=float, default=180.0, help="per configuration")
    p.add_argument("--json", type=Path, default=HERE / "results" / "multihost.json")
    args = p.parse_args(argv)
    if os.geteuid() != 0:
        p.error("needs root (ip netns, tc, mount)")
    if min(args.ranks) < 2 or args.iters < 1:
        p.error("--ranks must be >= 2 and --iters >= 1")
    rate = int(args.rate_gbit * 1e9)
    link_bytes_s = rate / 8
    hosts = Hosts(f"mh{os.getpid()}", max(args.ranks))
    rows: list[dict[str, Any]] = []
    plain = None
    try:
        hosts.shape(rate)
        if args.link_seconds > 0:
            plain = link_check(hosts, args.link_seconds) / link_bytes_s
            print(f"plain TCP: {plain:.3f} of the link", file=sys.stderr)
        port = 29500
        for world in args.ranks:
            for backend in args.backends:
                port += 1
                print(f"W={world} {backend} ...", file=sys.stderr, flush=True)
                raw = run_config(
                    hosts, backend, world, args.sizes, args.iters, args.warmup, port, args.timeout
                )
                for n in args.sizes:
                    row = {
                        "world": world,
                        "size": n,
                        "backend": backend,
                        **summarize(raw[str(n)], n, world, link_bytes_s),
                    }
                    row["raw"] = raw[str(n)]
                    row["stats"] = raw["stats"]
                    rows.append(row)
                    print(
                        f"  {fmt_size(n)}: {row['link_fraction']:.3f} of link, {row['cpu_s']:.3f} CPU s",
                        file=sys.stderr,
                    )
    finally:
        hosts.close()
    text = table(rows, args.rate_gbit, plain)
    print(text)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(
        json.dumps({"rate_bits": rate, "plain_tcp_fraction": plain, "rows": rows, "table": text}, indent=1)
    )
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
