"""``reference``: pure-PyTorch paged attention, the oracle of every test.

fp32 accumulation, one vectorised pass per sequence over its pages, every semantic of DESIGN §2
(GQA/MQA, bottom-right causal or non-causal, sliding window, softcap, sinks, fp8 KV). Runs on
CPU and CUDA; it is the default on a machine without a GPU.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from pydantic import BaseModel, ConfigDict, Field

from attnsdk._backend import Plan, check_forward_args
from attnsdk._capabilities import (
    Capabilities,
    Feature,
    GraphSupport,
    Reason,
    capability_reasons,
)
from attnsdk._graph import GraphHooks
from attnsdk._kv import FP8_KV_DTYPES, KVOrder, dequantize

if TYPE_CHECKING:
    from attnsdk._kv import KVCache, KVCacheLayout
    from attnsdk._layer import LayerSpec
    from attnsdk._metadata import AttentionMetadata

__all__ = ["ReferenceBackend", "ReferenceOptions"]


class ReferenceOptions(BaseModel):
    """Options of the ``reference`` backend."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_scores: int = Field(default=1 << 25, gt=0)
    """Upper bound on score-matrix elements held at once; long prefills are split in query chunks."""


class ReferenceBackend(GraphHooks):
    """The oracle: exact semantics, modest speed. See module docstring.

    Not capturable (it loops on host lengths), but its ``GraphHooks`` run eagerly, which lets
    adapters test their CUDA-graph paths on a CPU.
    """

    name = "reference"
    capabilities = Capabilities(
        devices=frozenset({"cpu", "cuda"}),
        dtypes=frozenset({torch.float16, torch.bfloat16, torch.float32}),
        kv_dtypes=FP8_KV_DTYPES,
        max_head_dim=1024,
        orders=frozenset(KVOrder),
        features=frozenset(Feature),
        graph_support=GraphSupport.NONE,
    )

    def __init__(self, options: ReferenceOptions | None = None) -> None:
        self.options = options or ReferenceOptions()

    @classmethod
    def environment_reasons(cls, device: torch.device | str | None = None) -> list[Reason]:
        return capability_reasons(cls.capabilities, None, None, device or "cpu")

    def unsupported_reasons(
        self,
        layer: LayerSpec | None = None,
        layout: KVCacheLayout | None = None,
        device: torch.device | str | None = None,
    ) -> list[Reason]:
        return capability_reasons(self.capabilities, layer, layout, device or "cpu")

    def plan(self, meta: AttentionMetadata) -> Plan:
        return Plan(meta)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        cache: KVCache,
        plan: Plan,
        layer: LayerSpec,
        *,
        sinks: torch.Tensor | None = None,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        check_forward_args(
            q, k, v, cache, plan, layer, sinks=sinks, k_scale=k_scale, v_scale=v_scale, out=out
        )
        meta = plan.metadata
        if k is not None and v is not None:
            t = meta.num_tokens
            cache.store(k[:t], v[:t], meta.slot_mapping[:t], k_scale=k_scale, v_scale=v_scale)
        if out is None:
            out = torch.empty(
                q.shape[0], layer.num_heads, layer.v_dim, dtype=q.dtype, device=q.device
            )
        qsl = meta.query_start_loc_cpu.tolist()
        seq_lens = meta.seq_lens_cpu.tolist()
        for b, seq_len in enumerate(seq_lens):
            q0, q1 = qsl[b], qsl[b + 1]
            if q1 > q0 and seq_len == 0:
                # A padding row with tokens but no keys (DESIGN §2 allows seq_len 0): zeros.
                out[q0:q1] = 0
            elif q1 > q0:
                kb, vb = self._gather(cache, meta.page_table[b], seq_len, k_scale, v_scale)
                self._attend(q[q0:q1], kb, vb, layer, sinks, out[q0:q1])
        return out

    @staticmethod
    def _gather(
        cache: KVCache,
        page_row: torch.Tensor,
        seq_len: int,
        k_scale: torch.Tensor | None,
        v_scale: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 K (L, Hkv, D) and V (L, Hkv, Dv) of one sequence, in position order."""
        p = cache.layout.page_size
        pages = page_row[: (seq_len + p - 1) // p].long()
        kb = cache.k_nhd[pages].flatten(0, 1)[:seq_len]
        vb = cache.v_nhd[pages].flatten(0, 1)[:seq_len]
        return dequantize(kb, k_scale), dequantize(vb, v_scale)

    def _attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: LayerSpec,
        sinks: torch.Tensor | None,
        out: torch.Tensor,
    ) -> None:
        """One sequence: q (n, Hq, D) at the last n of L positions, k/v (L, Hkv, D|Dv) fp32."""
        n, length = q.shape[0], k.shape[0]
        hkv, g = layer.num_kv_heads, layer.group_size
        chunk = max(1, self.options.max_scores // max(1, layer.num_heads * length))
        key_pos = torch.arange(length, device=q.device)
        sink = None if sinks is None else sinks.float().view(hkv, g, 1, 1)
        for c0 in range(0, n, chunk):
            qc = q[c0 : c0 + chunk].float().unflatten(1, (hkv, g))  # (c, Hkv, G, D)
            scores = torch.einsum("qhgd,khd->hgqk", qc, k) * layer.softmax_scale
            if layer.has_softcap:
                cap = float(layer.softcap or 0.0)
                scores = torch.tanh(scores / cap) * cap
            q_pos = length - n + c0 + torch.arange(qc.shape[0], device=q.device)
            rel = key_pos[None, :] - q_pos[:, None]  # key position minus query position
            allowed = torch.ones_like(rel, dtype=torch.bool)
            if layer.causal:
                allowed &= rel <= 0
            if layer.sliding_window is not None:
                allowed &= rel >= -layer.window_left
                if not layer.causal:
                    allowed &= rel <= layer.window_left
            scores = scores.masked_fill(~allowed, float("-inf"))
            row_max = scores.amax(dim=-1, keepdim=True)
            if sink is not None:
                row_max = torch.maximum(row_max, sink.expand_as(row_max))
            # A row that sees no key (and has no sink) has max -inf; it outputs zeros.
            row_max = torch.nan_to_num(row_max, neginf=0.0)
            probs = torch.exp(scores - row_max)
            denom = probs.sum(dim=-1, keepdim=True)
            if sink is not None:
                denom = denom + torch.exp(sink - row_max)
            probs = probs / denom.clamp_min(torch.finfo(torch.float32).tiny)
            o = torch.einsum("hgqk,khd->qhgd", probs, v)
            out[c0 : c0 + qc.shape[0]] = o.flatten(1, 2).to(out.dtype)
