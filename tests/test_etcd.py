"""The etcd v3 backend against real etcd processes on loopback (one member, and three).

Each test starts its own ``etcd`` (Debian's ``etcd-server`` 3.4) with a temporary data dir
and kills it afterwards; ranks are real processes.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

import arendez as dist
from arendez.errors import (
    AuthenticationError,
    RendezvousError,
    StoreConnectTimeoutError,
    StoreError,
    StoreTimeoutError,
)
from arendez.etcd import open_store, parse_url
from arendez.etcd.codec import b64, prefix_end
from arendez.rendezvous import plan
from arendez.store import Store
from tests.harness import PY, collect, popen, spawn_rank, wait_for_files
from tests.jobs import failures as failure_jobs
from tests.jobs import lifecycle as lifecycle_jobs

ETCD = shutil.which("etcd")
LEASE = 2  # seconds: the shortest lease etcd grants with its default election timeout

if not os.environ.get("ARENDEZ_CI"):  # CI installs both: there a missing one is a failure
    if ETCD is None:
        pytest.skip("etcd is not installed (apt-get install etcd-server)", allow_module_level=True)
    pytest.importorskip("aiohttp", reason="the etcd client needs pip install 'arendez[etcd]'")


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@dataclass
class Etcd:
    """A real etcd cluster of ``len(procs)`` members on loopback."""

    client_ports: list[int]
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    data: Path | None = None

    def endpoints(self, members: list[int] | None = None) -> str:
        chosen = range(len(self.client_ports)) if members is None else members
        return ",".join(f"127.0.0.1:{self.client_ports[i]}" for i in chosen)

    def url(self, job: str, auth: str = "", lease: int = LEASE) -> str:
        return f"etcd://{auth}{self.endpoints()}/{job}?lease={lease}"

    def kill(self, i: int) -> None:
        proc = self.procs[i]
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait()

    def stop(self) -> None:
        for i in range(len(self.procs)):
            self.kill(i)
        if self.data is not None:
            shutil.rmtree(self.data, ignore_errors=True)

    def post(self, path: str, body: dict[str, Any], member: int = 0, token: str = "") -> dict[str, Any]:
        return _post_json(f"http://127.0.0.1:{self.client_ports[member]}/v3/{path}", body, token)

    def count(self, prefix: str, token: str = "") -> int:
        key = prefix.encode()
        reply = self.post(
            "kv/range", {"key": b64(key), "range_end": b64(prefix_end(key)), "count_only": True}, token=token
        )
        return int(reply.get("count", 0))


def _post_json(url: str, body: dict[str, Any], token: str = "") -> dict[str, Any]:
    headers = {"Content-Type": "application/json", **({"Authorization": token} if token else {})}
    request = urllib.request.Request(url, json.dumps(body).encode(), headers)
    try:
        with urllib.request.urlopen(request, timeout=5) as resp:
            reply: dict[str, Any] = json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        reply = json.loads(exc.read())
    return reply


def start_etcd(tmp: Path, members: int) -> Etcd:
    assert ETCD is not None, "etcd is not installed (apt-get install etcd-server)"
    ports = _free_ports(2 * members)
    cluster = Etcd(ports[:members])
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    data = Path(tempfile.mkdtemp(prefix="arendez-etcd-", dir=shm))
    cluster.data = data  # memory-backed where possible: fsyncs are cheap, like a fast disk
    peers = ",".join(f"m{i}=http://127.0.0.1:{ports[members + i]}" for i in range(members))
    try:
        for i in range(members):
            client, peer = f"http://127.0.0.1:{ports[i]}", f"http://127.0.0.1:{ports[members + i]}"
            log = open(tmp / f"etcd-m{i}.log", "wb")  # noqa: SIM115 - the process owns it
            argv = [ETCD, "--name", f"m{i}", "--data-dir", str(data / f"m{i}")]
            argv += ["--listen-client-urls", client, "--advertise-client-urls", client]
            argv += ["--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer]
            argv += ["--initial-cluster", peers, "--initial-cluster-token", tmp.name]
            cluster.procs.append(subprocess.Popen(argv, stdout=log, stderr=log, start_new_session=True))
        deadline = time.monotonic() + 30
        for i in range(members):
            while True:
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{ports[i]}/health", timeout=1) as resp:
                        if json.loads(resp.read())["health"] == "true":
                            break
                except (OSError, ValueError, KeyError):
                    pass
                assert cluster.procs[i].poll() is None, (tmp / f"etcd-m{i}.log").read_text()[-2000:]
                assert time.monotonic() < deadline, f"etcd member {i} not healthy within 30s"
                time.sleep(0.1)
    except BaseException:
        cluster.stop()
        raise
    return cluster


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Etcd]:
    cluster = start_etcd(tmp_path_factory.mktemp("etcd1"), 1)
    yield cluster
    cluster.stop()


def _job(tmp: Path, what: str) -> str:
    return f"{what}-{tmp.name}"[-60:].strip("-")


# -- URLs --------------------------------------------------------------------------------------
def test_url_parsing_and_plan() -> None:
    ends, job, lease = parse_url("etcd://u:p%40ss@10.0.0.1:2379,[::1]:3000,etcd-b/train?lease=7")
    assert ends.hosts == (("10.0.0.1", 2379), ("::1", 3000), ("etcd-b", 2379))
    assert (ends.user, ends.password, job, lease) == ("u", "p@ss", "train", 7)
    p = plan("etcd://127.0.0.1:2379/j", 4, -1, env={})
    assert (p.host, p.port, p.job, p.store_url) == ("127.0.0.1", 2379, "j", "etcd://127.0.0.1:2379/j")
    p = plan(None, -1, -1, env={"ARENDEZ_URL": "etcd://h:1/j", "WORLD_SIZE": "2", "RANK": "1"})
    assert (p.world_size, p.rank, p.store_url) == (2, 1, "etcd://h:1/j")
    for bad, said in [
        ("etcd://h:1", "one job"),
        ("etcd://h:1/a/b", "one job"),
        ("etcd://h:x/j", "invalid port"),
        ("etcd://h:1/j?lease=0", "lease"),
        ("etcd://h:1/j?ttl=3", "unknown option"),
        ("etcd://user@h:1/j", "user:password"),
    ]:
        with pytest.raises(RendezvousError, match=said):
            parse_url(bad)


def test_missing_client_library_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("aiohttp", "arendez.etcd.store", "arendez.etcd.client"):
        monkeypatch.setitem(sys.modules, name, None)  # as if arendez[etcd] were not installed
    with pytest.raises(RendezvousError, match=r"pip install 'arendez\[etcd\]'"):
        open_store("etcd://127.0.0.1:2379/j")


# -- store ---------------------------------------------------------------------------------------
@pytest.fixture(params=["etcd", "arendez-server"])
def unconnected_store(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    """One conformance suite, two backends: new clients of one job's store on etcd or on our
    server, not connected yet."""
    job = _job(tmp_path, "store")
    if request.param == "etcd":
        url = request.getfixturevalue("etcd").url(job)
        return lambda: open_store(url, timeout=10)
    server = request.getfixturevalue("arendez_server")
    return lambda: Store("127.0.0.1", server.port, job, timeout=10)


@pytest.fixture
def store_factory(unconnected_store: Any) -> Any:
    return lambda: unconnected_store().connect()


async def test_a_store_connects_on_its_first_call_and_in_async_with(unconnected_store: Any) -> None:
    """(QA26: ``open_store(url)``'s client said "not connected (call connect() first)" and had no
    ``async with``, unlike ``Store``.)"""
    first = unconnected_store()
    await first.set("first-call", b"1")
    assert await first.get("first-call") == b"1"
    await first.close()
    with pytest.raises(StoreError, match="closed"):
        await first.get("first-call")
    async with unconnected_store() as second:
        assert await second.add("counted", 2) == 2
    with pytest.raises(StoreError, match="closed"):
        await second.add("counted", 2)


async def test_store_operations(store_factory: Any) -> None:
    a = await store_factory()
    b = await store_factory()
    try:
        await a.set("k", b"v1")
        assert await b.get("k") == b"v1"
        assert await a.add("n", 5) == 5 and await b.add("n", -2) == 3
        assert await a.compare_set("k", b"v1", b"v2") == b"v2"
        assert await a.compare_set("k", b"nope", b"v3") == b"v2"
        assert await a.compare_set("fresh", b"", b"x") == b"x"
        assert await a.compare_set("absent", b"want", b"x") == b"want"
        assert await a.check(["k", "n"]) and not await a.check(["k", "missing"])
        assert await a.num_keys() == 3
        assert await a.delete("fresh") and not await a.delete("fresh")
        with pytest.raises(StoreError, match="does not hold an integer"):
            await a.add("k", 1)
        with pytest.raises(StoreTimeoutError):
            await a.get("later", timeout=0.3)
        # a waiter is released by another client's write, not by polling a deadline out
        waiting = asyncio.ensure_future(a.wait(["w1", "w2"], timeout=10))
        getting = asyncio.ensure_future(a.get("w2", timeout=10))
        await asyncio.sleep(0.2)
        await b.set("w1", "1")
        await asyncio.sleep(0.1)
        assert not waiting.done()
        await b.set("w2", "2")
        await asyncio.wait_for(waiting, 5)
        assert await asyncio.wait_for(getting, 5) == b"2"
        # concurrent adds from two clients through compare-and-swap lose nothing
        await asyncio.gather(*(c.add("sum", 1) for c in (a, b) for _ in range(25)))
        assert int(await a.get("sum")) == 50
        await asyncio.gather(*(c.append("log", f"{i}.{j};") for i, c in enumerate((a, b)) for j in range(10)))
        parts = (await b.get("log")).decode().split(";")[:-1]
        assert sorted(parts) == sorted(f"{i}.{j}" for i in range(2) for j in range(10))  # none lost
    finally:
        await a.close()
        await b.close()


# -- rendezvous ------------------------------------------------------------------------------
async def test_rendezvous_assigns_ranks_and_rounds(etcd: Etcd, tmp_path: Path) -> None:
    job = _job(tmp_path, "rdzv")
    stores = [await open_store(etcd.url(job), timeout=10).connect() for _ in range(4)]
    try:
        members = await asyncio.gather(*(s.join(4, -1, f"10.0.0.{i}:1") for i, s in enumerate(stores)))
        assert sorted(m.rank for m in members) == [0, 1, 2, 3]
        assert len({m.nonce for m in members}) == 1
        for i, m in enumerate(members):
            assert m.peers[m.rank] == f"10.0.0.{i}:1" and m.peers == members[0].peers
        # the next round is a new one, with its own size; an explicit rank is taken once
        extra = [await open_store(etcd.url(job), timeout=10).connect() for _ in range(3)]
        try:
            first = asyncio.ensure_future(extra[0].join(2, 1, "a:1", timeout=10))
            await asyncio.sleep(0.3)
            with pytest.raises(RendezvousError, match=r"rank 1 of job .* has already joined"):
                await extra[1].join(2, 1, "b:1", timeout=5)
            second = await extra[2].join(2, 0, "c:1", timeout=5)
            assert (await first).peers == second.peers == ["c:1", "a:1"]
            assert second.nonce != members[0].nonce
        finally:
            for s in extra:
                await s.leave()
                await s.close()
    finally:
        for s in stores:
            await s.leave()
            await s.close()
    assert etcd.count(f"/arendez/{job}/") == 0


async def test_a_rank_that_leaves_on_its_way_out_of_a_failure_is_told_as_failed(
    etcd: Etcd, tmp_path: Path
) -> None:
    job = _job(tmp_path, "leave-failed")
    stores = [await open_store(etcd.url(job), timeout=10).connect() for _ in range(3)]
    events: list[dict[str, Any]] = []
    stores[0].on_event = events.append
    try:
        await asyncio.gather(*(s.join(3, r, f"10.0.0.{r}:1") for r, s in enumerate(stores)))
        why = "its process ended with an uncaught ValueError: bad batch"
        await stores[1].leave(failed=why)
        await stores[2].leave()
        for _ in range(100):
            if len(events) == 2:
                break
            await asyncio.sleep(0.05)
        got = sorted((e["rank"], e["event"], e["reason"]) for e in events)
        assert got == [(1, "rank_failed", why), (2, "rank_left", "left the job")], events
    finally:
        for s in stores:
            await s.leave()
            await s.close()


async def test_world_size_mismatch_and_deadline(etcd: Etcd, tmp_path: Path) -> None:
    url = etcd.url(_job(tmp_path, "mismatch"))
    a = await open_store(url, timeout=10).connect()
    b = await open_store(url, timeout=10).connect()
    try:
        joining = asyncio.ensure_future(a.join(3, 0, "a:1", timeout=1.0))
        await asyncio.sleep(0.3)
        with pytest.raises(RendezvousError, match="forming a world of 3"):
            await b.join(2, 1, "b:1", timeout=2)
        with pytest.raises(StoreTimeoutError, match="incomplete: only 1 of 3") as timed_out:
            await joining
        # as the arendez server says it: a RendezvousError that counts who joined
        assert isinstance(timed_out.value, RendezvousError), timed_out.value
        assert "only 1 of 3 ranks joined in time (missing: 2 rank(s): 1, 2)" in str(timed_out.value)
        # (QA25: the timed-out round's size stayed, and refused a world of 2 for good)
        c = await open_store(url, timeout=10).connect()
        try:
            both = await asyncio.gather(b.join(2, 1, "b:1", timeout=10), c.join(2, 0, "c:1", timeout=10))
            assert sorted(m.rank for m in both) == [0, 1]
        finally:
            await c.close()
    finally:
        await a.close()
        await b.close()


def _run(name: str, ws: int, url: str, *args: Any, timeout: float = 40) -> list[Any]:
    procs = [_spawn(name, r, ws, url, *args) for r in range(ws)]
    results = collect(procs, timeout)
    for res in results:
        assert res.returncode == 0, f"rank {res.rank} exited {res.returncode}:\n{res.stderr[-3000:]}"
    return [res.value for res in results]


def _spawn(name: str, rank: int, ws: int, url: str, *args: Any) -> subprocess.Popen[str]:
    return popen([PY, "-m", "tests.etcd_scenarios", name, str(rank), str(ws), url, json.dumps(list(args))])


@pytest.mark.timeout(90)
def test_job_over_etcd_runs_collectives_and_cleans_up(etcd: Etcd, tmp_path: Path) -> None:
    job = _job(tmp_path, "job")
    seen = _run("store_and_reduce", 3, etcd.url(job), 5, str(tmp_path), 0.0)
    assert seen == [[6 * (i >= 0) for i in range(5)]] * 3  # every rank added rank+1: 1+2+3
    out = _run("auto_rank", 3, etcd.url(job + "-auto"))
    assert sorted(o["rank"] for o in out) == [0, 1, 2] and all(o["all"] == [0, 1, 2] for o in out)
    assert etcd.count(f"/arendez/{job}/") == 0, "the finished job's keys were not deleted"
    assert etcd.count(f"/arendez/{job}-auto/") == 0


# -- liveness ----------------------------------------------------------------------------------
def _failure_run(etcd: Etcd, tmp_path: Path, sig: int) -> tuple[float, list[Any]]:
    url = etcd.url(_job(tmp_path, f"fail{sig}"))
    procs = [
        spawn_rank(failure_jobs.reduce_until_failure, r, 3, url, str(tmp_path), 1000, 30.0) for r in range(3)
    ]
    try:
        wait_for_files(tmp_path, "ready-*", 3)
        os.kill(procs[2].pid, sig)
        at = time.time()
        results = collect(procs[:2], 25)
    finally:
        procs[2].kill()
        procs[2].wait()
    return at, results


@pytest.mark.timeout(60)
def test_kill_9_rank_fails_survivors_within_lease(etcd: Etcd, tmp_path: Path) -> None:
    at, results = _failure_run(etcd, tmp_path, signal.SIGKILL)
    for res in results:
        assert res.returncode == 0, res.stderr[-3000:]
        out = res.value
        assert out["error"] == "RankFailedError" and out["rank_named"] == 2, out
        assert out["at"] - at < LEASE + 1, f"detected after {out['at'] - at:.2f}s"


@pytest.mark.timeout(60)
def test_stopped_rank_is_declared_failed_by_its_lease(etcd: Etcd, tmp_path: Path) -> None:
    """SIGSTOP keeps the rank's TCP connections open: only the expired lease can tell."""
    at, results = _failure_run(etcd, tmp_path, signal.SIGSTOP)
    for res in results:
        assert res.returncode == 0, res.stderr[-3000:]
        out = res.value
        assert out["error"] == "RankFailedError" and out["rank_named"] == 2, out
        assert "etcd lease expired" in out["message"], out
        print(f"rank {res.rank}: stopped rank declared failed after {out['at'] - at:.2f}s")
        assert out["at"] - at < LEASE + 1, f"detected after {out['at'] - at:.2f}s"


@pytest.mark.timeout(60)
def test_busy_event_loop_keeps_its_lease(etcd: Etcd, tmp_path: Path) -> None:
    url = etcd.url(_job(tmp_path, "busy"))
    procs = [spawn_rank(lifecycle_jobs.busy_loop, r, 2, url, 2.0 * LEASE) for r in range(2)]
    for res in collect(procs, 40):
        assert res.returncode == 0, res.stderr[-3000:]
        assert res.value == 2.0


# -- cluster, outage, auth -----------------------------------------------------------------------
@pytest.mark.timeout(90)
def test_destroy_with_etcd_gone_takes_seconds_not_its_timeout(tmp_path: Path) -> None:
    """(QA25: with etcd down at the end of a job, destroy_process_group spent its whole 30 s
    trying to leave the round, and said nothing.)"""
    cluster = start_etcd(tmp_path, 1)
    try:
        url = cluster.url(_job(tmp_path, "gone"))
        procs = [_spawn("destroy_after_etcd_is_gone", r, 2, url, str(tmp_path)) for r in range(2)]
        wait_for_files(tmp_path, "ready-*", 2)
        cluster.kill(0)
        (tmp_path / "gone").write_text("1")
        results = collect(procs, 60)
    finally:
        cluster.stop()
    for res in results:
        assert res.returncode == 0, res.stderr[-3000:]
        assert res.value["sum"] == 2.0
        assert res.value["destroy"] < 10, res.value  # (LEAVE_SECONDS, not the 30 s timeout)
        assert "could not leave its round on etcd" in res.stderr, res.stderr[-2000:]


@pytest.mark.timeout(120)
def test_losing_an_etcd_member_mid_job(tmp_path: Path) -> None:
    cluster = start_etcd(tmp_path, 3)
    try:
        url = cluster.url(_job(tmp_path, "cluster"))
        procs = [_spawn("store_and_reduce", r, 2, url, 30, str(tmp_path), 0.1) for r in range(2)]
        wait_for_files(tmp_path, "ready-*", 2)
        cluster.kill(0)  # the first endpoint: every client starts there
        results = collect(procs, 60)
        for res in results:
            assert res.returncode == 0, res.stderr[-3000:]
            assert res.value == [3] * 30
        # new ranks still join through the surviving majority
        assert _run("auto_rank", 2, cluster.url(_job(tmp_path, "after")))[0]["all"] == [0, 1]
    finally:
        cluster.stop()


async def test_unreachable_etcd_fails_at_the_deadline_naming_endpoints() -> None:
    ports = _free_ports(2)  # nothing listens there
    url = f"etcd://127.0.0.1:{ports[0]},127.0.0.1:{ports[1]}/nobody"
    started = time.monotonic()
    with pytest.raises(StoreError, match=f"127.0.0.1:{ports[0]},127.0.0.1:{ports[1]}") as info:
        await open_store(url).connect(timeout=1.0)
    assert 0.9 < time.monotonic() - started < 4.0
    assert "unreachable until the deadline" in str(info.value)
    assert isinstance(info.value, StoreConnectTimeoutError)  # a NetworkError: torch's DistNetworkError
    # the same through init_process_group: an ArendezError at its deadline, not a hang
    started = time.monotonic()
    with pytest.raises((StoreError, RendezvousError), match=f"127.0.0.1:{ports[0]}"):
        await dist.init_process_group(init_method=url, world_size=2, rank=0, timeout=1.5)
    assert time.monotonic() - started < 5.0
    assert not dist.is_initialized()


@pytest.mark.timeout(60)
def test_auth_wrong_password_is_authentication_error(tmp_path: Path) -> None:
    cluster = start_etcd(tmp_path, 1)
    try:
        for path, body in [
            ("auth/user/add", {"name": "root", "password": "rootpw"}),
            ("auth/user/add", {"name": "trainer", "password": "s3cret"}),
            ("auth/role/add", {"name": "root"}),
            ("auth/role/add", {"name": "arendez"}),
            (
                "auth/role/grant",
                {
                    "name": "arendez",
                    "perm": {
                        "key": b64("/arendez/"),
                        "range_end": b64(prefix_end(b"/arendez/")),
                        "permType": "READWRITE",
                    },
                },
            ),
            ("auth/user/grant", {"user": "trainer", "role": "arendez"}),
            ("auth/user/grant", {"user": "root", "role": "root"}),
            ("auth/enable", {}),
        ]:
            reply = cluster.post(path, body)
            assert "error" not in reply, (path, reply)
        job = _job(tmp_path, "auth")

        async def attempt(auth: str) -> None:
            store = await open_store(cluster.url(job, auth=auth), timeout=5).connect()
            await store.set("k", "v")
            await store.close()

        with pytest.raises(AuthenticationError, match="refused user 'trainer'"):
            asyncio.run(attempt("trainer:wrong@"))
        with pytest.raises(AuthenticationError):
            asyncio.run(attempt(""))  # auth is on: anonymous requests are refused
        asyncio.run(attempt("trainer:s3cret@"))
        out = _run("auto_rank", 2, cluster.url(job + "-job", auth="trainer:s3cret@"))
        assert out[0]["all"] == [0, 1]
    finally:
        cluster.stop()


@pytest.mark.timeout(60)
def test_launcher_runs_a_job_on_etcd(etcd: Etcd, tmp_path: Path) -> None:
    server = f"etcd://{etcd.endpoints()}?lease={LEASE}"
    script = Path(__file__).parent / "launch_scripts" / "allreduce.py"
    args = ["--server", server, "--job", _job(tmp_path, "run"), "--nproc", "2", str(script)]
    proc = popen([PY, "-m", "arendez.launch", *args])
    try:
        out, err = proc.communicate(timeout=50)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    assert out.count(f"sum=3 url=etcd://{etcd.endpoints()}/{_job(tmp_path, 'run')}?lease={LEASE}") == 2, out
