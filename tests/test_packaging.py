"""The project's top-level packages are its own: no installed distribution ships a module of the same name.

A dependency that starts shipping one (``transformers`` 5.25 began requiring
the ``kernels`` distribution, whose import name our kernel package then
shadowed) breaks imports far from the cause; this names the clash directly.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from pathlib import Path

import tomllib

REPO = Path(__file__).resolve().parents[1]
DISTRIBUTION = "pd-serve"


def top_level_packages() -> list[str]:
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    patterns = config["tool"]["setuptools"]["packages"]["find"]["include"]
    return [pattern.rstrip("*") for pattern in patterns]


def test_the_scan_reads_the_packages():
    assert {"pd", "router", "pd_kernels", "transfer"} <= set(top_level_packages())


def test_no_installed_distribution_ships_a_package_of_ours():
    shipped = importlib.metadata.packages_distributions()
    clashes = {name: sorted(set(shipped.get(name, [])) - {DISTRIBUTION}) for name in top_level_packages()}
    clashes = {name: others for name, others in clashes.items() if others}
    assert not clashes, f"installed distributions ship modules with our packages' names: {clashes}"


def test_each_package_imports_from_this_checkout():
    for name in top_level_packages():
        spec = importlib.util.find_spec(name)
        assert spec is not None and spec.origin is not None, f"{name} is not importable"
        assert Path(spec.origin).resolve().is_relative_to(REPO), f"{name} resolves to {spec.origin}, not {REPO}"
