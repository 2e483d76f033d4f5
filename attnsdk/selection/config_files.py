"""Reading attention config files: JSON, TOML, YAML, and ``[tool.attnsdk]`` in pyproject.toml.

Every problem is an ``UnsupportedConfigError`` that names the file (and the key, when the file
parses but holds the wrong thing); ``AttentionConfig`` validates what these functions return.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from attnsdk.contract.errors import UnsupportedConfigError

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = [
    "PYPROJECT",
    "WRAPPER",
    "config_table",
    "find_pyproject",
    "pyproject_table",
    "read_mapping",
]

WRAPPER = "attnsdk"
"""A config file may hold the config at top level or under this key (``[attnsdk]`` in TOML)."""
PYPROJECT = "pyproject.toml"


def config_table(path: Path) -> tuple[dict[str, Any], str]:
    """The config mapping in ``path`` and where it sits: ``"attnsdk"`` (the wrapper key),
    ``"tool.attnsdk"`` (a pyproject.toml) or ``""`` (top level)."""
    data = read_mapping(path)
    if WRAPPER in data:
        return _mapping(path, data[WRAPPER], WRAPPER), WRAPPER
    if path.name == PYPROJECT:
        table = pyproject_table(path, data)
        if table is None:
            raise UnsupportedConfigError(
                f"{_name(path)} has no [tool.attnsdk] table (the attnsdk config in a pyproject.toml)"
            )
        return table, "tool.attnsdk"
    return data, ""


def pyproject_table(path: Path, data: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """The ``[tool.attnsdk]`` table of a pyproject.toml, or None when it has none."""
    if data is None:
        if path.is_file() and WRAPPER not in _read(path, _name(path)):
            return None  # the common case, without parsing (Python 3.10 needs tomli for that)
        data = read_mapping(path)
    tool = data.get("tool")
    if tool is None:
        return None
    tool = _mapping(path, tool, "tool")
    if WRAPPER not in tool:
        return None
    return _mapping(path, tool[WRAPPER], "tool.attnsdk")


def find_pyproject(start: Path | None = None) -> Path | None:
    """The nearest pyproject.toml in ``start`` (default: the current directory) or above."""
    try:
        here = (start or Path.cwd()).resolve()
    except OSError:  # the current directory was deleted: there is no project around it
        return None
    for folder in (here, *here.parents):
        candidate = folder / PYPROJECT
        if candidate.is_file():
            return candidate
    return None


def read_mapping(path: Path, what: str = "attention config file") -> dict[str, Any]:
    """Parse a JSON, TOML or YAML file holding a mapping; errors call the file ``what``."""
    name = f"{what} {str(path)!r}"
    if not path.is_file():
        raise UnsupportedConfigError(f"{name} does not exist")
    parse = _parser(path, name)
    text = _read(path, name)
    try:
        data = parse(text)
    except Exception as exc:  # each parser has its own error type; report them alike
        raise UnsupportedConfigError(f"{name} cannot be parsed: {exc}") from exc
    if data is None and path.suffix.lower() in (".yaml", ".yml"):  # YAML without a document
        return {}
    if not isinstance(data, dict):
        raise UnsupportedConfigError(f"{name}: expected a mapping, found {type(data).__name__}")
    return data


def _read(path: Path, name: str) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise UnsupportedConfigError(f"{name} cannot be parsed (not UTF-8): {exc}") from exc
    except OSError as exc:
        raise UnsupportedConfigError(f"{name} cannot be read: {exc}") from exc


def _mapping(path: Path, value: Any, key: str) -> dict[str, Any]:
    if isinstance(value, dict):
        return value
    raise UnsupportedConfigError(
        f"{_name(path)} key {key!r}: expected a mapping (a table), found {type(value).__name__}"
    )


def _name(path: Path) -> str:
    return f"attention config file {str(path)!r}"


def _parser(path: Path, name: str) -> Callable[[str], Any]:
    """The ``loads`` for a config file's suffix; a missing parser library names its install."""
    suffix = path.suffix.lower()
    if suffix == ".json":
        return json.loads
    if suffix == ".toml":
        if sys.version_info >= (3, 11):
            import tomllib
        else:  # pragma: no cover - Python 3.10
            try:
                import tomli as tomllib  # type: ignore[import-not-found]
            except ImportError:
                raise UnsupportedConfigError(
                    f"reading {path.name} on Python 3.10 needs: pip install tomli"
                ) from None
        return tomllib.loads
    if suffix in (".yaml", ".yml"):
        try:
            import yaml  # type: ignore[import-untyped]
        except ImportError:
            raise UnsupportedConfigError(
                f"reading {path.name} needs PyYAML: pip install pyyaml (or use .json / .toml)"
            ) from None
        return yaml.safe_load
    raise UnsupportedConfigError(f"{name}: expected a .json, .toml, .yaml or .yml suffix")
