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
- ``ModelLayer`` / ``declare_model``: a model's attention layers, declared to the backend once
  at start-up (``Backend.prepare``), every refusal naming the engine's layer;
  ``ragged_reasons``: why a backend cannot run a layer through ``forward_ragged``.
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
from attnsdk.contract.capabilities import Feature
from attnsdk.contract.errors import InvalidInputError, Reason, ReasonKind, UnsupportedConfigError
from attnsdk.selection.config import AttentionConfig
from attnsdk.selection.config_files import find_pyproject
from attnsdk.selection.create import create_backend

if TYPE_CHECKING:
    from collections.abc import Callable, Hashable, Iterable
    from typing import TypeAlias

    import torch

    from attnsdk.contract.kv import KVCache, KVCacheLayout
    from attnsdk.contract.layer import LayerSpec

__all__ = [
    "AttnKind",
    "BackendSpec",
    "EngineVersions",
    "LayerEntry",
    "LayerState",
    "ModelLayer",
    "backend_key",
    "declare_model",
    "drop_in_class",
    "engine_attr",
    "ragged_reasons",
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

    def put(self, layer: Hashable, fingerprint: Hashable, entry: LayerEntry) -> None:
        """Keep ``entry`` (built ahead of the layer's first use, e.g. at start-up)."""
        self._entries[layer] = (fingerprint, entry)


@dataclass(frozen=True, slots=True)
class ModelLayer:
    """One attention layer of an engine's model, as the adapter declares it at start-up."""

    name: str
    """How the engine names the layer (SGLang: ``layers[3]``, its ``layer_id``; vLLM: its
    ``static_forward_context`` key, ``model.layers.3.self_attn.attn``)."""
    spec: LayerSpec
    layout: KVCacheLayout | None
    """The cache it reads; None for a layer whose K/V come with the call (``forward_ragged``:
    vLLM's encoder-only layers)."""
    dtype: torch.dtype | None = None
    """q's dtype, for a layer without a cache (``layout`` None); a cache layout carries it."""


def ragged_reasons(
    backend: Backend,
    layer: LayerSpec,
    device: torch.device | str | None,
    dtype: torch.dtype | None = None,
) -> list[Reason]:
    """Why ``backend`` cannot run ``layer`` through ``forward_ragged`` on ``device`` (q in
    ``dtype``): its refusals of that call (``Feature.RAGGED``: no ragged attention, dims its
    ragged kernel lacks, ...), environment first; [] when it can."""
    return list(
        backend.unsupported_reasons(layer, None, device, uses=(Feature.RAGGED,), dtype=dtype)
    )


def declare_model(
    backend: Backend,
    layers: Iterable[ModelLayer],
    device: torch.device | str | None,
    what: str,
    *,
    refused: Iterable[Reason] = (),
) -> None:
    """Declare a model's attention layers to ``backend`` once, before its first step.

    The layers over a cache go to ``Backend.prepare``, once per KV layout with each distinct
    layer shape (the backend then plans every shape from the first step on); the layers
    without a cache are checked for ``forward_ragged``. A model the backend cannot serve
    raises one ``UnsupportedConfigError`` (``what`` names the drop-in) with every reason of
    every layer, each field naming the engine's layers of that shape (``layers[3].softcap``;
    an environment reason, about no layer, comes once), before any layer is prepared.
    ``refused``: the reasons of layers the adapter could not map itself, raised with the rest.
    """
    groups: dict[KVCacheLayout | None, dict[tuple[LayerSpec, torch.dtype | None], list[str]]] = {}
    for layer in layers:
        key = (layer.spec, layer.dtype if layer.layout is None else None)
        groups.setdefault(layer.layout, {}).setdefault(key, []).append(layer.name)
    failed = list(refused)
    for layout, shapes in groups.items():
        for (spec, dtype), names in shapes.items():
            if layout is None:
                reasons = ragged_reasons(backend, spec, device, dtype)
            else:
                reasons = backend.unsupported_reasons(spec, layout, device)
            failed += [_named(r, _label(names)) for r in reasons]
    if failed:
        raise UnsupportedConfigError(
            f"{what}: the {backend.name} backend cannot serve this model:", sorted(set(failed))
        )
    for layout, shapes in groups.items():
        if layout is not None:
            backend.prepare([spec for spec, _ in shapes], layout, device)


def _named(reason: Reason, label: str) -> Reason:
    """``reason`` about the layers ``label`` names; an environment reason is about no layer
    (said once, not per shape)."""
    if reason.kind is ReasonKind.ENVIRONMENT:
        return reason
    return Reason(reason.kind, f"{label}.{reason.field}", reason.message)


def _label(names: list[str]) -> str:
    """The engine's names of the layers of one shape: all of them up to four, else the first
    two, the last and the count."""
    if len(names) <= 4:
        return ", ".join(names)
    return f"{names[0]}, {names[1]}, ..., {names[-1]} ({len(names)} layers)"
