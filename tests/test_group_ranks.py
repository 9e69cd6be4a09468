"""torch's ``group_dst``/``group_src``: a root named by its rank in the group, on every call
that has a root (the async API, so ``arendez.sync`` too, which wraps it)."""

from __future__ import annotations

import numpy as np
import pytest

import arendez as dist
from arendez.testing import run_ranks


async def _roots(rank: int) -> dict:
    sub = await dist.new_group([1, 2])  # group rank 0 is global rank 1, group rank 1 is global 2
    out: dict = {}
    if sub is dist.GroupMember.NON_GROUP_MEMBER:
        return out
    x = np.full(3, 10.0 * rank)
    await dist.broadcast(x, group=sub, group_src=1)  # global 2's
    out["broadcast"] = x.tolist()
    y = np.full(2, float(rank))
    await dist.reduce(y, group=sub, group_dst=0)  # into global 1
    out["reduce"] = y.tolist() if rank == 1 else None
    got = [np.zeros(1) for _ in range(2)] if rank == 2 else None
    await dist.gather(np.full(1, float(rank)), got, group=sub, group_dst=1)
    out["gather"] = [g.tolist() for g in got] if got is not None else None
    z = np.zeros(1)
    parts = [np.full(1, 7.0), np.full(1, 8.0)] if rank == 1 else None
    await dist.scatter(z, parts, group=sub, group_src=0)
    out["scatter"] = z.tolist()
    objs = [f"from {rank}"]
    await dist.broadcast_object_list(objs, group=sub, group_src=1)
    out["object"] = objs[0]
    if rank == 1:
        await dist.send(np.full(2, 5.0), group=sub, group_dst=1)
    else:
        buf = np.zeros(2)
        out["recv_from"] = await dist.recv(buf, group=sub, group_src=0)
        out["recv"] = buf.tolist()
    with pytest.raises(dist.InvalidArgumentError, match="give dst or group_dst, not both"):
        await dist.send(np.ones(1), 2, group=sub, group_dst=1)
    with pytest.raises(dist.InvalidArgumentError, match="send needs dst"):
        await dist.send(np.ones(1), group=sub)
    with pytest.raises(dist.InvalidArgumentError, match=r"group_src 2 is not in 0\.\.1"):
        await dist.broadcast(np.ones(1), group=sub, group_src=2)
    return out


@pytest.mark.timeout(60)
async def test_group_dst_and_group_src_name_roots_by_group_rank():
    results = await run_ranks(3, _roots)
    assert results[0] == {}
    one, two = results[1], results[2]
    assert one["broadcast"] == two["broadcast"] == [20.0] * 3
    assert one["reduce"] == [3.0, 3.0]
    assert two["gather"] == [[1.0], [2.0]] and one["gather"] is None
    assert (one["scatter"], two["scatter"]) == ([7.0], [8.0])
    assert one["object"] == two["object"] == "from 2"
    assert two["recv_from"] == 1 and two["recv"] == [5.0, 5.0]
