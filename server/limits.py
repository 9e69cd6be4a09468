"""The limits of what the server's state holds: per key, value, job and world, and jobs in all."""

from __future__ import annotations

from dataclasses import dataclass

from arendez.store_wire import MAX_KEY, MAX_VALUE


@dataclass(frozen=True)
class StateLimits:
    max_key: int = MAX_KEY
    max_value: int = MAX_VALUE
    max_keys_per_job: int = 100_000
    max_bytes_per_job: int = 256 << 20
    max_store_bytes: int = 4 << 30  # every job's keys + values together
    max_jobs: int = 10_000
    max_world_size: int = 65_536
