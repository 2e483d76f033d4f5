"""Packaging: what pyproject.toml declares, the layout behind it, and what pip builds from it.

The layout (DEVELOPERS.md, "Package layout"): one package, ``attnsdk/``, its adapters in
``attnsdk/adapters/``, no links. The package root is named in pyproject.toml (``"" = "."``),
so the editable install is one plain path in a ``.pth`` file, which type checkers follow
(setuptools' import-hook finder, used for a flat layout otherwise, they cannot).
"""

from __future__ import annotations

import ast
import importlib
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PROJECT = PYPROJECT["project"]
SOURCES = ["pyproject.toml", "README.md", "LICENSE", "attnsdk"]
"""What a build reads; copied so a build writes nothing into the tree."""
PIP_WHEEL = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]


def _python_files() -> list[Path]:
    return list((ROOT / "attnsdk").rglob("*.py"))


def _imported_modules(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name.partition(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.partition(".")[0])
    return names


def test_license_is_an_spdx_expression_with_its_file() -> None:
    assert PROJECT["license"] == "Apache-2.0"
    assert PROJECT["license-files"] == ["LICENSE"]
    assert "Apache License" in (ROOT / "LICENSE").read_text()
    # PEP 639 license expressions need setuptools 77.
    assert PYPROJECT["build-system"]["requires"] == ["setuptools>=77"]


def test_dependencies_are_imported_and_extras_match_their_imports() -> None:
    deps = {d.split(">")[0].split("=")[0].strip() for d in PROJECT["dependencies"]}
    assert deps == {"torch", "pydantic"}
    imported = set().union(*map(_imported_modules, _python_files()))
    assert "typing_extensions" not in imported
    extras = PROJECT["optional-dependencies"]
    assert extras["testing"] == ["hypothesis>=6", "pytest>=7"]
    assert extras["fa3"] == ["tokenspeed-fa3"]
    assert "attnsdk[testing]" in extras["dev"]
    assert extras["transformers"] == ["transformers>=5.17"]
    assert "attnsdk[transformers]" in extras["dev"]  # CI runs tests/integrations
    assert {"sphinx", "myst-parser"} <= {d.split("=")[0] for d in extras["docs"]}
    # hypothesis only where the testing extra says, behind an error that names it.
    users = [p for p in _python_files() if "hypothesis" in _imported_modules(p)]
    assert [p.relative_to(ROOT).as_posix() for p in users] == ["attnsdk/testing/strategies.py"]


def test_strategies_without_hypothesis_name_the_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "hypothesis", None)  # import hypothesis -> ImportError
    monkeypatch.delitem(sys.modules, "attnsdk.testing.strategies", raising=False)
    with pytest.raises(ModuleNotFoundError, match="pip install hypothesis") as info:
        importlib.import_module("attnsdk.testing.strategies")
    assert "[testing]" in str(info.value)
    assert info.value.name == "hypothesis"


def test_error_hints_install_what_exists_on_the_package_index() -> None:
    """attnsdk is not published: an error naming ``pip install "attnsdk[...]"`` cannot work."""
    offenders = [
        p.relative_to(ROOT).as_posix()
        for p in _python_files()
        if 'pip install "attnsdk[' in p.read_text() or "pip install 'attnsdk[" in p.read_text()
    ]
    assert offenders == []


def test_layout_has_no_links_and_one_package_root() -> None:
    tracked = subprocess.run(
        ["git", "ls-files", "-s"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.splitlines()
    links = [line.split("\t")[1] for line in tracked if line.startswith("120000")]
    assert links == [], "tracked symlinks hide files from grep and import-graph tools"
    assert not (ROOT / "src").exists()
    assert not (ROOT / "adapters").exists()
    assert (ROOT / "attnsdk" / "adapters" / "__init__.py").is_file()
    setuptools = PYPROJECT["tool"]["setuptools"]
    assert setuptools["package-dir"] == {"": "."}
    assert setuptools["packages"]["find"]["include"] == ["attnsdk", "attnsdk.*"]


@pytest.fixture(scope="module")
def source_copy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("setuptools", minversion="77")
    dest = tmp_path_factory.mktemp("attnsdk-src")
    for name in SOURCES:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(
                src, dest / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info")
            )
        else:
            shutil.copy2(src, dest / name)
    return dest


def test_wheel_holds_the_adapters_files_and_the_license(source_copy: Path, tmp_path: Path) -> None:
    subprocess.run(
        [*PIP_WHEEL, "-w", str(tmp_path), str(source_copy)],
        check=True,
        capture_output=True,
        timeout=120,
    )
    (wheel,) = tmp_path.glob("attnsdk-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        metadata = zf.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    expected = {p.relative_to(ROOT).as_posix() for p in (ROOT / "attnsdk").rglob("*.py")}
    assert {n for n in names if n.endswith(".py")} == expected  # every subpackage, nothing else
    assert "attnsdk/py.typed" in names
    assert not any(n.startswith(("adapters/", "src/", "tests/")) for n in names)
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assert "License-Expression: Apache-2.0" in metadata
    assert "typing-extensions" not in metadata.lower()
    assert "Provides-Extra: testing" in metadata


def test_editable_install_is_one_plain_path_to_the_checkout(
    source_copy: Path, tmp_path: Path
) -> None:
    """A path entry, not an import hook: what mypy and pyright follow."""
    code = (
        "import sys; from setuptools import build_meta as b; "
        f"print(b.build_editable({str(tmp_path)!r}))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=source_copy,
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
    )
    wheel = tmp_path / done.stdout.strip().splitlines()[-1]
    with zipfile.ZipFile(wheel) as zf:
        installed = [n for n in zf.namelist() if ".dist-info/" not in n]
        (pth,) = installed
        assert pth.endswith(".pth")
        lines = zf.read(pth).decode().split()
    assert lines == [str(source_copy.resolve())]
    # What the path holds: the package itself (and its metadata), nothing else importable.
    packages = sorted(p.parent.name for p in Path(lines[0]).glob("*/__init__.py"))
    assert packages == ["attnsdk"]
