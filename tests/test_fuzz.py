"""Hostile input at scale: >= 10^4 random or malformed frames and truncated streams hit a live
server while a real job runs on it. The server stays up, its memory bounded, the job correct.

Hypothesis draws a share of the batches (its strategies favour edge cases: huge integers, NaN,
empty and nested values); a seeded generator of the same kinds of frame, about a hundred times
cheaper to draw, makes up the volume (drawing 10^4 frames through hypothesis took ~30 s).
"""

from __future__ import annotations

import os
import random
import socket
import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.harness import collect, raw_frame, rss_kib, server, spawn_rank
from tests.jobs import store as store_jobs

FRAMES_PER_BATCH = 50
HYPOTHESIS_BATCHES = 40
RANDOM_BATCHES = 180

values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=20)
    | st.binary(max_size=64),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=8,
)
OPS = [
    "set",
    "get",
    "add",
    "compare_set",
    "append",
    "wait",
    "delete",
    "num_keys",
    "check",
    "join",
    "attach",
    "leave",
    "heartbeat",
    "status",
    "nope",
]
requests = st.fixed_dictionaries(
    {"op": st.sampled_from(OPS)},
    optional={
        "id": values,
        "key": st.text(max_size=12) | values,
        "value": st.binary(max_size=128) | values,
        "amount": values,
        "keys": st.lists(st.text(max_size=6), max_size=5) | values,
        "timeout": st.floats(0, 0.2) | values,
        "world_size": values,
        "rank": values,
        "nonce": values,
    },
)


frames = st.one_of(
    st.binary(min_size=1, max_size=96),  # noise
    values.map(raw_frame),  # well-framed, meaningless
    requests.map(raw_frame),  # plausible requests with wrong fields
    st.tuples(st.integers(0, 2**32 - 1), st.integers(0, 2**64 - 1)).map(lambda t: struct.pack("<IQ", *t)),
    requests.map(lambda r: raw_frame(r, payload=7) + b"payload"),  # the server takes no payloads
)


_EDGES: list[object] = [
    None, True, 0, -1, 2**63 - 1, -(2**63), 2**64 - 1, float("nan"), float("inf"), -0.0, "", b"",
    "x" * 300, b"\xff" * 64, [], {}, [[[[]]]], {"": {"": None}},
]  # fmt: skip


def _random_value(rng: random.Random, depth: int = 0) -> object:
    kind = rng.randrange(8 if depth < 3 else 6)
    if kind == 0:
        return rng.choice(_EDGES)
    if kind == 1:
        return rng.randrange(-(2**63), 2**64)
    if kind == 2:
        return rng.random() * 10 ** rng.randrange(-5, 30)
    if kind == 3:
        return "".join(chr(rng.randrange(1, 0x3000)) for _ in range(rng.randrange(20)))
    if kind == 4:
        return rng.randbytes(rng.randrange(64))
    if kind == 5:
        return rng.choice([None, False])
    if kind == 6:
        return [_random_value(rng, depth + 1) for _ in range(rng.randrange(5))]
    return {str(_random_value(rng, 3))[:8]: _random_value(rng, depth + 1) for _ in range(rng.randrange(5))}


def _random_request(rng: random.Random) -> dict[str, object]:
    request: dict[str, object] = {"op": rng.choice(OPS)}
    for field in ("id", "key", "value", "amount", "keys", "timeout", "world_size", "rank", "nonce"):
        if rng.random() < 0.4:
            request[field] = _random_value(rng)
    return request


def _random_frame(rng: random.Random) -> bytes:
    """One frame of the kinds ``frames`` draws, from ``rng``."""
    kind = rng.randrange(5)
    if kind == 0:
        return rng.randbytes(rng.randrange(1, 97))
    if kind == 1:
        return raw_frame(_random_value(rng))
    if kind == 2:
        return raw_frame(_random_request(rng))
    if kind == 3:
        return struct.pack("<IQ", rng.randrange(2**32), rng.randrange(2**64))
    return raw_frame(_random_request(rng), payload=7) + b"payload"


def _send_batch(port: int, batch: list[bytes], handshake: bool, cut: int) -> None:
    data = b"".join(batch)
    if cut:
        data = data[: max(1, len(data) - cut)]  # a truncated stream
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        if handshake:
            sock.recv(65536)
            sock.sendall(raw_frame({"job": "fuzz", "nonce": b"n" * 16}))
        try:
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
            sock.settimeout(2)
            while sock.recv(65536):
                pass
        except (ConnectionError, TimeoutError, OSError):
            pass  # the server hanging up on garbage is the expected outcome


@pytest.mark.timeout(240)
def test_server_survives_random_frames_while_a_job_runs():
    sent = [0]
    with server() as srv:
        url = f"{srv.url}/fuzzed-job"
        procs = [spawn_rank(store_jobs.store_and_reduce, r, 2, url, 400) for r in range(2)]
        try:
            baseline = rss_kib(srv.proc.pid)

            @settings(
                max_examples=HYPOTHESIS_BATCHES,
                deadline=None,
                database=None,
                suppress_health_check=list(HealthCheck),
            )
            @given(
                st.lists(frames, min_size=FRAMES_PER_BATCH, max_size=FRAMES_PER_BATCH),
                st.booleans(),
                st.integers(0, 40),
            )
            def fuzz(batch: list[bytes], handshake: bool, cut: int) -> None:
                _send_batch(srv.port, batch, handshake, cut)
                sent[0] += len(batch)

            fuzz()
            seed = int(os.environ.get("ARENDEZ_FUZZ_SEED", str(random.randrange(1 << 30))))
            print(f"fuzz seed {seed} (ARENDEZ_FUZZ_SEED replays it)")
            rng = random.Random(seed)
            for _ in range(RANDOM_BATCHES):
                batch = [_random_frame(rng) for _ in range(FRAMES_PER_BATCH)]
                _send_batch(srv.port, batch, rng.random() < 0.5, rng.randrange(41))
                sent[0] += len(batch)
            grown = rss_kib(srv.proc.pid) - baseline
        finally:
            results = collect(procs, 120)
        assert srv.proc.poll() is None, "the server died"
        assert "Traceback" not in srv.stderr_text(), srv.stderr_text()[-3000:]
    assert sent[0] >= 10_000
    assert grown < 64 * 1024, f"server RSS grew by {grown} KiB"
    for res in results:
        assert res.returncode == 0, res.stderr[-3000:]
        assert res.value == [3] * 400
