"""Data-parallel SGD with arendez: linear regression on numpy, one data shard per rank.

Each step every rank computes the gradient on its own shard, ``all_reduce(AVG)`` averages it, and
every rank applies the same update, so the weights stay identical (checked at the end).

    arendez-run --nproc 4 examples/train_sgd.py --steps 100
    RANK=0 WORLD_SIZE=4 ARENDEZ_URL=arendez://server:29400/sgd python examples/train_sgd.py
"""

from __future__ import annotations

import argparse
import hashlib
import sys

import numpy as np

import arendez as dist
from arendez import loop


def _args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--features", type=int, default=8)
    p.add_argument("--samples", type=int, default=256, help="samples per rank")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


async def main(args: argparse.Namespace) -> int:
    await dist.init_process_group()  # env://: ARENDEZ_URL or MASTER_ADDR/MASTER_PORT, RANK, WORLD_SIZE
    rank, world = dist.get_rank(), dist.get_world_size()
    true_w = np.random.default_rng(args.seed).normal(size=args.features)  # the same on every rank
    shard = np.random.default_rng([args.seed, rank + 1])  # this rank's own data
    x = shard.normal(size=(args.samples, args.features))
    y = x @ true_w + 0.01 * shard.normal(size=args.samples)

    w = np.zeros(args.features)
    grad = np.empty_like(w)
    for _ in range(args.steps):
        np.matmul(x.T, x @ w - y, out=grad)
        grad *= 2.0 / args.samples
        await dist.all_reduce(grad, op=dist.ReduceOp.AVG)
        w -= args.lr * grad

    loss = np.array([np.mean((x @ w - y) ** 2)])
    await dist.all_reduce(loss, op=dist.ReduceOp.AVG)
    digests: list[str | None] = [None] * world
    await dist.all_gather_object(digests, hashlib.sha256(w.tobytes()).hexdigest())
    identical = len(set(digests)) == 1
    print(f"rank {rank}/{world} loss={loss[0]:.6f} weights={np.array2string(w, precision=4)}", flush=True)
    await dist.destroy_process_group()
    if not identical:
        print(f"rank {rank}: weights differ between ranks: {digests}", file=sys.stderr, flush=True)
        return 1
    if rank == 0:
        print(f"rank 0: final loss {loss[0]:.6f}, weights identical on all {world} ranks", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(loop.run(main(_args())))
