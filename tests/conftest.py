from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.harness import ServerProcess, start_server


@pytest.fixture
def arendez_server() -> Iterator[ServerProcess]:
    """A real ``arendez-server`` process on a free loopback port."""
    srv = start_server()
    try:
        yield srv
    finally:
        srv.stop()
