"""How etcd's JSON gateway spells keys and ranges: base64 bytes, prefix range ends."""

from __future__ import annotations

import base64


def b64(data: bytes | str) -> str:
    """etcd's JSON carries keys and values as base64."""
    return base64.b64encode(data.encode() if isinstance(data, str) else data).decode()


def unb64(text: str | None) -> bytes:
    return base64.b64decode(text) if text else b""


def prefix_end(prefix: bytes) -> bytes:
    """The ``range_end`` that makes a range cover every key starting with ``prefix``."""
    end = bytearray(prefix)
    while end:
        if end[-1] < 0xFF:
            end[-1] += 1
            return bytes(end)
        end.pop()
    return b"\0"
