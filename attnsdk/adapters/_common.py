"""What the SGLang and vLLM adapters share, engine-neutral.

- ``resolve_backend``: one attnsdk backend per spec, shared by every object that plans or runs.
- ``drop_in_class``: a drop-in class with the engine's own base class mixed in when the engine
  is installed, so members the engine adds later exist; built on first use, so importing an
  adapter never imports its engine.
- ``EngineVersions``: the versions an adapter is tested on; outside them it warns once.
- ``LayerState``: per-layer ``LayerSpec`` + ``KVCache``, keyed on everything that defines them.
- ``AttnKind``: causality and KV rules of the engines' attention types.
- ``refuse``: the one way an adapter says "not served", with a reason.
- ``engine_attr``: an attribute of an engine object, a missing one a typed error naming it.
"""

from __future__ import annotations

import enum
import importlib
import importlib.metadata
import importlib.util
import logging
import os
import re
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

from attnsdk.contract.backend import Backend
from attnsdk.contract.errors import InvalidInputError, Reason, ReasonKind, UnsupportedConfigError
from attnsdk.selection.config import AttentionConfig
from attnsdk.selection.config_files import find_pyproject
from attnsdk.selection.create import create_backend

if TYPE_CHECKING:
    from collections.abc import Callable, Hashable
    from typing import TypeAlias

    from attnsdk.contract.kv import KVCache
    from attnsdk.contract.layer import LayerSpec

__all__ = [
    "AttnKind",
    "BackendSpec",
    "EngineVersions",
    "LayerEntry",
    "LayerState",
    "backend_key",
    "drop_in_class",
    "engine_attr",
    "refuse",
    "resolve_backend",
]

logger = logging.getLogger("attnsdk")

BackendSpec: TypeAlias = "str | AttentionConfig | Backend | None"
"""A backend name, an ``AttentionConfig``, a ready instance, or None (``AttentionConfig.from_env``:
``ATTNSDK_CONFIG``, ``ATTNSDK_BACKEND``, ``[tool.attnsdk]`` in pyproject.toml, else ``"auto"``)."""

_LOCK = threading.Lock()
_BACKENDS: dict[object, Backend] = {}


def backend_key(spec: BackendSpec) -> object:
    """What identifies the backend ``spec`` resolves to (the environment, for None)."""
    if spec is None:
        # The environment decides, so it is part of the identity of the backend it gave.
        env = (os.environ.get("ATTNSDK_CONFIG"), os.environ.get("ATTNSDK_BACKEND"))
        return ("env", *env, find_pyproject())
    if isinstance(spec, str):
        return ("name", spec)
    if isinstance(spec, AttentionConfig):
        return ("config", spec.model_dump_json())
    return ("instance", id(spec))


def resolve_backend(spec: BackendSpec, device: Any = None) -> Backend:
    """The attnsdk backend for ``spec``, created once per (spec, device) and then shared.

    Sharing matters: a plan made by one object (vLLM's builder) is run by others (each layer).
    """
    if spec is not None and not isinstance(spec, (str, AttentionConfig)):
        if not isinstance(spec, Backend):
            raise InvalidInputError(
                "backend", "a backend name, an AttentionConfig or a Backend", repr(spec)
            )
        return spec
    key = (backend_key(spec), None if device is None else str(device))
    with _LOCK:
        backend = _BACKENDS.get(key)
    if backend is None:
        backend = create_backend(spec, device=device)
        with _LOCK:
            backend = _BACKENDS.setdefault(key, backend)
    return backend


_T = TypeVar("_T")


def drop_in_class(
    impl: type[_T], name: str, module: str, base: tuple[str, str] | None, **attrs: Any
) -> type[_T]:
    """``impl`` as the public class ``module.name``, subclassing the engine's ``base``
    (``(module path, class name)``) when that module can be imported, else ``impl`` alone.

    ``impl``'s methods come first in the MRO, so the engine's base supplies only what the
    drop-in does not define: every member an engine release adds keeps its default.
    """
    bases: tuple[type, ...] = (impl,)
    engine_base = _engine_class(*base) if base is not None else None
    if engine_base is not None:
        bases = (impl, engine_base)
    return type(name, bases, {"__module__": module, "__qualname__": name, **attrs})


def _engine_class(module: str, name: str) -> type | None:
    if importlib.util.find_spec(module.partition(".")[0]) is None:
        return None
    return getattr(importlib.import_module(module), name)


def _version_tuple(text: str) -> tuple[int, ...]:
    m = re.match(r"(\d+)\.(\d+)\.(\d+)(?:\.?post(\d+))?", text)
    if m is None:
        return ()
    return tuple(int(g or 0) for g in m.groups())


@dataclass(frozen=True)
class EngineVersions:
    """The releases of an engine an adapter is tested on (``make test-engines``)."""

    package: str
    tested: tuple[str, ...]
    """Every version the engine tier runs, oldest first; between the first and the last is
    supported, outside it the adapter warns once."""

    @property
    def span(self) -> str:
        return f"{self.tested[0]} .. {self.tested[-1]}"

    def installed(self) -> str | None:
        try:
            return importlib.metadata.version(self.package)
        except importlib.metadata.PackageNotFoundError:
            return None

    def check(self) -> None:
        """Warn once when the installed release is outside the tested span."""
        found = self.installed()
        if found is None:
            return
        low, high = _version_tuple(self.tested[0]), _version_tuple(self.tested[-1])
        if low <= _version_tuple(found) <= high:
            return
        with _LOCK:
            if self.package in _WARNED:
                return
            _WARNED.add(self.package)
        logger.warning(
            "attnsdk: %s %s is outside the versions its adapter is tested on (%s); "
            "it may call methods this release renamed. Run `make test-engines` against it.",
            self.package,
            found,
            self.span,
        )


_WARNED: set[str] = set()


class AttnKind(enum.Enum):
    """What an engine's attention type means for attnsdk."""

    DECODER = "decoder"
    """Causal self-attention over the paged cache (per-step ``causal=False`` is honoured)."""
    BIDIRECTIONAL = "bidirectional"
    """Non-causal self-attention over the paged cache (SGLang ENCODER_ONLY and
    DECODER_BIDIRECTIONAL; vLLM non-causal decoder steps)."""
    ENCODER = "encoder"
    """Non-causal attention over this step's K/V only; no cache (vLLM ENCODER, ENCODER_ONLY)."""
    CROSS = "cross"
    """Decoder rows over an encoder's cached K/V (vLLM ENCODER_DECODER): a cross-attention step
    (``AttentionMetadata.cross_attention``)."""

    @property
    def causal(self) -> bool:
        return self is AttnKind.DECODER


def refuse(
    what: str, field: str, why: str, kind: ReasonKind = ReasonKind.CONFIGURATION
) -> NoReturn:
    """Raise ``UnsupportedConfigError`` for something the adapter does not serve."""
    raise UnsupportedConfigError(f"{what}: {field} {why}", [Reason(kind, field, why)])


def engine_attr(obj: object, owner: str, name: str) -> Any:
    """``obj.name``, read off an engine object that ``owner`` names (``model_runner``,
    ``forward_batch``, ``layer``, ...). A missing attribute (an engine release that renamed
    it, or a mock without it) raises ``InvalidInputError`` naming ``owner.name``, not a bare
    ``AttributeError`` from deep inside the adapter."""
    try:
        return getattr(obj, name)
    except AttributeError as exc:
        raise InvalidInputError(
            f"{owner}.{name}",
            f"an attribute the adapter reads from the engine's {owner}",
            f"a {type(obj).__name__} without it",
            "Is the engine release one the adapter is tested on?",
        ) from exc


@dataclass(frozen=True, slots=True)
class LayerEntry:
    """One layer as attnsdk sees it."""

    spec: LayerSpec
    cache: KVCache


class LayerState:
    """Per-layer ``LayerSpec`` and ``KVCache``, rebuilt whenever what defines them changes.

    ``fingerprint`` must hold everything the spec and the cache are derived from (head shape,
    window, dtypes, the engine buffer's address and shape): a layer id alone goes stale when an
    engine reallocates its pool or reuses an id for a draft model's layer.
    """

    def __init__(self) -> None:
        self._entries: dict[Hashable, tuple[Hashable, LayerEntry]] = {}

    def get(
        self, layer: Hashable, fingerprint: Hashable, build: Callable[[], LayerEntry]
    ) -> LayerEntry:
        found = self._entries.get(layer)
        if found is not None and found[0] == fingerprint:
            return found[1]
        entry = build()
        self._entries[layer] = (fingerprint, entry)
        return entry
