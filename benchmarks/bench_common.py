"""What the benchmark driver, its rank processes and its report share: sizes, units, policies."""

from __future__ import annotations

import argparse
import os
import re
import resource
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
KiB = 1024
MiB = 1024 * KiB
DEFAULT_SIZES = [8, KiB, 64 * KiB, MiB, 16 * MiB, 64 * MiB]
DEFAULT_DATA_SIZES = [MiB, 16 * MiB]
MEMORY_SIZE = 64 * MiB
COLLECTIVES = ("all_reduce", "broadcast", "all_gather")
BACKENDS = ("arendez", "arendez-tcp", "gloo")
#: the arendez backends and the ``ARENDEZ_SHM`` their ranks run with
ARENDEZ_SHM_ENV = {"arendez": "1", "arendez-tcp": "0"}

# (budget seconds of timed iterations per case, min iters, max iters, warm-up by size class)
POLICY_FULL = {"budget": 6.0, "min_iters": 5, "max_iters": 2000, "warmup": (20, 5, 2)}
POLICY_QUICK = {"budget": 0.25, "min_iters": 5, "max_iters": 200, "warmup": (5, 2, 2)}


# ============================================================================ shared helpers
def rerun_in_netns(script: str, *, torch: bool = False) -> int | None:
    """Re-run ``script`` (with this process's arguments but ``--netns``) inside a private
    network namespace with loopback up, and return its exit status; None when already inside
    one. Loopback only there: TCPStore reverse-resolves its peers and stalls on the resolver
    otherwise, and a host that tracks connections (nf_conntrack) drops packets once its table
    is full; a fresh namespace tracks none."""
    if os.environ.get("ARENDEZ_BENCH_NETNS"):
        return None
    argv = [a for a in sys.argv[1:] if a != "--netns"]
    command = f'ip link set lo up && exec "{sys.executable}" "{script}" "$@"'
    env = dict(os.environ, ARENDEZ_BENCH_NETNS="1")
    if torch:
        env["TORCH_CPP_LOG_LEVEL"] = "ERROR"
    return subprocess.call(["unshare", "-rn", "sh", "-c", command, "sh", *argv], env=env)


def fmt_size(n: int) -> str:
    for unit, scale in (("MiB", MiB), ("KiB", KiB)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmg]?)(i?b)?\s*", text, re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (try 8, 1KiB, 64K, 16MiB)")
    scale = {"": 1, "k": KiB, "m": MiB, "g": 1024 * MiB}[m.group(2).lower()]
    value = int(float(m.group(1)) * scale)
    if value <= 0 or value % 4:
        raise argparse.ArgumentTypeError(f"size {text!r} must be a positive multiple of 4 bytes (float32)")
    return value


def fmt_time(us: float | None) -> str:
    if us is None:
        return "—"
    if us >= 1000:
        return f"{us / 1000:.2f} ms"
    return f"{us:.1f} µs"


def fmt_bw(gbps: float | None) -> str:
    if gbps is None:
        return "—"
    return f"{gbps:.3g}" if gbps >= 0.001 else f"{gbps:.2e}"


def bus_bytes(collective: str, nbytes: int, n: int) -> float:
    """nccl-tests bus bytes for one operation of ``nbytes`` (all_gather: the output size)."""
    if collective == "all_reduce":
        return nbytes * 2 * (n - 1) / n
    if collective == "all_gather":
        return nbytes * (n - 1) / n
    return float(nbytes)


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark (VmHWM); False where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _busy_cpu_seconds() -> float | None:
    """CPU seconds the whole machine has spent busy (all processes, /proc/stat)."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    busy = sum(fields[:8]) - idle  # user nice system idle iowait irq softirq steal
    return busy / os.sysconf("SC_CLK_TCK")


def _own_cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system


def _peak_rss_kib() -> int:
    hwm = _status_kib("VmHWM")
    return hwm if hwm is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
