"""A rank that records its pid (and a child's) in PIDDIR, then sleeps or fails as told.

Arguments: ``--fail-rank K --code C`` (rank K exits C once every rank is up), ``--ignore-term``
(SIGTERM is ignored, so only SIGKILL ends it).
"""

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

p = argparse.ArgumentParser()
p.add_argument("--fail-rank", type=int, default=-1)
p.add_argument("--code", type=int, default=3)
p.add_argument("--ignore-term", action="store_true")
args = p.parse_args()
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
piddir = Path(os.environ["PIDDIR"])
if args.ignore_term:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
# A grandchild of the launcher, in this rank's process group: it must not outlive the run either.
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
(piddir / f"rank{rank}.tmp").write_text(f"{os.getpid()} {child.pid}")
(piddir / f"rank{rank}.tmp").rename(piddir / f"rank{rank}")
print(f"ready {rank}", flush=True)
if rank == args.fail_rank:
    deadline = time.monotonic() + 30
    while len(list(piddir.glob("rank?"))) < world and time.monotonic() < deadline:
        time.sleep(0.01)
    print(f"rank {rank} failing with {args.code}", file=sys.stderr, flush=True)
    sys.exit(args.code)
time.sleep(120)
