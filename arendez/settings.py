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
