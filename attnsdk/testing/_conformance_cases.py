"""The cases of ``attnsdk.testing.conformance``: layers, batch presets and the helpers that
compare a backend's cache with the reference's (a private module; the suite re-exports
``FEATURES``, ``PRESETS``, ``CHUNK_PRESETS`` and ``FeatureCase``)."""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pytest
import torch

from attnsdk.backends.base import BackendBase
from attnsdk.contract.kv import KVCache, KVCacheLayout
from attnsdk.contract.layer import LayerSpec
from attnsdk.contract.metadata import AttentionMetadata
from attnsdk.testing._spec import BatchSpec

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    from attnsdk.contract.backend import Backend
    from attnsdk.selection.config import AttentionConfig
    from attnsdk.testing._batch import PageOrder

_E4M3 = torch.float8_e4m3fn
PACKED = "packed"
"""Storage order of the layout cases: vLLM's [N, Hkv, P, D + Dv] tensor, K and V its halves."""
_ORDERS = ("NHD", "HND", PACKED)
_PAGE_ORDERS: tuple[PageOrder, ...] = ("shuffled", "interleaved", "contiguous")


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
    "fp8-e4m3": FeatureCase(_GQA, kv_dtype=_E4M3),
    "fp8-e4m3-per-head": FeatureCase(_GQA, kv_dtype=_E4M3, per_head_scales=True),
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
    "fp8-noncausal": FeatureCase({**_GQA, "causal": False}, kv_dtype=_E4M3),
    "mla": FeatureCase(_MLA),
    "mla-small": FeatureCase(
        {**_MLA, "num_heads": 8, "head_dim": 96, "v_head_dim": 64, "scale": 48**-0.5}
    ),
    "mla-fp8": FeatureCase(_MLA, kv_dtype=_E4M3),
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

_DTYPE_FEATURES = ("gqa", "everything", "fp8-e4m3")
_LSE_FEATURES = (
    "gqa", "mqa", "window", "noncausal", "noncausal-window", "softcap", "scale", "sinks",
    "v-head-dim", "fp8-e4m3", "everything",
)  # fmt: skip
_SPLIT_FEATURES = ("gqa", "softcap", "sinks")
"""Layers whose keys split into a prefix and a suffix pass exactly (no window)."""
_LSE_TOLERANCE = (5e-3, 1e-3)
"""(atol, rtol) of the log-sum-exp: fp32 from the same inputs on both sides; the slack covers
approximate exp2 / tanh (softcap) instructions. A missing sink term or a base-2 value misses it
by far more (the sink cases check that sinks move the lse by 10 * atol at least)."""
_CROSS_FEATURES = ("noncausal", "noncausal-sinks-softcap", "fp8-noncausal")
"""Layers a cross-attention step runs on (non-causal, no window, no chunks: ``attnsdk.features.cross``)."""
_TREE_FEATURES = ("gqa", "mqa", "softcap", "sinks", "v-head-dim", "fp8-e4m3", "mla", "mla-small")
"""Layers a tree verify step runs on (causal, no window, no chunks: ``attnsdk.features.tree``)."""
_TREE_PRESETS = ("verify", "mixed", "prefill", "empty_rows")
"""Trees over contexts, next to decodes and prefills, without context, and beside empty rows."""
_CHUNKED = ("chunked", "chunked-window", "chunked-noncausal", "chunked-sinks", "chunked-24")
_MLA_FEATURES = ("mla", "mla-small", "mla-fp8")
_MLA_PRESETS = ("decode", "prefill", "chunked_prefill", "mixed", "verify", "empty_rows")
"""MLA serves every batch kind the absorbed way (SGLang and vLLM send decodes, verifies and
short extends down it; prefills too when they choose so)."""


_RAGGED_FEATURES = (
    "mha", "gqa", "mqa", "window", "softcap", "scale", "sinks", "v-head-dim", "everything",
    "chunked", "noncausal-window",
)  # fmt: skip
_RAGGED_PREFIX_FEATURES = ("noncausal", "noncausal-sinks-softcap")
"""Layers of ragged steps: every layer rule over new tokens and over longer keys; prefix
chunks (every query sees every key) on the non-causal layers cross-attention takes."""
RAGGED_KINDS = ("prefill", "extend", "prefix")


@dataclass(frozen=True, slots=True)
class RaggedStep:
    """One random ``forward_ragged`` call: its metadata and inputs."""

    metadata: AttentionMetadata
    q: torch.Tensor
    k: torch.Tensor
    """(sum(seq_lens) + 3, Hkv, D): three rows past the last sequence's, which no key is."""
    v: torch.Tensor
    sinks: torch.Tensor | None


def ragged_step(
    layer: LayerSpec,
    kind: str,
    seed: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> RaggedStep:
    """A random ragged step of ``kind``: "prefill" (keys are the new tokens), "extend" (keys
    reach further back) or "prefix" (a cross-attention chunk: any number of keys, some none).
    Besides its random sequences, each step holds, in a random place, the ones on which the
    rules differ whatever the seed (``_RAGGED_ROWS`` and ``edge_rows(layer)``). Odd seeds drop
    ``key_start_loc``, which backends then derive. Sinks move rows well past the tolerance, as
    in ``BackendConformance._batch``, and are bf16 values."""
    rng = random.Random(f"ragged-{kind}-{seed}")
    b = rng.randint(1, 6)
    q = [rng.choice([0, 1, rng.randint(2, 40)]) for _ in range(b)]
    if kind == "prefill":
        s = list(q)
    elif kind == "extend":
        s = [n + rng.randint(0, 50) for n in q]
    else:
        s = [rng.choice([0, rng.randint(1, 60)]) for _ in range(b)]
    fixed = _RAGGED_ROWS[kind] + ([] if kind == "prefix" else edge_rows(layer))
    rows = [*zip(q, s), *(r for r in fixed if kind != "prefill" or r[0] == r[1])]
    rng.shuffle(rows)
    q, s = [n for n, _ in rows], [m for _, m in rows]
    meta = AttentionMetadata.for_ragged(q, s, device=device, cross_attention=kind == "prefix")
    if seed % 2:
        meta = dataclasses.replace(meta, key_start_loc=None)
    gen = torch.Generator().manual_seed(seed)
    keys = sum(s) + 3
    q_, k, v = (
        torch.randn(n, h, d, generator=gen).to(device=device, dtype=dtype)
        for n, h, d in (
            (meta.num_tokens, layer.num_heads, layer.head_dim),
            (keys, layer.num_kv_heads, layer.head_dim),
            (keys, layer.num_kv_heads, layer.v_dim),
        )
    )
    # bf16 values: FA3 reads sinks as bf16 (its documented rounding, which the paged cases
    # model with ``reference_batch``); a row of few keys would show the difference.
    sinks = (1.0 + 2.0 * torch.randn(layer.num_heads, generator=gen)).bfloat16().float()
    return RaggedStep(meta, q_, k, v, sinks.to(device) if layer.has_sinks else None)


_RAGGED_ROWS: dict[str, list[tuple[int, int]]] = {
    "prefill": [(5, 5)],
    "extend": [(5, 12)],
    "prefix": [(4, 9), (3, 2), (2, 0)],
}
"""(query_len, seq_len) rows every ragged step of a kind holds: several queries, where causal
and non-causal differ (with keys before them in an extend); in a prefix chunk, several queries
over more keys and over fewer (causal masking would hide keys from all but the last query), and
queries without keys (zeros, lse -inf or the sink)."""


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


def _mixed(seed: int) -> BatchSpec:
    return BatchSpec.mixed(batch_size=6, max_len=60, seed=seed)


def _chunk_edges_64(seed: int) -> BatchSpec:
    return BatchSpec.chunk_edges(64, seed=seed)


CHUNK_PRESETS: dict[str, Callable[[int], BatchSpec]] = {
    "chunk-edges": lambda seed: BatchSpec.chunk_edges(32, seed=seed),
    "decode": lambda seed: BatchSpec.decode(batch_size=8, max_context=200, seed=seed),
    "verify": lambda seed: BatchSpec.verify(batch_size=4, draft_tokens=4, seed=seed),
    "mixed+padding": lambda seed: BatchSpec.mixed(4, max_len=120, seed=seed).with_padding(2),
}
"""Batch preset name -> spec for a seed, for chunks of 32: rows on chunk edges, decode and
speculative verify rows anywhere in a chunk, a mixed batch with graph padding rows."""


def _rows(table: torch.Tensor, spans: list[tuple[int, int]]) -> torch.Tensor:
    """A page table whose row b is ``table[b, start:stop]``, padded with the reserved page 0."""
    width = max(1, *(stop - start for start, stop in spans))
    rows = torch.zeros(len(spans), width, dtype=table.dtype)
    for b, (start, stop) in enumerate(spans):
        rows[b, : stop - start] = table[b, start:stop]
    return rows


def _layers_for(layout: KVCacheLayout) -> list[LayerSpec]:
    """The feature layers that fit ``layout``'s KV heads and head dims."""
    dims = (layout.num_kv_heads, layout.head_dim, layout.v_dim)
    layers = [LayerSpec(**f.layer) for f in FEATURES.values() if f.kv_dtype is None]
    return [lay for lay in layers if (lay.num_kv_heads, lay.head_dim, lay.v_dim) == dims]


def _base(subject: Backend) -> BackendBase:
    if not isinstance(subject, BackendBase):
        pytest.skip(f"{type(subject).__name__} is no BackendBase: it has no prepare / warmup")
    return subject


def _name(config: str | AttentionConfig) -> str:
    return config if isinstance(config, str) else config.backend


def _dtype_id(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _packed(cache: KVCache) -> KVCache:
    """An HND cache as vLLM stores it: one [N, Hkv, P, D + Dv] tensor, K and V its halves."""
    d = cache.layout.head_dim
    both = torch.cat([cache.k, cache.v], dim=-1)
    return cache.layout.wrap(both[..., :d], both[..., d:])


def _copy(cache: KVCache) -> KVCache:
    """A copy that keeps the storage arrangement (a packed cache stays packed)."""
    if cache.layout.mla:  # one latent tensor: V is a view of it
        return cache.layout.wrap(cache.k.clone())
    same = cache.k.untyped_storage().data_ptr() == cache.v.untyped_storage().data_ptr()
    if same:
        return _packed(cache)
    return KVCache(cache.layout, cache.k.clone(), cache.v.clone())


def _entries(x: torch.Tensor) -> torch.Tensor:
    """(N, P, Hkv, D) as (N, P, bytes) on the CPU, to compare bits per slot."""
    return x.contiguous().cpu().view(torch.uint8).reshape(x.shape[0], x.shape[1], -1)


def _fp8_step(dtype: torch.dtype) -> tuple[float, float]:
    """(atol, rtol) of one step of ``dtype``: its smallest subnormal, 2 ** -mantissa bits."""
    return (2.0**-9, 2.0**-3) if dtype == _E4M3 else (2.0**-16, 2.0**-2)


def _slots(meta: AttentionMetadata) -> Iterator[int]:
    yield from (s for s in meta.slot_mapping[: meta.num_tokens].tolist() if s >= 0)


def _assert_same_cache(
    got: KVCache,
    want: KVCache,
    meta: AttentionMetadata,
    *,
    exact: bool,
    what: str = "step",
) -> None:
    """Every slot as ``want`` has it: bit-exact, or for fp8 slots the step writes, within one
    fp8 step (a kernel's division may round the other way). Names the first bad slot."""
    p = got.layout.page_size
    written = torch.zeros(got.num_pages * p, dtype=torch.bool)
    written[list(_slots(meta))] = True
    written = written.view(-1, p)
    for name, g, w in (("K", got.k_nhd, want.k_nhd), ("V", got.v_nhd, want.v_nhd)):
        bad = (_entries(g) != _entries(w)).any(dim=-1)
        if not exact:
            atol, rtol = _fp8_step(g.dtype)
            gf, wf = g.float().cpu(), w.float().cpu()
            near = ((gf - wf).abs() <= atol + rtol * wf.abs()).flatten(2).all(dim=-1)
            bad &= ~(written & near)
        if bool(bad.any()):
            page, offset = (int(i) for i in torch.nonzero(bad)[0])
            slot = page * p + offset
            role = "a slot it writes" if bool(written[page, offset]) else "a slot it must not touch"
            raise AssertionError(
                f"{name} cache after the {what} differs from the reference's at {int(bad.sum())} "
                f"slots; first: slot {slot} (page {page}, offset {offset}), {role}"
            )


def _branches(meta: AttentionMetadata) -> bool:
    """Whether some draft token of ``meta``'s tree does not see every earlier new token of its
    sequence (the tree is not a plain causal chain, so ignoring it changes the output)."""
    mask = meta.tree_mask
    if mask is None or not meta.num_tokens:
        return False
    qsl = meta.query_start_loc_cpu.long()
    qlen = qsl[1:] - qsl[:-1]
    rows = mask[: meta.num_tokens].cpu()
    index = torch.arange(meta.num_tokens) - torch.repeat_interleave(qsl[:-1], qlen)
    cols = torch.arange(rows.shape[1])
    earlier = cols[None, :] < index[:, None]
    return bool((earlier & ~rows).any())


def _with_siblings(meta: AttentionMetadata) -> AttentionMetadata:
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
