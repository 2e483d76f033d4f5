"""Hugging Face transformers: run a model's attention through attnsdk.

    from attnsdk.integrations.transformers import register

    name = register("reference")   # or an AttentionConfig, or None: the environment's config
    model = AutoModelForCausalLM.from_config(config, attn_implementation=name)

``register`` adds an attention function (the ``DynamicCache`` path) and a mask function under
``name`` to transformers' registries. Each call copies the layer's keys and values (already
concatenated with the cache's past by the model) into a scratch paged cache and runs one
``backend.forward``; the backend is created on first use per device.

attnsdk serves bottom-right causal (or non-causal) attention with a sliding window, chunks
(Llama 4), softcap and sinks over one contiguous run of keys per sequence, not arbitrary masks. The mask function
registered here always materialises the model's boolean mask, and the attention function checks
it against the pattern it computes, row by row: no padding and left padding (``generate`` on a
left-padded batch, a padded encoder batch) are served exactly; anything else (right padding in a
causal model, packed sequences, custom masks) raises ``UnsupportedConfigError`` rather than
computing something else. Query rows the mask leaves without any key (left padding in a causal
prefill) come out as zeros. Inference only: dropout > 0 is refused, and so is a call that would
need gradients (grad mode on and an input that requires grad: run under ``torch.no_grad()``,
as ``generate`` does, or train with ``attn_implementation='sdpa'``).

Shape legend: B batch rows, Sq new query tokens per row, Sk keys per row (cached + new),
Hq / Hkv query / KV heads, D / Dv QK / V head dims.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from attnsdk.contract.backend import check_no_grad
from attnsdk.contract.errors import (
    BackendUnavailableError,
    InvalidInputError,
    Reason,
    ReasonKind,
    UnsupportedConfigError,
)
from attnsdk.contract.kv import KVCache, KVCacheLayout
from attnsdk.contract.layer import LayerSpec
from attnsdk.contract.metadata import AttentionMetadata

if TYPE_CHECKING:
    from attnsdk.contract.backend import Backend
    from attnsdk.selection.config import AttentionConfig

__all__ = ["layer_spec", "register"]

PAGE_SIZE = 16
"""Tokens per page of the scratch cache."""
_INSTALL = 'pip install "transformers>=5.17"'
_ADVICE = (
    "pad on the left (tokenizer.padding_side = 'left') or run this model with "
    "attn_implementation='eager' or 'sdpa'"
)


def register(config: AttentionConfig | str | None = None, *, name: str = "attnsdk") -> str:
    """Register attnsdk with transformers under ``name`` and return ``name``.

    ``config`` picks the backend (a name, an ``AttentionConfig``, or None: the environment's,
    as ``create_backend``). Load a model with ``attn_implementation=name`` to use it.
    Registering again under the same name replaces the earlier registration.
    """
    try:
        from transformers import AttentionInterface  # type: ignore[import-untyped,unused-ignore]
        from transformers.masking_utils import (  # type: ignore[import-untyped,unused-ignore]
            AttentionMaskInterface,
            sdpa_mask,
        )
    except ImportError as exc:
        raise BackendUnavailableError(
            "attnsdk.integrations.transformers needs transformers >= 5.17.", _INSTALL
        ) from exc
    if not isinstance(name, str) or not name or name.startswith("paged|") or "flash" in name:
        # transformers takes every implementation name containing "flash" for one of its own
        # flash-attention kernels (and looks for it on the hub).
        raise InvalidInputError(
            "name", "a non-empty name without the 'paged|' prefix and without 'flash'", name
        )

    def mask_function(*args: Any, **kwargs: Any) -> Any:
        # Always the full boolean mask: without it the attention function could not see padding
        # (transformers drops the mask of a name that has no mask function).
        kwargs["allow_is_causal_skip"] = False
        kwargs["allow_is_bidirectional_skip"] = False
        return sdpa_mask(*args, **kwargs)

    AttentionMaskInterface.register(name, mask_function)
    AttentionInterface.register(name, _AttentionFunction(config))
    return name


@dataclass(frozen=True, slots=True)
class _Segment:
    """One attnsdk sequence: query rows ``q0:q1`` of batch row ``b`` over its keys ``lo:hi``."""

    b: int
    q0: int
    q1: int
    lo: int
    hi: int


class _AttentionFunction:
    """The function transformers calls for every attention layer (see the module docstring)."""

    def __init__(self, config: AttentionConfig | str | None) -> None:
        self.config = config
        self.forwards = 0
        """``backend.forward`` calls so far (tests check that the backend really ran)."""
        self._backends: dict[torch.device, Backend] = {}
        self._caches: dict[tuple[Any, ...], KVCache] = {}
        self._lock = threading.Lock()

    def backend(self, device: torch.device) -> Backend:
        with self._lock:
            if device not in self._backends:
                from attnsdk.selection.create import create_backend

                self._backends[device] = create_backend(self.config, device=device)
            return self._backends[device]

    def __call__(
        self,
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        scaling: float | None = None,
        dropout: float = 0.0,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        layer = layer_spec(module, query, key, value, scaling, dropout, **kwargs)
        b, sq, sk = query.shape[0], query.shape[2], key.shape[2]
        sinks = kwargs.get("s_aux")
        # Before the scratch cache is touched: a tensor that requires grad copied into it would
        # keep the cache in the autograd graph for every later call.
        check_no_grad(query=query, key=key, value=value, s_aux=sinks)
        segments = _segments(attention_mask, layer, b, sq, sk, getattr(module, "layer_idx", None))
        return self._attend(query, key, value, layer, segments, sinks), None

    def _attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        layer: LayerSpec,
        segments: list[_Segment],
        sinks: torch.Tensor | None,
    ) -> torch.Tensor:
        b, hq, sq, _ = query.shape
        device = query.device
        # Pages of each batch row, contiguous and after the reserved page 0; segments of the
        # same row share them (nothing is written: k and v go to forward as None).
        spans: dict[int, tuple[int, int, int]] = {}
        next_page = 1
        for s in segments:
            if s.b not in spans:
                spans[s.b] = (next_page, s.lo, s.hi)
                next_page += -(-(s.hi - s.lo) // PAGE_SIZE)
        cache = self._cache(key, value, query.dtype, next_page)
        k_flat = cache.k.view(-1, layer.num_kv_heads, layer.head_dim)
        v_flat = cache.v.view(-1, layer.num_kv_heads, layer.v_dim)
        with torch.no_grad():  # the scratch cache is state shared by every call: no graph in it
            for row, (page, lo, hi) in spans.items():
                start = page * PAGE_SIZE
                k_flat[start : start + hi - lo] = key[row, :, lo:hi].transpose(0, 1)
                v_flat[start : start + hi - lo] = value[row, :, lo:hi].transpose(0, 1)
        width = max((-(-(s.hi - s.lo) // PAGE_SIZE) for s in segments), default=1)
        page_table = [
            [spans[s.b][0] + i for i in range(width)] for s in segments
        ]  # past a row's own pages: never read (seq_lens bound it)
        meta = AttentionMetadata.from_seqlens(
            query_lens=[s.q1 - s.q0 for s in segments],
            seq_lens=[s.hi - s.lo for s in segments],
            page_table=page_table,
            page_size=PAGE_SIZE,
            device=device,
        )
        spans_of_rows = [torch.arange(s.b * sq + s.q0, s.b * sq + s.q1) for s in segments]
        rows = torch.cat(spans_of_rows or [torch.empty(0, dtype=torch.long)]).to(device)
        q = query.transpose(1, 2).reshape(b * sq, hq, -1).index_select(0, rows)
        backend = self.backend(device)
        plan = backend.plan(meta)
        out = backend.forward(
            q.contiguous(),
            None,
            None,
            cache,
            plan,
            layer,
            sinks=None if sinks is None else sinks.detach().float(),
        )
        self.forwards += 1
        full = torch.zeros(b * sq, hq, layer.v_dim, dtype=query.dtype, device=device)
        full.index_copy_(0, rows, out.to(query.dtype))
        return full.view(b, sq, hq, layer.v_dim)

    def _cache(
        self, key: torch.Tensor, value: torch.Tensor, dtype: torch.dtype, num_pages: int
    ) -> KVCache:
        """The scratch cache for these shapes, grown (never shrunk) to ``num_pages``."""
        layout = KVCacheLayout(
            num_kv_heads=key.shape[1],
            head_dim=key.shape[-1],
            page_size=PAGE_SIZE,
            dtype=dtype,
            v_head_dim=value.shape[-1] if value.shape[-1] != key.shape[-1] else None,
        )
        slot = (layout, key.device)
        with self._lock:
            cache = self._caches.get(slot)
            if cache is None or cache.num_pages < num_pages:
                cache = self._caches[slot] = layout.allocate(max(num_pages, 8), device=key.device)
            return cache


def layer_spec(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> LayerSpec:
    """The ``LayerSpec`` of one transformers attention call (its arguments as the model passes
    them: query ``[B, Hq, Sq, D]``, key / value ``[B, Hkv, Sk, D|Dv]``).

    Maps ``scaling``, causality (the call's ``is_causal``, else the module's), the Hugging Face
    ``sliding_window``, ``softcap``, sinks (``s_aux``) and Llama 4's chunked layers. Raises
    ``UnsupportedConfigError`` for what attnsdk does not compute (``dropout > 0``,
    ``position_bias``, ``head_mask``). An engine that routes a model's attention through attnsdk
    itself (examples/mini_engine.py) builds its layers with it too.
    """
    if dropout:
        raise UnsupportedConfigError(
            "attnsdk serves inference only:",
            [_reason("dropout", f"must be 0 (call model.eval()), found {dropout}")],
        )
    for arg in ("position_bias", "head_mask"):
        if kwargs.get(arg) is not None:
            raise UnsupportedConfigError(
                "attnsdk cannot serve this attention call:",
                [_reason(arg, "is not supported; use attn_implementation='eager'")],
            )
    b, hq, _, d = query.shape
    if key.dim() != 4 or key.shape[0] != b or value.shape[:3] != key.shape[:3]:
        raise InvalidInputError(
            "key/value", f"[B={b}, Hkv, Sk, D] tensors", (tuple(key.shape), tuple(value.shape))
        )
    hkv, dv = key.shape[1], value.shape[-1]
    is_causal = kwargs.get("is_causal")
    return LayerSpec(
        num_heads=hq,
        num_kv_heads=hkv,
        head_dim=d,
        v_head_dim=dv if dv != d else None,
        scale=scaling,
        causal=bool(getattr(module, "is_causal", True) if is_causal is None else is_causal),
        sliding_window=kwargs.get("sliding_window"),
        softcap=kwargs.get("softcap"),
        has_sinks=kwargs.get("s_aux") is not None,
        attention_chunk_size=_chunk_size(module),
    )


def _reason(field: str, message: str) -> Reason:
    return Reason(ReasonKind.BATCH, field, message)


def _allowed(mask: torch.Tensor, b: int, sq: int, sk: int) -> torch.Tensor:
    """(B, Sq, Sk) bool: which keys each query may see, from a boolean or additive 4-D mask."""
    if mask.dim() != 4 or mask.shape[0] != b or tuple(mask.shape[2:]) != (sq, sk):
        raise UnsupportedConfigError(
            "attnsdk cannot serve this attention mask:",
            [
                _reason(
                    "attention_mask", f"must be (B={b}, 1, {sq}, {sk}), found {tuple(mask.shape)}"
                )
            ],
        )
    if mask.dtype == torch.bool:
        allowed = mask
    else:
        # An additive mask: 0 where allowed, the dtype's minimum (or -inf) where not. Any other
        # value is a bias attnsdk cannot add.
        blocked = mask <= torch.finfo(mask.dtype).min / 2
        if not bool(((mask == 0) | blocked).all()):
            raise UnsupportedConfigError(
                "attnsdk cannot serve this attention mask:",
                [_reason("attention_mask", "holds a bias (values other than 0 and -inf)")],
            )
        allowed = ~blocked
    if mask.shape[1] != 1 and not bool((allowed == allowed[:, :1]).all()):
        raise UnsupportedConfigError(
            "attnsdk cannot serve this attention mask:",
            [_reason("attention_mask", "differs between heads")],
        )
    return allowed[:, 0].to(torch.bool)


def _chunk_size(module: torch.nn.Module) -> int | None:
    """The chunk size of a chunked-attention layer (Llama 4's ``layer_types[i] ==
    "chunked_attention"``, with ``config.attention_chunk_size``), else None."""
    config = getattr(module, "config", None)
    types = getattr(config, "layer_types", None)
    idx = getattr(module, "layer_idx", None)
    if not isinstance(types, (list, tuple)) or not isinstance(idx, int) or idx >= len(types):
        return None
    if types[idx] != "chunked_attention":
        return None
    return getattr(config, "attention_chunk_size", None)


def _pattern(layer: LayerSpec, query_len: int, seq_len: int, device: torch.device) -> torch.Tensor:
    """(query_len, seq_len) bool: the keys attnsdk lets each query see (DESIGN §2), positions
    counted from the sequence's first key."""
    pos = torch.arange(seq_len - query_len, seq_len, device=device)[:, None]
    j = torch.arange(seq_len, device=device)[None, :]
    seen = torch.ones(query_len, seq_len, dtype=torch.bool, device=device)
    if layer.causal:
        seen &= j <= pos
    if layer.sliding_window is not None:
        seen &= (pos - j) < layer.sliding_window
        if not layer.causal:
            seen &= (j - pos) < layer.sliding_window
    if layer.attention_chunk_size is not None:
        seen &= (j // layer.attention_chunk_size) == (pos // layer.attention_chunk_size)
    return seen


def _segments(
    mask: torch.Tensor | None, layer: LayerSpec, b: int, sq: int, sk: int, layer_idx: Any
) -> list[_Segment]:
    """The attnsdk sequences that compute exactly what ``mask`` asks, or an error saying why not.

    Per batch row: the query rows that see any key, over the run of keys any of them sees;
    a non-causal row with more queries than keys is split into chunks over the same keys.
    The pattern attnsdk computes for them must equal the mask, and rows left out must see
    nothing.
    """
    if mask is not None:
        # One copy to the host: the row-by-row work below would otherwise sync once per row.
        allowed = _allowed(mask, b, sq, sk).cpu()
    elif sq <= sk:  # the model built no mask: no padding, the layer's own pattern
        allowed = _pattern(layer, sq, sk, torch.device("cpu")).expand(b, sq, sk)
    elif not layer.causal and layer.sliding_window is None:
        allowed = torch.ones(b, sq, sk, dtype=torch.bool)
    else:
        raise InvalidInputError("query", f"at most Sk={sk} query tokens (causal or windowed)", sq)
    where = f"layer {layer_idx}" if layer_idx is not None else "attention layer"
    segments: list[_Segment] = []
    for row in range(b):
        seen = allowed[row]
        live = seen.any(dim=1).nonzero().flatten().tolist()
        if not live:
            continue  # a row of padding only: zeros
        keys = seen.any(dim=0).nonzero().flatten().tolist()
        q0, q1, lo, hi = live[0], live[-1] + 1, keys[0], keys[-1] + 1
        parts = _split(row, q0, q1, lo, hi, layer)
        expected = torch.zeros_like(seen)
        for s in parts:
            expected[s.q0 : s.q1, s.lo : s.hi] = _pattern(
                layer, s.q1 - s.q0, s.hi - s.lo, seen.device
            )
        if not torch.equal(expected, seen):
            kind = "causal" if layer.causal else "non-causal"
            window = "" if layer.sliding_window is None else f", window {layer.sliding_window}"
            raise UnsupportedConfigError(
                f"attnsdk cannot serve the attention mask of {where} ({kind}{window}):",
                [
                    _reason(
                        f"attention_mask[{row}]",
                        "is not one bottom-right aligned run of keys per sequence "
                        "(right padding, packed sequences or a custom mask); " + _ADVICE,
                    )
                ],
            )
        segments += parts
    return segments


def _split(row: int, q0: int, q1: int, lo: int, hi: int, layer: LayerSpec) -> list[_Segment]:
    """Rows ``q0:q1`` over keys ``lo:hi``; more queries than keys only without causality or a
    window (each query sees every key), in chunks of at most ``hi - lo`` queries."""
    n = hi - lo
    if q1 - q0 <= n or layer.causal or layer.sliding_window is not None:
        # More queries than keys with causality or a window: no segment, which no live row
        # matches, so the mask check refuses it.
        return [_Segment(row, q0, q1, lo, hi)] if q1 - q0 <= n else []
    return [_Segment(row, i, min(i + n, q1), lo, hi) for i in range(q0, q1, n)]
