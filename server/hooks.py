"""What the server tells an observer (metrics, the dashboard), and the way in to ``server/http.py``.

The server calls a :class:`ServerHooks` on its event loop; overrides must be quick and must not raise.
``server/http.py`` needs the ``metrics`` extra, so it is imported only when asked for, here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .rounds import Departure

if TYPE_CHECKING:
    from .http import HttpServer


class ServerHooks:
    """Called by the server as things happen; every method does nothing here."""

    def request(self, op: str, seconds: float, error: str | None) -> None:
        """A request ``op`` was answered after ``seconds`` (``error``: the error class name, if any)."""

    def refused(self, limit: str) -> None:
        """A connection or request was refused because ``limit`` was reached."""

    def departed(self, gone: Departure) -> None:
        """A rank left its job or was declared failed."""


def _http() -> Any:
    try:
        from . import http
    except ImportError as exc:
        raise SystemExit(f"arendez-server: {exc}") from None
    return http


def metrics_hooks() -> ServerHooks:
    """Hooks that keep Prometheus metrics and recent events (exits if the metrics extra is missing)."""
    hooks: ServerHooks = _http().Metrics()
    return hooks


async def start_http(server: Any, host: str, port: int) -> HttpServer:
    """Serve ``/metrics``, ``/status`` and the dashboard for ``server`` (its hooks: :func:`metrics_hooks`)."""
    http = _http()
    listener: HttpServer = http.HttpServer(server, server.config.hooks, host, port)
    await listener.start()
    return listener


def status_main(argv: list[str]) -> int:
    """``arendez-server status URL`` (see ``server/http.py``)."""
    code: int = _http().status_main(argv)
    return code
