"""`./dev`'s one set of packages for both jobs: each bound of scripts/dev-constraints.txt is the
one the package of the test job it names sets."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement

CONSTRAINTS = Path(__file__).resolve().parent.parent / "scripts" / "dev-constraints.txt"


def _constraints() -> list[tuple[Requirement, str]]:
    """(constraint, the package it comes from) per line, comments and blank lines aside."""
    found = []
    for line in CONSTRAINTS.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            requirement, source = line.split("#")
            found.append((Requirement(requirement), source.split()[0]))
    return found


@pytest.mark.parametrize(("constraint", "source"), _constraints(), ids=str)
def test_each_dev_constraint_is_the_bound_its_package_sets(
    constraint: Requirement, source: str
) -> None:
    try:
        required = [Requirement(line) for line in importlib.metadata.requires(source) or []]
    except importlib.metadata.PackageNotFoundError:
        pytest.skip(f"{source} is not installed (./dev test installs it)")
    [own] = [r for r in required if r.name == constraint.name and r.marker == constraint.marker]
    assert set(constraint.specifier) <= set(own.specifier), own
