"""``arendez-server``: run the rendezvous/store server until SIGTERM or SIGINT."""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import signal
import sys

from arendez import loop as _loop
from arendez import validate
from arendez.tls import server_context

from .admission import FD_RESERVE, raise_fd_limit
from .app import Server, ServerConfig
from .hooks import ServerHooks, metrics_hooks, start_http, status_main
from .limits import StateLimits


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="arendez-server", description=__doc__)
    arg = validate.argtype
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument(
        "--port",
        type=arg(validate.port, "--port"),
        default=29400,
        help="port (default 29400; 0 picks a free one)",
    )
    p.add_argument(
        "--token-file",
        type=arg(validate.token_path),
        help="file holding the shared token (or set ARENDEZ_TOKEN)",
    )
    p.add_argument(
        "--tls-cert", type=arg(validate.readable_file, "--tls-cert"), help="PEM certificate chain for TLS"
    )
    p.add_argument("--tls-key", type=arg(validate.readable_file, "--tls-key"), help="PEM private key for TLS")
    p.add_argument(
        "--tls-client-ca",
        type=arg(validate.readable_file, "--tls-client-ca"),
        help="require client certificates signed by this CA",
    )
    p.add_argument(
        "--lease",
        type=arg(validate.seconds, "--lease"),
        default=2.5,
        help="seconds without heartbeat = failed (default 2.5)",
    )
    p.add_argument(
        "--scoped-grace",
        type=arg(validate.seconds, "--scoped-grace"),
        default=10.0,
        help="seconds a scoped job's keys (torchrun's rendezvous) outlive its last client (default 10)",
    )
    p.add_argument(
        "--tcpstore-port",
        type=arg(validate.port, "--tcpstore-port"),
        help="also serve torch's own TCPStore clients on this port (0 picks one); their keys are "
        "job 'tcpstore's, as arendez.sync.TCPStore's. Not with a token or TLS: they cannot authenticate",
    )
    p.add_argument(
        "--tcpstore-grace",
        type=arg(validate.seconds, "--tcpstore-grace", allow_zero=True),
        default=0.0,
        help="seconds the TCPStore job's keys (torch's clients on --tcpstore-port, arendez.sync.TCPStore's "
        "on --port) outlive its last client (default 0: they go with it, as a torch store with its run)",
    )
    p.add_argument(
        "--log-level", type=arg(validate.log_level), default="INFO", help="DEBUG, INFO, WARNING, ERROR"
    )
    d = ServerConfig()
    lim = StateLimits()
    p.add_argument(
        "--backlog",
        type=arg(validate.at_least, 1, "--backlog"),
        default=d.backlog,
        help=f"listen queue (default {d.backlog})",
    )
    p.add_argument(
        "--max-connections",
        type=arg(validate.at_least, 1, "--max-connections"),
        default=None,
        help=f"default {d.max_connections}, or what the open-file limit allows if that is less",
    )
    p.add_argument(
        "--max-connections-per-host",
        type=arg(validate.at_least, 1, "--max-connections-per-host"),
        default=d.max_connections_per_host,
        help=f"default {d.max_connections_per_host}",
    )
    p.add_argument(
        "--max-pending-per-connection",
        type=arg(validate.at_least, 1, "--max-pending-per-connection"),
        default=d.max_pending_per_connection,
        help=f"blocking get/wait/join per connection (default {d.max_pending_per_connection})",
    )
    p.add_argument(
        "--max-unread-bytes",
        type=arg(validate.at_least, 1, "--max-unread-bytes"),
        default=d.max_unread_bytes,
        help=f"reply bytes all clients together may leave unread (default {d.max_unread_bytes})",
    )
    p.add_argument(
        "--max-unfinished-bytes",
        type=arg(validate.at_least, 1, "--max-unfinished-bytes"),
        default=d.max_unfinished_bytes,
        help=(
            "request bytes all clients' unfinished requests may hold together "
            f"(default {d.max_unfinished_bytes})"
        ),
    )
    p.add_argument(
        "--max-jobs",
        type=arg(validate.at_least, 1, "--max-jobs"),
        default=lim.max_jobs,
        help=f"default {lim.max_jobs}",
    )
    p.add_argument(
        "--max-world-size",
        type=arg(validate.at_least, 1, "--max-world-size"),
        default=lim.max_world_size,
        help=f"default {lim.max_world_size}",
    )
    p.add_argument(
        "--max-keys-per-job",
        type=arg(validate.at_least, 1, "--max-keys-per-job"),
        default=lim.max_keys_per_job,
        help=f"default {lim.max_keys_per_job}",
    )
    p.add_argument(
        "--max-bytes-per-job",
        type=arg(validate.at_least, 1, "--max-bytes-per-job"),
        default=lim.max_bytes_per_job,
        help=f"keys + values (default {lim.max_bytes_per_job})",
    )
    p.add_argument(
        "--max-store-bytes",
        type=arg(validate.at_least, 1, "--max-store-bytes"),
        default=lim.max_store_bytes,
        help=f"keys + values of every job together (default {lim.max_store_bytes})",
    )
    p.add_argument(
        "--http-port",
        type=arg(validate.port, "--http-port"),
        help="serve /metrics, /status and a dashboard on this port",
    )
    p.add_argument("--http-host", default="127.0.0.1", help="address for --http-port (default 127.0.0.1)")
    return p


def _parse(argv: list[str] | None) -> argparse.Namespace:
    """The arguments, every one checked: a bad one is a usage error (exit status 2)."""
    p = _parser()
    args = p.parse_args(argv)
    if bool(args.tls_cert) != bool(args.tls_key):
        p.error("--tls-cert and --tls-key go together")
    token = args.token_file or os.environ.get("ARENDEZ_TOKEN")
    if args.tcpstore_port is not None and (args.tls_cert or token):
        p.error(
            "--tcpstore-port serves torch's TCPStore clients, which cannot authenticate: it cannot be "
            "used with a token (--token-file, ARENDEZ_TOKEN) or TLS"
        )
    if args.tls_cert:
        try:
            validate.certificate_pair(args.tls_cert, args.tls_key)
        except ValueError as exc:
            p.error(str(exc))
    return args


def read_token(path: str | None) -> str | None:
    """The token from ``path`` (stripped), else ``ARENDEZ_TOKEN``, else None."""
    if path:
        with open(path, encoding="utf-8") as f:
            token = f.read().strip()
        if not token:
            raise SystemExit(f"arendez-server: token file {path} is empty")
        return token
    return os.environ.get("ARENDEZ_TOKEN") or None


#: Allocations between young collections in the standalone server (CPython's default is 700).
GC_YOUNG_THRESHOLD = 20_000


def _tune_gc() -> None:
    """The standalone server's heap grows with its connections (tens of objects each): collect
    the young generation less often, and keep what start-up made (modules, code: most of the heap
    of a new server) out of every later collection. Not for the
    embedded server: that process's collector belongs to the application."""
    gc.freeze()
    gc.set_threshold(GC_YOUNG_THRESHOLD, *gc.get_threshold()[1:])


async def _run(config: ServerConfig, http_host: str, http_port: int | None) -> None:
    server = Server(config)
    await server.start()
    http = None if http_port is None else await start_http(server, http_host, http_port)
    _tune_gc()
    print(f"arendez-server listening on {server.url}", flush=True)
    if server.tcpstore_port is not None:
        print(f"arendez-server TCPStore clients on {config.host}:{server.tcpstore_port}", flush=True)
    if http is not None:
        print(f"arendez-server http on {http.url}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    logging.getLogger("arendez.server").info("shutting down")
    await server.close()
    if http is not None:
        await http.close()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["status"]:
        return status_main(argv[1:])
    args = _parse(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    limits = StateLimits(
        max_keys_per_job=args.max_keys_per_job,
        max_bytes_per_job=args.max_bytes_per_job,
        max_store_bytes=args.max_store_bytes,
        max_jobs=args.max_jobs,
        max_world_size=args.max_world_size,
    )
    if args.max_connections is None:  # the default fits the open-file limit quietly
        args.max_connections = min(ServerConfig.max_connections, max(1, raise_fd_limit() - FD_RESERVE))
    config = ServerConfig(
        host=args.host,
        port=args.port,
        token=read_token(args.token_file),
        ssl=server_context(args.tls_cert, args.tls_key, args.tls_client_ca) if args.tls_cert else None,
        lease=args.lease,
        scoped_grace=args.scoped_grace,
        tcpstore_port=args.tcpstore_port,
        tcpstore_grace=args.tcpstore_grace,
        tcpstore_runs=True,
        backlog=args.backlog,
        max_connections=args.max_connections,
        max_connections_per_host=args.max_connections_per_host,
        max_pending_per_connection=args.max_pending_per_connection,
        max_unread_bytes=args.max_unread_bytes,
        max_unfinished_bytes=args.max_unfinished_bytes,
        raise_fd_limit=True,
        limits=limits,
        hooks=metrics_hooks() if args.http_port is not None else ServerHooks(),
    )
    try:
        _loop.run(_run(config, args.http_host, args.http_port))
    except OSError as exc:  # (binding one of its ports: in use, or not an address of this host)
        print(f"arendez-server: cannot listen: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
