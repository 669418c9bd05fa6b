"""Checks on how reinforge's modules import each other, read from the source with `ast` (nothing is imported).

Every import counts: top-level ones, those inside functions and those under `TYPE_CHECKING`, because each is a
real dependency (a function-level import only delays the cycle to the first call). Relative imports are resolved
against the importing module, and `from package import name` counts as an import of `package.name` when that is a
module, of `package` otherwise (the same rules as the floors tool the project runs before it stops).
"""
from __future__ import annotations

import ast
from pathlib import Path


def module_files(package_dir: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file under `package_dir` (a package's `__init__` is the package)."""
    root = package_dir.parent
    mods = {}
    for path in sorted(package_dir.rglob("*.py")):
        name = ".".join(path.relative_to(root).with_suffix("").parts)
        mods[name.removesuffix(".__init__")] = path
    return mods


def imported_modules(name: str, path: Path, mods: dict[str, Path]) -> set[str]:
    """The modules of `mods` that the module `name` (file `path`) imports anywhere in its body."""
    base = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            target = node.module or ""
            if node.level:
                parts = base.split(".")
                target = ".".join(parts[: len(parts) - node.level + 1] + ([target] if target else []))
            targets = [f"{target}.{a.name}" if f"{target}.{a.name}" in mods else target for a in node.names]
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in mods and "." in target:
                target = target.rsplit(".", 1)[0]
            if target in mods and target != name:
                found.add(target)
    return found


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of `graph` with more than one node, each sorted (iterative, so a
    long import chain cannot hit the recursion limit)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            for succ in successors:
                if succ not in index:
                    index[succ] = low[succ] = len(index)
                    stack.append(succ)
                    on_stack.add(succ)
                    work.append((succ, iter(sorted(graph.get(succ, ())))))
                    break
                if succ in on_stack:
                    low[node] = min(low[node], index[succ])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        components.append(sorted(component))
    return sorted(components)


def module_cycles(package_dir: Path, subpackage: str) -> list[list[str]]:
    """The import cycles among the modules of one subpackage of `package_dir` (e.g. "rollout"): strongly connected
    components of its modules, imports to modules outside the subpackage left out (those are the floors' business)."""
    mods = module_files(Path(package_dir))
    prefix = f"{Path(package_dir).name}.{subpackage}"
    inside = {m: p for m, p in mods.items() if m == prefix or m.startswith(prefix + ".")}
    graph = {m: {t for t in imported_modules(m, p, mods) if t in inside} for m, p in inside.items()}
    return strongly_connected(graph)


def package_cycles(package_dir: Path) -> list[list[str]]:
    """The import cycles among the first-level parts of `package_dir` (its subpackages and top-level modules)."""
    mods = module_files(Path(package_dir))
    top = Path(package_dir).name

    def part(module: str) -> str:
        return ".".join(module.split(".")[:2])

    graph: dict[str, set[str]] = {}
    for m, p in mods.items():
        if m == top:
            continue
        graph.setdefault(part(m), set()).update(part(t) for t in imported_modules(m, p, mods)
                                                if t != top and part(t) != part(m))
    return strongly_connected(graph)


def oversized(package_dir: Path, max_lines: int, max_function_lines: int) -> list[str]:
    """Files over `max_lines` lines and functions over `max_function_lines`, as "path (n)" / "path:name (n)"."""
    found = []
    for path in sorted(Path(package_dir).rglob("*.py")):
        text = path.read_text()
        if text.count("\n") > max_lines:
            found.append(f"{path} ({text.count(chr(10))})")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > max_function_lines:
                    found.append(f"{path}:{node.name} ({length})")
    return found
