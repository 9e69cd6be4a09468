"""docker-compose.yml and the Dockerfile, checked without a Docker engine.

``docker-compose config`` (Compose v1, Debian's ``docker-compose`` package) validates the file
against the Compose schema and prints it resolved (anchors merged); the test reads that back.
Without the binary it skips, except under ``ARENDEZ_CI=1``, where it fails.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.harness import ROOT, ServerProcess

WORLD = 4


def _compose() -> str:
    found = shutil.which("docker-compose")
    if found is None:
        reason = "docker-compose is not installed (apt-get install -y docker-compose)"
        if os.environ.get("ARENDEZ_CI") == "1":
            pytest.fail(f"{reason}, and ARENDEZ_CI=1 requires it")
        pytest.skip(reason)
    return found


def _yaml_to_json(text: str, compose: str) -> Any:
    """Parse YAML with PyYAML: ours if installed, else the interpreter docker-compose runs on."""
    try:
        import yaml

        return yaml.safe_load(text)
    except ImportError:
        pass
    shebang = Path(compose).read_text(errors="replace").splitlines()[0]
    assert shebang.startswith("#!"), f"{compose} is no Python script and PyYAML is missing"
    code = "import json, sys, yaml; json.dump(yaml.safe_load(sys.stdin), sys.stdout)"
    done = subprocess.run(
        [*shebang[2:].split(), "-c", code], input=text, capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.fixture(scope="module")
def config() -> dict[str, Any]:
    compose = _compose()
    done = subprocess.run(
        [compose, "-f", str(ROOT / "docker-compose.yml"), "config"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert done.returncode == 0, f"docker-compose config rejected the file:\n{done.stderr}"
    parsed: dict[str, Any] = _yaml_to_json(done.stdout, compose)
    return parsed


@pytest.mark.timeout(90)
def test_services(config: dict[str, Any]) -> None:
    services = config["services"]
    assert set(services) == {"server", *(f"rank{k}" for k in range(WORLD))}
    server = services["server"]
    assert server["build"]["context"] == str(ROOT)
    assert "command" not in server  # the image's CMD: arendez-server on 0.0.0.0:29400
    assert [(p["published"], p["target"]) for p in server["ports"]] == [(29400, 29400)]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("rank", range(WORLD))
def test_rank_services(config: dict[str, Any], rank: int) -> None:
    service = config["services"][f"rank{rank}"]
    assert service["command"] == ["python", "examples/train_sgd.py"]
    assert service["image"] == config["services"]["server"]["image"]
    assert service["environment"] == {
        "ARENDEZ_URL": "arendez://server:29400/sgd",
        "WORLD_SIZE": str(WORLD),
        "RANK": str(rank),
    }
    assert service["depends_on"] == {"server": {"condition": "service_healthy"}}
    assert service["healthcheck"] == {"test": ["NONE"]}  # the image's check is for the server


@pytest.mark.timeout(10)
def test_dockerfile_and_dockerignore() -> None:
    lines = [ln.strip() for ln in (ROOT / "Dockerfile").read_text().splitlines()]
    assert lines[[ln.startswith("FROM") for ln in lines].index(True)] == "FROM python:3.11-slim"
    assert "RUN pip install --no-cache-dir . \\" in lines
    assert "USER arendez" in lines and "EXPOSE 29400" in lines
    assert lines[-1] == 'CMD ["arendez-server", "--host", "0.0.0.0", "--port", "29400"]'
    ignored = set((ROOT / ".dockerignore").read_text().split())
    assert {".git", ".venv", "venv", "**/__pycache__", ".pytest_cache"} <= ignored
    assert not ignored & {"examples", "README.md", "pyproject.toml", "arendez", "server"}
    # The example the rank services run, and the main target of the image, exist in the context.
    assert (ROOT / "examples" / "train_sgd.py").is_file() and (ROOT / "README.md").is_file()


def _healthcheck() -> list[str]:
    lines = [ln.strip() for ln in (ROOT / "Dockerfile").read_text().splitlines()]
    health = next(ln for i, ln in enumerate(lines) if lines[i - 1].startswith("HEALTHCHECK"))
    probe: list[str] = json.loads(health.removeprefix("CMD "))
    assert probe[:2] == ["python", "-c"] and "29400" in probe[2]
    return probe


@pytest.mark.timeout(30)
def test_healthcheck_probe_tells_a_listening_server(arendez_server: ServerProcess) -> None:
    """The image's probe, pointed at a real server's port, then at that port once it is closed."""
    _, flag, code = _healthcheck()
    probe = [sys.executable, flag, code.replace("29400", str(arendez_server.port))]
    assert subprocess.run(probe, capture_output=True, timeout=10).returncode == 0
    arendez_server.stop()
    assert subprocess.run(probe, capture_output=True, timeout=10).returncode != 0
