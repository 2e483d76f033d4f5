"""vLLM adapter: ``CommonAttentionMetadata`` and KV tensors → attnsdk, plus a drop-in backend.

``VLLMAdapter`` converts (subclass it for a fork); ``AttnSDKAttentionBackend`` plugs any attnsdk
backend into vLLM v1; ``register()`` adds it to vLLM's registry; test doubles live in
``attnsdk.adapters.vllm.testing``. vLLM itself is never imported, except by ``register()``.
"""

from attnsdk.adapters.vllm._adapter import ENCODER_ONLY, VLLMAdapter
from attnsdk.adapters.vllm._backend import (
    AttnSDKAttentionBackend,
    AttnSDKMetadataBuilder,
    VLLMAttentionMetadata,
    VLLMCudaGraphSupport,
)
from attnsdk.adapters.vllm._impl import AttnSDKAttentionImpl
from attnsdk.adapters.vllm._layout import VLLMKVLayout, detect_kv_layout
from attnsdk.adapters.vllm._resolve import BackendSpec, register

__all__ = [
    "ENCODER_ONLY",
    "AttnSDKAttentionBackend",
    "AttnSDKAttentionImpl",
    "AttnSDKMetadataBuilder",
    "BackendSpec",
    "VLLMAdapter",
    "VLLMAttentionMetadata",
    "VLLMCudaGraphSupport",
    "VLLMKVLayout",
    "detect_kv_layout",
    "register",
]
