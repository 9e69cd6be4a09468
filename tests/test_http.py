"""``arendez-server --http-port``: /metrics, /status, the dashboard (in real headless chromium), ``status``.

Every test runs a real server process and real rank processes; a rank stopped with SIGSTOP keeps its
sockets open, so only the server's lease can declare it failed.
"""

from __future__ import annotations

import io
import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from tests.browser import Browser, chromium
from tests.harness import PY, ROOT, ServerProcess, popen, start_server

pytest.importorskip("prometheus_client", reason="needs the metrics extra: pip install -e '.[metrics]'")
from prometheus_client.parser import text_string_to_metric_families

WORLD = 4
LEASE = 2.0  # seconds; generous: the suite runs on 2 loaded cores


@contextmanager
def http_server(*args: str) -> Iterator[tuple[ServerProcess, str]]:
    """A real arendez-server with ``--http-port 0``; yields it and its HTTP base URL."""
    srv = start_server("--http-port", "0", "--lease", str(LEASE), *args)
    try:
        assert srv.proc.stdout is not None
        line = srv.proc.stdout.readline()
        assert line.startswith("arendez-server http on http://127.0.0.1:"), line
        yield srv, line.split()[-1]
    finally:
        srv.stop()


@contextmanager
def ranks(url: str, job: str, seconds: float, env: dict[str, str] | None = None) -> Iterator[list[Any]]:
    """``WORLD`` rank processes that join ``job`` and idle for ``seconds``; all killed after."""
    procs = [
        popen(
            [PY, "-m", "tests.ops_rank", str(seconds)],
            {"ARENDEZ_URL": f"{url}/{job}", "RANK": str(r), "WORLD_SIZE": str(WORLD), **(env or {})},
        )
        for r in range(WORLD)
    ]
    try:
        yield procs
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)  # works on a stopped process too
            proc.communicate(timeout=10)


def initialised(procs: list[Any]) -> None:
    """Wait until every rank's init returned: its round completes (and shows in /status) before
    the rank has connected to its peers, and a rank stopped in between fails their init."""
    for proc in procs:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "joined"


def get(url: str, token: str | None = None) -> tuple[int, str, bytes]:
    """Status code, content type and body of a GET."""
    request = urllib.request.Request(url)
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=10) as reply:
            return reply.status, reply.headers["Content-Type"], reply.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers["Content-Type"], exc.read()


def status(base: str, token: str | None = None) -> dict[str, Any]:
    code, ctype, body = get(f"{base}/status", token)
    assert code == 200 and ctype == "application/json", (code, body)
    parsed: dict[str, Any] = json.loads(body)
    return parsed


def metrics(base: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of /metrics, parsed by prometheus_client's own parser."""
    code, ctype, body = get(f"{base}/metrics")
    assert code == 200 and ctype.startswith("text/plain"), (code, ctype)
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(body.decode())
        for s in family.samples
    }


def status_cli(*args: str) -> subprocess.CompletedProcess[str]:
    """``arendez-server status ...`` in its own process (without ARENDEZ_TOKEN from our environment)."""
    env = {k: v for k, v in os.environ.items() if k != "ARENDEZ_TOKEN"}
    argv = [PY, "-m", "arendez_server", "status", *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=30, env=env, cwd=ROOT)


def until(check: Callable[[], Any], timeout: float, what: str) -> Any:
    """Poll ``check`` (bounded in time) until it returns something truthy."""
    deadline = time.monotonic() + timeout
    while not (value := check()):
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout}s")
        time.sleep(0.1)
    return value


def members(snap: dict[str, Any], job: str) -> dict[int, str]:
    """rank -> state of the job's complete rounds in a /status snapshot."""
    found = [j for j in snap["jobs"] if j["name"] == job]
    rounds = [r for j in found for r in j["rounds"] if r["complete"]]
    return {m["rank"]: m["state"] for r in rounds for m in r["members"]}


ALL_ACTIVE = dict.fromkeys(range(WORLD), "active")


@pytest.mark.timeout(60)
def test_metrics_parse_and_move_when_a_job_runs() -> None:
    with http_server() as (srv, base):
        before = metrics(base)
        assert before[("arendez_jobs", ())] == 0
        assert before[("arendez_holding_declarations", ())] == 0
        assert before[("arendez_ranks", (("state", "active"),))] == 0
        with ranks(srv.url, "m", 1.0) as procs:
            until(lambda: metrics(base)[("arendez_ranks", (("state", "active"),))] == WORLD, 30, "4 active")
            during = metrics(base)
            assert during[("arendez_jobs", ())] == 1 and during[("arendez_rounds", ())] == 1
            assert during[("arendez_connections", ())] >= WORLD
            for proc in procs:
                assert proc.wait(30) == 0
        active = ("arendez_ranks", (("state", "active"),))
        after = until(lambda: (m := metrics(base))[active] == 0 and m, 10, "no active rank in /metrics")
        assert after[("arendez_request_seconds_count", (("op", "join"),))] == WORLD
        assert after[("arendez_request_seconds_count", (("op", "leave"),))] == WORLD
        assert after[("arendez_request_seconds_count", (("op", "heartbeat"),))] > 0  # leases kept alive
        assert after[("arendez_departures_total", (("kind", "left"),))] == WORLD
        assert ("arendez_departures_total", (("kind", "failed"),)) not in after
        assert after[("arendez_jobs", ())] == 0  # an idle job is forgotten


@pytest.mark.timeout(60)
def test_a_rank_that_dies_of_an_uncaught_exception_is_a_failure_with_its_reason_everywhere() -> None:
    """Not a clean leave: the peers' next collective names the exception, and the server
    records (and /status shows) the rank as failed, with the same reason."""
    script = str(ROOT / "tests" / "scripts" / "crash_mid_job.py")
    with http_server() as (srv, base):
        procs = [popen([PY, script, f"{srv.url}/crash", str(r), "2"]) for r in range(2)]
        try:
            outs = [proc.communicate(timeout=40) for proc in procs]
        finally:
            for proc in procs:
                proc.kill()
                proc.wait()
        assert procs[1].returncode == 1 and "RuntimeError: rank crashes mid-job" in outs[1][1], outs[1][1]
        assert procs[0].returncode == 0, outs[0][1][-3000:]
        seen = json.loads(outs[0][0].strip().splitlines()[-1])
        why = "its process ended with an uncaught RuntimeError: rank crashes mid-job"
        assert seen["error"] == "RankFailedError" and seen["ranks"] == [1], seen
        assert why in seen["message"], seen
        job = next(j for j in status(base)["jobs"] if j["name"] == "crash")
        events = {e["rank"]: (e["kind"], e["reason"]) for e in job["events"]}
        assert events == {0: ("left", "left the job"), 1: ("failed", why)}, job["events"]


@pytest.mark.timeout(60)
def test_a_stopped_rank_left_alone_with_the_server_is_declared_failed() -> None:
    """(Review: with the rest of its job killed at the same moment, the stopped rank was the one
    keeper connection left open, and a server that heard nobody held its declaration for good.)"""
    with http_server() as (srv, base), ranks(srv.url, "alone", 40.0) as procs:
        until(lambda: members(status(base), "alone") == ALL_ACTIVE, 30, "4 active ranks in /status")
        initialised(procs)
        os.kill(procs[-1].pid, signal.SIGSTOP)
        for proc in procs[:-1]:
            os.killpg(proc.pid, signal.SIGKILL)

        def failed() -> list[int]:
            jobs = [j for j in status(base)["jobs"] if j["name"] == "alone"]
            return sorted(e["rank"] for j in jobs for e in j["events"] if e["kind"] == "failed")

        until(lambda: failed() == list(range(WORLD)), LEASE + 8, "every rank failed in /status")
        assert status(base)["holding_declarations"] is False


@pytest.mark.timeout(60)
def test_status_shows_the_job_then_the_rank_stopped_with_sigstop() -> None:
    with http_server() as (srv, base), ranks(srv.url, "s", 40.0) as procs:
        until(lambda: members(status(base), "s") == ALL_ACTIVE, 30, "4 active ranks in /status")
        initialised(procs)
        snap = status(base)
        job = next(j for j in snap["jobs"] if j["name"] == "s")
        (round_,) = job["rounds"]
        assert round_["world_size"] == WORLD and len(round_["id"]) == 12
        for m in round_["members"]:
            assert m["address"].startswith("127.0.0.1:") and 0 <= m["lease_age"] < LEASE + 1
        os.kill(procs[2].pid, signal.SIGSTOP)
        want = {**ALL_ACTIVE, 2: "failed"}
        until(lambda: members(status(base), "s") == want, LEASE + 8, "rank 2 failed in /status")
        job = next(j for j in status(base)["jobs"] if j["name"] == "s")
        assert [(e["rank"], e["kind"]) for e in job["events"]] == [(2, "failed")]
        ages = {m["rank"]: m["lease_age"] for m in job["rounds"][0]["members"]}
        # (QA25: the age ran from the round's completion, whatever the heartbeats: over a lease
        # by now for the live ranks too)
        assert all(ages[r] < LEASE for r in (0, 1, 3)) and ages[2] > LEASE, ages
        assert metrics(base)[("arendez_departures_total", (("kind", "failed"),))] == 1

        table = status_cli(base)
        assert table.returncode == 0, table.stderr
        cells = [ln.split() for ln in table.stdout.splitlines()]
        rows = {c[0]: c[1] for c in cells if c and c[0] in {str(r) for r in range(WORLD)}}
        assert rows == {"0": "active", "1": "active", "2": "failed", "3": "active"}, table.stdout
        assert "job 's'" in table.stdout and "rank 2 failed: no heartbeat" in table.stdout

        for proc in procs:  # the whole job dies: the server forgets it, /status still shows its end
            os.killpg(proc.pid, signal.SIGKILL)

        def ended() -> dict[str, Any] | None:
            found = [j for j in status(base)["jobs"] if j["name"] == "s"]
            return found[0] if found and found[0]["ended"] else None

        job = until(ended, 15, "job 's' shown as ended in /status")
        assert job["rounds"] == [] and job["events"][0]["rank"] == 2
        assert sorted(e["rank"] for e in job["events"]) == [0, 1, 2, 3]
        assert metrics(base)[("arendez_jobs", ())] == 0
        table = status_cli(base)
        assert "job 's'  ended" in table.stdout and "rank 2 failed: no heartbeat" in table.stdout


@pytest.mark.timeout(30)
def test_token_guards_status_and_metrics_not_the_page(tmp_path: Any) -> None:
    (tmp_path / "token").write_text("s3cret\n")
    with http_server("--token-file", str(tmp_path / "token")) as (_, base):
        for path in ("/status", "/metrics"):
            code, _, body = get(base + path)
            assert code == 401 and b"Bearer" in body
            assert get(base + path, "wrong")[0] == 401
            assert get(base + path, "s3cret")[0] == 200
        assert get(base + "/")[0] == 200  # the page holds no data: it fetches /status with the token
        done = status_cli(base)
        assert done.returncode == 1 and "HTTP 401" in done.stderr
        done = status_cli(base, "--token-file", str(tmp_path / "token"))
        assert done.returncode == 0 and "no jobs" in done.stdout, done.stderr


@pytest.mark.timeout(30)
def test_bad_http_requests_get_clear_answers_and_the_server_carries_on() -> None:
    with http_server() as (_, base):
        code, _, body = get(base + "/nope")
        assert code == 404 and b"/status" in body
        request = urllib.request.Request(base + "/status", method="POST")
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(request, timeout=10)
        assert err.value.code == 405
        host, port = base.removeprefix("http://").split(":")
        garbage = {
            b"\x00\xff garbage\r\n\r\n": b"HTTP/1.1 400 Bad Request\r\n",
            b"GET / HTTP/1.1\r\nHost: x\r\nX: " + b"a" * 70_000 + b"\r\n\r\n": b"HTTP/1.1 431 ",
        }
        for sent, expected in garbage.items():
            with socket.create_connection((host, int(port)), timeout=5) as sock:
                sock.sendall(sent)
                reply = b""
                while chunk := sock.recv(65536):  # the server answers, then closes
                    reply += chunk
            assert reply.startswith(expected) and b"bad HTTP request" in reply, reply
        code, _, _ = get(base + "/status")
        assert code == 200
        done = status_cli("ftp://x")
        assert done.returncode == 1
        assert done.stderr.startswith("arendez-server status: status URL must start with http://")


@pytest.mark.timeout(30)
def test_too_many_idle_http_connections_get_503_and_the_rest_are_served() -> None:
    from arendez_server.http import MAX_HTTP_CONNECTIONS

    with http_server() as (_, base):
        host, port = base.removeprefix("http://").split(":")
        idle = [socket.create_connection((host, int(port)), timeout=5) for _ in range(MAX_HTTP_CONNECTIONS)]
        try:
            until(lambda: get(base + "/status")[0] == 503, 10, "a 503 once the idle connections are open")
            code, _, body = get(base + "/status")
            assert code == 503 and f"already {MAX_HTTP_CONNECTIONS} HTTP connections".encode() in body
        finally:
            for sock in idle:
                sock.close()
        until(lambda: get(base + "/status")[0] == 200, 10, "served again once they closed")


def _colour_pixels(png: bytes) -> dict[str, int]:
    """How many pixels of the dashboard's active-green and failed-red a screenshot has."""
    from PIL import Image

    image = Image.open(io.BytesIO(png)).convert("RGB")
    colours = {"green": (0x2C, 0xA0, 0x2C), "red": (0xD6, 0x27, 0x28)}
    counts = dict.fromkeys(colours, 0)
    for count, rgb in image.getcolors(maxcolors=1 << 20) or []:
        for name, want in colours.items():
            if rgb == want:
                counts[name] += count
    return counts


def _js(states: dict[str, str]) -> str:
    """A JavaScript string literal of ``JSON.stringify(states)``."""
    return json.dumps(json.dumps(states, separators=(",", ":")))


RANK_STATES = """JSON.stringify(Object.fromEntries([...document.querySelectorAll(
    '[data-job="web"] tr[data-rank]')].map((tr) => [tr.dataset.rank, tr.dataset.state])))"""


def _chromium() -> str:
    binary = chromium()
    if binary is None:
        if os.environ.get("ARENDEZ_CI") == "1":
            pytest.fail("chromium is not installed (apt-get install chromium), and ARENDEZ_CI=1 requires it")
        pytest.skip("chromium is not installed (apt-get install chromium)")
    return binary


@pytest.mark.timeout(60)
def test_dashboard_takes_the_token_from_its_address(tmp_path: Any) -> None:
    (tmp_path / "token").write_text("s3cret")
    with http_server("--token-file", str(tmp_path / "token")) as (_, base):
        browser = Browser(_chromium())
        try:
            browser.open(base + "/")
            updated = "document.getElementById('updated').textContent"
            shown = browser.wait_for(f"{updated}.startsWith('cannot refresh') && {updated}", 20, "a refusal")
            assert "HTTP 401" in shown
            browser.open(base + "/#token=s3cret")
            browser.wait_for(f"{updated}.startsWith('updated ')", 20, "a refresh with the token")
            assert "0 jobs" in browser.evaluate("document.getElementById('summary').textContent")
        finally:
            browser.close()


@pytest.mark.timeout(90)
def test_dashboard_in_headless_chromium_shows_ranks_then_the_failed_one(tmp_path: Any) -> None:
    binary = _chromium()
    pytest.importorskip("PIL", reason="the screenshot check needs pillow (the test extra)")
    with http_server() as (srv, base), ranks(srv.url, "web", 60.0) as procs:
        until(lambda: members(status(base), "web") == ALL_ACTIVE, 30, "4 active ranks in /status")
        initialised(procs)
        browser = Browser(binary)
        try:
            browser.open(base + "/")
            want = {str(r): "active" for r in range(WORLD)}
            browser.wait_for(f"{RANK_STATES} === {_js(want)}", 20, "4 active ranks")
            text = browser.evaluate("document.body.innerText")
            assert "job web" in text and text.count("active") >= WORLD
            first = browser.screenshot()
            (tmp_path / "active.png").write_bytes(first)
            seen = _colour_pixels(first)
            assert seen["green"] > 0 and seen["red"] == 0, seen

            os.kill(procs[1].pid, signal.SIGSTOP)
            want["1"] = "failed"  # the same page, refreshing itself: no reload
            browser.wait_for(f"{RANK_STATES} === {_js(want)}", LEASE + 10, "rank 1 failed")
            event = "document.body.innerText.includes('rank 1 failed: no heartbeat')"
            browser.wait_for(event, 5, "the failure among the recent events")
            second = browser.screenshot()
            (tmp_path / "failed.png").write_bytes(second)
            seen = _colour_pixels(second)
            assert seen["green"] > 0 and seen["red"] > 0, seen
        finally:
            browser.close()


@pytest.mark.timeout(60)
def test_the_status_cli_names_a_wrong_port_and_a_missing_token_file_without_a_traceback() -> None:
    """(QA25: the store port instead of --http-port gave a BadStatusLine traceback full of
    binary bytes, a missing --token-file a FileNotFoundError traceback.)"""
    with http_server() as (srv, base):
        wrong = status_cli(f"http://127.0.0.1:{srv.port}")
        missing = status_cli(base, "--token-file", "/nonexistent/token")
    assert wrong.returncode == 1 and "Traceback" not in wrong.stderr, wrong.stderr
    assert "no HTTP status answer there (is it the server's --http-port" in wrong.stderr, wrong.stderr
    assert missing.returncode == 2 and "Traceback" not in missing.stderr, missing.stderr
    assert "--token-file /nonexistent/token: No such file or directory" in missing.stderr, missing.stderr
