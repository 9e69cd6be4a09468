"""Tuning knobs read from the environment, with errors that name the variable."""

from __future__ import annotations

import os


def env_int(name: str, default: int, *, minimum: int = 1) -> int:
    """The integer in ``$name`` (``default`` when unset or empty); a clear error otherwise."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {raw!r}") from None
    if value < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {value}")
    return value


def env_seconds(name: str, default: float) -> float:
    """The non-negative number of seconds in ``$name`` (``default`` when unset or empty)."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name} must be a number of seconds, got {raw!r}") from None
    if not value >= 0 or value == float("inf"):
        raise ValueError(f"{name} must be a finite number of seconds, at least 0, got {raw!r}")
    return value
