"""Auth (HMAC challenge-response, server and peer links) and TLS with a throwaway certificate."""

from __future__ import annotations

import socket
import subprocess
from pathlib import Path

import pytest

import arendez as dist
from arendez.transports.tcp import split_address
from tests.harness import collect, raw_frame, read_until_closed, run_ranks, server, spawn_rank, wait_for_files
from tests.jobs import collectives as collectives_jobs
from tests.jobs import failures as failures_jobs
from tests.jobs import lifecycle as lifecycle_jobs
from tests.jobs import shm as shm_jobs

TOKEN = "s3cret-token"


@pytest.fixture
def token_server(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    with server("--token-file", str(token_file)) as srv:
        yield srv


@pytest.mark.timeout(30)
async def test_wrong_or_missing_token_is_refused(token_server):
    for token in ("wrong", None):
        store = dist.Store("127.0.0.1", token_server.port, "job", token=token, timeout=3)
        with pytest.raises(dist.AuthenticationError):
            await store.connect()
    store = await dist.Store("127.0.0.1", token_server.port, "job", token=TOKEN, timeout=3).connect()
    await store.set("k", "v")
    assert await store.get("k") == b"v"
    await store.close()


@pytest.mark.timeout(30)
def test_without_token_nothing_but_the_handshake_is_answered(token_server):
    with socket.create_connection(("127.0.0.1", token_server.port)) as sock:
        challenge = sock.recv(65536)
        assert b"nonce" in challenge and TOKEN.encode() not in challenge
        sock.sendall(raw_frame({"job": "x", "nonce": b"0" * 16, "proof": b"forged" * 5}))
        sock.sendall(raw_frame({"op": "get", "id": 1, "key": "k"}))
        rest = read_until_closed(sock)
    assert b"AuthenticationError" in rest and b'"ok"' not in rest and b"\xa2ok" not in rest


@pytest.mark.timeout(30)
def test_a_client_refused_at_the_handshake_reads_why_though_it_sent_on(token_server):
    """What it sent behind its hello is read and dropped before the close, so the client reads
    the AuthenticationError, not a connection reset (bytes left unread at a close make the
    kernel answer with a reset, which drops the answer and fails the client's send)."""
    with socket.create_connection(("127.0.0.1", token_server.port)) as sock:
        sock.recv(65536)
        hello = raw_frame({"job": "x", "nonce": b"0" * 16, "proof": b"forged" * 5})
        sock.sendall(hello + bytes(4 << 20))  # (more than the socket buffers hold)
        assert b"AuthenticationError" in read_until_closed(sock)


@pytest.mark.timeout(60)
def test_token_job_and_stranger_cannot_join_the_mesh(token_server, tmp_path):
    url = f"arendez://{TOKEN}@127.0.0.1:{token_server.port}/guarded"
    procs = [spawn_rank(failures_jobs.guarded_job, r, 2, url, str(tmp_path)) for r in range(2)]
    try:
        wait_for_files(tmp_path, "addr-*", 2, 20)
        host, port = split_address((tmp_path / "addr-0").read_text())
        # a stranger without the token: challenged, refused, disconnected
        with socket.create_connection((host, int(port))) as sock:
            sock.recv(65536)
            sock.sendall(raw_frame({"rank": 1, "round": b"x" * 16, "nonce": b"0" * 16}))
            assert b"AuthenticationError" in read_until_closed(sock)
        (tmp_path / "probed").write_text("1")
    finally:
        results = collect(procs, 30)
    for res in results:
        assert res.returncode == 0, res.stderr[-3000:]
        assert res.value == [3.0, 3.0]  # the job went on unharmed


def _make_certs(tmp: Path) -> dict[str, str]:
    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=30)

    ca_key, ca, key, csr, cert = (
        str(tmp / n) for n in ("ca.key", "ca.pem", "node.key", "node.csr", "node.pem")
    )
    openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        ca_key,
        "-out",
        ca,
        "-days",
        "1",
        "-subj",
        "/CN=arendez-test-ca",
    )
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", csr, "-subj", "/CN=127.0.0.1")
    ext = tmp / "ext.cnf"
    ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    openssl(
        "x509",
        "-req",
        "-in",
        csr,
        "-CA",
        ca,
        "-CAkey",
        ca_key,
        "-CAcreateserial",
        "-out",
        cert,
        "-days",
        "1",
        "-extfile",
        str(ext),
    )
    return {"ca": ca, "cert": cert, "key": key}


@pytest.mark.timeout(90)
def test_tls_round_trip_server_and_peers(tmp_path):
    certs = _make_certs(tmp_path)
    env = {"ARENDEZ_TLS_CA": certs["ca"], "ARENDEZ_TLS_CERT": certs["cert"], "ARENDEZ_TLS_KEY": certs["key"]}
    with server("--tls-cert", certs["cert"], "--tls-key", certs["key"]) as srv:
        values = run_ranks(collectives_jobs.steady_all_reduce, 2, f"{srv.url}/tls", 5, 100_000, env=env)
        assert values == [9.0, 9.0]  # (0 + 4) + (1 + 4) in the last round
        # under TLS large payloads too go through TLS, not shared memory
        for res in run_ranks(shm_jobs.shm_job, 2, f"{srv.url}/tls-shm", 300_001, 1, env=env):
            assert res["shm"] == 0 and res["received"] > 300_001, res
        # plain TCP to a TLS server fails with a clear error, not a hang
        store = dist.Store("127.0.0.1", srv.port, "plain", timeout=2)

        async def plain() -> None:
            await store.connect()

        import asyncio

        with pytest.raises(dist.StoreError):
            asyncio.run(plain())


@pytest.mark.timeout(90)
def test_tls_with_embedded_tcp_server(tmp_path):
    certs = _make_certs(tmp_path)
    env = {"ARENDEZ_TLS_CA": certs["ca"], "ARENDEZ_TLS_CERT": certs["cert"], "ARENDEZ_TLS_KEY": certs["key"]}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert run_ranks(lifecycle_jobs.reinit, 2, f"tcp://127.0.0.1:{port}", 1, env=env)[0][0] == 1.0
