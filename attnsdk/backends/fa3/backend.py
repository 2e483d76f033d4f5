"""``fa3``: FlashAttention-3 paged attention on Hopper (compute capability 9.x).

One varlen ``flash_attn_with_kvcache`` launch serves a whole mixed batch (decode, extend,
prefill, empty and padding rows) straight from the paged cache: ``cu_seqlens_q`` splits the
query rows, ``cache_seqlens`` and ``page_table`` locate each sequence's keys. New K/V are written
first by a one-launch Triton store that skips negative slots (no device sync). Importing this
module imports no kernel library; ``FA3Backend(...)`` does. What a step works out once for all
its layers (scheduler metadata, chunked layers' virtual batches, a tree step's passes) is
``planner``'s.

``lse=``: FA3 always computes each row's natural-log log-sum-exp (sinks included); it is copied
(transposed from FA3's (Hq, T)) into the caller's buffer.

fp8 KV (e4m3): FA3 multiplies q·k in fp8, so q is cast to the cache dtype too, as SGLang does,
but clamped to ±448 first (torch's cast turns larger values into NaN). ``k_scale`` / ``v_scale``
become the kernel's (B, Hkv) descales through zero-stride views. FA3 returns bf16 for fp8
inputs, hence fp8 KV needs a bf16 layer.

Chunked local attention (``LayerSpec.attention_chunk_size``): a chunked layer runs the same
kernel over the step's virtual batch (``planner`` says how it is made and when graphs serve it).

MLA (``LayerSpec.mla``, kv_lora_rank 512 + rope 64), as SGLang's FA3 backend runs it: q's
rope part against the cache's rope dims as q·k, q's latent part as FA3's ``qv`` against the
latent (the V view), one launch per step. It needs an FA3 build with the hdim 64 x 512 kernels
(``flash_attn_config`` without FLASH_ATTENTION_DISABLE_HDIMDIFF64) and a provider whose call
takes ``qv``; bf16 / fp16 caches, no window, softcap, sinks or chunks; tree steps as below (the
latent split applies to both passes); no precomputed scheduler metadata.

Tree verify (``AttentionMetadata.tree_mask``): FA3 takes no mask, so a tree step runs as two
launches, as SGLang runs EAGLE topk > 1: a non-causal pass over each sequence's context and a
non-causal pass in which each query row reads its visible draft tokens through a page table
of slots over the cache viewed with pages of one token, merged by ``attnsdk.merge_states``
(``attnsdk.features.tree``) straight from FA3's own log-sum-exps. Eager only (a captured plan has no
mask), NHD caches with separate K and V, a provider that returns the log-sum-exp.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from attnsdk.backends.fa3.kernels import (
    INSTALL_COMMAND,
    PROVIDERS,
    build_flags,
    find_provider,
    load_kernel,
)
from attnsdk.backends.fa3.options import FA3Options
from attnsdk.backends.fa3.planner import (
    FA3Plan,
    LayerArgs,
    Scheduler,
    fa3_window,
    plan_step,
    step_scheduler,
    step_tree,
    step_virtual,
)
from attnsdk.backends.fa3.refusals import build_reasons, provider_reasons, ragged_layer
from attnsdk.backends.gpu import DeviceStoreBackend
from attnsdk.contract.capabilities import (
    Capabilities,
    Feature,
    GraphSupport,
    device_reasons,
)
from attnsdk.contract.errors import (
    BackendUnavailableError,
    Reason,
    ReasonKind,
    UnsupportedConfigError,
)
from attnsdk.contract.kv import KVOrder
from attnsdk.features.chunked import check_capture
from attnsdk.features.tree import token_pool
from attnsdk.kernels.merge import merge_states

if TYPE_CHECKING:
    from attnsdk.backends.base import AttendArgs, RaggedArgs
    from attnsdk.backends.fa3.kernels import KernelCall
    from attnsdk.contract.capabilities import Request
    from attnsdk.contract.kv import KVCache, KVCacheLayout
    from attnsdk.contract.layer import LayerSpec
    from attnsdk.contract.metadata import AttentionMetadata
    from attnsdk.contract.plan import GraphBuffers, Plan
    from attnsdk.features.tree import TreePasses

__all__ = ["FA3Backend"]

_PROVIDER_FEATURES = frozenset({Feature.LSE, Feature.TREE_MASK, Feature.RAGGED})
"""Step features whose service depends on the provider's call (``provider_reasons``)."""
_FP8 = torch.float8_e4m3fn
_FP8_MAX = float(torch.finfo(_FP8).max)
_CFG = ReasonKind.CONFIGURATION
_Scales = tuple[torch.Tensor | None, torch.Tensor | None]
"""``k_scale`` and ``v_scale`` as ``forward`` got them."""


class FA3Backend(DeviceStoreBackend):
    """FlashAttention-3 on Hopper. See the module docstring."""

    name = "fa3"
    priority = 100
    capabilities = Capabilities(
        devices=frozenset({"cuda"}),
        dtypes=frozenset({torch.float16, torch.bfloat16}),
        kv_dtypes=frozenset({_FP8}),
        max_head_dim=256,
        head_dim_multiple=8,
        orders=frozenset(KVOrder),
        min_compute_capability=(9, 0),
        max_compute_capability=(9, 9),
        features=frozenset(Feature),
        graph_support=GraphSupport.ANY_BATCH,
        mla_dims=frozenset({(512, 64)}),
    )
    Options = FA3Options
    plan_type = FA3Plan
    options: FA3Options

    def __init__(self, options: FA3Options | None = None) -> None:
        super().__init__(options)
        self._kernel: KernelCall = load_kernel(self.options.provider)
        self._ragged_v_pad: dict[LayerSpec, int] = {}
        """Layer -> the zero columns its V gets in a ragged call on this build (0: none)."""
        wanted, op = self.options.precompute_scheduler, self._kernel.scheduler
        if wanted and op is None:
            raise UnsupportedConfigError(
                "fa3 option precompute_scheduler=True needs the scheduler op of flash_attn_interface",
                [Reason(_CFG, "precompute_scheduler", f"unavailable with {self._kernel.provider}")],
            )
        self._scheduler: Scheduler | None = (
            None
            if op is None or wanted is False
            else Scheduler(op, self.options.num_splits, self.options.pack_gqa)
        )
        """FA3's scheduler op when scheduler metadata is precomputed (``planner``), else None."""

    @property
    def provider(self) -> str:
        """The kernel package in use."""
        return self._kernel.provider

    @classmethod
    def environment_reasons(cls, device: torch.device | str | None = None) -> list[Reason]:
        """Is a kernel library installed, is there a CUDA device, is it sm 9.x? Imports nothing."""
        reasons = device_reasons(cls.capabilities, device)
        if find_provider() is None:
            reasons.append(
                Reason(
                    ReasonKind.ENVIRONMENT,
                    "install",
                    f"needs one of {', '.join(PROVIDERS.values())}, found none: {INSTALL_COMMAND}",
                )
            )
        return sorted(reasons)

    @classmethod
    def refusals(cls, request: Request) -> list[Reason]:
        """``BackendBase``'s, what this FA3 build refuses (``refusals.build_reasons``) and what
        the provider's call cannot pass (MLA's qv, the log-sum-exp, dense K/V;
        ``refusals.provider_reasons``: the provider is loaded to ask it, when installed)."""
        reasons = super().refusals(request) + build_reasons(request, build_flags())
        provider = find_provider(cls.options_of(request).provider)
        # Loading the provider imports it: only for what only it can answer (``attnsdk info``
        # and plain layers import no kernel library).
        if provider is not None and (request.mla or request.uses & _PROVIDER_FEATURES):
            try:
                kernel = load_kernel(provider)
            except BackendUnavailableError as exc:
                reasons.append(Reason(ReasonKind.ENVIRONMENT, "install", str(exc)))
            else:
                reasons += provider_reasons(request, kernel)
        return sorted(set(reasons))

    def layer_state(self, layer: LayerSpec, layout: KVCacheLayout) -> LayerArgs:
        return LayerArgs.of(layer, layout)

    # -- per step ---------------------------------------------------------------------------

    def make_plan(self, meta: AttentionMetadata) -> FA3Plan:
        """Everything the step's layers share, for the prepared layer shapes: a tree step's two
        passes (per page size), chunked layers' virtual batches, and FA3's scheduler metadata
        per layer shape (``planner.plan_step``). A layer that was not prepared works these out
        at its own call."""
        return plan_step(meta, self._layer_states, self._scheduler)

    def capture_plan(self, meta: AttentionMetadata, state: GraphBuffers) -> Plan:
        """``GraphHooks.capture_plan``; refused for captures of several query tokens per
        sequence when a prepared layer is chunked (``attnsdk.features.chunked.check_capture``)."""
        if any(layer.attention_chunk_size is not None for layer, _ in self.prepared):
            check_capture(meta)
        return super().capture_plan(meta, state)

    # -- per layer --------------------------------------------------------------------------

    def check_step(self, plan: Plan, cache: KVCache) -> None:
        super().check_step(plan, cache)
        if plan.metadata.tree_mask is not None:
            _token_pools(cache)  # before anything is written

    def attend(self, call: AttendArgs) -> torch.Tensor:
        q, cache, plan, layer, state = call.q, call.cache, call.plan, call.layer, call.state
        sinks, k_scale, v_scale, out, lse = call.unpacked()
        st = state
        meta = plan.metadata if st.chunk is None else step_virtual(plan, st.chunk, st.page_size)
        dest, out = out, _kernel_out(out, q, layer)
        if meta.num_seqs == 0 or q.shape[0] == 0:
            return dest
        if q.stride(-1) != 1:
            q = q.contiguous()  # FA3 reads each head vector as one contiguous run
        if st.quantized:
            q = q.clamp(-_FP8_MAX, _FP8_MAX).to(_FP8)
        if sinks is not None:
            # FA3 (flash_api_stable) reads the sink logits as bf16 whatever the compute dtype.
            sinks = sinks.to(torch.bfloat16)
        scales = (k_scale, v_scale)
        if meta.tree_mask is not None:
            passes = step_tree(plan, st.page_size)
            self._attend_tree(q, cache, plan, passes, layer, st, sinks, scales, out, lse)
        else:
            scheduler = step_scheduler(
                self._scheduler, plan, meta, layer, st, causal=st.causal, page_size=st.page_size
            )
            self._launch(q, cache.k_nhd, cache.v_nhd, out, meta, layer, st, st.causal,
                         sinks, scales, lse, scheduler)  # fmt: skip
        return out if dest is out else dest.copy_(out)

    def attend_ragged(self, call: RaggedArgs) -> torch.Tensor:
        """One varlen launch over dense K/V (``flash_attn_varlen_func``'s form of the op).
        V narrower than K on a build without that pair's kernels is zero-padded to K's width
        (``refusals.ragged_layer``) and the output sliced back."""
        q, k, v, plan, layer = call.q, call.k, call.v, call.plan, call.layer
        key_start_loc = call.key_start_loc
        sinks, out, lse = call.sinks, call.out, call.lse
        meta = plan.metadata
        pad = self._ragged_v_pad.get(layer)
        if pad is None:
            pad = self._ragged_v_pad[layer] = ragged_layer(layer, build_flags()).v_dim - layer.v_dim
        dest, out = out, _kernel_out(out, q, layer, pad)
        if meta.num_seqs == 0 or q.shape[0] == 0:
            return dest
        if pad:  # cat with fresh zeros: ~1.6x faster than F.pad on the H200
            v = torch.cat((v, v.new_zeros(*v.shape[:-1], pad)), dim=-1)
        q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
        self._kernel(
            q,
            k,
            v,
            out,
            cu_seqlens_q=meta.query_start_loc,
            cache_seqlens=None,
            page_table=None,
            max_seqlen_q=meta.max_query_len,
            softmax_scale=layer.softmax_scale,
            causal=layer.causal,
            window=fa3_window(layer),
            softcap=float(layer.softcap or 0.0),
            q_descale=None,
            k_descale=None,
            v_descale=None,
            scheduler_metadata=None,
            # One split unless pinned, as flash_attn_varlen_func: FA3's heuristic (0) cost
            # 6-23 % on prefills measured on the H200 (docs/benchmarks.md, "Ragged").
            num_splits=self.options.num_splits or 1,
            pack_gqa=self.options.pack_gqa,
            sinks=None if sinks is None else sinks.to(torch.bfloat16),
            lse=lse,
            cu_seqlens_k=key_start_loc,
            max_seqlen_k=meta.max_seq_len,
        )
        return out if dest is out else dest.copy_(out[..., : layer.v_dim])

    def _attend_tree(
        self,
        q: torch.Tensor,
        cache: KVCache,
        plan: Plan,
        passes: TreePasses,
        layer: LayerSpec,
        st: LayerArgs,
        sinks: torch.Tensor | None,
        scales: _Scales,
        out: torch.Tensor,
        lse: torch.Tensor | None,
    ) -> None:
        """Tree verify (``attnsdk.features.tree``): the context pass and the draft pass (pages of one
        token, the sinks counted there once), merged by their log-sum-exps.

        Eager verify at small batches is host-bound (docs/benchmarks.md, "Tree verify"), so
        the passes allocate their outputs once, merge FA3's own log-sum-exps in place of
        copies (``merge_states`` reads strides), use scheduler metadata made once per plan
        like a plain step, and mask the context pass's lse only when a sequence has none."""
        t, hq = passes.drafts.num_tokens, layer.num_heads
        q = q[:t]  # rows past num_tokens are unspecified: both passes cover the real ones
        k_pool, v_pool = _token_pools(cache)
        parts = torch.empty(2, t, hq, layer.v_dim, dtype=out.dtype, device=out.device)
        runs = (
            (cache.k_nhd, cache.v_nhd, passes.context, None, st.page_size, "tree-context"),
            (k_pool, v_pool, passes.drafts, sinks, 1, "tree-drafts"),
        )
        lses: list[torch.Tensor] = []
        for part, (k, v, meta, part_sinks, page_size, name) in zip(parts, runs, strict=True):
            scheduler = step_scheduler(
                self._scheduler, plan, meta, layer, st, causal=False, page_size=page_size, part=name
            )
            part_lse = self._launch(q, k, v, part, meta, layer, st, False, part_sinks, scales,
                                    None, scheduler, return_lse=True)  # fmt: skip
            assert part_lse is not None  # check_step refused providers without it
            lses.append(part_lse)
        lse_a, lse_b = lses
        # A pass that sees no key: -inf, whatever the kernel writes for an empty row.
        if passes.some_context_empty:
            lse_a.masked_fill_(passes.context_empty[:, None], float("-inf"))
        lse_b.masked_fill_(passes.drafts_empty[:, None], float("-inf"))
        merge_states(
            parts[0], lse_a, parts[1], lse_b, out=out[:t], lse_out=None if lse is None else lse[:t]
        )

    def _launch(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        out: torch.Tensor,
        meta: AttentionMetadata,
        layer: LayerSpec,
        st: LayerArgs,
        causal: bool,
        sinks: torch.Tensor | None,
        scales: _Scales,
        lse: torch.Tensor | None,
        scheduler: torch.Tensor | None,
        *,
        return_lse: bool = False,
    ) -> torch.Tensor | None:
        """One FA3 launch over ``meta``'s batch; fp8 scales become (B, Hkv) descales. An MLA
        layer splits q and the cache at the latent: rope parts as q / k, latent ones as qv / v.
        ``return_lse``: return FA3's own log-sum-exp as a (T, Hq) view (no copy)."""
        b, hkv = meta.num_seqs, layer.num_kv_heads
        k_descale, v_descale = (
            None if not st.quantized or x is None else x.reshape(1, -1).expand(b, hkv)
            for x in scales
        )
        qv = None
        if st.latent is not None:
            q, qv = q[..., st.latent :], q[..., : st.latent]
            k_cache, v_cache = k_cache[..., st.latent :], k_cache[..., : st.latent]
        return self._kernel(
            q,
            k_cache,
            v_cache,
            out,
            cu_seqlens_q=meta.query_start_loc,
            cache_seqlens=meta.seq_lens,
            page_table=meta.page_table,
            max_seqlen_q=meta.max_query_len,
            softmax_scale=st.scale,
            causal=causal,
            window=st.window,
            softcap=st.softcap,
            q_descale=None,
            k_descale=k_descale,
            v_descale=v_descale,
            scheduler_metadata=scheduler,
            num_splits=self.options.num_splits,
            pack_gqa=self.options.pack_gqa,
            sinks=sinks,
            lse=lse,
            qv=qv,
            return_lse=return_lse,
        )


def _kernel_out(out: torch.Tensor, q: torch.Tensor, layer: LayerSpec, pad: int = 0) -> torch.Tensor:
    """Where FA3 writes: ``out`` itself, or a fresh (T, Hq, Dv + pad) buffer copied back after
    the call when FA3 cannot write ``out`` (it writes each head vector contiguously) or V is
    padded by ``pad`` columns."""
    if out.stride(-1) == 1 and not pad:
        return out
    return torch.empty(
        q.shape[0], layer.num_heads, layer.v_dim + pad, dtype=q.dtype, device=q.device
    )


def _token_pools(cache: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V viewed with pages of one token (the tree's draft pass), or the reason not."""
    k, v = token_pool(cache.k_nhd), token_pool(cache.v_nhd)
    if k is None or v is None:
        raise UnsupportedConfigError(
            "the fa3 backend cannot serve a tree verify step on this cache:",
            [
                Reason(
                    ReasonKind.BATCH,
                    "tree_mask",
                    "needs pages that are runs of page_size token rows (an NHD cache with "
                    "separate K and V tensors: the draft pass reads single tokens)",
                )
            ],
        )
    return k, v
