"""The server's HTTP side for operators: ``/metrics`` (Prometheus), ``/status`` (JSON), ``/`` (dashboard).

Needs the ``metrics`` extra (``pip install 'arendez[metrics]'``: prometheus_client, h11). It reads the
server only through :func:`snapshot`, on the server's event loop, and learns about requests, refusals
and departures through :class:`Metrics`, the server's hooks. With a server token, ``/status`` and
``/metrics`` need ``Authorization: Bearer TOKEN``; the dashboard page and its assets hold no data and
are served to anyone (the page takes the token from its URL fragment: ``/#token=TOKEN``).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import hmac
import http.client
import json
import logging
import os
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from http import HTTPStatus
from importlib import resources
from typing import Any

from arendez.errors import ArendezError
from arendez.transports import local

from .hooks import ServerHooks
from .rounds import Departure

try:
    import h11
    from prometheus_client import CollectorRegistry, Counter, Histogram
    from prometheus_client.core import GaugeMetricFamily, Metric
    from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
except ImportError as exc:  # pragma: no cover - depends on the environment
    need = "arendez-server --http-port and status need the metrics extra: pip install 'arendez[metrics]'"
    raise ImportError(f"{need} ({exc})") from exc

log = logging.getLogger("arendez.server.http")

#: Events kept per job for the dashboard, and jobs whose events are kept.
EVENTS_PER_JOB = 20
EVENT_JOBS = 1000
#: Jobs that ended (the server forgot them) still shown, with their last events, for this long.
ENDED_JOBS = 20
ENDED_SECONDS = 3600.0
MAX_HTTP_CONNECTIONS = 64
STATES = ("joining", "active", "left", "failed")
MAX_REQUEST_HEAD = 8192
READ_TIMEOUT = 10.0
ASSETS = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/dashboard.js": ("dashboard.js", "text/javascript; charset=utf-8"),
    "/dashboard.css": ("dashboard.css", "text/css; charset=utf-8"),
}


def _empty(job: Any) -> bool:
    """A job that holds nothing (e.g. the one the process-wide lease connections name)."""
    return not job.kv and not job.rounds and job.forming is None


def snapshot(server: Any, events: Metrics | None = None) -> dict[str, Any]:
    """A JSON-ready copy of what ``server`` (an ``arendez_server.app.Server``) holds right now.

    The one place that reads the server's internals: jobs with their key counts, the round being
    formed and the completed rounds with each member's rank, address, state and lease age.
    """
    now = time.monotonic()
    jobs = []
    for name, job in list(server.state.jobs.items()):
        if _empty(job):
            continue
        rounds = []
        forming = job.forming
        for round_ in [*job.rounds.values(), *([forming] if forming is not None else [])]:
            complete = round_.complete
            members = [
                {
                    "rank": m.rank,
                    "address": local.parse(m.address)[0],  # (not the same-host socket's name)
                    "state": m.state.value if complete else "joining",
                    "lease_age": round(max(0.0, now - m.seen()), 3),
                }
                for _, m in sorted(round_.members.items())
            ]
            rounds.append(
                {
                    "id": round_.nonce.hex()[:12],
                    "world_size": round_.world_size,
                    "complete": round_.complete,
                    "members": members,
                }
            )
        jobs.append(
            {
                "name": name,
                "ended": False,
                "keys": len(job.kv),
                "bytes": job.nbytes,
                "rounds": rounds,
                "events": events.events(name) if events is not None else [],
            }
        )
    if events is not None:  # the jobs that ended lately: their failures stay visible
        live = {job["name"] for job in jobs}
        for name, last in events.ended(live, ENDED_JOBS, time.time() - ENDED_SECONDS):
            jobs.append({"name": name, "ended": True, "keys": 0, "bytes": 0, "rounds": [], "events": last})
    return {
        "time": time.time(),
        "url": server.url,
        "lease": server.config.lease,
        # no heartbeat for a while and leases ran out: failure declarations are on hold
        "holding_declarations": server.holding_declarations,
        "connections": len(server.admission.conns),
        "jobs": jobs,
    }


def counts(server: Any) -> dict[str, Any]:
    """Totals over what ``server`` holds (cheaper than :func:`snapshot`: no per-member copies)."""
    ranks: collections.Counter[str] = collections.Counter(dict.fromkeys(STATES, 0))
    rounds = keys = stored = 0
    jobs = [job for job in server.state.jobs.values() if not _empty(job)]
    for job in jobs:
        keys += len(job.kv)
        stored += job.nbytes
        forming = job.forming
        if forming is not None:
            rounds += 1
            ranks["joining"] += len(forming.members)
        for round_ in job.rounds.values():
            rounds += 1
            ranks.update(m.state.value for m in round_.members.values())
    return {
        "jobs": len(jobs),
        "rounds": rounds,
        "ranks": dict(ranks),
        "connections": len(server.admission.conns),
        "keys": keys,
        "bytes": stored,
    }


class Metrics(ServerHooks):
    """Prometheus metrics and recent events, fed by the server's hooks; one registry per server."""

    def __init__(self) -> None:
        self.server: Any = None  # set by HttpServer: the gauges read it at scrape time
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Histogram(
            "arendez_request_seconds",
            "Time from a request to its reply, by op (get, wait and join include their waiting)",
            ["op"],
            registry=self.registry,
            buckets=(0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 30),
        )
        self.errors = Counter(
            "arendez_request_errors", "Requests answered with an error, by op and error", ["op", "error"],
            registry=self.registry,
        )  # fmt: skip
        self.refusals = Counter(
            "arendez_refusals", "Connections or requests refused by a limit", ["limit"],
            registry=self.registry,
        )  # fmt: skip
        self.departures = Counter(
            "arendez_departures", "Ranks that left (left) or were declared failed (failed)", ["kind"],
            registry=self.registry,
        )  # fmt: skip
        self.registry.register(_StateCollector(self))
        self._by_op: dict[str, Any] = {}
        self._events: collections.OrderedDict[str, collections.deque[dict[str, Any]]] = (
            collections.OrderedDict()
        )

    # -- hooks -------------------------------------------------------------------------------
    def request(self, op: str, seconds: float, error: str | None) -> None:
        child = self._by_op.get(op)  # the server only reports known ops: a few keys
        if child is None:
            child = self._by_op[op] = self.requests.labels(op)
        child.observe(seconds)
        if error is not None:
            self.errors.labels(op, error).inc()

    def refused(self, limit: str) -> None:
        self.refusals.labels(limit).inc()

    def departed(self, gone: Departure) -> None:
        self.departures.labels("failed" if gone.failed else "left").inc()
        kind = "failed" if gone.failed else "left"
        self._event(gone.job, {"time": time.time(), "rank": gone.rank, "kind": kind, "reason": gone.reason})

    # -- events ------------------------------------------------------------------------------
    def _event(self, job: str, event: dict[str, Any]) -> None:
        found = self._events.get(job)
        if found is None:
            found = self._events[job] = collections.deque(maxlen=EVENTS_PER_JOB)
            while len(self._events) > EVENT_JOBS:
                self._events.popitem(last=False)
        self._events.move_to_end(job)
        found.append(event)

    def events(self, job: str) -> list[dict[str, Any]]:
        """The job's recent events, newest last."""
        return list(self._events.get(job, ()))

    def ended(self, live: set[str], most: int, since: float) -> list[tuple[str, list[dict[str, Any]]]]:
        """Up to ``most`` jobs not in ``live`` with events after ``since``, the latest first."""
        found: list[tuple[str, list[dict[str, Any]]]] = []
        for name in reversed(self._events):
            if len(found) >= most:
                break
            last = self._events[name]
            if name not in live and last and last[-1]["time"] >= since:
                found.append((name, list(last)))
        return found


class _StateCollector:
    """Gauges computed from a snapshot at scrape time."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        server = self.metrics.server
        if server is None:
            return
        now = counts(server)
        yield GaugeMetricFamily("arendez_jobs", "Jobs the server holds", value=now["jobs"])
        yield GaugeMetricFamily("arendez_rounds", "Rounds, complete or forming", value=now["rounds"])
        by_state = GaugeMetricFamily("arendez_ranks", "Ranks by state", labels=["state"])
        for state, count in sorted(now["ranks"].items()):
            by_state.add_metric([state], count)
        yield by_state
        yield GaugeMetricFamily("arendez_connections", "Open client connections", value=now["connections"])
        yield GaugeMetricFamily("arendez_store_keys", "Keys in all jobs' stores", value=now["keys"])
        yield GaugeMetricFamily("arendez_store_bytes", "Bytes of keys and values stored", value=now["bytes"])
        yield GaugeMetricFamily(
            "arendez_holding_declarations",
            "1 while no client is heard and failure declarations are held (is the server cut off?)",
            value=int(server.holding_declarations),
        )


class HttpServer:
    """Serves ``/metrics``, ``/status`` and the dashboard for one arendez server."""

    def __init__(self, server: Any, metrics: Metrics, host: str = "127.0.0.1", port: int = 0) -> None:
        self.server = server
        self.metrics = metrics
        metrics.server = server
        self.host = host
        self.port = port
        self.token: str | None = server.config.token
        self._listener: asyncio.Server | None = None
        self._clients: set[asyncio.Task[None]] = set()

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    async def start(self) -> None:
        self._listener = await asyncio.start_server(self._client, self.host, self.port, reuse_address=True)
        self.port = self._listener.sockets[0].getsockname()[1]
        log.info("arendez-server HTTP (metrics, status, dashboard) on %s", self.url)

    async def close(self) -> None:
        if self._listener is not None:
            self._listener.close()
        for task in list(self._clients):
            task.cancel()
        if self._clients:
            await asyncio.gather(*self._clients, return_exceptions=True)
        if self._listener is not None:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(2):
                    await self._listener.wait_closed()

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._clients.add(task)
        try:
            if len(self._clients) > MAX_HTTP_CONNECTIONS:
                conn = h11.Connection(h11.SERVER)
                busy = f"already {MAX_HTTP_CONNECTIONS} HTTP connections open: try again\n".encode()
                writer.write(self._response(conn, 503, "text/plain", busy))
            else:
                async with asyncio.timeout(READ_TIMEOUT):
                    await self._serve(reader, writer)
            await writer.drain()
        except h11.RemoteProtocolError as exc:  # 400, or 431 for a head over MAX_REQUEST_HEAD bytes
            reply = f"bad HTTP request: {exc} (requests: GET, head at most {MAX_REQUEST_HEAD} bytes)\n"
            writer.write(self._response(h11.Connection(h11.SERVER), exc.error_status_hint, "text/plain",
                                        reply.encode()))  # fmt: skip
        except (TimeoutError, ConnectionError):
            pass
        finally:
            self._clients.discard(task)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_REQUEST_HEAD)
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                data = await reader.read(65536)
                conn.receive_data(data)
                if not data and conn.their_state is not h11.DONE:
                    return
                continue
            if isinstance(event, h11.Request):
                break
            if isinstance(event, h11.ConnectionClosed):
                return
        headers = {name.lower(): value for name, value in event.headers}
        target = event.target.decode("ascii", "replace").split("?", 1)[0]
        status, ctype, body = self.route(event.method.decode("ascii", "replace"), target, headers)
        writer.write(self._response(conn, status, ctype, body, head=event.method == b"HEAD"))

    def route(self, method: str, path: str, headers: dict[bytes, bytes]) -> tuple[int, str, bytes]:
        """Status code, content type and body for one request."""
        if method not in ("GET", "HEAD"):
            return 405, "text/plain", f"method {method!r:.20} not allowed: GET or HEAD\n".encode()
        if path in ASSETS:
            name, ctype = ASSETS[path]
            return 200, ctype, resources.files(__package__).joinpath("dashboard", name).read_bytes()
        if path not in ("/status", "/metrics"):
            return 404, "text/plain", f"no such page {path!r:.80}: try /, /status or /metrics\n".encode()
        if self.token is not None:
            given = headers.get(b"authorization", b"")
            if not hmac.compare_digest(given, b"Bearer " + self.token.encode()):
                return 401, "text/plain", b"this server needs Authorization: Bearer <token>\n"
        if path == "/status":
            body = json.dumps(snapshot(self.server, self.metrics)).encode()
            return 200, "application/json", body
        return 200, CONTENT_TYPE_LATEST, generate_latest(self.metrics.registry)

    @staticmethod
    def _response(conn: h11.Connection, status: int, ctype: str, body: bytes, head: bool = False) -> bytes:
        headers = [
            ("Content-Type", ctype),
            ("Content-Length", str(len(body))),
            ("Cache-Control", "no-store"),
            ("Connection", "close"),
        ]
        if status == 401:
            headers.append(("WWW-Authenticate", "Bearer"))
        reason = HTTPStatus(status).phrase.encode()
        out = conn.send(h11.Response(status_code=status, headers=headers, reason=reason)) or b""
        if not head:
            out += conn.send(h11.Data(data=body)) or b""
        return out + (conn.send(h11.EndOfMessage()) or b"")


# -- arendez-server status URL --------------------------------------------------------------------
def fetch_status(url: str, token: str | None = None, timeout: float = 10.0) -> dict[str, Any]:
    """GET ``URL/status`` (``URL`` the server's HTTP address) and return the parsed JSON."""
    if not url.startswith(("http://", "https://")):
        raise ArendezError(f"status URL must start with http:// or https://, got {url!r:.80}")
    request = urllib.request.Request(url.rstrip("/") + "/status")
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            status: dict[str, Any] = json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        raise ArendezError(f"{url}: HTTP {exc.code} {exc.read().decode(errors='replace').strip()}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise ArendezError(f"{url}: cannot fetch the status ({exc})") from None
    except (http.client.HTTPException, ValueError):  # (not HTTP, or not JSON: another port?)
        raise ArendezError(
            f"{url}: no HTTP status answer there (is it the server's --http-port, not its store port?)"
        ) from None
    return status


def format_status(status: dict[str, Any]) -> str:
    """The status as a plain-text table: one block per job, one line per rank."""
    lines = [f"server {status['url']}  connections {status['connections']}  lease {status['lease']:g}s"]
    if not status["jobs"]:
        lines.append("no jobs")
    for job in status["jobs"]:
        lines.append("")
        if job.get("ended"):
            lines.append(f"job {job['name']!r}  ended (its last events:)")
        else:
            lines.append(f"job {job['name']!r}  keys {job['keys']}  bytes {job['bytes']}")
        for round_ in job["rounds"]:
            joined = len(round_["members"])
            what = "round" if round_["complete"] else f"forming ({joined}/{round_['world_size']} joined)"
            lines.append(f"  {what} {round_['id'] or '-'}  world size {round_['world_size']}")
            lines.append(f"    {'RANK':>6}  {'STATE':<8}  {'LEASE AGE':>9}  ADDRESS")
            for m in round_["members"]:
                age = f"{m['lease_age']:.1f}s"
                lines.append(f"    {m['rank']:>6}  {m['state']:<8}  {age:>9}  {m['address']}")
        for event in job["events"][-5:]:
            when = time.strftime("%H:%M:%S", time.localtime(event["time"]))
            lines.append(f"  {when} rank {event['rank']} {event['kind']}: {event['reason']}")
    return "\n".join(lines)


def status_main(argv: list[str]) -> int:
    """``arendez-server status URL``: print the server's status as a table."""
    from .cli import read_token

    p = argparse.ArgumentParser(prog="arendez-server status", description=status_main.__doc__)
    p.add_argument("url", help="the server's HTTP address, e.g. http://127.0.0.1:29480")
    p.add_argument("--token-file", help="file holding the server's token (or set ARENDEZ_TOKEN)")
    p.add_argument("--json", action="store_true", help="print the status JSON as it came")
    args = p.parse_args(argv)
    try:
        status = fetch_status(args.url, read_token(args.token_file))
    except OSError as exc:  # (the token file)
        print(f"arendez-server status: --token-file {args.token_file}: {exc.strerror}", file=sys.stderr)
        return 2
    except ArendezError as exc:
        print(f"arendez-server status: {exc}", file=sys.stderr)
        return 1
    try:
        print(json.dumps(status, indent=2) if args.json else format_status(status), flush=True)
    except BrokenPipeError:  # (``| head``: the reader left; no traceback, and none at exit)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    return 0
