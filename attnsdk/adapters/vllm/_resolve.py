"""vLLM's own symbols, ``bind`` (a drop-in class per attnsdk backend) and ``register()``."""

from __future__ import annotations

import importlib
import importlib.util
import sys
import threading
from typing import Any, TypeVar

from attnsdk.adapters._common import BackendSpec, backend_key
from attnsdk.contract.errors import BackendUnavailableError

__all__ = ["BackendSpec", "bind", "register", "register_mla_prefill", "vllm_symbol"]

_T = TypeVar("_T", bound=type)
_LOCK = threading.Lock()
_BOUND: dict[tuple[type, object], type] = {}


def bind(base: _T, spec: BackendSpec) -> _T:
    """``base`` itself, or a subclass of it carrying ``attnsdk_backend = spec``.

    vLLM asks the backend class for its builder and impl classes; binding lets a one-line
    subclass of the backend class (``attnsdk_backend = "fa3"``) configure all three.
    """
    if spec is getattr(base, "attnsdk_backend", None):
        return base
    key = (base, backend_key(spec))
    with _LOCK:
        bound = _BOUND.get(key)
        if bound is None:
            namespace = {"attnsdk_backend": spec, "__module__": base.__module__}
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

    Select it with ``--attention-backend CUSTOM`` (``AttentionConfig(backend="CUSTOM")``).
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


_MLA_PREFILL_REGISTRY = "vllm.v1.attention.backends.mla.prefill.registry"


def register_mla_prefill(
    class_path: str = "attnsdk.adapters.vllm.AttnSDKMLAPrefillBackend", slot: str = "CUSTOM"
) -> Any:
    """Register the MLA prefill backend with vLLM's MLA prefill registry; returns the enum
    member.

    Select it with ``AttentionConfig(mla_prefill_backend="CUSTOM")`` (``slot``; a new name
    adds a member). ``class_path`` may name a subclass that sets ``attnsdk_backend``. As with
    ``register()``, vLLM's worker processes need it too: call it from a plugin entry point.
    """
    try:
        module = importlib.import_module(_MLA_PREFILL_REGISTRY)
    except ImportError as err:
        raise BackendUnavailableError(
            f"register_mla_prefill() needs vLLM's MLA prefill registry ({_MLA_PREFILL_REGISTRY}, "
            f"vLLM 0.33 or later), which is not importable here: {err}",
            "pip install 'vllm>=0.33'",
        ) from err
    enum_cls = module.MLAPrefillBackendEnum
    if slot in enum_cls.__members__:
        member = enum_cls[slot]
        module.register_mla_prefill_backend(member, class_path)
        return member
    module.register_mla_prefill_backend(slot, class_path)  # vLLM adds the member
    return enum_cls[slot]
