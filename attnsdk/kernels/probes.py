"""Is a kernel package installed? Path lookups only, so asking never imports a kernel library
(``importlib.util.find_spec`` on a dotted name would import the parent package)."""

from __future__ import annotations

import importlib.machinery
import importlib.util
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Iterable

__all__ = ["first_present", "module_present"]


def module_present(name: str) -> bool:
    """True when ``name`` (possibly dotted) can be imported; imports nothing."""
    top, _, rest = name.partition(".")
    spec = importlib.util.find_spec(top)
    for part in rest.split(".") if rest else ():
        if spec is None or spec.submodule_search_locations is None:
            return False
        spec = importlib.machinery.PathFinder.find_spec(part, list(spec.submodule_search_locations))
    return spec is not None


def first_present(names: Iterable[str]) -> str | None:
    """The first importable module of ``names``; None when none is. Imports nothing."""
    return next((n for n in names if module_present(n)), None)
