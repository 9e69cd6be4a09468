"""The arendez rendezvous/store server (standalone, or embedded in rank 0's event loop)."""

from .app import Server, ServerConfig
from .hosted import start_server

__all__ = ["Server", "ServerConfig", "start_server"]
