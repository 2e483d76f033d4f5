"""Backend registry: ``register_backend``, ``backend_names``, ``lookup``; entry-point plugins.

Creating and choosing backends (``create_backend``, ``explain``, "auto") is ``_create``.
Registering never activates anything: a registry entry is a name, a factory (or a lazy
"module:attr" path to one), a priority and an options model. Built-ins and the
``attnsdk.backends`` entry-point group are resolved on first use.
"""

from __future__ import annotations

import difflib
import importlib
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from attnsdk.contract.backend import EnvironmentProbe, NoOptions
from attnsdk.contract.errors import InvalidInputError, Reason, ReasonKind, UnsupportedConfigError

if TYPE_CHECKING:
    import torch

    from attnsdk.contract.backend import Backend

__all__ = ["AUTO", "Registration", "backend_names", "canonical_name", "lookup", "register_backend"]

logger = logging.getLogger("attnsdk")

ENTRY_POINT_GROUP = "attnsdk.backends"
AUTO = "auto"
"""The name that is no backend: pick the highest-priority one that can run here."""


Factory = Callable[[Any], "Backend"]


@dataclass(frozen=True, slots=True)
class _Entry:
    name: str
    target: Factory | str
    priority: int | None
    """None (entry-point plugins): the factory's ``priority`` attribute, read on first use."""
    options: type[BaseModel] | str | None
    """None: the factory's ``Options`` attribute, else ``NoOptions``."""
    auto: bool = True
    """False for composites (``routed``): asked for by name, never picked by "auto"."""

    def factory(self) -> Any:
        return _resolve(self.target)

    def resolved_priority(self) -> int:
        """The priority; a plugin's is read from its class (imported outside the lock)."""
        if self.priority is not None:
            return self.priority
        try:
            value = getattr(self.factory(), "priority", 0)
        except Exception as exc:  # a broken plugin is reported when it is used
            _warn_once(self.name, f"attnsdk: backend plugin {self.name!r} cannot be loaded: {exc}")
            return 0
        if isinstance(value, bool) or not isinstance(value, int):
            _warn_once(
                self.name,
                f"attnsdk: backend plugin {self.name!r} has priority {value!r}, not an int; "
                "using 0",
            )
            return 0
        return value

    def options_model(self) -> type[BaseModel]:
        """The options model; one that cannot be loaded or is not a pydantic model is refused."""
        where = "its factory's Options" if self.options is None else repr(self.options)
        try:
            if self.options is None:
                model = getattr(self.factory(), "Options", NoOptions)
            else:
                model = _resolve(self.options)
        except Exception as exc:  # a broken plugin path: one backend that cannot be configured
            why = f"{where} cannot be loaded: {type(exc).__name__}: {exc}"
            raise UnsupportedConfigError(
                f"backend {self.name!r}: options model {why}",
                [Reason(ReasonKind.CONFIGURATION, "options", why)],
            ) from exc
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            why = f"{where} is {model!r}, not a pydantic model class"
            raise UnsupportedConfigError(
                f"backend {self.name!r}: options model {why}",
                [Reason(ReasonKind.CONFIGURATION, "options", why)],
            )
        return model

    def environment_reasons(self, device: torch.device | str | None) -> list[Reason]:
        try:
            factory = self.factory()
        except Exception as exc:  # a broken plugin is one backend that cannot run, not a crash
            why = f"{self.target} cannot be loaded: {type(exc).__name__}: {exc}"
            return [Reason(ReasonKind.ENVIRONMENT, "import", why)]
        if not isinstance(factory, EnvironmentProbe):
            return []  # a plain factory: what it creates answers (``unsupported_reasons``)
        try:
            return list(factory.environment_reasons(device))
        except Exception as exc:  # a crashing probe is a backend that cannot run, not a crash
            why = f"{self.target} environment_reasons() raised {type(exc).__name__}: {exc}"
            return [Reason(ReasonKind.ENVIRONMENT, "environment_reasons", why)]


class Registration:
    """Handle returned by ``register_backend``; ``remove()`` unregisters (idempotent)."""

    def __init__(self, name: str, entry: _Entry) -> None:
        self.name = name
        self._entry = entry

    def remove(self) -> None:
        with _LOCK:
            if _REGISTRY.get(self.name) is self._entry:
                del _REGISTRY[self.name]

    def __repr__(self) -> str:
        return f"Registration({self.name!r})"


_LOCK = threading.RLock()
_REGISTRY: dict[str, _Entry] = {}
_PLUGINS_LOADED = False
_WARNED: set[str] = set()


def register_backend(
    name: str,
    factory: Factory | str,
    *,
    priority: int | None = None,
    options: type[BaseModel] | str | None = None,
    replace: bool = False,
    auto: bool = True,
) -> Registration:
    """Register a backend under ``name``; nothing is imported or created until it is used.

    ``factory(options) -> Backend`` may be a class or a ``"module:attr"`` path. ``"auto"`` picks
    the highest ``priority`` that can run; None reads the factory's ``priority`` attribute (as
    for entry-point plugins), else 0. ``auto=False`` registers a backend that is asked for by
    name only (a composite such as ``routed``). ``options`` is the pydantic model that validates the
    backend's options in an ``AttentionConfig``; None means the factory's ``Options`` attribute,
    else no options. A ``BackendBase`` subclass answers "auto" and ``explain`` without being
    created (``environment_reasons(device)``, ``refusals(request)``); so does any factory with
    those classmethods (``attnsdk.BackendClass``).

    >>> from attnsdk.backends.reference import ReferenceBackend, ReferenceOptions
    >>> handle = register_backend(
    ...     "my-reference", ReferenceBackend, priority=-1, options=ReferenceOptions)
    >>> "my-reference" in backend_names()
    True
    >>> handle.remove()
    """
    if not isinstance(name, str) or not name or name.casefold() == AUTO:
        why = f"must be a non-empty str other than 'auto' (in any case), found {name!r}"
        raise UnsupportedConfigError(
            f"cannot register a backend named {name!r}: pick a non-empty name other than 'auto'",
            [Reason(ReasonKind.CONFIGURATION, "name", why)],
        )
    if isinstance(factory, str):
        _check_path("factory", factory)
    elif not callable(factory):
        raise InvalidInputError(
            "factory", "a callable (options) -> Backend or a 'module:attr' path", repr(factory)
        )
    if priority is not None and (isinstance(priority, bool) or not isinstance(priority, int)):
        raise InvalidInputError(
            "priority", "an int (higher wins in 'auto') or None (the factory's)", repr(priority)
        )
    if not isinstance(auto, bool):
        raise InvalidInputError("auto", "True or False", repr(auto))
    if isinstance(options, str):
        _check_path("options", options)
    elif options is not None and not (isinstance(options, type) and issubclass(options, BaseModel)):
        raise InvalidInputError(
            "options", "None, a pydantic model class or a 'module:attr' path", repr(options)
        )
    if not isinstance(replace, bool):
        raise InvalidInputError("replace", "True or False", repr(replace))
    entry = _Entry(name, factory, priority, options, auto=auto)
    _load_plugins()
    with _LOCK:
        if name in _REGISTRY and not replace:
            raise UnsupportedConfigError(
                f"a backend named {name!r} is already registered; pass replace=True to override it",
                [Reason(ReasonKind.CONFIGURATION, "name", f"{name!r} is already registered")],
            )
        _REGISTRY[name] = entry
    return Registration(name, entry)


def backend_names() -> list[str]:
    """Registered backend names, highest priority first."""
    return [e.name for e in _entries()]


def lookup(name: str) -> _Entry:
    """The registry entry for ``name``, matched exactly, else ignoring case (``"FA3"`` is
    ``"fa3"``). Two registered names that match only ignoring case make the name ambiguous; an
    unknown name lists the known ones and the closest."""
    if not isinstance(name, str):
        raise InvalidInputError("backend", "a backend name (str)", repr(name))
    _load_plugins()
    with _LOCK:
        entry = _REGISTRY.get(name)
        if entry is not None:
            return entry
        folded = [e for n, e in _REGISTRY.items() if n.casefold() == name.casefold()]
        known = sorted(_REGISTRY)
    if len(folded) == 1:
        return folded[0]
    if folded:
        names = sorted(e.name for e in folded)
        listed = " and ".join(repr(n) for n in names)
        raise UnsupportedConfigError(
            f"attention backend name {name!r} is ambiguous: it matches {listed} ignoring case; "
            "use the exact name",
            [Reason(ReasonKind.CONFIGURATION, "backend", f"{name!r} matches {listed}")],
        )
    by_folded = {n.casefold(): n for n in [*known, AUTO]}
    close = difflib.get_close_matches(name.casefold(), list(by_folded), n=1)
    hint = f" Did you mean {by_folded[close[0]]!r}?" if close else ""
    raise UnsupportedConfigError(
        f"unknown attention backend {name!r}; known backends: {', '.join([AUTO, *known])}.{hint}",
        [Reason(ReasonKind.CONFIGURATION, "backend", f"{name!r} is not registered")],
    )


def canonical_name(name: str) -> str:
    """``"auto"`` or the registered name ``name`` stands for (see ``lookup``).

    >>> canonical_name("Reference"), canonical_name("AUTO")
    ('reference', 'auto')
    """
    if isinstance(name, str) and name.casefold() == AUTO:
        return AUTO
    return lookup(name).name


def _entries() -> list[_Entry]:
    _load_plugins()
    with _LOCK:
        entries = list(_REGISTRY.values())
    # Plugin priorities import the plugin: outside the lock, so a plugin that registers more
    # backends while it is imported (on another thread, too) cannot deadlock with a lookup.
    return sorted(entries, key=lambda e: (-e.resolved_priority(), e.name))


def _resolve(target: Any) -> Any:
    if not isinstance(target, str):
        return target
    module, _, attr = target.partition(":")
    obj: Any = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


_BUILTINS = frozenset({"reference", "fa3", "routed", "flashinfer", "flex"})


def _register_builtins() -> None:
    """The built-in backends; each states its priority and options model on its class (read on
    first use, as a plugin's are): fa3 100, flashinfer 90, reference 0, flex -10, below the
    reference so that without a GPU "auto" keeps the reference (DESIGN §4), which needs no
    compiler; routed is a composite, asked for by name."""
    for name, target in (
        ("reference", "attnsdk.backends.reference:ReferenceBackend"),
        ("fa3", "attnsdk.backends.fa3:FA3Backend"),
        ("flashinfer", "attnsdk.backends.flashinfer:FlashInferBackend"),
        ("flex", "attnsdk.backends.flex:FlexBackend"),
    ):
        _REGISTRY[name] = _Entry(name, target, None, None)
    _REGISTRY["routed"] = _Entry(
        "routed", "attnsdk.selection.routed:RoutedBackend", None, None, auto=False
    )


def _load_plugins() -> None:
    """Add entry-point backends (``[project.entry-points."attnsdk.backends"]``) once.

    Reading entry points imports no plugin: their modules load on first use, outside the lock.
    A plugin named like a built-in is ignored with a warning.
    """
    global _PLUGINS_LOADED
    with _LOCK:
        if _PLUGINS_LOADED:
            return
        _PLUGINS_LOADED = True
    found = list(entry_points(group=ENTRY_POINT_GROUP))  # metadata only, no plugin import
    with _LOCK:
        for ep in found:
            if ep.name in _BUILTINS:
                _warn_once(
                    ep.name,
                    f"attnsdk: ignoring backend entry point {ep.name!r} = {ep.value}: "
                    f"{ep.name!r} is a built-in backend",
                )
                continue
            _REGISTRY.setdefault(ep.name, _Entry(ep.name, ep.value, None, None))


def _check_path(field: str, path: str) -> None:
    module, sep, attr = path.partition(":")
    if not (module and sep and attr):
        raise InvalidInputError(field, "a 'module:attr' path", repr(path))


def _warn_once(key: str, message: str) -> None:
    with _LOCK:
        if key in _WARNED:
            return
        _WARNED.add(key)
    logger.warning(message)


_register_builtins()
