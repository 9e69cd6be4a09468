"""A rendezvous that times out counts the ranks that joined (the caller included) and names the
missing ones."""

from __future__ import annotations

import socket

import pytest

import arendez as dist


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.timeout(30)
async def test_a_rank_alone_counts_itself_and_names_the_missing() -> None:
    url = f"tcp://127.0.0.1:{_free_port()}"
    with pytest.raises(
        dist.RendezvousError, match=r"only 1 of 3 ranks joined in time \(missing: 2 rank\(s\): 1, 2\)"
    ):
        await dist.init_process_group(init_method=url, world_size=3, rank=0, timeout=1.0)
    assert not dist.is_initialized()
