"""vLLM adapter: ``CommonAttentionMetadata`` and KV tensors → attnsdk, plus a drop-in backend.

``VLLMAdapter`` converts (subclass it for a fork); ``AttnSDKAttentionBackend`` plugs any attnsdk
backend into vLLM v1 (with ``AttnSDKMetadataBuilder`` and ``AttnSDKAttentionImpl``);
``register()`` adds it to vLLM's registry; ``AttnSDKMLABackend`` runs MLA layers' decode on an
attnsdk backend inside vLLM's MLA machinery and ``AttnSDKMLAPrefillBackend`` their expanded
prefill (``register_mla_prefill()``; both need vLLM); test doubles live in
``attnsdk.adapters.vllm.testing``.
vLLM is imported only when a drop-in class is first used (to subclass vLLM's base classes, if
vLLM is installed) and by ``register()``.
"""

from typing import TYPE_CHECKING, Any

from attnsdk.adapters.vllm._adapter import VLLMAdapter
from attnsdk.adapters.vllm._backend import VLLM_VERSIONS
from attnsdk.adapters.vllm._builder import VLLMAttentionMetadata, VLLMCudaGraphSupport
from attnsdk.adapters.vllm._layout import VLLMKVLayout, detect_kv_layout
from attnsdk.adapters.vllm._resolve import BackendSpec, register, register_mla_prefill

if TYPE_CHECKING:
    from attnsdk.adapters.vllm._backend import (
        AttnSDKAttentionBackendBase as AttnSDKAttentionBackend,
    )
    from attnsdk.adapters.vllm._builder import (
        AttnSDKMetadataBuilderBase as AttnSDKMetadataBuilder,
    )
    from attnsdk.adapters.vllm._impl import AttnSDKAttentionImplBase as AttnSDKAttentionImpl
    from attnsdk.adapters.vllm._mla import AttnSDKMLABackendBase as AttnSDKMLABackend
    from attnsdk.adapters.vllm._mla import AttnSDKMLAImplBase as AttnSDKMLAImpl
    from attnsdk.adapters.vllm._mla import (
        AttnSDKMLAMetadataBuilderBase as AttnSDKMLAMetadataBuilder,
    )
    from attnsdk.adapters.vllm._mla_prefill import (
        AttnSDKMLAPrefillBackendBase as AttnSDKMLAPrefillBackend,
    )

__all__ = [
    "VLLM_VERSIONS",
    "AttnSDKAttentionBackend",
    "AttnSDKAttentionImpl",
    "AttnSDKMLABackend",
    "AttnSDKMLAImpl",
    "AttnSDKMLAMetadataBuilder",
    "AttnSDKMLAPrefillBackend",
    "AttnSDKMetadataBuilder",
    "BackendSpec",
    "VLLMAdapter",
    "VLLMAttentionMetadata",
    "VLLMCudaGraphSupport",
    "VLLMKVLayout",
    "detect_kv_layout",
    "register",
    "register_mla_prefill",
]

_DROP_INS = {"AttnSDKAttentionBackend": 0, "AttnSDKMetadataBuilder": 1, "AttnSDKAttentionImpl": 2}
_MLA_DROP_INS = {"AttnSDKMLABackend": 0, "AttnSDKMLAMetadataBuilder": 1, "AttnSDKMLAImpl": 2}


def __getattr__(name: str) -> Any:
    if name in _DROP_INS:
        from attnsdk.adapters.vllm._backend import vllm_classes

        return vllm_classes()[_DROP_INS[name]]
    if name in _MLA_DROP_INS:
        from attnsdk.adapters.vllm._mla import vllm_mla_classes

        return vllm_mla_classes()[_MLA_DROP_INS[name]]
    if name == "AttnSDKMLAPrefillBackend":
        from attnsdk.adapters.vllm._mla_prefill import vllm_mla_prefill_class

        return vllm_mla_prefill_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
