"""Imports point inward: the layers of ``gateway``, top to bottom, and a check that keeps them so.

A module may import from its own layer or any layer below, never above; within a layer the
packages' imports must not form a cycle (``routing`` reads ``workers``, so ``workers`` may not read
``routing``). ``sim``, ``bench`` and ``procs`` (the process kit of tests and benchmarks) are side
trees: they may import the product; of the product
only the commands that run them (``cli``, ``demo``) may import them. Every import counts: at
module level, inside functions, under ``TYPE_CHECKING``, relative, and ``__import__`` /
``importlib.import_module`` of a constant name.

The checker is the small AST walk below rather than import-linter: the rules fit in a screen and
need no dependency. The synthetic-tree tests prove it reports each kind of slip.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE_DIR = Path(__file__).resolve().parents[2] / "gateway"

LAYERS: tuple[frozenset[str], ...] = (
    frozenset({"cli", "demo", "server", "supervisor", "app"}),
    frozenset({"api"}),
    frozenset({"services"}),
    frozenset({"dispatch"}),
    frozenset({"upstream"}),
    frozenset({"errors", "request", "auth"}),
    frozenset({"routing", "budgets", "prompt", "kvindex", "workers", "overload", "metrics",
               "exposition"}),
    frozenset({"config"}),
    frozenset({"kvmath", "planner", "presets", "promtext", "processes", "httpd", "backlog",
               "tasks", "native", "gil"}),
)
"""Top to bottom; each name is a module or subpackage directly under ``gateway``."""

SIDE_TREES = frozenset({"sim", "bench", "procs"})
PACKAGE_INIT_IMPORTS = "native"
"""What ``gateway/__init__.py`` may import: the compiled modules' finder, which must be installed
before anything else of the package is imported."""
RUNS_SIDE_TREES = frozenset({"cli", "demo"})


@dataclass(frozen=True)
class Import:
    path: str  # relative to the package's parent, e.g. gateway/workers/worker.py
    line: int
    source: str  # top-level part of the importer: "workers"
    target: str  # top-level part of the imported module: "routing"

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.source} -> {self.target}"


def _part(module: str, package: str) -> str | None:
    """``gateway.routing.types`` -> ``routing``; ``None`` outside the package."""
    parts = module.split(".")
    if parts[0] != package:
        return None
    return parts[1] if len(parts) > 1 else ""


def _imported(node: ast.AST, module: list[str], is_package: bool) -> Iterator[str]:
    if isinstance(node, ast.Import):
        yield from (alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom):
        base = [] if node.level == 0 else (module if is_package else module[:-1])
        base = base[: len(base) - max(node.level - 1, 0)]
        if node.module:
            base = [*base, *node.module.split(".")]
        # Each imported name may be a module itself (``from gateway import config``).
        yield from (".".join([*base, alias.name]) for alias in node.names)
    elif (isinstance(node, ast.Call) and node.args
          and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
        func = node.func
        name = func.id if isinstance(func, ast.Name) else (
            func.attr if isinstance(func, ast.Attribute) else "")
        if name in ("__import__", "import_module"):
            yield node.args[0].value


def scan(package_dir: Path) -> list[Import]:
    """Every import of the package by its own modules (into other top-level parts)."""
    package = package_dir.name
    found: dict[Import, None] = {}  # ordered, and one entry per line and target
    for path in sorted(package_dir.rglob("*.py")):
        rel = path.relative_to(package_dir.parent)
        is_package = path.name == "__init__.py"
        module = list(rel.with_suffix("").parts)
        if is_package:
            module = module[:-1]
        source = _part(".".join(module), package)
        assert source is not None
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            for name in _imported(node, module, is_package):
                target = _part(name, package)
                if target is not None and target != source:
                    found[Import(rel.as_posix(), getattr(node, "lineno", 0), source, target)] = None
    return list(found)


def _layer(part: str) -> int | None:
    return next((i for i, layer in enumerate(LAYERS) if part in layer), None)


def violations(imports: list[Import]) -> list[str]:
    """Every import that points up a layer, into a side tree, or closes a cycle of packages."""
    found: list[str] = []
    edges: dict[str, set[str]] = {}
    for imp in imports:
        if imp.source in SIDE_TREES:
            continue
        if imp.source == "":  # the package's __init__, run first by every process
            if imp.target != PACKAGE_INIT_IMPORTS:
                found.append(f"{imp}: the package's __init__ imports only {PACKAGE_INIT_IMPORTS!r}")
            continue
        if imp.target in SIDE_TREES:
            if imp.source not in RUNS_SIDE_TREES:
                found.append(f"{imp}: the product imports the side tree {imp.target!r}")
            continue
        source, target = _layer(imp.source), _layer(imp.target)
        if source is None or target is None:
            unplaced = imp.source if source is None else imp.target
            found.append(f"{imp}: {unplaced!r} is in no layer")
            continue
        if target < source:
            found.append(f"{imp}: imports upward (layer {source} -> layer {target})")
        edges.setdefault(imp.source, set()).add(imp.target)
    found += [f"cycle of packages: {' -> '.join(c)}" for c in _cycles(edges)]
    return found


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each package that is on one (depth-first, deterministic order)."""
    cycles: list[list[str]] = []
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> None:
        if node in path:
            cycles.append([*path[path.index(node):], node])
            return
        if node in done:
            return
        for nxt in sorted(edges.get(node, ())):
            visit(nxt, [*path, node])
        done.add(node)

    for start in sorted(edges):
        visit(start, [])
    return cycles


# --- the package -----------------------------------------------------------------------------


def test_every_part_of_the_package_is_in_a_layer_or_a_side_tree() -> None:
    parts = {p.stem if p.is_file() else p.name for p in PACKAGE_DIR.iterdir()
             if (p.is_file() and p.suffix == ".py" and p.name != "__init__.py")
             or (p.is_dir() and (p / "__init__.py").exists())}
    placed = set().union(*LAYERS) | SIDE_TREES

    assert parts - placed == set()
    assert placed - parts == set(), "a layer names a part that no longer exists"


def test_imports_point_inward() -> None:
    assert violations(scan(PACKAGE_DIR)) == []


# --- the checker, on synthetic trees -----------------------------------------------------------


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "gateway"
    for rel, text in {"__init__.py": "", **files}.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        for parent in path.relative_to(root).parents:
            (root / parent / "__init__.py").touch()
        path.write_text(text)
    return root


@pytest.mark.parametrize(
    "text",
    [
        "from gateway.api.deps import ServicesDep\n",
        "import gateway.api.deps\n",
        "def f():\n    from gateway.api import deps\n",
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from gateway.api import deps\n",
        "from .api import deps\n",
        "import importlib\nimportlib.import_module('gateway.api.deps')\n",
    ],
    ids=["from", "import", "function-local", "type-checking", "relative", "import_module"],
)
def test_upward_import_is_reported_however_it_is_written(tmp_path: Path, text: str) -> None:
    root = _tree(tmp_path, {"dispatch.py": text, "api/deps.py": ""})

    (found,) = violations(scan(root))

    assert found.startswith("gateway/dispatch.py:") and "dispatch -> api: imports upward" in found


def test_relative_import_from_a_subpackage_resolves_to_the_part_it_names(tmp_path: Path) -> None:
    root = _tree(tmp_path, {"upstream/proxy.py": "from ..api.deps import ServicesDep\n",
                            "api/deps.py": ""})

    assert violations(scan(root)) == [
        "gateway/upstream/proxy.py:1: upstream -> api: imports upward (layer 4 -> layer 1)"]


def test_downward_and_same_package_imports_pass(tmp_path: Path) -> None:
    root = _tree(tmp_path, {
        "dispatch.py": "from gateway.routing.router import Router\nfrom gateway import errors\n",
        "routing/router.py": "from gateway.routing.types import Decision\nfrom . import types\n"
                             "from ..workers.worker import Worker\n",
        "routing/types.py": "", "workers/worker.py": "", "errors.py": "",
    })

    assert violations(scan(root)) == []


def test_cycle_between_packages_of_one_layer_is_reported(tmp_path: Path) -> None:
    """The slip this test was written for: workers/worker.py imported routing/types.py while
    routing/router.py imported workers/ (each package needed the other)."""
    root = _tree(tmp_path, {
        "routing/router.py": "from gateway.workers.worker import Worker\n",
        "workers/worker.py": "from gateway.routing.types import Candidate\n",
        "routing/types.py": "",
    })

    assert violations(scan(root)) == ["cycle of packages: routing -> workers -> routing"]


def test_product_importing_a_side_tree_is_reported_except_by_the_commands_that_run_it(
    tmp_path: Path,
) -> None:
    root = _tree(tmp_path, {
        "services.py": "from gateway.sim import fleet\n",
        "demo.py": "from gateway.sim import fleet\n",
        "sim/fleet.py": "from gateway.services import Services\n",
    })

    assert violations(scan(root)) == [
        "gateway/services.py:1: services -> sim: the product imports the side tree 'sim'"]


def test_module_in_no_layer_is_reported(tmp_path: Path) -> None:
    root = _tree(tmp_path, {"helpers.py": "from gateway import config\n", "config.py": ""})

    assert violations(scan(root)) == ["gateway/helpers.py:1: helpers -> config: 'helpers' is in no layer"]


def test_the_package_init_may_import_the_native_finder_and_nothing_else(tmp_path: Path) -> None:
    root = _tree(tmp_path, {"native.py": "", "config.py": ""})
    (root / "__init__.py").write_text("from gateway import native\nfrom gateway import config\n")

    assert violations(scan(root)) == [
        "gateway/__init__.py:2:  -> config: the package's __init__ imports only 'native'"]
