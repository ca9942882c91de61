#!/usr/bin/env python3
"""Check that imports between the moetrain packages point one way only.

The packages form a layered graph (ARCHITECTURE.md §1)::

    mt-data, mt-ops  ->  mt-models  ->  mt-parallel  ->  mt-train

A module may import from its own package and from the packages below it, never from
a package above or beside it, and never from another package's private modules or
names (anything whose dotted path has a component starting with ``_``, other than
``__init__``/``__main__``). mt-data must also stay free of torch, so that a data box
needs no GPU stack.

Usage: ``python tools/check_layering.py [REPO_ROOT]``; exits 1 and lists every
violation as ``file:line: message``.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

# package -> the packages it may import (besides itself)
ALLOWED: dict[str, frozenset[str]] = {
    "mt_data": frozenset(),
    "mt_ops": frozenset(),
    "mt_models": frozenset({"mt_ops"}),
    "mt_parallel": frozenset({"mt_models", "mt_ops"}),
    "mt_train": frozenset({"mt_data", "mt_ops", "mt_models", "mt_parallel"}),
}
# package -> third-party top-level modules it must never import
FORBIDDEN_THIRD_PARTY: dict[str, frozenset[str]] = {
    "mt_data": frozenset({"torch", "triton"}),
}


def _is_private(part: str) -> bool:
    return part.startswith("_") and not (part.startswith("__") and part.endswith("__"))


def _imports(tree: ast.AST) -> list[tuple[int, str, list[str]]]:
    """Returns (line, absolute module path, imported names) for every import."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.append((node.lineno, alias.name, []))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module, [a.name for a in node.names]))
    return found


def check_file(path: Path, owner: str, rel: str) -> list[str]:
    """Returns the layering violations of one source file owned by package `owner`."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    except SyntaxError as err:
        return [f"{rel}:{err.lineno}: cannot parse: {err.msg}"]
    problems = []
    for line, module, names in _imports(tree):
        parts = module.split(".")
        top = parts[0]
        if top in FORBIDDEN_THIRD_PARTY.get(owner, ()):
            problems.append(f"{rel}:{line}: {owner} must not import {top}")
            continue
        if top not in ALLOWED or top == owner:
            continue
        if top not in ALLOWED[owner]:
            allowed = ", ".join(sorted(ALLOWED[owner])) or "no other moetrain package"
            problems.append(
                f"{rel}:{line}: {owner} imports {module}, against the layering "
                f"({owner} may use {allowed})"
            )
            continue
        private = [p for p in parts[1:] if _is_private(p)] + [n for n in names if _is_private(n)]
        if private:
            problems.append(
                f"{rel}:{line}: {owner} reaches into private {module} ({', '.join(private)}); "
                f"use {top}'s public API or make the name public there"
            )
    return problems


def check_repo(root: Path) -> list[str]:
    """Checks every Python file of every package (sources and tests) under `root`."""
    problems = []
    packages = root / "packages"
    if not packages.is_dir():
        return [f"{packages}: no packages/ directory; pass the repository root"]
    for pkg_dir in sorted(packages.iterdir()):
        owner = pkg_dir.name.replace("-", "_")
        if owner not in ALLOWED:
            continue
        for path in sorted(pkg_dir.rglob("*.py")):
            if any(part in {".venv", "build", "dist"} for part in path.parts):
                continue
            problems += check_file(path, owner, str(path.relative_to(root)))
    return problems


def main(argv: list[str] | None = None) -> int:
    """Prints violations and returns the exit code (0 when the layering holds)."""
    argv = sys.argv[1:] if argv is None else argv
    root = Path(argv[0]) if argv else Path(__file__).resolve().parent.parent
    problems = check_repo(root)
    for problem in problems:
        print(problem)
    if problems:
        print(f"{len(problems)} layering violation(s)")
        return 1
    print("layering ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
