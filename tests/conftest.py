from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.elastic_run import Run
from tests.harness import ServerProcess, start_server


@pytest.fixture
def arendez_server() -> Iterator[ServerProcess]:
    """A real ``arendez-server`` process on a free loopback port."""
    srv = start_server()
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(autouse=True, scope="session")
def _flight_recorder_dumps(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Dumps of the suite's deliberate timeouts and kills go to pytest's temp dir, not /tmp;
    child processes inherit the variable."""
    folder = tmp_path_factory.mktemp("flightrec")
    saved = os.environ.get("ARENDEZ_FLIGHT_RECORDER_DIR")
    os.environ["ARENDEZ_FLIGHT_RECORDER_DIR"] = str(folder)
    yield
    if saved is None:
        os.environ.pop("ARENDEZ_FLIGHT_RECORDER_DIR", None)
    else:
        os.environ["ARENDEZ_FLIGHT_RECORDER_DIR"] = saved


@pytest.fixture
def runs() -> Iterator[list[Run]]:
    """``arendez-run`` jobs a test starts (elastic tests): killed at the end, none left behind."""
    started: list[Run] = []
    yield started
    for run in started:
        run.kill()
    for run in started:
        assert not run.leftovers(), "processes left behind"
