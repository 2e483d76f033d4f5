"""Which attnsdk backend a drop-in class delegates to, vLLM's own symbols, and ``register()``."""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import threading
from typing import TYPE_CHECKING, Any, TypeVar

from attnsdk import AttentionConfig, Backend, BackendUnavailableError, create_backend

if TYPE_CHECKING:
    from typing import TypeAlias

__all__ = ["BackendSpec", "bind", "register", "resolve_backend", "vllm_symbol"]

BackendSpec: TypeAlias = str | AttentionConfig | Backend | None
"""A backend name, an ``AttentionConfig``, a ready instance, or None (``ATTNSDK_CONFIG`` /
``ATTNSDK_BACKEND`` from the environment, else ``"auto"``)."""

_T = TypeVar("_T", bound=type)
_LOCK = threading.Lock()
_BACKENDS: dict[object, Backend] = {}
_BOUND: dict[tuple[type, object, object], type] = {}


def _key(spec: BackendSpec) -> object:
    if spec is None:
        # The environment decides, so it is part of the identity of the backend it gave.
        return ("env", os.environ.get("ATTNSDK_CONFIG"), os.environ.get("ATTNSDK_BACKEND"))
    if isinstance(spec, str):
        return ("name", spec)
    if isinstance(spec, AttentionConfig):
        return ("config", spec.model_dump_json())
    return ("instance", id(spec))


def resolve_backend(spec: BackendSpec) -> Backend:
    """The attnsdk backend for ``spec``, created once and shared by the builder and every layer.

    Sharing matters: a plan is made by the builder's backend and consumed by each layer's.
    """
    if spec is not None and not isinstance(spec, (str, AttentionConfig)):
        return spec
    key = _key(spec)
    with _LOCK:
        backend = _BACKENDS.get(key)
    if backend is None:
        backend = create_backend(spec)
        with _LOCK:
            backend = _BACKENDS.setdefault(key, backend)
    return backend


def bind(base: _T, spec: BackendSpec, **attrs: object) -> _T:
    """``base`` itself, or a subclass of it carrying ``attnsdk_backend = spec`` and ``attrs``.

    vLLM asks the backend class for its builder and impl classes; binding lets a one-line
    subclass of the backend class (``attnsdk_backend = "fa3"``) configure all three.
    """
    if spec is getattr(base, "attnsdk_backend", None) and all(
        getattr(base, k, None) == v for k, v in attrs.items()
    ):
        return base
    key = (base, _key(spec), tuple(sorted(attrs.items(), key=lambda kv: kv[0])))
    with _LOCK:
        bound = _BOUND.get(key)
        if bound is None:
            namespace = {"attnsdk_backend": spec, "__module__": base.__module__, **attrs}
            bound = type(base.__name__, (base,), namespace)
            bound.__qualname__ = base.__qualname__
            _BOUND[key] = bound
    return bound  # type: ignore[return-value]


_VLLM_MODULES = (
    "vllm.v1.attention.backend",
    "vllm.v1.attention.backends.utils",
    "vllm.attention.backends.abstract",
)


def vllm_symbol(name: str) -> Any:
    """vLLM's ``name`` (e.g. ``AttentionCGSupport``) if vLLM has already loaded it, else None.

    Never imports vLLM: when vLLM calls the drop-in classes its modules are loaded, and its
    code compares against its own enum / class objects, so those must be returned then.
    """
    for module_name in _VLLM_MODULES:
        module = sys.modules.get(module_name)
        if module is not None and hasattr(module, name):
            return getattr(module, name)
    return None


_REGISTRY_MODULES = ("vllm.v1.attention.backends.registry", "vllm.attention.backends.registry")


def register(
    class_path: str = "attnsdk.adapters.vllm.AttnSDKAttentionBackend", slot: str = "CUSTOM"
) -> Any:
    """Register the drop-in backend with vLLM's backend registry; returns the enum member.

    Select it with ``--attention-backend CUSTOM`` (or ``VLLM_ATTENTION_BACKEND=CUSTOM``).
    ``class_path`` may name a subclass that sets ``attnsdk_backend``. vLLM's worker processes
    need it too: call this from a ``vllm.general_plugins`` entry point (docs/adapters/vllm.md).
    """
    if importlib.util.find_spec("vllm") is None:
        raise BackendUnavailableError(
            "register() needs vLLM, which is not installed.", "pip install vllm"
        )
    for module_name in _REGISTRY_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        enum_cls = getattr(module, "AttentionBackendEnum", None)
        register_backend = getattr(module, "register_backend", None)
        if enum_cls is not None and register_backend is not None:
            member = enum_cls[slot]
            register_backend(member, class_path)
            return member
    raise BackendUnavailableError(
        "this vLLM has no AttentionBackendEnum / register_backend registry "
        f"(looked in {', '.join(_REGISTRY_MODULES)}).",
        "pip install -U vllm",
    )
