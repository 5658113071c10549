"""The pins that CI installs (.ci/constraints.txt) lie inside the ranges pyproject.toml admits."""

from pathlib import Path

import pytest
from packaging.requirements import Requirement

tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from Python 3.11")

ROOT = Path(__file__).resolve().parents[1]


def _pins() -> dict[str, str]:
    pins = {}
    for line in (ROOT / ".ci/constraints.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, version = line.split("==")
            pins[name.lower().replace("_", "-")] = version
    return pins


def test_constraints_pin_versions_that_pyproject_admits():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    ranges = [Requirement(text) for text in project["dependencies"] + extras["test"] + extras["lm-eval"]]
    pins = _pins()
    assert {"transformers", "pytest", "lm-eval"} <= pins.keys()
    for requirement in ranges:
        name = requirement.name.lower().replace("_", "-")
        if name in pins:
            assert requirement.specifier.contains(pins[name]), f"{name}=={pins[name]} is outside pyproject's {requirement}"
