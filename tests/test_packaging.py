"""The README's second command (``pip install -e ".[test]"``) changes nothing the first (``pip install -e .``)
installed (issue 41.1: torchrl's pin silently downgraded tensordict 0.15.3 to 0.14.3). The first install takes
the newest release each core range allows, so every upper bound that a test-extra package (or what it needs)
puts on a core dependency must be one the core range puts too."""

from __future__ import annotations

from importlib import metadata

import pytest
from conftest import REPO
from packaging.requirements import Requirement
from packaging.version import Version

tomllib = pytest.importorskip("tomllib")  # Python 3.11+
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
CORE = {Requirement(spec).name.lower(): Requirement(spec) for spec in PROJECT["dependencies"]}


def _requires(name: str) -> list[Requirement]:
    """What the installed distribution ``name`` needs, its own extras aside."""
    needs = [Requirement(spec) for spec in metadata.requires(name) or []]
    return [need for need in needs if need.marker is None or need.marker.evaluate({"extra": ""})]


def _closure() -> dict[str, list[Requirement]]:
    """Each installed distribution the test extra pulls in, core dependencies and rolloutcli aside: its needs."""
    found: dict[str, list[Requirement]] = {}
    todo = [Requirement(spec).name.lower() for spec in PROJECT["optional-dependencies"]["test"]]
    while todo:
        name = todo.pop()
        if name in found or name in CORE or name == "rolloutcli":
            continue
        try:
            found[name] = _requires(name)
        except metadata.PackageNotFoundError:
            continue
        todo += [need.name.lower() for need in found[name]]
    return found


def _first_refused(operator: str, version: str) -> Version | None:
    """The lowest version an upper bound refuses (None for a lower bound)."""
    bound = Version(version.removesuffix(".*"))
    if operator == "<":
        return bound
    if operator in ("<=", "==", "~="):
        release = list(bound.release) + [0] * (3 - len(bound.release))
        if operator == "~=" or version.endswith(".*"):  # ~=X.Y refuses X+1; ~=X.Y.Z refuses X.Y+1
            cut = max(len(bound.release) - 1, 1)
            return Version(".".join(map(str, [*release[: cut - 1], release[cut - 1] + 1])))
        return Version(".".join(map(str, [*release[:2], release[2] + 1])))
    return None


def test_the_test_extra_bounds_no_core_dependency_below_its_core_range() -> None:
    closure = _closure()
    if "torchrl" not in closure:
        pytest.skip("the test extra is not installed")
    loose = []
    for name, needs in closure.items():
        for need in needs:
            core = CORE.get(need.name.lower())
            for spec in need.specifier if core is not None else []:
                refused = _first_refused(spec.operator, spec.version)
                if refused is not None and core.specifier.contains(refused, prereleases=True):
                    loose.append(f"{name} needs {need}, pyproject.toml allows {core.name} {refused}")
    assert loose == []
