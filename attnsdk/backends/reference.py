"""``reference``: pure-PyTorch paged attention, the oracle of every test.

fp32 accumulation, one vectorised pass per sequence over its pages, every semantic of DESIGN §2
(GQA/MQA, bottom-right causal or non-causal, sliding window, chunked local attention, softcap,
sinks, fp8 KV, tree verify masks) and the log-sum-exp (``lse=``: the log of the fp32 softmax denominator). Runs on
CPU and CUDA; it is the default on a machine without a GPU.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from pydantic import BaseModel, ConfigDict, Field

from attnsdk.backends.base import AttendArgs, BackendBase, RaggedArgs
from attnsdk.contract.capabilities import Capabilities, Feature, GraphSupport
from attnsdk.contract.kv import FP8_KV_DTYPES, KVOrder
from attnsdk.contract.validate import check_pages

if TYPE_CHECKING:
    from attnsdk.contract.kv import KVCache
    from attnsdk.contract.layer import LayerSpec
    from attnsdk.contract.plan import Plan

__all__ = ["ReferenceBackend", "ReferenceOptions"]


class ReferenceOptions(BaseModel):
    """Options of the ``reference`` backend."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_scores: int = Field(default=1 << 25, gt=0)
    """Upper bound on score-matrix elements held at once; long prefills are split in query chunks."""


class ReferenceBackend(BackendBase):
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
    Options = ReferenceOptions
    options: ReferenceOptions

    def check_step(self, plan: Plan, cache: KVCache) -> None:
        # The oracle may sync: every page it will read is checked before anything is written.
        check_pages(plan.metadata, cache.layout.page_size, cache.num_pages)

    def attend(self, call: AttendArgs) -> torch.Tensor:
        q, cache, plan, layer, _state = call.q, call.cache, call.plan, call.layer, call.state
        sinks, k_scale, v_scale, out, lse = call.unpacked()
        meta = plan.metadata
        qsl = meta.query_start_loc_cpu.tolist()
        seq_lens = meta.seq_lens_cpu.tolist()
        longest = max((s for b, s in enumerate(seq_lens) if qsl[b + 1] > qsl[b]), default=0)
        # One fp32 workspace per forward: fresh multi-MB buffers per sequence cost page faults
        # that, on a CPU, take longer than the attention itself.
        ws_k = torch.empty(layer.num_kv_heads, longest, layer.head_dim, device=q.device)
        ws_v = torch.empty(layer.num_kv_heads, longest, layer.v_dim, device=q.device)
        for b, seq_len in enumerate(seq_lens):
            q0, q1 = qsl[b], qsl[b + 1]
            if q1 > q0 and seq_len == 0:  # queries without keys (cross-attention): zeros
                out[q0:q1] = 0
                if lse is not None:
                    lse[q0:q1] = float("-inf") if sinks is None else sinks.float()
            elif q1 > q0:
                p = cache.layout.page_size
                pages = meta.page_table[b, : (seq_len + p - 1) // p].long()
                kb = _head_major(cache.k_nhd, pages, seq_len, k_scale, ws_k)
                vb = _head_major(cache.v_nhd, pages, seq_len, v_scale, ws_v)
                rows_lse = None if lse is None else lse[q0:q1]
                tree = None if meta.tree_mask is None else meta.tree_mask[q0:q1, : q1 - q0]
                self._attend(q[q0:q1], kb, vb, layer, sinks, out[q0:q1], rows_lse, tree)
        return out

    def attend_ragged(self, call: RaggedArgs) -> torch.Tensor:
        q, k, v, plan, layer = call.q, call.k, call.v, call.plan, call.layer
        key_start_loc = call.key_start_loc
        sinks, out, lse = call.sinks, call.out, call.lse
        meta = plan.metadata
        qsl = meta.query_start_loc_cpu.tolist()
        starts = key_start_loc.tolist()  # the oracle may sync
        for b, seq_len in enumerate(meta.seq_lens_cpu.tolist()):
            q0, q1 = qsl[b], qsl[b + 1]
            if q1 == q0:
                continue
            rows_lse = None if lse is None else lse[q0:q1]
            if seq_len == 0:  # queries without keys (an empty prefix chunk): zeros
                out[q0:q1] = 0
                if rows_lse is not None:
                    rows_lse[:] = float("-inf") if sinks is None else sinks.float()
                continue
            k0 = starts[b]
            kb = k[k0 : k0 + seq_len].transpose(0, 1).float()
            vb = v[k0 : k0 + seq_len].transpose(0, 1).float()
            self._attend(q[q0:q1], kb, vb, layer, sinks, out[q0:q1], rows_lse, None)
        return out

    def _attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: LayerSpec,
        sinks: torch.Tensor | None,
        out: torch.Tensor,
        lse: torch.Tensor | None,
        tree: torch.Tensor | None,
    ) -> None:
        """One sequence: q (n, Hq, D) at the last n of L positions, k/v (Hkv, L, D|Dv) fp32;
        ``lse`` (n, Hq) fp32 or None; ``tree`` its (n, n) rows of the step's tree mask or None."""
        n, length = q.shape[0], k.shape[1]
        hkv, g, dv = layer.num_kv_heads, layer.group_size, layer.v_dim
        chunk = max(1, self.options.max_scores // max(1, layer.num_heads * length))
        key_pos = torch.arange(length, device=q.device)
        sink = None if sinks is None else sinks.float().view(hkv, g, 1, 1)
        for c0 in range(0, n, chunk):
            c = min(chunk, n - c0)
            # Head-major queries so both products are plain batched matmuls over KV heads.
            qh = q[c0 : c0 + c].float().view(c, hkv, g, -1).permute(1, 2, 0, 3)
            scores = torch.matmul(qh.reshape(hkv, g * c, -1), k.transpose(1, 2))
            scores = scores.view(hkv, g, c, length).mul_(layer.softmax_scale)
            if layer.has_softcap:
                cap = float(layer.softcap or 0.0)
                scores = scores.div_(cap).tanh_().mul_(cap)
            q_pos = length - n + c0 + torch.arange(c, device=q.device)
            rel = key_pos[None, :] - q_pos[:, None]  # key position minus query position
            allowed = torch.ones_like(rel, dtype=torch.bool)
            if layer.causal:
                allowed &= rel <= 0
            if tree is not None:  # among the new tokens: ancestors and self (entries j <= i)
                allowed[:, length - n :] &= tree[c0 : c0 + c].to(q.device)
            if layer.sliding_window is not None:
                allowed &= rel >= -layer.window_left
                if not layer.causal:
                    allowed &= rel <= layer.window_left
            if layer.attention_chunk_size is not None:
                size = layer.attention_chunk_size
                allowed &= key_pos[None, :] // size == q_pos[:, None] // size
            if not bool(allowed.all()):
                scores = scores.masked_fill_(~allowed, float("-inf"))
            row_max = scores.amax(dim=-1, keepdim=True)
            if sink is not None:
                row_max = torch.maximum(row_max, sink.expand_as(row_max))
            # A row that sees no key (and has no sink) has max -inf; it outputs zeros.
            row_max = torch.nan_to_num(row_max, neginf=0.0)
            probs = scores.sub_(row_max).exp_()
            denom = probs.sum(dim=-1, keepdim=True)
            if sink is not None:
                denom = denom + torch.exp(sink - row_max)
            if lse is not None:
                # log(0) = -inf: a row that sees no key and no sink (its max was set to 0).
                row_lse = (row_max + denom.log()).view(hkv, g, c)
                lse[c0 : c0 + c] = row_lse.permute(2, 0, 1).flatten(1, 2)
            probs = probs.div_(denom.clamp_min(torch.finfo(torch.float32).tiny))
            o = torch.matmul(probs.view(hkv, g * c, length), v)  # (Hkv, G*c, Dv)
            out[c0 : c0 + c] = o.view(hkv, g, c, dv).permute(2, 0, 1, 3).flatten(1, 2)


def _head_major(
    cache: torch.Tensor,
    pages: torch.Tensor,
    seq_len: int,
    scale: torch.Tensor | None,
    workspace: torch.Tensor,
) -> torch.Tensor:
    """One sequence's K or V as fp32 (Hkv, L, D), in position order, in ``workspace``."""
    # index_select, not advanced indexing: about 4x faster for whole pages on a CPU.
    tokens = cache.index_select(0, pages).flatten(0, 1)[:seq_len].transpose(0, 1)
    x = workspace[:, :seq_len].copy_(tokens)  # converts and transposes in one pass
    if cache.dtype in FP8_KV_DTYPES and scale is not None:
        x.mul_(scale.float().reshape(-1, 1, 1))
    return x
