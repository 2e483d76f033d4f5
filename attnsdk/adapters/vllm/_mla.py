"""vLLM's MLA layers (DeepSeek V2/V3/R1, Kimi K2) with their decode on an attnsdk backend.

vLLM runs every MLA layer through its own ``MLACommonImpl``: it projects the queries, writes
the latent cache (``do_kv_cache_update``), and runs the expanded prefill with one of its MLA
prefill backends (``attention_config.mla_prefill_backend``; attnsdk's is
``AttnSDKMLAPrefillBackend``, in ``_mla_prefill``). What a backend adds is the decode
rows, ``forward_mqa``: queries absorbed into the latent space (``kv_lora_rank + rope`` dims)
over the latent cache, one KV head, output in the latent space (vLLM applies ``W_UV``). The
drop-in runs that on any attnsdk backend with ``Feature.MLA`` (``LayerSpec.for_mla`` over
``KVCacheLayout.for_mla``), with one plan per step made by its builder::

    class FlashInferMLA(AttnSDKMLABackend):
        attnsdk_backend = "flashinfer"

These classes subclass vLLM's (an MLA layer is vLLM's machinery plus ``forward_mqa``), so they
exist only where vLLM is installed. Speculative verifies (DeepSeek's MTP) run as decode rows of
several tokens (vLLM's ``QueryLenSupport.VARLEN``); full CUDA graphs are not offered (plans are
per step); fp8 latent caches are read with the layer's ``_k_scale`` (on backends serving fp8
MLA); packed fp8 row formats, sliding windows, softcap, ALiBi, decode and prefill context
parallelism and adaptive verification are refused.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from typing import Any, ClassVar

import torch

from attnsdk.adapters._common import ModelLayer, drop_in_class, resolve_backend
from attnsdk.adapters.vllm._adapter import VLLMAdapter
from attnsdk.adapters.vllm._backend import (
    VLLM_VERSIONS,
    kernel_block_sizes,
    serves_compute_capability,
)
from attnsdk.adapters.vllm._builder import declare_group, no_full_graphs
from attnsdk.adapters.vllm._layout import compute_dtype_by_name, fp8_storage_dtype
from attnsdk.adapters.vllm._resolve import BackendSpec, bind
from attnsdk.contract.errors import (
    BackendUnavailableError,
    InvalidMetadataError,
    Reason,
    ReasonKind,
    UnsupportedConfigError,
)
from attnsdk.contract.kv import KVCache, KVCacheLayout
from attnsdk.contract.layer import LayerSpec
from attnsdk.contract.metadata import AttentionMetadata
from attnsdk.contract.plan import Plan

__all__ = [
    "AttnSDKMLABackendBase",
    "AttnSDKMLAImplBase",
    "AttnSDKMLAMetadataBuilderBase",
    "vllm_mla_classes",
]

_MLA_MODULE = "vllm.model_executor.layers.attention.mla_attention"
_KV_CACHE_DTYPES = ["auto", "float16", "bfloat16", "fp8", "fp8_e4m3"]
"""The latent cache in the model's dtype, or vLLM's fp8 latent: e4m3 rows of ``latent /
layer._k_scale`` (vLLM views the uint8 cache as e4m3 before ``forward_mqa``). DeepSeek's packed
``fp8_ds_mla`` / ``nvfp4_ds_mla`` row formats are not mapped."""
_ROPE = 64
"""DeepSeek's and Kimi's rope dims, which vLLM's MLA head sizes (320, 512, 576) assume."""


class AttnSDKMLAMetadataBuilderBase:
    """vLLM's ``MLACommonMetadataBuilder`` plus one attnsdk plan of the step's decode rows.

    vLLM's builder splits the batch (decode rows first) and builds its own prefill metadata;
    ``build`` then plans the decode rows and hands the plan to every layer in
    ``metadata.decode.plan``. ``query_len_support`` is vLLM's ``VARLEN``: with speculative
    decoding, vLLM raises ``reorder_batch_threshold`` to the verify length, and a request of up
    to that many new tokens is a decode row (attnsdk's MLA decode is causal over any query
    length); otherwise decode rows are single tokens."""

    attnsdk_backend: ClassVar[BackendSpec] = None
    adapter: ClassVar[VLLMAdapter] = VLLMAdapter()
    """Subclass ``VLLMAdapter`` and set it here to read a fork's fields."""
    decode_cls: ClassVar[type]
    """vLLM's ``MLACommonDecodeMetadata`` plus ``plan`` (set when the classes are built)."""

    def __init__(
        self,
        kv_cache_spec: Any,
        layer_names: list[str],
        vllm_config: Any,
        device: torch.device,
        *args: Any,
        **kwargs: Any,
    ) -> None:
        super().__init__(  # type: ignore[call-arg]  # vLLM's MLACommonMetadataBuilder
            kv_cache_spec, layer_names, vllm_config, device, *args, **kwargs
        )
        self.backend = resolve_backend(self.attnsdk_backend)
        self.speculative = getattr(vllm_config, "speculative_config", None) is not None
        """Speculative decoding is on: vLLM's host copy of ``seq_lens`` is then an upper bound
        (every draft taken as accepted), so ``decode_metadata`` reads the exact lengths."""
        # The group's MLA layers, declared once (Backend.prepare) before the first step.
        declare_group(
            self.backend, kv_cache_spec, layer_names, vllm_config, device, type(self).__name__
        )

    @classmethod
    def get_cudagraph_support(cls, vllm_config: Any = None, kv_cache_spec: Any = None) -> Any:
        """NEVER for full graphs: plans are per-step objects; piecewise graphs work."""
        return no_full_graphs()

    def build(
        self, common_prefix_len: int, common_attn_metadata: Any, fast_build: bool = False
    ) -> Any:
        md = super().build(  # type: ignore[misc]
            common_prefix_len, common_attn_metadata, fast_build
        )
        if md.decode is not None:
            meta = self.decode_metadata(common_attn_metadata, md.num_decodes, md.num_decode_tokens)
            fields = {f.name: getattr(md.decode, f.name) for f in dataclasses.fields(md.decode)}
            md.decode = self.decode_cls(**fields, plan=self.backend.plan(meta))
        return md

    def decode_metadata(
        self, common_attn_metadata: Any, num_decodes: int, num_decode_tokens: int
    ) -> AttentionMetadata:
        """The step's first ``num_decodes`` requests (vLLM orders decodes first) as attnsdk
        metadata. No slots (-1): vLLM has written their latents before ``forward_mqa``.

        With speculative decoding, vLLM's only host copy of ``seq_lens`` assumes every draft
        was accepted (async scheduling, MTP draft steps), and backends plan from host lengths
        (flashinfer's page index): the exact lengths are copied from the device then
        (``VLLMAdapter.with_exact_seq_lens``, one sync per step)."""
        meta = self.adapter.build_metadata(common_attn_metadata)
        if self.speculative:
            meta = self.adapter.with_exact_seq_lens(meta)
        b = num_decodes
        if int(meta.query_start_loc_cpu[b]) != num_decode_tokens:
            raise InvalidMetadataError(
                "num_decode_tokens",
                f"the first {b} requests' tokens, query_start_loc_cpu[{b}] = "
                f"{int(meta.query_start_loc_cpu[b])}",
                num_decode_tokens,
            )
        return AttentionMetadata.from_tensors(
            query_start_loc=meta.query_start_loc[: b + 1],
            seq_lens=meta.seq_lens[:b],
            page_table=meta.page_table[:b],
            slot_mapping=torch.full(
                (num_decode_tokens,), -1, dtype=torch.int64, device=meta.device
            ),
            query_start_loc_cpu=meta.query_start_loc_cpu[: b + 1],
            seq_lens_cpu=meta.seq_lens_cpu[:b],
        )


class AttnSDKMLAImplBase:
    """vLLM's ``MLACommonImpl`` with ``forward_mqa`` on the attnsdk backend.

    Everything else (projections, cache writes, the expanded prefill and its merge) is vLLM's
    own code, unchanged."""

    attnsdk_backend: ClassVar[BackendSpec] = None
    supports_pcp: ClassVar[bool] = False
    """Prefill context parallelism changes vLLM's decode split and shards decodes across
    ranks: not mapped."""

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        alibi_slopes: list[float] | None,
        sliding_window: int | None,
        kv_cache_dtype: str,
        logits_soft_cap: float | None,
        attn_type: str,
        kv_sharing_target_layer_name: str | None,
        **mla_args: Any,
    ) -> None:
        super().__init__(  # type: ignore[call-arg]  # vLLM's MLACommonImpl
            num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window,
            kv_cache_dtype, logits_soft_cap, attn_type, kv_sharing_target_layer_name,
            **mla_args,
        )  # fmt: skip
        # vLLM would hand fp8-quantized queries to a backend that says it takes them.
        self.supports_quant_query_input = False
        kind = getattr(attn_type, "value", attn_type)
        dcp = getattr(self, "dcp_world_size", 1)
        checks = (  # (field, refused, expected, found)
            ("alibi_slopes", alibi_slopes is not None, "None", "ALiBi slopes"),
            ("sliding_window", sliding_window is not None, "None", sliding_window),
            ("logits_soft_cap", bool(logits_soft_cap), "None", logits_soft_cap),
            ("attn_type", kind != "decoder", "'decoder'", repr(kind)),
            ("kv_cache_dtype", kv_cache_dtype not in _KV_CACHE_DTYPES,
             f"one of {_KV_CACHE_DTYPES}", repr(kv_cache_dtype)),
            ("decode_context_parallel_size", dcp > 1, "1", dcp),
        )  # fmt: skip
        reasons = [
            Reason(ReasonKind.CONFIGURATION, name, f"must be {expected}, found {found}")
            for name, refused, expected, found in checks
            if refused
        ]
        if reasons:
            raise UnsupportedConfigError("AttnSDKMLABackend cannot serve this layer:", reasons)
        self.backend = resolve_backend(self.attnsdk_backend)
        self.latent_dtype = fp8_storage_dtype(kv_cache_dtype)
        """The fp8 dtype of vLLM's latent cache (read with ``layer._k_scale``), else None."""
        self._kv_cache_dtype = kv_cache_dtype
        rank = int(mla_args["kv_lora_rank"])
        self.spec = LayerSpec.for_mla(
            num_heads, kv_lora_rank=rank, rope_dim=int(mla_args["qk_rope_head_dim"]), scale=scale
        )
        self._cache: tuple[tuple[Any, ...], KVCache] | None = None

    def attnsdk_layer(self, name: str, page_size: int, dtype: torch.dtype) -> ModelLayer:
        """This layer as its builder declares it at start-up: the MLA decode layer over the
        latent cache ``_wrap`` will adopt (``page_size`` tokens per block, in ``dtype``, or
        vLLM's fp8 latent)."""
        spec = self.spec
        layout = KVCacheLayout.for_mla(
            page_size,
            kv_lora_rank=spec.v_dim,
            rope_dim=spec.head_dim - spec.v_dim,
            dtype=dtype,
            kv_dtype=self.latent_dtype,
        )
        return ModelLayer(name, spec, layout)

    def forward_mqa(
        self,
        q: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        kv_c_and_k_pe_cache: torch.Tensor,
        attn_metadata: Any,
        layer: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The decode rows: q (rows, H, rank + rope), or its (latent, rope) halves, over the
        latent cache (blocks, block_size, rank + rope); out (rows, H, rank), no lse."""
        if isinstance(q, tuple):
            q = torch.cat(q, dim=-1)
        plan = getattr(attn_metadata.decode, "plan", None)
        if not isinstance(plan, Plan):
            raise InvalidMetadataError(
                "attn_metadata.decode.plan",
                "the attnsdk plan AttnSDKMLABackend's builder makes",
                type(plan).__name__,
            )
        cache = self._wrap(kv_c_and_k_pe_cache, q.dtype)
        k_scale = _latent_scale(layer) if cache.layout.is_quantized else None
        return self.backend.forward(q, None, None, cache, plan, self.spec, k_scale=k_scale), None

    def _wrap(self, kv: torch.Tensor, dtype: torch.dtype) -> KVCache:
        """vLLM's latent cache (blocks, block_size, rank + rope) as attnsdk's MLA cache in the
        compute ``dtype``, adopted without a copy; reused while vLLM hands the same tensor. An
        fp8 cache comes viewed as e4m3 (as uint8 if a caller did not view it)."""
        key = (kv.data_ptr(), tuple(kv.shape), kv.stride(), kv.dtype, dtype)
        if self._cache is None or self._cache[0] != key:
            if kv.dim() != 3:
                raise InvalidMetadataError(
                    "kv_c_and_k_pe_cache",
                    "(num_blocks, block_size, kv_lora_rank + rope)",
                    tuple(kv.shape),
                )
            fp8 = self.latent_dtype
            if fp8 is not None and kv.dtype == torch.uint8:
                kv = kv.view(fp8)
            if kv.dtype != (fp8 or dtype):
                raise InvalidMetadataError(
                    "kv_c_and_k_pe_cache.dtype",
                    f"{fp8 or dtype} (kv_cache_dtype {self._kv_cache_dtype!r})",
                    kv.dtype,
                )
            layout = KVCacheLayout.for_mla(
                kv.shape[1],
                kv_lora_rank=self.spec.v_dim,
                rope_dim=kv.shape[2] - self.spec.v_dim,
                dtype=dtype,
                kv_dtype=fp8,
            )
            self._cache = (key, layout.wrap(kv.unsqueeze(2)))
        return self._cache[1]


def _latent_scale(layer: Any) -> torch.Tensor:
    """vLLM's fp32 scale of an fp8 latent cache (``layer._k_scale``: latent = e4m3 * scale)."""
    scale = getattr(layer, "_k_scale", None)
    if not isinstance(scale, torch.Tensor):
        raise InvalidMetadataError(
            "layer._k_scale", "the fp32 scale tensor of an fp8 latent cache", type(scale).__name__
        )
    return scale.float()


class AttnSDKMLABackendBase:
    """vLLM's ``MLACommonBackend`` naming the drop-in's impl and builder, with what the
    attnsdk backend supports. Use it as ``attnsdk.adapters.vllm.AttnSDKMLABackend``."""

    attnsdk_backend: ClassVar[BackendSpec] = None
    impl_cls: ClassVar[type]
    builder_cls: ClassVar[type]
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16]
    supported_kv_cache_dtypes: ClassVar[list[str]] = _KV_CACHE_DTYPES

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @classmethod
    def supports_device_cpu_query_lens_mismatch(cls) -> bool:
        """False: the decode plan reads host query lengths (adaptive verification trims
        drafts on the device only)."""
        return False

    @classmethod
    def get_impl_cls(cls) -> type:
        return bind(cls.impl_cls, cls.attnsdk_backend)

    @classmethod
    def get_builder_cls(cls) -> type:
        return bind(cls.builder_cls, cls.attnsdk_backend)

    @classmethod
    def get_supported_kernel_block_sizes(cls, kv_cache_spec: Any = None) -> list[Any]:
        return kernel_block_sizes(resolve_backend(cls.attnsdk_backend))

    @classmethod
    def supports_compute_capability(cls, capability: Any) -> bool:
        return serves_compute_capability(resolve_backend(cls.attnsdk_backend), capability)

    @classmethod
    def supports_combination(
        cls,
        head_size: int,
        dtype: torch.dtype,
        kv_cache_dtype: str | None,
        block_size: int | None,
        use_mla: bool,
        has_sink: bool,
        use_sparse: bool,
        use_mm_prefix: bool,
        device_capability: Any,
    ) -> str | None:
        """vLLM's last check: None when the attnsdk backend serves this MLA layer, else its
        reasons. vLLM asks with the latent row's ``head_size`` (rank + rope, rope 64)."""
        backend = resolve_backend(cls.attnsdk_backend)
        caps = backend.capabilities
        rank = head_size - _ROPE
        layer = LayerSpec.for_mla(1, kv_lora_rank=rank, rope_dim=_ROPE)
        page = block_size or max(caps.min_page_size, caps.page_size_multiple)
        known = kv_cache_dtype is None or kv_cache_dtype in _KV_CACHE_DTYPES
        fp8 = fp8_storage_dtype(kv_cache_dtype) if known else None
        layout = KVCacheLayout.for_mla(
            page, kv_lora_rank=rank, rope_dim=_ROPE, dtype=dtype, kv_dtype=fp8
        )
        device = "cuda" if device_capability is not None else None
        reasons = [str(r) for r in backend.unsupported_reasons(layer, layout, device)]
        if not known:
            reasons.append(
                f"kv_cache_dtype must be one of {_KV_CACHE_DTYPES}, found {kv_cache_dtype!r}"
            )
        if has_sink or use_sparse or use_mm_prefix:
            reasons.append("sinks, sparse MLA and multimodal prefixes are not served")
        compute = compute_dtype_by_name(kv_cache_dtype)
        if compute is not None and compute != dtype:
            reasons.append(
                f"kv_cache_dtype {kv_cache_dtype!r} with a {dtype} model: the latent cache is "
                "in the model dtype"
            )
        return "; ".join(reasons) or None


@functools.cache
def vllm_mla_classes() -> tuple[type, type, type]:
    """The public (backend, builder, impl) MLA classes, subclassing vLLM's MLA machinery.
    Raises ``BackendUnavailableError`` where vLLM is not installed (MLA needs its code)."""
    VLLM_VERSIONS.check()
    try:
        machinery = importlib.import_module(_MLA_MODULE)
    except ImportError as err:
        raise BackendUnavailableError(
            f"AttnSDKMLABackend subclasses vLLM's MLA layer machinery ({_MLA_MODULE}), which "
            f"is not importable here: {err}",
            "pip install vllm",
        ) from err
    decode_cls = dataclasses.make_dataclass(
        "AttnSDKMLADecodeMetadata",
        [("plan", Any, dataclasses.field(default=None))],
        bases=(machinery.MLACommonDecodeMetadata,),
        namespace={"__module__": "attnsdk.adapters.vllm"},
    )
    where = "attnsdk.adapters.vllm"
    impl = drop_in_class(
        AttnSDKMLAImplBase, "AttnSDKMLAImpl", where, (_MLA_MODULE, "MLACommonImpl")
    )
    builder = drop_in_class(
        AttnSDKMLAMetadataBuilderBase,
        "AttnSDKMLAMetadataBuilder",
        where,
        (_MLA_MODULE, "MLACommonMetadataBuilder"),
        decode_cls=decode_cls,
        query_len_support=machinery.QueryLenSupport.VARLEN,
    )
    backend = drop_in_class(
        AttnSDKMLABackendBase,
        "AttnSDKMLABackend",
        where,
        (_MLA_MODULE, "MLACommonBackend"),
        impl_cls=impl,
        builder_cls=builder,
    )
    return backend, builder, impl
