"""Drop-in vLLM v1 attention backend classes that delegate to any attnsdk backend.

``AttnSDKAttentionBackend`` (vLLM's ``AttentionBackend``), ``AttnSDKMetadataBuilder``
(``AttentionMetadataBuilder``) and ``AttnSDKAttentionImpl`` (``AttentionImpl``) carry vLLM's
method names and signatures. They are built on first use (``vllm_classes``): when vLLM is
installed each subclasses vLLM's own base class, so members a vLLM release adds keep vLLM's
default; without vLLM they stand alone (unit tests with the mocks). Pick the attnsdk backend
with a subclass::

    class FA3Backend(AttnSDKAttentionBackend):
        attnsdk_backend = "fa3"          # a name, an AttentionConfig or a Backend instance

None (the default) reads the environment (``AttentionConfig.from_env``: ``ATTNSDK_CONFIG``,
``ATTNSDK_BACKEND``, ``[tool.attnsdk]`` in pyproject.toml), else picks "auto".
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from attnsdk.adapters._common import AttnKind, EngineVersions, drop_in_class, resolve_backend
from attnsdk.adapters.vllm._adapter import VLLMAdapter, vllm_attn_kind
from attnsdk.adapters.vllm._builder import (
    AttnSDKMetadataBuilderBase,
)
from attnsdk.adapters.vllm._impl import AttnSDKAttentionImplBase
from attnsdk.adapters.vllm._layout import compute_dtype_by_name, fp8_storage_dtype
from attnsdk.adapters.vllm._resolve import BackendSpec, bind, vllm_symbol
from attnsdk.contract.capabilities import Feature, GraphSupport
from attnsdk.contract.errors import AttnSDKError
from attnsdk.contract.kv import KVCacheLayout

if TYPE_CHECKING:
    from attnsdk.contract.backend import Backend

__all__ = ["VLLM_VERSIONS", "AttnSDKAttentionBackendBase", "vllm_classes"]

VLLM_VERSIONS = EngineVersions("vllm", ("0.33.0", "0.34.0"))
"""The vLLM releases the engine tier (``make test-engines``) runs the drop-in in."""

_VLLM_BACKEND_MODULE = "vllm.v1.attention.backend"


class AttnSDKAttentionBackendBase:
    """vLLM's ``AttentionBackend``: names the impl and builder and says what is supported.

    Use it as ``attnsdk.adapters.vllm.AttnSDKAttentionBackend`` (vLLM's base mixed in). vLLM
    0.29+ hands every layer a ``[num_blocks, Hkv, block_size, 2 * head_size]`` view (K‖V) in
    any of its physical layouts; the impl reads it as it is.
    """

    attnsdk_backend: ClassVar[BackendSpec] = None
    impl_cls: ClassVar[type]
    """The impl class (set when the public classes are built)."""
    builder_cls: ClassVar[type]
    """The builder class (set when the public classes are built)."""

    forward_includes_kv_cache_update: ClassVar[bool] = True
    """forward writes K/V through the attnsdk backend's own store (sync-free on the GPU)."""
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[str]] = [
        "auto",
        "float16",
        "bfloat16",
        "fp8",
        "fp8_e4m3",
        "fp8_e5m2",
    ]

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @classmethod
    def get_impl_cls(cls) -> type:
        return bind(cls.impl_cls, cls.attnsdk_backend)

    @classmethod
    def get_builder_cls(cls) -> type:
        return bind(cls.builder_cls, cls.attnsdk_backend)

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[Any, ...] | None:
        """None: any of vLLM's physical layouts (the impl reads any strides)."""
        return None

    @classmethod
    def get_supported_kernel_block_sizes(cls, kv_cache_spec: Any = None) -> list[Any]:
        return kernel_block_sizes(_backend(cls))

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return []  # any head size the backend declares; validate_configuration checks it

    @classmethod
    def full_cls_name(cls) -> tuple[str, str]:
        return (cls.__module__, cls.__qualname__)

    @classmethod
    def supports_head_size(cls, head_size: int) -> bool:
        caps = _backend(cls).capabilities
        return head_size <= caps.max_head_dim and head_size % caps.head_dim_multiple == 0

    @classmethod
    def supports_dtype(cls, dtype: torch.dtype) -> bool:
        return dtype in _backend(cls).capabilities.dtypes

    @classmethod
    def supports_kv_cache_dtype(cls, kv_cache_dtype: str | None) -> bool:
        if kv_cache_dtype is None or kv_cache_dtype not in cls.supported_kv_cache_dtypes:
            return kv_cache_dtype is None
        fp8 = fp8_storage_dtype(kv_cache_dtype)
        return fp8 is None or fp8 in _backend(cls).capabilities.kv_dtypes

    @classmethod
    def supports_block_size(cls, block_size: int | None) -> bool:
        caps = _backend(cls).capabilities
        return block_size is None or (
            block_size >= caps.min_page_size and block_size % caps.page_size_multiple == 0
        )

    @classmethod
    def get_preferred_block_size(cls, default_block_size: int) -> int:
        caps = _backend(cls).capabilities
        if cls.supports_block_size(default_block_size):
            return default_block_size
        m = caps.page_size_multiple
        return max(m, -(-caps.min_page_size // m) * m)

    @classmethod
    def supports_sink(cls) -> bool:
        return Feature.SINKS in _backend(cls).capabilities.features

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return Feature.SLIDING_WINDOW in _backend(cls).capabilities.features

    @classmethod
    def supports_non_causal(cls) -> bool:
        return Feature.NON_CAUSAL in _backend(cls).capabilities.features

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        kind = vllm_attn_kind(attn_type)
        if kind is AttnKind.CROSS:
            return Feature.CROSS_ATTENTION in _backend(cls).capabilities.features
        return kind is not None and (kind.causal or cls.supports_non_causal())

    @classmethod
    def supports_per_head_quant_scales(cls) -> bool:
        return True  # attnsdk takes () / (1,) / (Hkv,) k_scale and v_scale

    @classmethod
    def supports_compute_capability(cls, capability: Any) -> bool:
        return serves_compute_capability(_backend(cls), capability)

    @classmethod
    def is_mla(cls) -> bool:
        return False

    @classmethod
    def is_sparse(cls) -> bool:
        return False

    @classmethod
    def is_ssm(cls) -> bool:
        return False

    @classmethod
    def supports_mm_prefix(cls) -> bool:
        return False

    @classmethod
    def supports_alibi_sqrt(cls) -> bool:
        return False

    @classmethod
    def supports_rswa(cls) -> bool:
        return False

    @classmethod
    def supports_batch_invariance(cls) -> bool:
        return False

    @classmethod
    def supports_device_cpu_query_lens_mismatch(cls) -> bool:
        """False: attnsdk plans from the host query lengths (adaptive verification trims
        drafts on the device only)."""
        return False

    @classmethod
    def supports_kv_connector(cls) -> bool:
        return True  # the cache is vLLM's own tensor in vLLM's own layout

    @classmethod
    def validate_configuration(
        cls,
        head_size: int,
        dtype: torch.dtype,
        kv_cache_dtype: str | None,
        block_size: int | None,
        use_mla: bool = False,
        has_sink: bool = False,
        use_sparse: bool = False,
        use_mm_prefix: bool = False,
        use_per_head_quant_scales: bool = False,
        device_capability: Any = None,
        attn_type: str = "decoder",
        has_sliding_window: bool = False,
        use_non_causal: bool = False,
        use_batch_invariant: bool = False,
        use_kv_connector: bool = False,
        use_pcp: bool = False,
        use_adaptive_verification: bool = False,
        use_dcp: bool = False,
        use_rswa: bool = False,
        **newer_options: object,
    ) -> list[str]:
        """Every reason this backend cannot serve the configuration, as vLLM wants them: strings.

        The attnsdk backend's own reasons come first (environment, then configuration), then
        what the adapter does not map. A flag a newer vLLM adds is refused while it is set:
        attnsdk cannot vouch for a feature it has not seen.
        """
        reasons: list[str] = []
        kind = getattr(attn_type, "value", attn_type)
        try:
            backend = _backend(cls)
            layer = VLLMAdapter().layer_spec(
                1,
                head_size,
                head_size**-0.5,
                1,
                sliding_window=2 if has_sliding_window else None,
                attn_type=kind,
                has_sinks=has_sink,
                causal=not use_non_causal,
            )
            layout = KVCacheLayout(
                num_kv_heads=1,
                head_dim=head_size,
                page_size=block_size or max(1, backend.capabilities.min_page_size),
                dtype=dtype,
                kv_dtype=fp8_storage_dtype(kv_cache_dtype)
                if cls.supports_kv_cache_dtype(kv_cache_dtype)
                else None,
            )
            device = "cuda" if device_capability is not None else None
            reasons += [str(r) for r in backend.unsupported_reasons(layer, layout, device)]
        except AttnSDKError as exc:  # no backend here, or a dtype attnsdk has no layout for
            reasons.append(str(exc))
        compute = compute_dtype_by_name(kv_cache_dtype)
        checks = {
            "MLA layers are served by attnsdk.adapters.vllm.AttnSDKMLABackend (vLLM's "
            "MLACommonBackend), not by this drop-in": use_mla,
            "sparse attention not supported": use_sparse,
            "partial multimodal token full attention not supported": use_mm_prefix,
            "batch invariance not supported": use_batch_invariant,
            "PCP not supported": use_pcp,
            "DCP not supported": use_dcp,
            "R-SWA not supported": use_rswa,
            "device-cpu query lens mismatch not supported, this is needed for adaptive "
            "verification": use_adaptive_verification,
            f"attention type {kind} not supported": vllm_attn_kind(kind) is None,
            f"kv_cache_dtype {kv_cache_dtype!r} not supported": kv_cache_dtype is not None
            and kv_cache_dtype not in cls.supported_kv_cache_dtypes,
            f"kv_cache_dtype {kv_cache_dtype!r} with a {dtype} model: attnsdk stores K/V in "
            "the model dtype or fp8": compute is not None and compute != dtype,
        }
        reasons += [reason for reason, failed in checks.items() if failed]
        reasons += [
            f"{name}={value!r} is not checked by attnsdk (a newer vLLM option)"
            for name, value in newer_options.items()
            if value not in (None, False, 0)
        ]
        return reasons

    @classmethod
    def graph_support(cls) -> GraphSupport:
        """The attnsdk backend's own CUDA-graph level (the builder reports NEVER; see its doc)."""
        return _backend(cls).capabilities.graph_support


def _backend(cls: type[AttnSDKAttentionBackendBase]) -> Backend:
    return resolve_backend(cls.attnsdk_backend)


# What both drop-ins (this one and the MLA one, _mla.py) tell vLLM from the attnsdk backend.


def kernel_block_sizes(backend: Backend) -> list[Any]:
    """vLLM's block sizes for ``backend``: multiples of its page-size multiple."""
    multiple_of = vllm_symbol("MultipleOf")
    base = backend.capabilities.page_size_multiple
    return [multiple_of(base)] if multiple_of is not None else [base]


def serves_compute_capability(backend: Backend, capability: Any) -> bool:
    """Whether ``capability`` (vLLM's ``DeviceCapability``) is in ``backend``'s range."""
    caps = backend.capabilities
    cc = (capability.major, capability.minor)
    low, high = caps.min_compute_capability, caps.max_compute_capability
    return (low is None or cc >= low) and (high is None or cc <= high)


@functools.cache
def vllm_classes() -> tuple[type, type, type]:
    """The public (backend, builder, impl) classes, built on first use with vLLM's base classes
    mixed in when vLLM is installed (and its version checked)."""
    VLLM_VERSIONS.check()
    module = "attnsdk.adapters.vllm"
    impl = drop_in_class(
        AttnSDKAttentionImplBase,
        "AttnSDKAttentionImpl",
        module,
        (_VLLM_BACKEND_MODULE, "AttentionImpl"),
    )
    builder = drop_in_class(
        AttnSDKMetadataBuilderBase,
        "AttnSDKMetadataBuilder",
        module,
        (_VLLM_BACKEND_MODULE, "AttentionMetadataBuilder"),
    )
    backend = drop_in_class(
        AttnSDKAttentionBackendBase,
        "AttnSDKAttentionBackend",
        module,
        (_VLLM_BACKEND_MODULE, "AttentionBackend"),
        impl_cls=impl,
        builder_cls=builder,
    )
    return backend, builder, impl
