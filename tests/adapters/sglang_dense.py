"""A float64 oracle of one SGLang attention step, written from SGLang's conventions.

It never touches a page table: each request's K/V are gathered token by token through
``req_to_token`` (SGLang's own map) after the step's writes at ``out_cache_loc``, and attention is
computed head by head with explicit position masks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from attnsdk import LayerSpec
    from attnsdk.adapters.sglang.testing import SGLangBatch


@dataclass(frozen=True)
class Expected:
    out: torch.Tensor
    """(T, Hq * Dv) float64; rows of padding tokens are zero."""
    k_buffer: torch.Tensor
    """The layer's K buffer after the step, in its storage dtype."""
    v_buffer: torch.Tensor
    lse: torch.Tensor
    """(T, Hq) float64 natural-log log-sum-exp (sinks included); -inf on padding rows."""


def expected_step(
    batch: SGLangBatch,
    layer: LayerSpec,
    *,
    write: bool = True,
    sinks: torch.Tensor | None = None,
) -> Expected:
    """What one layer must return and leave in its buffers (call before running the step)."""
    fb = batch.forward_batch
    pool = batch.model_runner.token_to_kv_pool
    hq, hkv, d, dv = layer.num_heads, layer.num_kv_heads, layer.head_dim, layer.v_dim
    t = batch.q.shape[0]
    real = batch.real_tokens
    k_buf = pool.k_buffer[0].detach().cpu().clone()
    v_buf = pool.v_buffer[0].detach().cpu().clone()
    if write:
        loc = fb.out_cache_loc.cpu()[real]
        k_buf[loc] = batch.k.cpu().view(t, hkv, d)[real].to(k_buf.dtype)
        v_buf[loc] = batch.v.cpu().view(t, hkv, dv)[real].to(v_buf.dtype)
    r2t = batch.model_runner.req_to_token_pool.req_to_token.cpu().long()
    rows = fb.req_pool_indices.cpu().tolist()
    q_all = batch.q.cpu().double().view(t, hq, d)
    out = torch.zeros(t, hq, dv, dtype=torch.float64)
    lse = torch.full((t, hq), float("-inf"), dtype=torch.float64)
    scale = layer.softmax_scale
    group = hq // hkv
    # A tree verify's mask, read as SGLang lays it out: per row, D x (prefix + D) booleans.
    # A tree: EAGLE topk > 1, or NGRAM (its verify input has no topk: always a tree).
    custom = getattr(fb.spec_info, "custom_mask", None)
    topk = getattr(fb.spec_info, "topk", None)
    tree = custom.cpu() if custom is not None and (topk is None or topk > 1) else None
    offset = 0
    start = 0
    for b, (n, total) in enumerate(zip(batch.spec.query_lens, batch.spec.seq_lens)):
        block = offset
        if tree is not None:
            offset += n * (int(fb.seq_lens_cpu[b]) + n)
        if batch.spec.padded[b]:
            start += n
            continue
        slots = r2t[rows[b], :total]
        keys = k_buf[slots].double()  # (total, Hkv, D)
        values = v_buf[slots].double()
        for i in range(n):
            p = total - n + i
            for h in range(hq):
                kh = h // group
                scores = (keys[:, kh] @ q_all[start + i, h]) * scale
                if layer.softcap:
                    scores = layer.softcap * torch.tanh(scores / layer.softcap)
                allowed = torch.ones(total, dtype=torch.bool)
                j = torch.arange(total)
                if layer.causal:
                    allowed &= j <= p
                if layer.sliding_window is not None:
                    allowed &= j >= p - layer.sliding_window + 1
                    if not layer.causal:
                        allowed &= j <= p + layer.sliding_window - 1
                if layer.attention_chunk_size is not None:
                    allowed &= j // layer.attention_chunk_size == p // layer.attention_chunk_size
                if tree is not None:
                    allowed &= tree[block + i * total : block + (i + 1) * total]
                logits = scores.masked_fill(~allowed, float("-inf"))
                if sinks is not None:
                    logits = torch.cat([logits, sinks[h].double().cpu().view(1)])
                probs = torch.softmax(logits, 0)[:total]
                out[start + i, h] = probs @ values[:, kh]
                lse[start + i, h] = torch.logsumexp(logits, 0)
        start += n
    return Expected(out.view(t, hq * dv), k_buf, v_buf, lse)
