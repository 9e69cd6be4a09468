"""Demo: a standalone arendez-server and 4 ranks that join it by URL and all_reduce.

python examples/allreduce_demo.py            # starts its own server on a free port
python examples/allreduce_demo.py --url arendez://host:29400/demo   # use a running one
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import signal
import subprocess
import sys

import numpy as np

import arendez as dist
from arendez import loop


async def rank_main(url: str, world_size: int) -> None:
    await dist.init_process_group(init_method=url, world_size=world_size)  # the server assigns ranks
    rank = dist.get_rank()
    x = np.arange(4, dtype=np.float32) * (rank + 1)
    await dist.all_reduce(x)
    expected = np.arange(4, dtype=np.float32) * sum(range(1, world_size + 1))
    status = "ok" if np.array_equal(x, expected) else "WRONG"
    print(f"rank {rank}/{world_size}: all_reduce -> {x.tolist()} [{status}]", flush=True)
    await dist.destroy_process_group()
    if status != "ok":
        sys.exit(1)


def worker(url: str, world_size: int) -> None:
    loop.run(rank_main(url, world_size))


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--url", help="arendez://host:port/job of a running server")
    parser.add_argument("--ranks", type=int, default=4)
    args = parser.parse_args()
    server = None
    url = args.url
    if url is None:
        server = subprocess.Popen(
            [sys.executable, "-m", "arendez_server", "--port", "0", "--log-level", "WARNING"],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert server.stdout is not None
        line = server.stdout.readline().strip()
        print(line, flush=True)
        url = line.rsplit(" ", 1)[-1] + "/demo"
    try:
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=worker, args=(url, args.ranks)) for _ in range(args.ranks)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(60)
        failed = [p.exitcode for p in procs if p.exitcode != 0]
        for p in procs:
            if p.is_alive():
                p.kill()
        print("demo " + ("FAILED" if failed else "succeeded"), flush=True)
        return 1 if failed else 0
    finally:
        if server is not None:
            server.send_signal(signal.SIGTERM)
            server.wait(10)


if __name__ == "__main__":
    sys.exit(main())
