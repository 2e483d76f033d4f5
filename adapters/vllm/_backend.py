"""Drop-in vLLM v1 attention backend classes that delegate to any attnsdk backend.

``AttnSDKAttentionBackend`` (vLLM's ``AttentionBackend``), ``AttnSDKMetadataBuilder``
(``AttentionMetadataBuilder``) and ``AttnSDKAttentionImpl`` (``AttentionImpl``) carry vLLM's
method names and signatures without importing vLLM. Pick the attnsdk backend with a subclass::

    class FA3Backend(AttnSDKAttentionBackend):
        attnsdk_backend = "fa3"          # a name, an AttentionConfig or a Backend instance

None (the default) reads ``ATTNSDK_CONFIG`` / ``ATTNSDK_BACKEND``, else picks "auto".
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from attnsdk import (
    AttnSDKError,
    Feature,
    GraphSupport,
    KVCacheLayout,
)
from attnsdk.adapters.vllm._adapter import VLLMAdapter
from attnsdk.adapters.vllm._impl import AttnSDKAttentionImpl
from attnsdk.adapters.vllm._layout import VLLMKVLayout, fp8_storage_dtype
from attnsdk.adapters.vllm._resolve import BackendSpec, bind, resolve_backend, vllm_symbol

if TYPE_CHECKING:
    from attnsdk import AttentionMetadata, Backend, Plan

__all__ = [
    "AttnSDKAttentionBackend",
    "AttnSDKMetadataBuilder",
    "VLLMAttentionMetadata",
    "VLLMCudaGraphSupport",
]


class VLLMCudaGraphSupport(enum.IntEnum):
    """Stand-in for vLLM's ``AttentionCGSupport`` (same names and values) when vLLM is not loaded."""

    NEVER = 0
    UNIFORM_SINGLE_TOKEN_DECODE = 1
    UNIFORM_BATCH = 2
    ALWAYS = 3


@dataclass(frozen=True, slots=True)
class VLLMAttentionMetadata:
    """What ``AttnSDKMetadataBuilder.build`` returns and every layer's ``forward`` reads."""

    plan: Plan
    """The attnsdk plan of this step (``plan.metadata`` is the ``AttentionMetadata``)."""
    backend: Backend
    """The backend that made ``plan``; the layers run with it, so plan and kernel always match."""
    num_actual_tokens: int
    """Query rows that are real (vLLM's name); later rows of q and output are padding."""
    max_query_len: int
    max_seq_len: int
    causal: bool
    """The step's causal flag (False for non-causal / encoder-only batches)."""

    @property
    def metadata(self) -> AttentionMetadata:
        return self.plan.metadata

    # vLLM's FlashAttentionMetadata names, for engine code that peeks at a backend's metadata.

    @property
    def query_start_loc(self) -> torch.Tensor:
        return self.plan.metadata.query_start_loc

    @property
    def seq_lens(self) -> torch.Tensor:
        return self.plan.metadata.seq_lens

    @property
    def block_table(self) -> torch.Tensor:
        return self.plan.metadata.page_table

    @property
    def slot_mapping(self) -> torch.Tensor:
        return self.plan.metadata.slot_mapping


class AttnSDKMetadataBuilder:
    """vLLM's ``AttentionMetadataBuilder``: one ``CommonAttentionMetadata`` → one plan per step."""

    attnsdk_backend: ClassVar[BackendSpec] = None
    adapter: ClassVar[VLLMAdapter] = VLLMAdapter()
    """Subclass ``VLLMAdapter`` and set it here to read a fork's fields."""
    reorder_batch_threshold: ClassVar[int | None] = None
    """attnsdk backends take mixed batches in any order, so vLLM need not reorder them."""
    supports_update_block_table: ClassVar[bool] = True

    def __init__(
        self, kv_cache_spec: Any, layer_names: list[str], vllm_config: Any, device: torch.device
    ) -> None:
        self.kv_cache_spec = kv_cache_spec
        self.layer_names = layer_names
        self.vllm_config = vllm_config
        self.device = device
        self.backend = resolve_backend(self.attnsdk_backend)

    @classmethod
    def get_cudagraph_support(cls, vllm_config: Any = None, kv_cache_spec: Any = None) -> Any:
        """NEVER for full graphs: plans are per-step objects; piecewise graphs work (see docs)."""
        enum_cls = vllm_symbol("AttentionCGSupport")
        return VLLMCudaGraphSupport.NEVER if enum_cls is None else enum_cls.NEVER

    def build(
        self, common_prefix_len: int, common_attn_metadata: Any, fast_build: bool = False
    ) -> VLLMAttentionMetadata:
        """Plan the step. A common prefix is attended like any other context (no cascade)."""
        meta = self.adapter.build_metadata(common_attn_metadata)
        return VLLMAttentionMetadata(
            plan=self.backend.plan(meta),
            backend=self.backend,
            num_actual_tokens=int(common_attn_metadata.num_actual_tokens),
            max_query_len=meta.max_query_len,
            max_seq_len=meta.max_seq_len,
            causal=self.adapter.causal(common_attn_metadata),
        )

    def build_for_cudagraph_capture(self, common_attn_metadata: Any) -> VLLMAttentionMetadata:
        return self.build(0, common_attn_metadata)

    def build_for_drafting(
        self, common_attn_metadata: Any, draft_index: int
    ) -> VLLMAttentionMetadata:
        return self.build(0, common_attn_metadata, fast_build=True)

    def update_block_table(
        self, metadata: VLLMAttentionMetadata, blk_table: torch.Tensor, slot_mapping: torch.Tensor
    ) -> VLLMAttentionMetadata:
        """Same batch, another KV-cache group's block table and slots: re-plan, no rebuild."""
        old = metadata.metadata
        meta = dataclasses.replace(
            old,
            page_table=blk_table[: old.num_seqs].to(torch.int32),
            slot_mapping=slot_mapping[: metadata.num_actual_tokens].to(torch.int64),
        )
        return dataclasses.replace(metadata, plan=self.backend.plan(meta))

    def use_cascade_attention(self, *args: object, **kwargs: object) -> bool:
        return False


class AttnSDKAttentionBackend:
    """vLLM's ``AttentionBackend``: names the impl and builder, the KV shape and what is supported.

    ``kv_cache_layout`` picks the cache shape vLLM allocates (any of the three the adapter reads).
    """

    attnsdk_backend: ClassVar[BackendSpec] = None
    kv_cache_layout: ClassVar[VLLMKVLayout] = VLLMKVLayout.KV_BLOCKS
    impl_cls: ClassVar[type[AttnSDKAttentionImpl]] = AttnSDKAttentionImpl
    builder_cls: ClassVar[type[AttnSDKMetadataBuilder]] = AttnSDKMetadataBuilder

    accept_output_buffer: ClassVar[bool] = True
    forward_includes_kv_cache_update: ClassVar[bool] = True
    """forward writes K/V through the attnsdk backend's own store (sync-free on the GPU)."""
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[str]] = [
        "auto",
        "float16",
        "bfloat16",
        "float32",
        "fp8",
        "fp8_e4m3",
        "fp8_e5m2",
    ]

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @classmethod
    def get_impl_cls(cls) -> type[AttnSDKAttentionImpl]:
        return bind(
            cls.impl_cls,
            cls.attnsdk_backend,
            kv_cache_layout=cls.kv_cache_layout,
            forward_includes_kv_cache_update=cls.forward_includes_kv_cache_update,
        )

    @classmethod
    def get_builder_cls(cls) -> type[AttnSDKMetadataBuilder]:
        return bind(cls.builder_cls, cls.attnsdk_backend)

    @staticmethod
    def get_metadata_cls() -> type[VLLMAttentionMetadata]:
        return VLLMAttentionMetadata

    @classmethod
    def get_kv_cache_shape(
        cls,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        cache_dtype_str: str = "auto",
    ) -> tuple[int, ...]:
        n, p, h, d = num_blocks, block_size, num_kv_heads, head_size
        if cls.kv_cache_layout is VLLMKVLayout.KV_BLOCKS:
            return (2, n, p, h, d)
        if cls.kv_cache_layout is VLLMKVLayout.BLOCKS_KV:
            return (n, 2, p, h, d)
        return (n, h, p, 2 * d)

    @classmethod
    def get_kv_cache_stride_order(
        cls, include_num_layers_dimension: bool = False
    ) -> tuple[int, ...]:
        # PACKED is token-major in memory ([N, P, Hkv, 2D]) like vLLM's own; the others are as shaped.
        order = (0, 2, 1, 3) if cls.kv_cache_layout is VLLMKVLayout.PACKED else tuple(range(5))
        if include_num_layers_dimension:
            return (0, *(i + 1 for i in order))
        return order

    @classmethod
    def get_supported_kernel_block_sizes(cls) -> list[Any]:
        caps = _backend(cls).capabilities
        base = caps.page_size_multiple
        multiple_of = vllm_symbol("MultipleOf")
        return [multiple_of(base)] if multiple_of is not None else [base]

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
    def supports_non_causal(cls) -> bool:
        return Feature.NON_CAUSAL in _backend(cls).capabilities.features

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        kind = getattr(attn_type, "value", attn_type)
        if kind == "decoder":
            return True
        return kind in ("encoder_only", "encoder") and cls.supports_non_causal()

    @classmethod
    def supports_per_head_quant_scales(cls) -> bool:
        return True  # attnsdk takes () / (1,) / (Hkv,) k_scale and v_scale

    @classmethod
    def supports_compute_capability(cls, capability: Any) -> bool:
        caps = _backend(cls).capabilities
        cc = (capability.major, capability.minor)
        low, high = caps.min_compute_capability, caps.max_compute_capability
        return (low is None or cc >= low) and (high is None or cc <= high)

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
    def supports_batch_invariance(cls) -> bool:
        return False

    @classmethod
    def supports_kv_connector(cls) -> bool:
        return True

    @classmethod
    def get_required_kv_cache_layout(cls) -> str | None:
        return None

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
        use_non_causal: bool = False,
        use_batch_invariant: bool = False,
        use_kv_connector: bool = False,
        **newer_options: object,
    ) -> list[str]:
        """Every reason this backend cannot serve the configuration, as vLLM wants them: strings.

        The attnsdk backend's own reasons come first (environment, then configuration).
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
                attn_type=kind,
                has_sinks=has_sink,
                causal=not use_non_causal,
            )
            kv_dtype = (
                fp8_storage_dtype(kv_cache_dtype)
                if cls.supports_kv_cache_dtype(kv_cache_dtype)
                else None
            )
            layout = KVCacheLayout(
                num_kv_heads=1,
                head_dim=head_size,
                page_size=block_size or max(1, backend.capabilities.min_page_size),
                dtype=dtype,
                kv_dtype=kv_dtype,
            )
            device = "cuda" if device_capability is not None else None
            reasons += [str(r) for r in backend.unsupported_reasons(layer, layout, device)]
        except AttnSDKError as exc:  # no backend here, or a dtype attnsdk has no layout for
            reasons.append(str(exc))
        checks = {
            "MLA not supported": lambda: use_mla,
            "sparse attention not supported": lambda: use_sparse,
            "partial multimodal token full attention not supported": lambda: use_mm_prefix,
            "batch invariance not supported": lambda: use_batch_invariant,
            f"attention type {kind} not supported": lambda: not cls.supports_attn_type(kind),
            f"kv_cache_dtype {kv_cache_dtype!r} not supported": lambda: (
                not cls.supports_kv_cache_dtype(kv_cache_dtype)
            ),
        }
        for reason, failed in checks.items():
            try:
                if failed():
                    reasons.append(reason)
            except AttnSDKError:  # the backend itself is unavailable: reported above
                continue
        return reasons

    @classmethod
    def graph_support(cls) -> GraphSupport:
        """The attnsdk backend's own CUDA-graph level (the builder reports NEVER; see its doc)."""
        return _backend(cls).capabilities.graph_support


def _backend(cls: type[AttnSDKAttentionBackend]) -> Backend:
    return resolve_backend(cls.attnsdk_backend)
