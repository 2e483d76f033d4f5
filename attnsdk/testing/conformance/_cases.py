"""The cases' data: the feature layers (``FEATURES``), the batch presets (``PRESETS``,
``CHUNK_PRESETS``), which features and presets each case runs, and the rows that make a batch
tell a rule apart whatever its seed (``edge_rows``, sibling drafts in a tree)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from attnsdk.testing._spec import BatchSpec

if TYPE_CHECKING:
    from collections.abc import Callable

    from attnsdk.contract.layer import LayerSpec
    from attnsdk.contract.metadata import AttentionMetadata

E4M3 = torch.float8_e4m3fn
PACKED = "packed"
"""Storage order of the layout cases: vLLM's [N, Hkv, P, D + Dv] tensor, K and V its halves."""
ORDERS = ("NHD", "HND", PACKED)


@dataclass(frozen=True, slots=True)
class FeatureCase:
    """One feature case: the layer's and the layout's options on top of the plain layer."""

    layer: dict[str, Any]
    kv_dtype: torch.dtype | None = None
    per_head_scales: bool = False


_GQA = {"num_heads": 8, "num_kv_heads": 2, "head_dim": 64}
_MLA = {  # DeepSeek V3 on 8 GPUs: 16 heads over the 512 + 64 latent, scale 192 ** -0.5
    "num_heads": 16,
    "num_kv_heads": 1,
    "head_dim": 576,
    "v_head_dim": 512,
    "scale": 192**-0.5,
    "mla": True,
}
FEATURES: dict[str, FeatureCase] = {
    "mha": FeatureCase({"num_heads": 4, "num_kv_heads": 4, "head_dim": 64}),
    "gqa": FeatureCase(_GQA),
    "mqa": FeatureCase({**_GQA, "num_kv_heads": 1}),
    "window": FeatureCase({**_GQA, "sliding_window": 13}),
    "noncausal": FeatureCase({**_GQA, "causal": False}),
    "noncausal-window": FeatureCase({**_GQA, "causal": False, "sliding_window": 9}),
    "softcap": FeatureCase({**_GQA, "softcap": 2.0}),
    "scale": FeatureCase({**_GQA, "scale": 0.3}),
    "sinks": FeatureCase({**_GQA, "has_sinks": True}),
    "sinks-window": FeatureCase({**_GQA, "has_sinks": True, "sliding_window": 9}),
    "v-head-dim": FeatureCase({**_GQA, "head_dim": 192, "v_head_dim": 128}),
    "fp8-e4m3": FeatureCase(_GQA, kv_dtype=E4M3),
    "fp8-e4m3-per-head": FeatureCase(_GQA, kv_dtype=E4M3, per_head_scales=True),
    "everything": FeatureCase({**_GQA, "sliding_window": 17, "softcap": 5.0, "has_sinks": True}),
    "chunked": FeatureCase({**_GQA, "attention_chunk_size": 32}),
    "chunked-64": FeatureCase({**_GQA, "attention_chunk_size": 64}),
    "chunked-window": FeatureCase({**_GQA, "attention_chunk_size": 32, "sliding_window": 13}),
    "chunked-noncausal": FeatureCase({**_GQA, "causal": False, "attention_chunk_size": 32}),
    "chunked-sinks": FeatureCase({**_GQA, "attention_chunk_size": 32, "has_sinks": True}),
    "chunked-24": FeatureCase({**_GQA, "attention_chunk_size": 24}),
    "noncausal-sinks-softcap": FeatureCase(
        {**_GQA, "causal": False, "has_sinks": True, "softcap": 3.0}
    ),
    "fp8-noncausal": FeatureCase({**_GQA, "causal": False}, kv_dtype=E4M3),
    "mla": FeatureCase(_MLA),
    "mla-small": FeatureCase(
        {**_MLA, "num_heads": 8, "head_dim": 96, "v_head_dim": 64, "scale": 48**-0.5}
    ),
    "mla-fp8": FeatureCase(_MLA, kv_dtype=E4M3),
}
"""Feature name -> case. "mha" is the plain layer of the preset cases; "gqa" of the others.
"chunked-24" is not a multiple of the usual page sizes, which virtual-batch backends refuse.
"scale" is not head_dim ** -0.5 (MLA's is not either, but not every backend serves MLA).
"mla" has DeepSeek's dims; "mla-small" the same shape, small enough for kernels with a head-dim
limit (a backend serves the dims it declares, ``Capabilities.mla_dims``)."""


def _preset(name: str) -> Callable[[int], BatchSpec]:
    return lambda seed: BatchSpec.presets(seed)[name]


PRESETS: dict[str, Callable[[int], BatchSpec]] = {
    **{name: _preset(name) for name in BatchSpec.presets()},
    "mixed+padding": lambda seed: BatchSpec.mixed(4, max_len=40, seed=seed).with_padding(2, 3),
}
"""Batch preset name -> spec for a seed: ``BatchSpec.presets()`` (decode, prefill, chunked
prefill, mixed, speculative verify, long context, empty rows, graph padding) and padding rows of
several tokens."""


def mixed(seed: int) -> BatchSpec:
    """The mixed batch of the feature, layout and dtype cases."""
    return BatchSpec.mixed(batch_size=6, max_len=60, seed=seed)


def chunk_edges_64(seed: int) -> BatchSpec:
    return BatchSpec.chunk_edges(64, seed=seed)


CHUNK_PRESETS: dict[str, Callable[[int], BatchSpec]] = {
    "chunk-edges": lambda seed: BatchSpec.chunk_edges(32, seed=seed),
    "decode": lambda seed: BatchSpec.decode(batch_size=8, max_context=200, seed=seed),
    "verify": lambda seed: BatchSpec.verify(batch_size=4, draft_tokens=4, seed=seed),
    "mixed+padding": lambda seed: BatchSpec.mixed(4, max_len=120, seed=seed).with_padding(2),
}
"""Batch preset name -> spec for a seed, for chunks of 32: rows on chunk edges, decode and
speculative verify rows anywhere in a chunk, a mixed batch with graph padding rows."""

# -- which features and presets each case runs ---------------------------------------------------

DTYPE_FEATURES = ("gqa", "everything", "fp8-e4m3")
CHUNKED = ("chunked", "chunked-window", "chunked-noncausal", "chunked-sinks", "chunked-24")
LSE_FEATURES = (
    "gqa", "mqa", "window", "noncausal", "noncausal-window", "softcap", "scale", "sinks",
    "v-head-dim", "fp8-e4m3", "everything",
)  # fmt: skip
SPLIT_FEATURES = ("gqa", "softcap", "sinks")
"""Layers whose keys split into a prefix and a suffix pass exactly (no window)."""
CROSS_FEATURES = ("noncausal", "noncausal-sinks-softcap", "fp8-noncausal")
"""Layers a cross-attention step runs on (non-causal, no window, no chunks: ``attnsdk.features.cross``)."""
TREE_FEATURES = ("gqa", "mqa", "softcap", "sinks", "v-head-dim", "fp8-e4m3", "mla", "mla-small")
"""Layers a tree verify step runs on (causal, no window, no chunks: ``attnsdk.features.tree``)."""
TREE_PRESETS = ("verify", "mixed", "prefill", "empty_rows")
"""Trees over contexts, next to decodes and prefills, without context, and beside empty rows."""
MLA_FEATURES = ("mla", "mla-small", "mla-fp8")
MLA_PRESETS = ("decode", "prefill", "chunked_prefill", "mixed", "verify", "empty_rows")
"""MLA serves every batch kind the absorbed way (SGLang and vLLM send decodes, verifies and
short extends down it; prefills too when they choose so)."""
RAGGED_FEATURES = (
    "mha", "gqa", "mqa", "window", "softcap", "scale", "sinks", "v-head-dim", "everything",
    "chunked", "noncausal-window",
)  # fmt: skip
RAGGED_PREFIX_FEATURES = ("noncausal", "noncausal-sinks-softcap")
"""Layers of ragged steps: every layer rule over new tokens and over longer keys; prefix
chunks (every query sees every key) on the non-causal layers cross-attention takes."""

# -- rows that tell the rules apart --------------------------------------------------------------


def edge_rows(layer: LayerSpec) -> list[tuple[int, int]]:
    """(query_len, seq_len) rows on which ``layer``'s position rules bite, whatever the seed:
    added to every batch of a layer with a sliding window or attention chunks (rows with
    query_len == seq_len are prefills; a ragged prefill keeps only those).

    With a window W: two queries over W + 1 keys, at positions W - 1 (its window holds keys
    0..W-1 exactly: one narrower misses key 0) and W (its window just leaves out key 0: one
    wider sees it); and a prefill of W + 2 tokens, where the same boundaries fall between new
    tokens (and, non-causal, on the far side too). With chunks of C: queries at C - 1, C and
    C + 1 over C + 2 keys (the last of the first chunk, then two that must not see it), and
    a prefill across the boundary.
    """
    rows = []
    if layer.sliding_window is not None:
        w = layer.sliding_window
        rows += [(2, w + 1), (w + 2, w + 2)]
    if layer.attention_chunk_size is not None:
        c = layer.attention_chunk_size
        rows += [(3, c + 2), (c + 2, c + 2)]
    return rows


def with_siblings(meta: AttentionMetadata) -> AttentionMetadata:
    """``meta`` with new token 1 of its first sequence of several made a root, a sibling of
    token 0 (itself always a root): a token that must not see an earlier one, so the tree is
    no causal chain whatever the random parents were. Token 1's descendants lose token 0 too."""
    if meta.tree_mask is None:
        return meta
    qsl = meta.query_start_loc_cpu.tolist()
    first = next((b for b in range(meta.num_seqs) if qsl[b + 1] - qsl[b] >= 2), None)
    if first is None:
        return meta
    mask = meta.tree_mask.cpu().clone()
    rows = mask[qsl[first] : qsl[first + 1]]  # a view: the writes below go to ``mask``
    rows[rows[:, 1], 0] = False
    return dataclasses.replace(meta, tree_mask=mask.to(meta.device))
