"""``AttnSDKAttentionImpl``: vLLM's per-layer ``AttentionImpl``, delegating to an attnsdk backend.

Shape legend: T query rows (``num_actual_tokens`` of them real), Hq / Hkv heads, D head size.
vLLM 0.33+ hands q/k/v as (T, H, D) and an output buffer (T, Hq, D); (T, H * D) is accepted
too. Results are written into that buffer, only its first ``num_actual_tokens`` rows.

The impl refuses at construction what only its arguments say (ALiBi, an unmapped attention
type, extra arguments); whether the backend serves the layer is asked once for the whole KV
cache group by the group's builder (``attnsdk_layer``, ``declare_group``), naming the layer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import torch

from attnsdk.adapters._common import AttnKind, ModelLayer, refuse, resolve_backend
from attnsdk.adapters.vllm._adapter import VLLMAdapter, vllm_attn_kind
from attnsdk.adapters.vllm._builder import encoder_plan
from attnsdk.adapters.vllm._layout import fp8_storage_dtype
from attnsdk.contract.capabilities import Feature
from attnsdk.contract.checks import check_positive_float
from attnsdk.contract.errors import InvalidInputError
from attnsdk.contract.kv import KVCacheLayout
from attnsdk.contract.plan import Plan

if TYPE_CHECKING:
    from attnsdk.adapters._common import BackendSpec
    from attnsdk.adapters.vllm._builder import VLLMAttentionMetadata
    from attnsdk.contract.kv import KVCache
    from attnsdk.contract.layer import LayerSpec

__all__ = ["AttnSDKAttentionImplBase"]


class AttnSDKAttentionImplBase:
    """vLLM's ``AttentionImpl`` for one layer. vLLM constructs it with the arguments below.

    Use it as ``attnsdk.adapters.vllm.AttnSDKAttentionImpl`` (vLLM's base mixed in).
    """

    attnsdk_backend: ClassVar[BackendSpec] = None
    adapter: ClassVar[VLLMAdapter] = VLLMAdapter()
    forward_includes_kv_cache_update: ClassVar[bool] = True

    # Attributes vLLM reads from every impl.
    can_return_lse_for_decode: ClassVar[bool] = False
    need_to_return_lse_for_decode: ClassVar[bool] = False
    supports_quant_query_input: ClassVar[bool] = False
    """vLLM must hand q in the compute dtype: attnsdk dequantises fp8 K/V itself."""
    supports_pcp: ClassVar[bool] = False
    supports_dcp: ClassVar[bool] = False
    dcp_world_size: ClassVar[int] = 1
    dcp_rank: ClassVar[int] = 0
    pcp_world_size: ClassVar[int] = 1
    pcp_rank: ClassVar[int] = 0
    total_cp_world_size: ClassVar[int] = 1
    total_cp_rank: ClassVar[int] = 0

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        alibi_slopes: list[float] | None = None,
        sliding_window: int | None = None,
        kv_cache_dtype: str = "auto",
        logits_soft_cap: float | None = None,
        attn_type: str = "decoder",
        kv_sharing_target_layer_name: str | None = None,
        sinks: torch.Tensor | None = None,
        **extra_impl_args: Any,
    ) -> None:
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = check_positive_float("scale", scale)
        self.num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        fp8_storage_dtype(kv_cache_dtype)  # an unknown name fails here, not at the first step
        self.kv_cache_dtype = kv_cache_dtype
        self.attn_type = str(getattr(attn_type, "value", attn_type))
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.sinks = sinks
        self.backend = resolve_backend(self.attnsdk_backend)
        what = "attnsdk cannot serve this vLLM layer"
        if alibi_slopes is not None:
            refuse(what, "alibi_slopes", "ALiBi is not supported")
        kind = vllm_attn_kind(self.attn_type)
        if kind is None:
            refuse(what, "attn_type", f"{self.attn_type} is not mapped")
        if (
            kind is AttnKind.CROSS
            and Feature.CROSS_ATTENTION not in self.backend.capabilities.features
        ):
            refuse(
                what,
                "attn_type",
                f"encoder_decoder needs a backend with cross-attention; {self.backend.name!r} "
                "has none",
            )
        self.kind: AttnKind = kind
        # vLLM passes model-specific extras (use_alibi_sqrt, FlexAttention block sizes, ...)
        # only to backends that asked for them; a set one asks for what attnsdk lacks.
        for name, value in extra_impl_args.items():
            if value is not None and value is not False:
                refuse(what, name, f"is not served (found {value!r})")
        if int(getattr(self, "dcp_world_size", 1)) > 1:
            refuse(what, "decode_context_parallel_size", "> 1 (DCP) is not served")
        if sinks is not None and not isinstance(sinks, torch.Tensor):
            raise InvalidInputError("sinks", f"None or an fp32 ({num_heads},) tensor", repr(sinks))
        if sinks is not None and (sinks.dim() != 1 or sinks.shape[0] != num_heads):
            raise InvalidInputError(
                "sinks.shape", f"({num_heads},) one per query head", tuple(sinks.shape)
            )
        self._layers = {
            causal: self.adapter.layer_spec(
                num_heads,
                head_size,
                scale,
                self.num_kv_heads,
                sliding_window=sliding_window,
                logits_soft_cap=logits_soft_cap,
                attn_type=self.attn_type,
                has_sinks=sinks is not None,
                causal=causal and self.kind.causal,
            )
            for causal in (True, False)
        }
        self._cache_key: tuple[object, ...] | None = None
        self._cache: KVCache | None = None

    @property
    def layer_spec(self) -> LayerSpec:
        """The layer as attnsdk sees it in a causal step."""
        return self._layers[True]

    def attnsdk_layer(self, name: str, page_size: int, dtype: torch.dtype) -> ModelLayer:
        """This layer as its builder declares it at start-up (``declare_group``): the causal
        step's ``LayerSpec`` over the KV layout the impl will read vLLM's cache as
        (``page_size`` tokens per block, q in ``dtype``, K/V stored in it or in the fp8 dtype
        ``kv_cache_dtype`` names), or without a cache for an encoder layer
        (``forward_ragged``). A non-causal decoder step's spec is prepared at its first
        forward."""
        if self.kind is AttnKind.ENCODER:
            return ModelLayer(name, self.layer_spec, None, dtype)
        layout = KVCacheLayout(
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_size,
            page_size=page_size,
            dtype=dtype,
            kv_dtype=fp8_storage_dtype(self.kv_cache_dtype) or dtype,
        )
        return ModelLayer(name, self.layer_spec, layout)

    def forward(
        self,
        layer: Any,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: torch.Tensor,
        attn_metadata: VLLMAttentionMetadata | None,
        output: torch.Tensor | None = None,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Write this step's K/V (unless vLLM did, or the layer shares another's), then attend."""
        if not isinstance(output, torch.Tensor):
            raise InvalidInputError(
                "output", "vLLM's preallocated (T, Hq, D) output buffer", _kind(output)
            )
        for name, scale in (
            ("output_scale", output_scale),
            ("output_block_scale", output_block_scale),
        ):
            if scale is not None:
                refuse("attnsdk cannot fuse output quantization", name, "is not supported")
        if attn_metadata is None:
            return output.fill_(0)  # vLLM's profiling run
        if not isinstance(getattr(attn_metadata, "plan", None), Plan):
            raise InvalidInputError(
                "attn_metadata",
                "the VLLMAttentionMetadata that AttnSDKMetadataBuilder.build made",
                _kind(attn_metadata),
            )
        if (key is None) != (value is None):
            raise InvalidInputError("key/value", "both tensors or both None", "only one of them")
        n = attn_metadata.num_actual_tokens
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_size
        q = _heads("query", query[:n], hq, d)
        out, out_is_view = _output_heads(output[:n], hq, d)
        layer_spec = self._layers[attn_metadata.causal]
        sinks = None if self.sinks is None else self.sinks.float()
        if self.kind is AttnKind.ENCODER:
            if key is None or value is None:
                raise InvalidInputError(
                    "key/value", "tensors (encoder attention has no KV cache)", None
                )
            # This step's own K/V, no cache: ragged attention, planned once per step.
            k_enc, v_enc = _heads("key", key[:n], hkv, d), _heads("value", value[:n], hkv, d)
            result = attn_metadata.backend.forward_ragged(
                q, k_enc, v_enc, encoder_plan(attn_metadata), layer_spec, sinks=sinks, out=out
            )
        elif self.kind is AttnKind.CROSS:
            cache = self._kv(kv_cache, q.dtype)
            k_scale, v_scale = _scales(layer, cache)
            slots = attn_metadata.encoder_slot_mapping
            if key is not None and value is not None and slots is not None and slots.numel():
                # The encoder's K/V, once per request (its first decoder step): one row per
                # encoder token, at the slots vLLM's CrossAttentionBuilder computed.
                e = slots.shape[0]
                k_enc, v_enc = _heads("key", key[:e], hkv, d), _heads("value", value[:e], hkv, d)
                cache.store(k_enc, v_enc, slots, k_scale=k_scale, v_scale=v_scale)
            result = attn_metadata.backend.forward(
                q, None, None, cache, attn_metadata.plan, layer_spec,
                sinks=sinks, k_scale=k_scale, v_scale=v_scale, out=out,
            )  # fmt: skip
        else:
            cache = self._kv(kv_cache, q.dtype)
            k: torch.Tensor | None = None
            v: torch.Tensor | None = None
            if (
                self.forward_includes_kv_cache_update
                and key is not None
                and value is not None
                and self._writes_kv()
            ):
                k, v = _heads("key", key[:n], hkv, d), _heads("value", value[:n], hkv, d)
            k_scale, v_scale = _scales(layer, cache)
            result = attn_metadata.backend.forward(
                q,
                k,
                v,
                cache,
                attn_metadata.plan,
                layer_spec,
                sinks=sinks,
                k_scale=k_scale,
                v_scale=v_scale,
                out=out,
            )
        if result is not out or not out_is_view:
            output[:n].copy_(result.reshape(output[:n].shape))
        return output

    def do_kv_cache_update(
        self,
        layer: Any,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """vLLM's split store step: row t of key/value goes to ``slot_mapping[t]`` (< 0: skipped).

        Uses ``KVCache.store``, whose boolean mask synchronises a CUDA device; the default path
        (``forward_includes_kv_cache_update``) stores through the backend instead.
        """
        if self.kind is AttnKind.ENCODER or key is None or value is None:
            return
        if not self._writes_kv():
            return
        n, hkv, d = slot_mapping.shape[0], self.num_kv_heads, self.head_size
        k, v = _heads("key", key[:n], hkv, d), _heads("value", value[:n], hkv, d)
        cache = self._kv(kv_cache, k.dtype)
        k_scale, v_scale = _scales(layer, cache)
        cache.store(k, v, slot_mapping, k_scale=k_scale, v_scale=v_scale)

    def process_weights_after_loading(self, act_dtype: torch.dtype) -> None:
        return None

    def fused_output_quant_supported(self, quant_key: Any) -> bool:
        return False

    def fused_rope_kvcache_supported(self) -> bool:
        return False

    def fused_qk_norm_rope_kvcache_supported(self) -> bool:
        return False

    def _writes_kv(self) -> bool:
        # A KV-sharing layer reads the cache an earlier layer wrote; it never writes its own.
        return self.kv_sharing_target_layer_name is None

    def _kv(self, kv_cache: torch.Tensor, dtype: torch.dtype) -> KVCache:
        """The layer's cache views; wrapped once and reused while vLLM hands the same tensor."""
        if not isinstance(kv_cache, torch.Tensor):
            raise InvalidInputError("kv_cache", "a torch.Tensor", _kind(kv_cache))
        key = (kv_cache.data_ptr(), tuple(kv_cache.shape), kv_cache.stride(), kv_cache.dtype, dtype)
        if key != self._cache_key or self._cache is None:
            self._cache = self.adapter.kv_cache(
                kv_cache,
                self.num_kv_heads,
                self.head_size,
                dtype=dtype,
                kv_cache_dtype=self.kv_cache_dtype,
            )
            self._cache_key = key
        return self._cache


def _heads(name: str, t: torch.Tensor, heads: int, dim: int) -> torch.Tensor:
    """(T, H, D) view of a (T, H, D) or (T, H * D) tensor (no copy)."""
    if t.dim() == 3 and t.shape[1:] == (heads, dim):
        return t
    if t.dim() == 2 and t.shape[1] == heads * dim:
        try:
            return t.view(t.shape[0], heads, dim)
        except RuntimeError:
            raise InvalidInputError(
                f"{name}.stride()", "strides viewable as (T, H, D)", t.stride()
            ) from None
    raise InvalidInputError(
        f"{name}.shape", f"(T, {heads}, {dim}) or (T, {heads * dim})", tuple(t.shape)
    )


def _output_heads(t: torch.Tensor, heads: int, dim: int) -> tuple[torch.Tensor, bool]:
    """(T, Hq, D) destination and whether it aliases vLLM's buffer (else the caller copies back)."""
    try:
        return _heads("output", t, heads, dim), True
    except InvalidInputError:
        if t.dim() != 2 or t.shape[1] != heads * dim:
            raise
        return torch.empty(t.shape[0], heads, dim, dtype=t.dtype, device=t.device), False


def _scales(layer: Any, cache: KVCache) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """vLLM's per-layer fp8 scales (``_k_scale`` / ``_v_scale``); None for an unquantised cache."""
    if not cache.layout.is_quantized:
        return None, None
    k_scale, v_scale = getattr(layer, "_k_scale", None), getattr(layer, "_v_scale", None)
    if not isinstance(k_scale, torch.Tensor) or not isinstance(v_scale, torch.Tensor):
        raise InvalidInputError(
            "layer._k_scale / layer._v_scale",
            "fp32 scale tensors for an fp8 KV cache",
            f"{_kind(k_scale)} / {_kind(v_scale)}",
        )
    return k_scale.float(), v_scale.float()


def _kind(value: object) -> str:
    return "None" if value is None else f"a {type(value).__name__}"
