"""The benchmark's report: ratios against gloo, the markdown table, machine information."""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import os
import platform
import subprocess
from typing import Any

from bench_common import (
    ARENDEZ_SHM_ENV,
    BACKENDS,
    COLLECTIVES,
    MEMORY_SIZE,
    ROOT,
    MiB,
    bus_bytes,
    fmt_bw,
    fmt_size,
    fmt_time,
)


def key_prefix(backend: str) -> str:
    """Prefix of a backend's keys in a comparison row: ``arendez``, ``arendez_tcp``, ``gloo``."""
    return backend.replace("-", "_")


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def compare(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (collective, ranks, size) with every backend's numbers side by side.

    Ratios: ``latency_ratio`` / ``busbw_ratio`` are arendez/gloo, ``tcp_latency_ratio`` /
    ``tcp_busbw_ratio`` arendez-tcp/gloo, ``shm_tcp_busbw_ratio`` arendez/arendez-tcp.
    """
    by_key: dict[tuple[str, int, int], dict[str, dict[str, Any]]] = {}
    for r in results:
        n = r["ranks"]
        t = r["median_us"] * 1e-6
        r["algbw_gbps"] = r["size"] / t / 1e9
        r["busbw_gbps"] = bus_bytes(r["collective"], r["size"], n) / t / 1e9
        by_key.setdefault((r["collective"], n, r["size"]), {})[r["backend"]] = r
    order = {c: i for i, c in enumerate(COLLECTIVES)}
    rows = []
    for (coll, n, size), per in sorted(by_key.items(), key=lambda kv: (order[kv[0][0]], kv[0][1], kv[0][2])):
        row: dict[str, Any] = {"collective": coll, "ranks": n, "size": size}
        for backend in BACKENDS:
            res, name = per.get(backend), key_prefix(backend)
            row[f"{name}_median_us"] = res["median_us"] if res else None
            row[f"{name}_busbw_gbps"] = res["busbw_gbps"] if res else None
            row[f"{name}_verified"] = res["verified"] if res else None
            row[f"{name}_foreign_cpus"] = res.get("foreign_cpus") if res else None
            if backend in ARENDEZ_SHM_ENV:
                # which transport carried the payload: shm bytes / received bytes, over all ranks
                shm = res.get("shm_bytes_per_iter") if res else None
                rcv = res.get("received_bytes_per_iter") if res else None
                frac = None
                if shm is not None and rcv is not None:
                    frac = sum(shm) / sum(rcv) if sum(rcv) else 0.0
                row[f"{name}_shm_fraction"] = frac
        row["latency_ratio"] = _ratio(row["arendez_median_us"], row["gloo_median_us"])
        row["busbw_ratio"] = _ratio(row["arendez_busbw_gbps"], row["gloo_busbw_gbps"])
        row["tcp_latency_ratio"] = _ratio(row["arendez_tcp_median_us"], row["gloo_median_us"])
        row["tcp_busbw_ratio"] = _ratio(row["arendez_tcp_busbw_gbps"], row["gloo_busbw_gbps"])
        row["shm_tcp_busbw_ratio"] = _ratio(row["arendez_busbw_gbps"], row["arendez_tcp_busbw_gbps"])
        rows.append(row)
    return rows


def _failed_cell(failures: list[dict[str, Any]], backend: str, coll: str, n: int, size: int) -> str | None:
    for f in failures:
        if (f["backend"], f["collective"], f["ranks"], f["size"]) == (backend, coll, n, size):
            return "FAILED"
    return None


def markdown(
    info: dict[str, Any],
    rows: list[dict[str, Any]],
    results: list[dict[str, Any]],
    failures: list[dict[str, Any]],
    backends: list[str],
    policy: dict[str, Any],
) -> str:
    loop = info.get("arendez_loop") or "?"
    head = (
        f"arendez vs torch.distributed gloo — {info['cpu_count']} CPUs ({info.get('cpu_model') or '?'}), "
        f"Python {info['python']}, numpy {info['numpy']}, torch {info['torch'] or 'n/a'}, "
        f"uvloop {'on' if 'uvloop' in loop else 'off'} ({info['uvloop'] or 'n/a'}), "
        f"algorithm {info['arendez_algorithm']}, arendez {info['git_commit'] or '?'}"
    )
    lines = [
        f"**{head}**",
        "",
        "arendez: the default, shared memory between ranks on this host (ARENDEZ_SHM=1); "
        "arendez-tcp: arendez with ARENDEZ_SHM=0 and ARENDEZ_LOCAL_SOCKETS=0: "
        "every byte over loopback TCP, as gloo. "
        "Latency: median over iterations of the max over ranks. Bus bandwidth in GB/s (nccl-tests). "
        "Ratios a/g are arendez/gloo, tcp/g arendez-tcp/gloo: latency < 1 and bandwidth > 1 mean "
        "that arendez backend is faster. all_gather size = gathered output. Other load "
        "(arendez/arendez-tcp/gloo): CPUs' worth of work by other processes while timing "
        "(noise; 0 on a quiet machine).",
        "",
        "| collective | ranks | size | arendez | arendez-tcp | gloo "
        "| arendez busbw | arendez-tcp busbw | gloo busbw | busbw a/g | busbw tcp/g "
        "| latency a/g | latency tcp/g | other load a/tcp/g |",
        "|---|---:|---:|" + "---:|" * 11,
    ]
    all_keys = {(r["collective"], r["ranks"], r["size"]) for r in rows} | {
        (f["collective"], f["ranks"], f["size"]) for f in failures if f["collective"]
    }
    have = {(r["collective"], r["ranks"], r["size"]): r for r in rows}
    order = {c: i for i, c in enumerate(COLLECTIVES)}
    for key in sorted(all_keys, key=lambda k: (order[k[0]], k[1], k[2])):
        coll, n, size = key
        row = have.get(key, {})
        cells = [coll, str(n), fmt_size(size)]
        for b in BACKENDS:
            v = row.get(f"{key_prefix(b)}_median_us")
            bad = "" if row.get(f"{key_prefix(b)}_verified") in (True, None) else " (WRONG)"
            cells.append(
                (fmt_time(v) + bad) if v is not None else (_failed_cell(failures, b, coll, n, size) or "—")
            )
        cells += [fmt_bw(row.get(f"{key_prefix(b)}_busbw_gbps")) for b in BACKENDS]
        for k in ("busbw_ratio", "tcp_busbw_ratio", "latency_ratio", "tcp_latency_ratio"):
            ratio = row.get(k)
            cells.append(f"{ratio:.2f}" if ratio is not None else "—")
        loads = [row.get(f"{key_prefix(b)}_foreign_cpus") for b in BACKENDS]
        cells.append("/".join("—" if v is None else f"{v:.2f}" for v in loads))
        lines.append("| " + " | ".join(cells) + " |")
    mem = [r for r in results if r.get("memory")]
    if mem:
        lines += [
            "",
            f"Memory and copies, all_reduce {fmt_size(MEMORY_SIZE)} (max over ranks; growth of peak RSS "
            "from just before the first call to after the timed iterations, relative to the array):",
            "",
            "| backend | ranks | peak RSS growth | / array | tracemalloc peak (1 call) | / array "
            "| copied B/iter | received B/iter | copied/received | shm B/iter |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        rank_of = {b: i for i, b in enumerate(BACKENDS)}
        for r in sorted(mem, key=lambda r: (rank_of.get(r["backend"], len(BACKENDS)), r["ranks"])):
            m = r["memory"]
            growth = [
                g for g in (m.get("hwm_growth_kib") or m.get("maxrss_growth_kib") or []) if g is not None
            ]
            g_mib = max(growth) / 1024 if growth else None
            tm = [t for t in m.get("tracemalloc_peak_bytes", []) if t is not None]
            tm_mib = max(tm) / MiB if tm else None
            cp = r.get("copied_bytes_per_iter")
            rv = r.get("received_bytes_per_iter")
            sh = r.get("shm_bytes_per_iter")
            arr = MEMORY_SIZE / MiB
            lines.append(
                "| "
                + " | ".join(
                    [
                        r["backend"],
                        str(r["ranks"]),
                        f"{g_mib:.1f} MiB" if g_mib is not None else "—",
                        f"{g_mib / arr:.2f}" if g_mib is not None else "—",
                        f"{tm_mib:.1f} MiB" if tm_mib is not None else "—",
                        f"{tm_mib / arr:.2f}" if tm_mib is not None else "—",
                        f"{max(cp):,.0f}" if cp else "—",
                        f"{max(rv):,.0f}" if rv else "—",
                        f"{sum(cp) / sum(rv):.3f}" if cp and rv and sum(rv) else "—",
                        f"{max(sh):,.0f}" if sh else "—",
                    ]
                )
                + " |"
            )
    if failures:
        lines += ["", "Failures:", ""]
        for f in failures:
            what = (
                f"{f['collective']} {fmt_size(f['size'])}"
                if f["collective"]
                else f"({f.get('phase', 'startup')})"
            )
            lines.append(f"- {f['backend']} n={f['ranks']} {what}: {f['reason']}")
    skipped = [b for b in BACKENDS if b not in backends]
    if skipped:
        lines += ["", f"Not run: {', '.join(skipped)}."]
    budget = f"fixed {policy['iters']} iters" if policy.get("iters") else f"~{policy['budget']} s per case"
    bounds = f"min {policy['min_iters']}, max {policy['max_iters']}"
    lines += ["", f"Iterations: {budget} ({bounds}), barrier before each."]
    return "\n".join(lines)


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def machine_info(args: argparse.Namespace) -> dict[str, Any]:
    commit = None
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        commit = (
            subprocess.run(
                ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                capture_output=True,
                text=True,
                timeout=5,
            ).stdout.strip()
            or None
        )
    cpu_model = None
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
        for line in f:
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    return {
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "cpu_model": cpu_model,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "numpy": _version("numpy"),
        "torch": _version("torch"),
        "uvloop": _version("uvloop"),
        "msgpack": _version("msgpack"),
        "arendez": _version("arendez"),
        "git_commit": commit,
        "uvloop_disabled_env": os.environ.get("ARENDEZ_NO_UVLOOP") == "1",
        "arendez_algorithm": args.algorithm or os.environ.get("ARENDEZ_ALGORITHM") or "auto",
    }
