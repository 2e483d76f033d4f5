"""The MLA half of the SGLang drop-in (DeepSeek V2/V3/R1, Kimi K2: ``attention_arch`` MLA).

- The absorbed layer (DeepSeek's ``attn_mqa``: one KV head of kv_lora_rank + rope dims,
  ``v_head_dim`` = kv_lora_rank) runs as an attnsdk MLA layer over the ``MLATokenToKVPool``
  buffer, in both of SGLang's call forms: q ``[T, H*(rank+rope)]`` with k the whole latent row,
  or q ``[T, H*rank]`` and k ``[T, 1, rank]`` with ``q_rope`` / ``k_rope`` keywords (DeepSeek's
  ``forward_absorb``).
- The expanded prefill layer (``attn_mha``: q / k of qk_nope + rope dims and v of its own,
  which never touch the cache) runs as ``Backend.forward_ragged`` over the keys
  ``SGLangAdapter.mha_metadata`` reads off the batch, and returns ``[T, H, Dv]`` as SGLang's
  FA3 backend does.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch

from attnsdk.adapters._common import engine_attr, refuse
from attnsdk.adapters.sglang._layer import as_heads, layer_shape
from attnsdk.contract.errors import UnsupportedConfigError

if TYPE_CHECKING:
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch

    from attnsdk.adapters._common import LayerEntry
    from attnsdk.adapters.sglang._adapter import SGLangAdapter
    from attnsdk.contract.backend import Backend
    from attnsdk.contract.layer import LayerSpec
    from attnsdk.contract.plan import Plan

__all__ = ["SGLangMLALayers"]


class SGLangMLALayers:
    """An MLA model's two layer kinds for the drop-in (``SGLangAttentionBackendImpl`` mixes it
    in; its ``forward_extend`` routes MLA layers here).

    Reads the drop-in's ``backend``, ``adapter`` and ``token_to_kv_pool``; owns the ragged
    plans of the step (``_ragged``) and the expanded layers' specs (``_mha_specs``).
    """

    backend: Backend
    adapter: SGLangAdapter
    token_to_kv_pool: Any
    _ragged: tuple[Plan | None, dict[tuple[object, ...], Plan]]
    """The step plan the ragged plans belong to, and those plans by kind of call."""
    _mha_specs: dict[tuple[object, ...], LayerSpec]
    """The expanded-prefill layers' specs by ``layer_shape``, sinks and prefix-chunk flag."""

    if TYPE_CHECKING:

        def _adapter(self) -> SGLangAdapter: ...

    def _expanded(self, layer: RadixAttention) -> bool:
        """Whether ``layer`` is an MLA model's expanded prefill layer: its head dims are not
        the latent pool's row."""
        layer_id = layer_shape(layer)[0]
        pool = self.token_to_kv_pool
        k_buf = engine_attr(pool, "token_to_kv_pool", "get_key_buffer")(layer_id)
        return int(layer.head_dim) != k_buf.shape[-1]

    def _attend_mla(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        q_rope: torch.Tensor | None,
        k_rope: torch.Tensor | None,
        layer: RadixAttention,
        fb: ForwardBatch,
        save_kv_cache: bool,
        entry: LayerEntry,
        plan: Plan,
        want_lse: bool,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The absorbed MLA layer: q and the new latent rows as (T, H, rank + rope) and
        (T, 1, rank + rope), from either of SGLang's call forms (see the module docstring)."""
        spec, cache = entry.spec, entry.cache
        rank, heads, rows = spec.v_dim, spec.num_heads, q.shape[0]
        rope = spec.head_dim - rank
        if q_rope is not None:
            q3 = torch.cat(
                [as_heads("q", q, heads, rank), as_heads("q_rope", q_rope, heads, rope)], dim=-1
            )
        else:
            q3 = as_heads("q", q, heads, spec.head_dim)
        k3 = None
        if save_kv_cache and k is not None:
            if k_rope is not None:
                k3 = torch.cat([as_heads("k", k, 1, rank), as_heads("k_rope", k_rope, 1, rope)], -1)
            else:
                k3 = as_heads("k", k, 1, spec.head_dim)
            if plan.graph is not None:
                # A replayed step's slots live in the graph runner's out_cache_loc only; the
                # pool's MLA door for split latent and rope (its combined-row one has no
                # decode-context-parallel write path).
                pool, loc = self.token_to_kv_pool, engine_attr(fb, "forward_batch", "out_cache_loc")
                if k_rope is not None:
                    pool.set_mla_kv_buffer(layer, loc, k3[..., :rank], k3[..., rank:])
                else:
                    pool.set_kv_buffer(layer, loc, k3, k3[..., :rank])
                k3 = None
        lse = torch.empty(rows, heads, dtype=torch.float32, device=q.device) if want_lse else None
        # SGLang's MLA pool casts the latent to fp8 without a scale, and reads it back so.
        out = self.backend.forward(q3, k3, None, cache, plan, spec, lse=lse)
        out = out.reshape(rows, heads * rank)
        return (out, lse) if lse is not None else out

    def _attend_mha(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        layer: RadixAttention,
        fb: ForwardBatch,
        save_kv_cache: bool,
        plan: Plan,
        sinks: torch.Tensor | None,
        want_lse: bool,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """DeepSeek's ``attn_mha`` (see the module docstring): ragged attention, no cache."""
        where = f"layer {layer_shape(layer)[0]} (an MLA model's expanded prefill, attn_mha)"
        if k is None or v is None:
            refuse(where, "k/v", "are required: this layer's keys come with the call")
        if save_kv_cache:
            refuse(
                where,
                "save_kv_cache",
                "must be False: the cache holds the latent, written through set_mla_kv_buffer",
            )
        ragged = self._ragged_plan(fb, plan)
        cross = ragged.metadata.cross_attention
        key = (*layer_shape(layer), sinks is not None, cross)
        spec = self._mha_specs.get(key)
        if spec is None:  # built once per layer shape, not per call (it validates)
            spec = self.adapter.layer_spec(layer, has_sinks=sinks is not None)
            if cross:  # a prefix chunk: every key is before the queries
                spec = dataclasses.replace(spec, causal=False)
            self._mha_specs[key] = spec
        forward_ragged = getattr(self.backend, "forward_ragged", None)
        if forward_ragged is None:
            refuse(where, "backend", f"{self.backend.name!r} has no forward_ragged")
        heads, rows = spec.num_heads, q.shape[0]
        q3 = as_heads("q", q, heads, spec.head_dim)
        k3 = as_heads("k", k, spec.num_kv_heads, spec.head_dim).to(q.dtype)
        v3 = as_heads("v", v, spec.num_kv_heads, spec.v_dim).to(q.dtype)
        lse = torch.empty(rows, heads, dtype=torch.float32, device=q.device) if want_lse else None
        try:
            out = forward_ragged(q3, k3, v3, ragged, spec, sinks=sinks, lse=lse)
        except UnsupportedConfigError as err:
            raise UnsupportedConfigError(
                f"{where}: {str(err).splitlines()[0]} (or pin DeepSeek's dispatch to the "
                "absorbed layer: docs/adapters/sglang.md, MLA)",
                err.reasons,
            ) from err
        return (out, lse) if lse is not None else out

    def _ragged_plan(self, fb: ForwardBatch, plan: Plan) -> Plan:
        """The ragged plan of this kind of ``attn_mha`` call in the step of ``plan``: planned
        at its first layer, reused by the others."""
        owner, plans = self._ragged
        if owner is not plan:
            owner, plans = plan, {}
            self._ragged = (owner, plans)
        attend = getattr(fb, "attn_attend_prefix_cache", None)
        kind = (attend, getattr(fb, "prefix_chunk_idx", None) if attend else None,
                bool(getattr(fb, "mha_one_shot", False)))  # fmt: skip
        ragged = plans.get(kind)
        if ragged is None:
            meta = self._adapter().mha_metadata(fb, plan.metadata)
            ragged = plans[kind] = self.backend.plan(meta)
        return ragged
