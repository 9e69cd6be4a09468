"""Argument checks shared by the API and the command lines: each names the argument, the value
and what is allowed, and runs before anything touches the network.

The functions raise ``TypeError`` (wrong kind of value) or ``ValueError`` (right kind, outside what
is allowed); ``argtype`` adapts one for ``argparse`` so a command line reports the same words as a
usage error (exit status 2) instead of a traceback.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import ssl
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

MAX_PORT = 65535
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
#: ``backend=`` names ``init_process_group`` accepts (``gloo`` is an alias of ``tcp``).
BACKENDS = ("tcp", "gloo", "arendez")


def integer(value: object, name: str) -> int:
    """``value`` as an int; bools and floats are refused (``rank=1.5`` is a mistake, not a 1)."""
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, str):
            try:
                return int(value.strip(), 10)
            except ValueError:
                pass
            raise ValueError(f"{name} must be an integer, got {value!r}")
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    return value


def index(value: object, name: str) -> int:
    """An int given to the API (a rank, a tag): no bools, floats or strings."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    return value


def port(value: object, name: str = "port", *, lowest: int = 0) -> int:
    """A TCP port, 0-65535 (0: the system picks a free one; ``lowest=1`` where one is dialled)."""
    number = integer(value, name)
    if not lowest <= number <= MAX_PORT:
        raise ValueError(f"{name} must be in {lowest}-{MAX_PORT}, got {number}")
    return number


def at_least(value: object, minimum: int, name: str) -> int:
    """An int no smaller than ``minimum``."""
    number = integer(value, name)
    if number < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {number}")
    return number


def world_size(value: object, name: str = "world_size") -> int:
    """-1 (take it from the environment or the server) or a size of at least 1."""
    number = integer(value, name)
    if number != -1 and number < 1:
        raise ValueError(f"{name} must be at least 1 (or -1 to take it from the environment), got {number}")
    return number


def rank(value: object, size: int, name: str = "rank") -> int:
    """-1 (the server assigns one) or a rank in 0..size-1 (any rank >= 0 when size is unknown)."""
    number = integer(value, name)
    if number == -1:
        return number
    if number < 0:
        raise ValueError(f"{name} must be -1 (assigned) or at least 0, got {number}")
    if size >= 1 and number >= size:
        raise ValueError(f"{name} must be in 0..{size - 1} for world_size {size}, got {number}")
    return number


def seconds(value: object, name: str = "timeout", *, allow_zero: bool = False) -> float:
    """A finite, positive number of seconds (a ``datetime.timedelta`` is accepted)."""
    if isinstance(value, datetime.timedelta):
        number = value.total_seconds()
    elif isinstance(value, bool) or not isinstance(value, int | float | str):
        raise TypeError(f"{name} must be seconds (a number or datetime.timedelta), got {value!r}")
    else:
        try:
            number = float(value)
        except ValueError:
            raise ValueError(f"{name} must be a number of seconds, got {value!r}") from None
    if not math.isfinite(number) or number < 0 or (number == 0 and not allow_zero):
        allowed = "finite and >= 0" if allow_zero else "finite and > 0"
        raise ValueError(f"{name} must be {allowed} seconds, got {value!r}")
    return number


def optional_seconds(value: object, name: str = "timeout") -> float | None:
    """None (the default applies) or ``seconds(value)``."""
    return None if value is None else seconds(value, name)


def text(value: object, name: str, *, empty: bool = True) -> str:
    """A ``str`` (non-empty unless ``empty``)."""
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, got {type(value).__name__} {value!r}")
    if not empty and not value:
        raise ValueError(f"{name} must not be empty")
    return value


def backend(value: object, name: str = "backend") -> str | None:
    """None or one of ``BACKENDS``."""
    if value is not None and not isinstance(value, str):
        raise TypeError(f"{name} must be a str or None, got {type(value).__name__} {value!r}")
    if value is not None and value not in BACKENDS:
        raise ValueError(f"{name} must be one of {', '.join(BACKENDS)} (or None), got {value!r}")
    return value


def init_method(value: object, name: str = "init_method") -> str | None:
    """None or a URL string (its scheme and parts are checked by ``rendezvous.plan``)."""
    if value is not None and not isinstance(value, str):
        raise TypeError(f"{name} must be a URL str or None, got {type(value).__name__} {value!r}")
    return value


def rank_list(value: object, size: int, name: str = "ranks") -> list[int]:
    """A non-empty collection of distinct ints in 0..size-1, sorted."""
    if isinstance(value, str | bytes) or not hasattr(value, "__iter__"):
        raise TypeError(f"{name} must be a sequence of ranks, got {type(value).__name__} {value!r}")
    items = list(value)
    for item in items:
        if isinstance(item, bool) or not isinstance(item, int):
            raise TypeError(f"{name} must hold ints, got {type(item).__name__} {item!r} in {items!r}")
        if not 0 <= item < size:
            raise ValueError(f"{name} must be ranks in 0..{size - 1}, got {item} in {items!r}")
    if not items:
        raise ValueError(f"{name} must name at least one rank, got {items!r}")
    if len(set(items)) != len(items):
        raise ValueError(f"{name} must be distinct, got {items!r}")
    return sorted(items)


def readable_file(value: object, name: str) -> str:
    """The path of a regular file this process can read."""
    if not isinstance(value, str | os.PathLike) or not str(value):
        raise TypeError(f"{name} must be a file path, got {value!r}")
    path = os.fspath(value)
    if not os.path.exists(path):
        raise ValueError(f"{name} {path!r} does not exist")
    if not os.path.isfile(path):
        raise ValueError(f"{name} {path!r} is not a regular file")
    if not os.access(path, os.R_OK):
        raise ValueError(f"{name} {path!r} is not readable by this user")
    return str(path)


def token_file(value: object, name: str = "--token-file") -> str:
    """A readable file whose content, stripped, is a non-empty token; returns the token."""
    path = readable_file(value, name)
    try:
        with open(path, encoding="utf-8") as f:
            token = f.read().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{name} {path!r} cannot be read as text: {exc}") from None
    if not token:
        raise ValueError(f"{name} {path!r} is empty; it must hold the shared token")
    return token


def token_path(value: object, name: str = "--token-file") -> str:
    """``token_file`` for a command line that reads the file later: returns the checked path."""
    token_file(value, name)
    return readable_file(value, name)


def certificate_pair(cert: str, key: str) -> None:
    """The PEM certificate chain and private key load and belong together."""
    readable_file(cert, "--tls-cert")
    readable_file(key, "--tls-key")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(cert, key)
    except (ssl.SSLError, OSError) as exc:
        raise ValueError(f"--tls-cert {cert!r} with --tls-key {key!r} does not load: {exc}") from None


def log_level(value: object, name: str = "--log-level") -> str:
    """One of the standard logging levels, any case."""
    if not isinstance(value, str) or value.upper() not in LOG_LEVELS:
        raise ValueError(f"{name} must be one of {', '.join(LOG_LEVELS)}, got {value!r}")
    return value.upper()


def argtype(check: Callable[..., T], *args: Any, **kwargs: Any) -> Callable[[str], T]:
    """``check`` as an ``argparse`` type: its message becomes the usage error."""

    def parse(text: str) -> T:
        try:
            return check(text, *args, **kwargs)
        except (TypeError, ValueError) as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    parse.__name__ = getattr(check, "__name__", "value")
    return parse


def store_address(host: object, number: object, job: object) -> int:
    """A store client's ``host`` (non-empty), port ``number`` (1-65535) and ``job`` (text);
    returns the port."""
    text(host, "host", empty=False)
    text(job, "job")
    return port(index(number, "port"), lowest=1)
