"""The package's floor plan: imports run downward only, and no modules import each other in a
circle (docs/architecture.md).

    contract <- features <- kernels <- backends <- selection
             <- {adapters, integrations, testing} <- attnsdk (the public face) <- {_cli, _bench}

Every import counts, inside functions and under ``TYPE_CHECKING`` too: a type-only import
that runs upward is still a lower layer that knows a higher one.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "attnsdk"
LAYERS = {
    "contract": 0,
    "features": 1,
    "kernels": 2,
    "backends": 3,
    "selection": 4,
    "adapters": 5,
    "integrations": 5,
    "testing": 5,
    "": 6,  # attnsdk/__init__.py, the public face
    "_cli": 7,
    "_bench": 7,
    "__main__": 8,
}


def _module(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _imports(path: Path, module: str) -> set[str]:
    """Every attnsdk module ``path`` imports (a ``from X import name`` counts as X.name when
    that is a module of the package, else X)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "attnsdk")
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            if base.split(".")[0] != "attnsdk":
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in MODULES else base)
    return found - {module}


MODULES = {_module(p): p for p in sorted(PACKAGE.rglob("*.py"))}
GRAPH = {m: _imports(p, m) for m, p in MODULES.items()}


def test_every_module_is_on_a_known_layer() -> None:
    assert {_layer(m) for m in MODULES} <= set(LAYERS)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_run_downward(module: str) -> None:
    mine = LAYERS[_layer(module)]
    upward = sorted(
        f"{module} imports {other} ({_layer(other) or 'attnsdk'})"
        for other in GRAPH[module]
        if LAYERS[_layer(other)] > mine
        # the face's version string is data, not code: the CLI and bench reports print it
        and not (other == "attnsdk" and mine >= LAYERS["_cli"])
    )
    assert upward == []


def test_siblings_of_the_top_floor_do_not_import_each_other() -> None:
    """adapters, integrations and testing each stand on the layers below, not on each other;
    only an adapter's test doubles (``attnsdk.adapters.<engine>.testing``) build on the test
    kit, as an integrator's tests would."""
    siblings = {"adapters", "integrations", "testing"}
    crossing = sorted(
        f"{m} imports {o}"
        for m, others in GRAPH.items()
        for o in others
        if _layer(m) in siblings
        and _layer(o) in siblings
        and _layer(o) != _layer(m)
        and not (m.endswith(".testing") and _layer(m) == "adapters" and _layer(o) == "testing")
    )
    assert crossing == []


def test_no_module_imports_itself_through_others() -> None:
    """No circle: a depth-first walk finds no edge back to a module on the current path."""
    state: dict[str, int] = {}  # 1: on the path, 2: done
    circles: list[str] = []

    def walk(m: str, path: list[str]) -> None:
        state[m] = 1
        for o in sorted(GRAPH.get(m, ())):
            if o not in GRAPH:
                continue
            if state.get(o) == 1:
                circles.append(" -> ".join([*path[path.index(o) :], o]))
            elif o not in state:
                walk(o, [*path, o])
        state[m] = 2

    for m in sorted(GRAPH):
        if m not in state:
            walk(m, [m])
    assert circles == []
