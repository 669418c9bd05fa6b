"""The floors of the package (docs/architecture.md): no import cycle between its parts or between the modules of
one part, counting every import (tests/layering_checks.py); a top level that shows the parts; the size limits of
STYLE.md."""
from __future__ import annotations

from pathlib import Path

import pytest
from repo_paths import REPO

from tests.layering_checks import module_cycles, oversized, package_cycles, strongly_connected

PACKAGE = REPO / "reinforge"
PACKAGES = sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file())


def test_every_part_is_checked() -> None:
    assert {"config", "jobs", "curation", "settings", "rollout", "rewards", "verifiers"} <= set(PACKAGES)


def test_the_parts_of_the_package_import_downward_only() -> None:
    assert package_cycles(PACKAGE) == []


def test_the_top_level_shows_the_parts() -> None:
    modules = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(modules) <= 8, modules


def test_no_file_over_450_lines_and_no_function_over_80() -> None:
    assert oversized(PACKAGE, 450, 80) == []


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


def test_the_floor_checker_finds_a_cycle_between_parts(tmp_path: Path) -> None:
    files = {"__init__.py": "", "low/__init__.py": "", "low/a.py": "def f():\n    from pkg.high import b\n",
             "high/__init__.py": "", "high/b.py": "from pkg.low.a import f\n", "top.py": "import pkg.high.b\n"}
    for name, text in files.items():
        (tmp_path / "pkg" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "pkg" / name).write_text(text)
    assert package_cycles(tmp_path / "pkg") == [["pkg.high", "pkg.low"]]
    assert oversized(tmp_path / "pkg", 10, 1) == [f"{tmp_path / 'pkg' / 'low' / 'a.py'}:f (2)"]
