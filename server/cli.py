"""``arendez-server``: run the rendezvous/store server until SIGTERM or SIGINT."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys

from arendez import loop as _loop
from arendez import validate
from arendez.tls import server_context

from .app import Server, ServerConfig


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="arendez-server", description=__doc__)
    arg = validate.argtype
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument(
        "--port", type=arg(validate.port, "--port"), default=29400, help="port (0 picks a free one)"
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
        help="seconds without heartbeat = failed",
    )
    p.add_argument(
        "--log-level", type=arg(validate.log_level), default="INFO", help="DEBUG, INFO, WARNING, ERROR"
    )
    return p


def _parse(argv: list[str] | None) -> argparse.Namespace:
    """The arguments, every one checked: a bad one is a usage error (exit status 2)."""
    p = _parser()
    args = p.parse_args(argv)
    if bool(args.tls_cert) != bool(args.tls_key):
        p.error("--tls-cert and --tls-key go together")
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


async def _run(config: ServerConfig) -> None:
    server = Server(config)
    await server.start()
    print(f"arendez-server listening on {server.url}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    logging.getLogger("arendez.server").info("shutting down")
    await server.close()


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    config = ServerConfig(
        host=args.host,
        port=args.port,
        token=read_token(args.token_file),
        ssl=server_context(args.tls_cert, args.tls_key, args.tls_client_ca) if args.tls_cert else None,
        lease=args.lease,
    )
    _loop.run(_run(config))
    return 0


if __name__ == "__main__":
    sys.exit(main())
