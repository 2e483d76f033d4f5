"""What the SGLang drop-in reads off a ``RadixAttention`` layer: its ``LayerSpec`` (SGLang's
window is W - 1; its chunk size is the model's, on the layers flagged ``use_irope``), the key
its spec and cache are cached under, and its per-call q/k/v as head views."""

from __future__ import annotations

import numbers
import operator
from typing import TYPE_CHECKING, Any

from attnsdk.adapters._common import AttnKind, engine_attr
from attnsdk.contract.errors import InvalidInputError, Reason, ReasonKind, UnsupportedConfigError
from attnsdk.contract.layer import LayerSpec

if TYPE_CHECKING:
    import torch
    from sglang.srt.layers.radix_attention import RadixAttention

__all__ = [
    "as_heads",
    "is_radix_attention",
    "kv_scales",
    "layer_fingerprint",
    "layer_shape",
    "radix_layer_spec",
]


_ATTN_KINDS = {
    "decoder": AttnKind.DECODER,
    # Both attend over the paged cache without a causal mask (SGLang's FA3 does the same; a
    # one-token decode sees every earlier key either way).
    "encoder_only": AttnKind.BIDIRECTIONAL,
    "decoder_bidirectional": AttnKind.BIDIRECTIONAL,
}
"""SGLang's ``AttentionType`` values."""


def radix_layer_spec(
    layer: RadixAttention,
    *,
    has_sinks: bool = False,
    attention_chunk_size: int | None = None,
    mla: bool = False,
) -> LayerSpec:
    """``LayerSpec`` of a RadixAttention-like layer; raises for semantics attnsdk lacks.

    ``attention_chunk_size`` is the model's (SGLang's ``model_runner.attention_chunk_size``):
    SGLang's FA3 backend applies it to the layers with ``use_irope`` set (Llama 4's RoPE
    layers) and to no other, and so does this mapping. ``mla``: the model's latent pool
    (``MLATokenToKVPool``) backs the layer (DeepSeek's ``attn_mqa``: one KV head of
    kv_lora_rank + rope dims, ``v_head_dim`` = kv_lora_rank).
    """
    layer_id = getattr(layer, "layer_id", "?")
    if getattr(layer, "is_cross_attention", False):
        raise UnsupportedConfigError(
            f"layer {layer_id}.is_cross_attention: expected False, found True",
            [Reason(ReasonKind.CONFIGURATION, "is_cross_attention", "encoder KV is not mapped")],
        )
    attn_type = getattr(layer, "attn_type", "decoder")
    attn_type = str(getattr(attn_type, "value", attn_type)).lower()
    kind = _ATTN_KINDS.get(attn_type)
    if kind is None:
        raise UnsupportedConfigError(
            f"layer {layer_id}.attn_type: expected one of {sorted(_ATTN_KINDS)}, found {attn_type}",
            [Reason(ReasonKind.CONFIGURATION, "attn_type", f"{attn_type} has no attnsdk mapping")],
        )
    method = getattr(layer, "logit_capping_method", "tanh")
    cap = _layer_number(layer, "logit_cap", 0.0) or 0.0
    if cap > 0 and method != "tanh":
        raise UnsupportedConfigError(
            f"layer {layer_id}.logit_capping_method: expected 'tanh', found {method!r}",
            [Reason(ReasonKind.CONFIGURATION, "logit_capping_method", "only tanh softcap")],
        )
    window = _layer_number(layer, "sliding_window_size", -1, integral=True)
    v_dim = _layer_number(layer, "v_head_dim", -1, integral=True)
    return LayerSpec(
        num_heads=_layer_number(layer, "tp_q_head_num", integral=True),
        num_kv_heads=_layer_number(layer, "tp_k_head_num", integral=True),
        head_dim=_layer_number(layer, "head_dim", integral=True),
        v_head_dim=None if v_dim is None or v_dim < 0 else int(v_dim),
        scale=_layer_number(layer, "scaling"),
        causal=kind.causal,
        # SGLang stores W - 1 (FlashAttention's left window); -1 or None means no window.
        sliding_window=None if window is None or window < 0 else int(window) + 1,
        softcap=cap if cap > 0 else None,
        has_sinks=has_sinks,
        attention_chunk_size=attention_chunk_size if getattr(layer, "use_irope", False) else None,
        mla=mla,
    )


def _layer_number(layer: Any, name: str, default: Any = ..., *, integral: bool = False) -> Any:
    """A number attribute of a RadixAttention-like layer (None stays None), type-checked."""
    value: Any = (
        engine_attr(layer, "layer", name) if default is ... else getattr(layer, name, default)
    )
    if value is None:
        return None
    if integral and not isinstance(value, bool) and isinstance(value, numbers.Integral):
        return int(value)
    if not integral and not isinstance(value, bool) and isinstance(value, numbers.Real):
        return float(value)
    raise InvalidInputError(f"layer.{name}", "an int" if integral else "a number", repr(value))


_SHAPE_FIELDS = (
    "layer_id",
    "tp_q_head_num",
    "tp_k_head_num",
    "head_dim",
    "v_head_dim",
    "scaling",
    "sliding_window_size",
    "logit_cap",
    "attn_type",
)
_shape_fields = operator.attrgetter(*_SHAPE_FIELDS)


def layer_shape(layer: RadixAttention) -> tuple[object, ...]:
    """What a ``LayerSpec`` is derived from, of a SGLang layer (with ``layer_id`` first: an id
    reused by a draft model's layer of another shape is another key). Read on every forward,
    so in one ``attrgetter``; only a missing attribute pays for finding which, to name it."""
    try:
        fields = _shape_fields(layer)
    except AttributeError:
        for name in _SHAPE_FIELDS:
            engine_attr(layer, "layer", name)
        raise
    # Read with defaults, as radix_layer_spec reads them: a mapping they change (a layer that
    # turns out to be cross-attention) must not hit a spec built for the layer without it.
    return (
        *fields,
        getattr(layer, "use_irope", False),
        getattr(layer, "is_cross_attention", False),
        getattr(layer, "logit_capping_method", "tanh"),
    )


def is_radix_attention(module: object) -> bool:
    """Whether ``module`` is a ``RadixAttention`` (known by the attributes SGLang's backends
    read off it; SGLang is not imported)."""
    return all(hasattr(module, name) for name in _SHAPE_FIELDS) and isinstance(
        getattr(module, "layer_id", None), int
    )


def layer_fingerprint(
    shape: tuple[object, ...],
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    dtype: torch.dtype,
    sinks: bool,
) -> tuple[object, ...]:
    """Everything a layer's ``LayerEntry`` is derived from (see ``LayerState``)."""
    return (k_buf.data_ptr(), v_buf.data_ptr(), k_buf.shape, v_buf.shape, k_buf.dtype, dtype,
            sinks, *shape)  # fmt: skip


def as_heads(name: str, t: torch.Tensor, heads: int, dim: int) -> torch.Tensor:
    """``t`` ([T, H*D] or [T, H, D]) as a (T, H, D) view; a wrong width is a typed error."""
    if t.dim() in (2, 3) and t.shape[1:].numel() == heads * dim:
        return t.reshape(t.shape[0], heads, dim)
    raise InvalidInputError(
        f"{name}.shape", f"(T, {heads} * {dim}) or (T, {heads}, {dim})", tuple(t.shape)
    )


def kv_scales(layer: RadixAttention) -> tuple[Any, Any]:
    """The layer's ``k_scale`` / ``v_scale`` (SGLang hands them to the pool and the kernel)."""
    return engine_attr(layer, "layer", "k_scale"), engine_attr(layer, "layer", "v_scale")
