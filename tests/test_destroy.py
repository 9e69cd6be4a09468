"""destroy_process_group as DESIGN §1 specifies, between real processes."""

from __future__ import annotations

import pytest

from tests.harness import run_ranks


@pytest.mark.timeout(60)
def test_subgroup_destroy_keeps_default_group(arendez_server):
    results = run_ranks("subgroup_destroy", 3, f"{arendez_server.url}/subgroup")
    for rank, res in enumerate(results):
        assert res["world_sum"] == 3 and res["initialized"] is True
        if rank < 2:
            assert res["member"] and res["sub_rank"] == rank and res["sub_size"] == 2
            assert res["sub_sum"] == 2
            assert res["after"].startswith("NotInitializedError") and "init_process_group" in res["after"]
        else:
            assert not res["member"] and res["sub_rank"] == -1 and res["sub_size"] == -1


@pytest.mark.timeout(60)
def test_destroy_then_reinit_and_error_after(arendez_server):
    results = run_ranks("reinit", 2, f"{arendez_server.url}/reinit", 3)
    for res in results:
        assert res[:3] == [1.0, 3.0, 5.0]
        assert "init_process_group" in res[3]


@pytest.mark.timeout(60)
def test_reinit_over_embedded_tcp_server():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = run_ranks("reinit", 3, f"tcp://127.0.0.1:{port}", 2)
    for res in results:
        assert res[:2] == [3.0, 6.0]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("size", [1000, 300_001])  # inline over TCP; through shared memory
def test_a_peer_that_left_after_sending_does_not_fail_what_it_fed(arendez_server, size):
    url = f"{arendez_server.url}/left-{size}"
    first, second = run_ranks("left_after_sending", 2, url, size, timeout=50)
    assert second == "left"
    assert "rank 1" in first and "destroyed its process group" in first, first
    assert float(first.rsplit("after ", 1)[1].rstrip("s")) < 1.0, first  # at once, not at the deadline
