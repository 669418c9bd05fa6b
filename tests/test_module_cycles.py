"""No import cycle between the modules of one package, counting every import (tests/layering_checks.py)."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.layering_checks import module_cycles, strongly_connected

PACKAGE = Path(__file__).resolve().parent.parent / "reinforge"
PACKAGES = ["agents", "data", "distributed", "eval", "kernels", "learner", "loops", "models", "objectives", "rewards",
            "rollout", "tasks", "telemetry", "verifiers"]


@pytest.mark.parametrize("package", PACKAGES)
def test_the_modules_of_a_package_import_each_other_without_a_cycle(package: str) -> None:
    assert module_cycles(PACKAGE, package) == []


def test_the_checker_finds_cycles_by_every_kind_of_import(tmp_path: Path) -> None:
    # A package whose cycles close through an import inside a function, one under TYPE_CHECKING and a relative one.
    pkg = tmp_path / "pkg" / "sub"
    pkg.mkdir(parents=True)
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.sub.b import x\n")
    (pkg / "b.py").write_text("def f():\n    from pkg.sub import a\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .d import y\n")
    (pkg / "d.py").write_text("import pkg.sub.c\n")
    (pkg / "e.py").write_text("from . import a\n")          # imports into the cycle, not part of it
    assert module_cycles(tmp_path / "pkg", "sub") == [["pkg.sub.a", "pkg.sub.b"], ["pkg.sub.c", "pkg.sub.d"]]


def test_strongly_connected_components_of_a_hand_drawn_graph() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": {"e"}, "e": {"d"}, "f": {"a"}, "g": set()}
    assert strongly_connected(graph) == [["a", "b", "c"], ["d", "e"]]
