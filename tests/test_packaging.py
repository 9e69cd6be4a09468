"""Every package of the source tree is installed (a non-editable install, as in the Docker image,
only ships what pyproject.toml lists)."""

from __future__ import annotations

import tomllib

from tests.harness import ROOT


def test_every_subpackage_is_listed_in_pyproject() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    roots = {name: ROOT / path for name, path in config["package-dir"].items()}
    found = set()
    for name, folder in roots.items():
        for init in folder.rglob("__init__.py"):
            relative = init.parent.relative_to(folder).parts
            found.add(".".join((name, *relative)))
    assert found <= listed, f"packages missing from pyproject.toml: {sorted(found - listed)}"
    for name in listed - found:  # data-only packages (the dashboard's assets) must exist too
        root, *rest = name.split(".")
        assert roots[root].joinpath(*rest).is_dir(), name
