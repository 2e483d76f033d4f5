"""An independent float64 oracle of DESIGN §2, written from the text, not from any backend.

It rebuilds each sequence's K/V densely from the paged cache (after the step's writes), then
computes attention head by head with explicit masks, softcap and sinks, and each row's
log-sum-exp as ``torch.logsumexp`` of its logits (the sink one of them). Slow and obvious on
purpose: backends are checked against it, so it must not share their shortcuts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from attnsdk import LayerSpec
    from attnsdk.testing import Batch

_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


@dataclass(frozen=True)
class Semantics:
    """The per-layer knobs of DESIGN §2, resolved (no ``None`` defaults left to interpret)."""

    num_heads: int
    num_kv_heads: int
    scale: float
    causal: bool
    window: int | None
    """Hugging Face sliding window W (the query at p sees p - W + 1 .. p), or None."""
    softcap: float | None
    """None or 0 disables it."""
    chunk: int | None = None
    """Chunked local attention C: positions split into chunks [kC, (k+1)C); a query sees only
    keys of its own chunk (on top of the rules above). None = off."""

    @classmethod
    def of(cls, layer: LayerSpec) -> Semantics:
        return cls(
            num_heads=layer.num_heads,
            num_kv_heads=layer.num_kv_heads,
            scale=layer.head_dim**-0.5 if layer.scale is None else float(layer.scale),
            causal=layer.causal,
            window=layer.sliding_window,
            softcap=layer.softcap,
            chunk=layer.attention_chunk_size,
        )


def to_nhd(x: torch.Tensor, order: str) -> torch.Tensor:
    """A cache tensor as (N, P, Hkv, D), from its storage order (docs/kv_layout.md)."""
    return x if order == "NHD" else x.permute(0, 2, 1, 3)


def store_dtype_value(
    x: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | None
) -> torch.Tensor:
    """What the cache holds for new K/V rows ``x`` (T, Hkv, D): fp8 stores x / scale."""
    if dtype not in _FP8:
        return x.to(dtype)
    y = x.float()
    if scale is not None:
        y = y / _per_head(scale, x.shape[1]).float()[:, None]
    return y.to(dtype)


def load_float64(x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """Stored K/V (..., Hkv, D) as float64; fp8 values are multiplied by their scale."""
    y = x.to(torch.float64)
    if x.dtype in _FP8 and scale is not None:
        y = y * _per_head(scale, x.shape[-2]).to(torch.float64)[:, None]
    return y


def _per_head(scale: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    flat = scale.reshape(-1)
    return flat.expand(num_kv_heads) if flat.numel() == 1 else flat


def cache_after_writes(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    order: str,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    slot_mapping: torch.Tensor,
    num_tokens: int,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The expected (N, P, Hkv, D|Dv) cache after a step: the initial one with only the new
    tokens' slots replaced (negative slots and ``k=v=None`` write nothing)."""
    kc = to_nhd(k_cache, order).clone()
    vc = to_nhd(v_cache, order).clone()
    if k is None or v is None:
        return kc, vc
    page_size = kc.shape[1]
    new_k = store_dtype_value(k[:num_tokens], kc.dtype, k_scale)
    new_v = store_dtype_value(v[:num_tokens], vc.dtype, v_scale)
    for t, slot in enumerate(slot_mapping[:num_tokens].tolist()):
        if slot < 0:
            continue
        page, offset = divmod(slot, page_size)
        kc[page, offset] = new_k[t]
        vc[page, offset] = new_v[t]
    return kc, vc


def visible(query_pos: torch.Tensor, key_pos: torch.Tensor, sem: Semantics) -> torch.Tensor:
    """(n, L) bool: may the query at ``query_pos[i]`` see the key at ``key_pos[j]``?"""
    p = query_pos[:, None]
    j = key_pos[None, :]
    ok = torch.ones(p.shape[0], j.shape[1], dtype=torch.bool)
    if sem.causal:
        ok &= j <= p
    if sem.window is not None:
        ok &= p - j <= sem.window - 1
        if not sem.causal:
            ok &= j - p <= sem.window - 1
    if sem.chunk is not None:
        ok &= j // sem.chunk == p // sem.chunk
    return ok


def attention(
    q: torch.Tensor,
    k_nhd: torch.Tensor,
    v_nhd: torch.Tensor,
    query_lens: list[int],
    seq_lens: list[int],
    page_table: torch.Tensor,
    sem: Semantics,
    *,
    sinks: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    tree_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 output (sum(query_lens), Hq, Dv) and log-sum-exp (sum(query_lens), Hq) for the
    query rows of every sequence.

    ``tree_mask`` (speculative-tree verify, DESIGN "later: a tree mask"): the query row that is
    new token i of its sequence sees new token j only when ``tree_mask[row, j]`` (and j <= i,
    from causality); the keys before the sequence's new tokens stay visible.

    ``k_nhd`` / ``v_nhd`` are the cache after this step's writes; sequence b's key at position
    j lives at page ``page_table[b, j // P]``, offset ``j % P``. A query row that sees no key
    outputs zeros; its log-sum-exp is the sink, or -inf without one.
    """
    page_size = k_nhd.shape[1]
    group = sem.num_heads // sem.num_kv_heads
    dv = v_nhd.shape[-1]
    out = torch.zeros(sum(query_lens), sem.num_heads, dv, dtype=torch.float64)
    lse = torch.full((sum(query_lens), sem.num_heads), float("-inf"), dtype=torch.float64)
    table = page_table.cpu().long()
    row = 0
    for b, (n, length) in enumerate(zip(query_lens, seq_lens)):
        if n == 0:
            continue
        key_pos = torch.arange(length)
        pages = table[b, key_pos // page_size] if length else key_pos
        keys = load_float64(k_nhd[pages, key_pos % page_size], k_scale)  # (L, Hkv, D)
        values = load_float64(v_nhd[pages, key_pos % page_size], v_scale)  # (L, Hkv, Dv)
        query_pos = torch.arange(length - n, length)
        mask = visible(query_pos, key_pos, sem)
        if tree_mask is not None:
            for i in range(n):
                for j in range(n):
                    if not bool(tree_mask[row + i, j]):
                        mask[i, length - n + j] = False
        for h in range(sem.num_heads):
            kv = h // group
            s = (q[row : row + n, h].to(torch.float64) @ keys[:, kv].T) * sem.scale
            if sem.softcap:
                s = sem.softcap * torch.tanh(s / sem.softcap)
            s = s.masked_fill(~mask, float("-inf"))
            logits = s
            if sinks is not None:
                sink_col = torch.full((n, 1), float(sinks[h]), dtype=torch.float64)
                logits = torch.cat([s, sink_col], dim=1)
            if logits.shape[1] == 0:  # no key and no sink: the row stays zero, lse -inf
                continue
            lse[row : row + n, h] = torch.logsumexp(logits, dim=1)
            m = logits.max(dim=1, keepdim=True).values
            m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
            e = torch.exp(logits - m)
            p = e[:, :length] / e.sum(dim=1, keepdim=True)
            o = p @ values[:, kv]
            sees_nothing = ~mask.any(dim=1)
            o[sees_nothing] = 0.0
            out[row : row + n, h] = o
        row += n
    return out, lse


def ragged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    query_lens: list[int],
    seq_lens: list[int],
    sem: Semantics,
    *,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``attention`` over K/V given densely (``forward_ragged``): sequence b's ``seq_lens[b]``
    keys are the next rows of k / v (Tk, Hkv, D | Dv), key i at position i. Each key row is
    made a page of one token, so the rules are ``attention``'s own."""
    starts = [sum(seq_lens[:b]) for b in range(len(seq_lens))]
    width = max(seq_lens, default=0)
    table = torch.tensor(
        [[s + min(i, max(n - 1, 0)) for i in range(width)] for s, n in zip(starts, seq_lens)],
        dtype=torch.long,
    ).reshape(len(seq_lens), width)
    return attention(q, k[:, None], v[:, None], query_lens, seq_lens, table, sem, sinks=sinks)


@dataclass(frozen=True, slots=True)
class Expected:
    """What the oracle says a step produces."""

    out: torch.Tensor
    """(T, Hq, Dv) float64, the real rows."""
    lse: torch.Tensor
    """(T, Hq) float64: natural-log log-sum-exp of each real row (sinks included)."""
    k: torch.Tensor
    """The K cache after the step, NHD."""
    v: torch.Tensor
    """The V cache after the step, NHD."""


def run_oracle(batch: Batch, *, write: bool = True) -> Expected:
    """The output, log-sum-exp and cache an ``attnsdk.testing.Batch`` step must produce.

    ``write=False`` models ``forward(q, None, None, ...)``.
    """
    meta = batch.metadata
    cache = batch.cache
    order = cache.layout.kv_order.value
    write = write and not meta.cross_attention  # cross-attention reads the encoder's keys
    new_v, v_scale = batch.v, batch.v_scale
    if cache.layout.mla:  # MLA: V is the latent, the first Dv dims of K (and K's scale reads it)
        new_v, v_scale = batch.k[..., : cache.layout.v_dim], batch.k_scale
    kc, vc = cache_after_writes(
        cache.k,
        cache.v,
        order,
        batch.k if write else None,
        new_v if write else None,
        meta.slot_mapping.cpu(),
        meta.num_tokens,
        batch.k_scale,
        v_scale,
    )
    qsl = meta.query_start_loc_cpu.tolist()
    out, lse = attention(
        batch.q[: meta.num_tokens],
        kc,
        vc,
        [qsl[i + 1] - qsl[i] for i in range(len(qsl) - 1)],
        meta.seq_lens_cpu.tolist(),
        meta.page_table,
        Semantics.of(batch.layer),
        sinks=batch.sinks,
        k_scale=batch.k_scale,
        v_scale=v_scale,
        tree_mask=None if meta.tree_mask is None else meta.tree_mask.cpu(),
    )
    return Expected(out, lse, kc, vc)


def assert_same_bits(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Bitwise equality (fp8 included), naming the first differing (page, offset)."""
    a = actual.contiguous().view(torch.uint8).reshape(*actual.shape[:2], -1)
    e = expected.contiguous().view(torch.uint8).reshape(*expected.shape[:2], -1)
    if a.shape != e.shape:
        raise AssertionError(f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}")
    diff = (a != e).any(dim=-1)
    if bool(diff.any()):
        page, offset = (int(i) for i in torch.nonzero(diff)[0])
        raise AssertionError(
            f"{what}: {int(diff.sum())} (page, offset) entries differ, first at "
            f"page {page} offset {offset} (slot {page * actual.shape[1] + offset})"
        )
