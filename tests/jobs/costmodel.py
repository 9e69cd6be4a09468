"""Rank code for tests/test_costmodel.py: which links an all_reduce saw and what it chose."""

from __future__ import annotations

from typing import Any

import numpy as np


async def algorithm_choice(rank: int, world_size: int, nbytes: int) -> dict[str, Any]:
    import arendez as dist
    from arendez import algorithms

    seen: list[tuple[str | None, str]] = []
    real = algorithms.Chooser.__call__  # (the world's chooser: what a collective asks)

    def spy(self: Any, collective: str, n: int, size: int, link: str | None = None) -> str:
        picked = real(self, collective, n, size, link)
        seen.append((link, picked))
        return picked

    algorithms.Chooser.__call__ = spy  # type: ignore[method-assign]
    x = np.full(nbytes // 4, rank + 1, np.float32)
    await dist.all_reduce(x)
    return {
        "link": seen[-1][0],
        "algorithm": seen[-1][1],
        "exact": bool(np.all(x == sum(range(1, world_size + 1)))),
    }
