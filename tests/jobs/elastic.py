"""Rank code of the elastic tests (``tests/test_elastic_rounds.py``)."""

from __future__ import annotations

from typing import Any

import numpy as np

import arendez as dist
from arendez import elastic


async def share(slot: int, world_size: int, url: str) -> dict[str, Any]:
    """Join an elastic world of ``world_size``; take rank 0's state through ``share_state``."""
    await dist.init_process_group(init_method=url, world_size=(world_size, world_size), timeout=20)
    me = dist.get_rank()
    mine = {"w": np.arange(6, dtype=np.float32).reshape(2, 3) * (me + 1), "step": 7 + me, "tag": "x"}
    got = await elastic.share_state(mine if me == 0 else None)
    out = {
        "w": got["w"].tolist(),
        "dtype": str(got["w"].dtype),
        "step": got["step"],
        "tag": got["tag"],
        "generation": elastic.generation(),
        "survivors": elastic.survivors(),
    }
    # then every rank re-forms at once (no failure): the same ranks, survivors all
    rank, size = await elastic.reform(timeout=10)
    out.update(reformed=[rank, size, me], generation2=elastic.generation(), survivors2=elastic.survivors())
    await dist.destroy_process_group()
    return out
