"""Creating and choosing backends: ``create_backend``, ``explain`` and "auto".

An explicit backend that cannot run (or serve the model) raises with every reason; "auto" walks
the registry by priority, skips what cannot run here or serve every layer, and logs its choice
once. Nothing here registers anything (``_registry``).
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

import torch

from attnsdk.contract.backend import BackendClass, missing_members
from attnsdk.contract.capabilities import Request
from attnsdk.contract.errors import (
    AttnSDKError,
    BackendUnavailableError,
    InvalidInputError,
    Reason,
    ReasonKind,
    UnsupportedConfigError,
)
from attnsdk.selection.debug import debug_enabled, wrap_debug
from attnsdk.selection.registry import AUTO, _entries, _Entry, canonical_name, lookup

if TYPE_CHECKING:
    from collections.abc import Iterable

    from pydantic import BaseModel

    from attnsdk.contract.backend import Backend
    from attnsdk.contract.capabilities import Feature
    from attnsdk.contract.kv import KVCacheLayout
    from attnsdk.contract.layer import LayerSpec
    from attnsdk.selection.config import AttentionConfig

__all__ = ["create_backend", "explain"]

logger = logging.getLogger("attnsdk")

_LOCK = threading.Lock()
_LOGGED_AUTO: set[str] = set()
"""Backends "auto" has announced (once each)."""


def create_backend(
    config: AttentionConfig | str | None = None,
    *,
    device: torch.device | str | None = None,
    layers: Iterable[LayerSpec] | None = None,
    layout: KVCacheLayout | None = None,
) -> Backend:
    """Create a backend from a name, an ``AttentionConfig`` or (None) the environment.

    None reads the environment (``AttentionConfig.from_env``: ``ATTNSDK_CONFIG``, a file, then
    ``ATTNSDK_BACKEND``, a name, then ``[tool.attnsdk]`` in pyproject.toml, else ``"auto"``).
    Names are matched ignoring case when no registered name matches exactly.
    ``"auto"`` creates the highest-priority backend that can run here and logs its choice once;
    an explicit backend that cannot run raises ``UnsupportedConfigError`` with every reason.

    Given the model (``layers``, one ``LayerSpec`` per attention layer, and the cache
    ``layout``), ``"auto"`` picks the highest-priority backend that serves every layer (a model
    with softcap skips a backend without it), and the backend is ``prepare``-d for the model;
    an explicit backend that cannot serve a layer raises with every reason, naming the layer.

    >>> create_backend("reference").name
    'reference'
    """
    from attnsdk.contract.checks import check_device
    from attnsdk.selection.config import AttentionConfig

    if device is not None:
        device = check_device("device", device)
    model = _check_model(layers, layout)
    entry: _Entry | None = None
    if config is None:
        config = AttentionConfig.from_env()
    elif isinstance(config, str):
        if canonical_name(config) != AUTO:
            # Asked before the config resolves the options model (a plugin's may not load).
            entry = lookup(config)
            _check_can_run(entry, device)
            config = AttentionConfig(backend=entry.name)
        else:
            config = AttentionConfig()
    elif not isinstance(config, AttentionConfig):
        raise InvalidInputError(
            "config", "a backend name, an AttentionConfig or None", repr(config)
        )
    if config.backend == AUTO:
        backend = _create_auto(config, device, model)
    else:
        if entry is None:
            entry = lookup(config.backend)
            _check_can_run(entry, device)
        backend = _create(entry, config.options)
    if model is not None:
        backend.prepare(model[0], model[1], device)
    return wrap_debug(backend) if debug_enabled(config) else backend


def _check_model(
    layers: Iterable[LayerSpec] | None, layout: KVCacheLayout | None
) -> tuple[list[LayerSpec], KVCacheLayout] | None:
    from attnsdk.contract.kv import KVCacheLayout
    from attnsdk.contract.layer import LayerSpec

    if layers is None and layout is None:
        return None
    if layers is None or layout is None:
        given, missing = ("layers", "layout") if layout is None else ("layout", "layers")
        raise InvalidInputError(missing, f"given together with {given}", None)
    if not isinstance(layout, KVCacheLayout):
        raise InvalidInputError("layout", "a KVCacheLayout", type(layout).__name__)
    if isinstance(layers, LayerSpec):
        layers = [layers]
    listed = list(layers)
    for i, layer in enumerate(listed):
        if not isinstance(layer, LayerSpec):
            raise InvalidInputError(f"layers[{i}]", "a LayerSpec", type(layer).__name__)
    return listed, layout


def _model_reasons(
    entry: _Entry,
    model: tuple[list[LayerSpec], KVCacheLayout],
    device: torch.device | str | None,
) -> list[Reason]:
    """Why ``entry`` cannot serve the model: each distinct layer's reasons, naming the layer."""
    layers, layout = model
    found: list[Reason] = []
    seen: dict[LayerSpec, int] = {}
    for i, layer in enumerate(layers):
        if layer in seen:
            continue
        seen[layer] = i
        found += [
            Reason(r.kind, f"layers[{i}].{r.field}", r.message)
            for r in _reasons(entry, Request(layer, layout, _as_device(device)))
        ]
    return sorted(set(found))


def _create(entry: _Entry, options: BaseModel) -> Backend:
    """Call the factory; anything but a Backend, or an unexpected exception, is an AttnSDKError."""
    try:
        backend = entry.factory()(options)
    except AttnSDKError:
        raise
    except Exception as exc:
        raise UnsupportedConfigError(
            f"backend {entry.name!r} failed to start:",
            [Reason(ReasonKind.ENVIRONMENT, "create", f"{type(exc).__name__}: {exc}")],
        ) from exc
    missing = missing_members(backend)
    if missing:
        raise UnsupportedConfigError(
            f"backend {entry.name!r}: its factory returned {type(backend).__name__}, not an "
            f"attnsdk.Backend: it lacks {', '.join(missing)} (subclass attnsdk.BackendBase, "
            "which has every member)",
            [Reason(ReasonKind.CONFIGURATION, "factory", f"lacks {', '.join(missing)}")],
        )
    return backend


def _as_device(device: torch.device | str | None) -> torch.device | None:
    return None if device is None else torch.device(device)


def _check_can_run(entry: _Entry, device: torch.device | str | None) -> None:
    reasons = entry.environment_reasons(device)
    if reasons:
        raise UnsupportedConfigError(f"backend {entry.name!r} cannot run here:", reasons)


def explain(
    config: AttentionConfig | str,
    layer: LayerSpec | None = None,
    layout: KVCacheLayout | None = None,
    device: torch.device | str | None = None,
    *,
    uses: Iterable[Feature] = (),
) -> dict[str, list[Reason]]:
    """Every reason each candidate backend cannot serve ``layer`` / ``layout`` on ``device``
    with the step features ``uses`` (``Feature.LSE``, ``RAGGED``, ``TREE_MASK``,
    ``CROSS_ATTENTION``).

    For ``"auto"`` the backends it may pick are listed in the order it tries them (every
    registered backend by priority, or ``AutoOptions.candidates``); otherwise only the configured
    one. An empty list means the backend can serve the request.

    >>> from attnsdk import LayerSpec
    >>> explain("reference", LayerSpec(num_heads=8, num_kv_heads=2, head_dim=64))
    {'reference': []}
    """
    from attnsdk.contract.checks import check_device
    from attnsdk.contract.kv import KVCacheLayout
    from attnsdk.contract.layer import LayerSpec
    from attnsdk.selection.config import AttentionConfig

    if not isinstance(config, (str, AttentionConfig)):
        raise InvalidInputError("config", "a backend name or an AttentionConfig", repr(config))
    for field, value, kind in (("layer", layer, LayerSpec), ("layout", layout, KVCacheLayout)):
        if value is not None and not isinstance(value, kind):
            raise InvalidInputError(field, f"None or a {kind.__name__}", repr(value))
    dev = check_device("device", device) if device is not None else None
    name = canonical_name(config if isinstance(config, str) else config.backend)
    if name != AUTO:
        entries = [lookup(name)]
    else:
        entries = _auto_entries(
            config if isinstance(config, AttentionConfig) else AttentionConfig()
        )
    # An explicit config's options count (flex compiled or not, flashinfer's decode kernel);
    # "auto" creates its candidates with their default options.
    options = config.options if isinstance(config, AttentionConfig) and name != AUTO else None
    request = Request(layer, layout, dev, options, frozenset(uses))
    return {e.name: _reasons(e, request) for e in entries}


def _reasons(entry: _Entry, request: Request) -> list[Reason]:
    """Why ``entry`` cannot serve ``request`` (its ``options``: the configured ones, None for
    the defaults, which is what "auto" creates)."""
    env = entry.environment_reasons(request.device)
    if any(r.field == "import" for r in env):
        return env
    factory = entry.factory()
    # A backend class answers without being created (its refusals: FA3 adds its build's,
    # flex and flashinfer those of their options).
    if isinstance(factory, BackendClass):
        return sorted(set(env) | set(factory.refusals(request)))
    if env:
        return env
    try:
        backend = _create(entry, request.options or entry.options_model()())
    except BackendUnavailableError as exc:
        return [Reason(ReasonKind.ENVIRONMENT, "install", str(exc))]
    r = request
    return backend.unsupported_reasons(r.layer, r.layout, r.device, uses=r.uses, dtype=r.dtype)


def _create_auto(
    config: AttentionConfig,
    device: torch.device | str | None,
    model: tuple[list[LayerSpec], KVCacheLayout] | None = None,
) -> Backend:
    skipped: dict[str, list[Reason]] = {}
    for entry in _auto_entries(config):
        reasons = entry.environment_reasons(device)
        if not reasons and model is not None:
            reasons = _model_reasons(entry, model, device)
        if reasons:
            skipped[entry.name] = reasons
            continue
        try:
            backend = _create(entry, entry.options_model()())
        except (AttnSDKError, ImportError) as exc:
            # Its environment looked fine but creating it failed (e.g. an unusable kernel build):
            # that is one more backend "auto" cannot use, reported with the others.
            skipped[entry.name] = [Reason(ReasonKind.ENVIRONMENT, "create", str(exc))]
            continue
        with _LOCK:
            first = entry.name not in _LOGGED_AUTO
            _LOGGED_AUTO.add(entry.name)
        if first:
            why = "; ".join(f"{n}: {r[0]}" for n, r in skipped.items())
            logger.info(
                "attnsdk auto backend: %s%s", entry.name, f" (skipped {why})" if why else ""
            )
        return backend
    flat = [Reason(r.kind, f"{n}.{r.field}", r.message) for n, rs in skipped.items() for r in rs]
    what = "serve this model" if model is not None else "run here"
    raise UnsupportedConfigError(
        f"no attention backend can {what}: " + ", ".join(f"{n}" for n in skipped), flat
    )


def _auto_entries(config: AttentionConfig) -> list[_Entry]:
    """The backends "auto" tries, in order: ``AutoOptions.candidates``, else all by priority
    but composites (``routed``), which are asked for by name."""
    candidates = getattr(config.options, "candidates", None)
    if candidates:
        return [lookup(n) for n in candidates]
    return [e for e in _entries() if e.auto]
