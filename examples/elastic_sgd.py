"""Data-parallel SGD (numpy) that keeps training when a rank dies, and takes replacements in.

    arendez-run --nproc 4 --max-restarts 3 --min-nproc 2 examples/elastic_sgd.py --steps 300

Full-batch gradient descent on a least-squares problem whose data every rank generates from the
same seed: rank r of W takes the samples r, r+W, ...; one all_reduce sums the gradients (and the
loss, and how many ranks the server says wait to join). The sum is the full gradient whatever
the world size, so the weights follow the same path whoever dies, up to rounding: the final line
of every rank of the final round holds the same digest.

On a ``RankFailedError`` every rank calls ``reform()`` and the survivors go on in a smaller
world; when ranks wait to join (the launcher's replacements), every rank sees it in the same
all_reduce and re-forms at that step. After each re-form ``share_state`` hands rank 0's weights
and step (rank 0 is the lowest surviving old rank) to everyone.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import time
from typing import Any

import numpy as np

import arendez as dist
from arendez import elastic, loop


class JoinersWaiting(Exception):
    """Ranks wait to join: re-form at this step boundary (every rank sees it in the same sum)."""


def dataset(samples: int, features: int) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """The same data on every rank (seed 0): y = X w* + noise."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((samples, features))
    w_true = rng.standard_normal(features)
    y = x @ w_true + 0.01 * rng.standard_normal(samples)
    return x, y


def reference(steps: int, samples: int, features: int, lr: float) -> np.ndarray[Any, Any]:
    """The weights one process gets after ``steps`` steps (what every elastic run must match)."""
    x, y = dataset(samples, features)
    w = np.zeros(features)
    for _ in range(steps):
        w -= lr * (x.T @ (x @ w - y)) / samples
    return w


async def train(args: argparse.Namespace) -> dict[str, Any]:
    x, y = dataset(args.samples, args.features)
    state: dict[str, Any] = {"w": np.zeros(args.features), "step": 0}
    buf = np.empty(args.features + 2)
    rank = -1
    while True:
        try:
            state = await elastic.share_state(state)
            rank, size = dist.get_rank(), dist.get_world_size()
            print(
                f"rank {rank} of {size}: generation {elastic.generation()}, "
                f"{elastic.survivors()} survivor(s), at step {state['step']}",
                flush=True,
            )
            w = state["w"]
            while state["step"] < args.steps:
                xs, ys = x[rank::size], y[rank::size]
                err = xs @ w - ys
                buf[: args.features] = xs.T @ err
                buf[args.features] = err @ err
                buf[args.features + 1] = elastic.joiners_waiting()
                await dist.all_reduce(buf)
                w -= args.lr * buf[: args.features] / args.samples
                state["step"] += 1
                if rank == 0 and (state["step"] % args.log_every == 0 or state["step"] == 1):
                    print(f"step {state['step']} loss {buf[args.features] / args.samples:.6f}", flush=True)
                if args.step_time:
                    await asyncio.sleep(args.step_time)
                if buf[args.features + 1] > 0 and state["step"] < args.steps:
                    raise JoinersWaiting
            break
        except dist.RankFailedError as exc:
            print(f"rank {rank}: {exc}; re-forming", flush=True)
            started = time.perf_counter()
            rank, size = await elastic.reform(timeout=args.reform_timeout)
            print(f"re-formed as rank {rank} of {size} in {time.perf_counter() - started:.3f}s", flush=True)
        except JoinersWaiting:
            rank, size = await elastic.reform(timeout=args.reform_timeout)
            print(f"took joiners in: rank {rank} of {size}", flush=True)
    w = state["w"]
    return {
        "rank": dist.get_rank(),
        "world_size": dist.get_world_size(),
        "generation": elastic.generation(),
        "step": state["step"],
        "loss": float(np.mean((x @ w - y) ** 2)),
        "digest": hashlib.sha256(w.tobytes()).hexdigest()[:16],
        "w": w.tolist(),
    }


async def main(args: argparse.Namespace) -> None:
    await dist.init_process_group(timeout=args.timeout)  # env://: arendez-run sets the range
    try:
        result = await train(args)
    finally:
        await dist.destroy_process_group()
    print("final " + json.dumps(result), flush=True)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--samples", type=int, default=2048)
    p.add_argument("--features", type=int, default=16)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--step-time", type=float, default=0.02, help="seconds of pretend work per step")
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--timeout", type=float, default=60.0, help="collective and join timeout (s)")
    p.add_argument("--reform-timeout", type=float, default=30.0)
    return p.parse_args(argv)


if __name__ == "__main__":
    loop.run(main(parse()))
