"""``fa3``: FlashAttention-3 paged attention on Hopper (compute capability 9.x).

One varlen ``flash_attn_with_kvcache`` launch serves a whole mixed batch (decode, extend,
prefill, empty and padding rows) straight from the paged cache: ``cu_seqlens_q`` splits the
query rows, ``cache_seqlens`` and ``page_table`` locate each sequence's keys. New K/V are written
first by a one-launch Triton store that skips negative slots (no device sync). Importing this
module imports no kernel library; ``FA3Backend(...)`` does.

``lse=``: FA3 always computes each row's natural-log log-sum-exp (sinks included); it is copied
(transposed from FA3's (Hq, T)) into the caller's buffer.

fp8 KV (e4m3): FA3 multiplies q·k in fp8, so q is cast to the cache dtype too, as SGLang does,
but clamped to ±448 first (torch's cast turns larger values into NaN). ``k_scale`` / ``v_scale``
become the kernel's (B, Hkv) descales through zero-stride views. FA3 returns bf16 for fp8
inputs, hence fp8 KV needs a bf16 layer.

Chunked local attention (``LayerSpec.attention_chunk_size``): FA3 has no chunk mask, so a chunked
layer runs the same kernel over the step's virtual batch (``attnsdk.features.chunked``: one sequence
per chunk a sequence's queries touch), made once per step and chunk size in ``make_plan`` for
the prepared layers. The chunk size must be a multiple of the page size. CUDA graphs capture
chunked layers in decode graphs only, where the virtual batch has one row per sequence and is
rebuilt on the device inside the graph.

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

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from attnsdk.backends.fa3.kernels import (
    INSTALL_COMMAND,
    PROVIDERS,
    build_flags,
    find_provider,
    load_kernel,
)
from attnsdk.backends.gpu import DeviceStoreBackend, mla_kernel_reasons
from attnsdk.contract.capabilities import (
    Capabilities,
    Feature,
    GraphSupport,
    device_reasons,
    is_mla,
)
from attnsdk.contract.errors import Reason, ReasonKind, UnsupportedConfigError
from attnsdk.contract.kv import KVOrder
from attnsdk.contract.plan import Plan
from attnsdk.features.chunked import check_capture, chunk_reasons, prepared_chunks, virtual_metadata
from attnsdk.features.tree import TreePasses, token_pool, tree_passes
from attnsdk.kernels.merge import merge_states

if TYPE_CHECKING:
    from attnsdk.backends.fa3.kernels import KernelCall
    from attnsdk.contract.kv import KVCache, KVCacheLayout
    from attnsdk.contract.layer import LayerSpec
    from attnsdk.contract.metadata import AttentionMetadata
    from attnsdk.contract.plan import GraphBuffers

__all__ = ["FA3Backend", "FA3Options", "FA3Plan"]

_FP8 = torch.float8_e4m3fn
_FP8_MAX = float(torch.finfo(_FP8).max)
_CFG = ReasonKind.CONFIGURATION


class FA3Options(BaseModel):
    """Options of the ``fa3`` backend."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    provider: Literal["auto", "flash_attn_interface", "sgl_kernel", "vllm"] = "auto"
    """Kernel package; "auto" takes the first installed in that order."""
    num_splits: int = Field(default=0, ge=0, le=256)
    """Split-KV chunks; 0 lets FA3's heuristic (and its dynamic per-sequence split) decide."""
    pack_gqa: bool | None = None
    """Pack a KV head's query heads into one tile; None lets FA3 decide."""
    precompute_scheduler: bool | None = None
    """Compute FA3's ``scheduler_metadata`` once per step and layer shape (at the first layer)
    instead of inside every layer's call. None (default): on whenever the provider exposes FA3's
    scheduler op (flash_attn_interface does), else off; True insists (an error without the op);
    False turns it off. Measured on an H200 (docs/benchmarks.md) it saves
    ~10 µs of host time per eager layer and ~16% of GPU time per layer at batch 1 under graph
    replay, and is neutral at batch 64-256; the per-step cost is one small launch."""


@dataclass(frozen=True, slots=True)
class FA3Plan(Plan):
    """``Plan`` plus the per-step FA3 scheduler metadata, filled lazily per layer shape."""

    scheduler: dict[tuple[object, ...], torch.Tensor] = field(default_factory=dict)
    virtual: dict[tuple[int, int], AttentionMetadata] = field(default_factory=dict)
    """(chunk size, page size) -> the step's virtual batch for chunked layers."""
    tree: dict[int, TreePasses] = field(default_factory=dict)
    """Page size -> a tree verify step's two passes (``attnsdk.features.tree``); empty otherwise."""


@dataclass(frozen=True, slots=True)
class _Static:
    """Per (layer, layout) kernel arguments, worked out once."""

    scale: float
    causal: bool
    window: tuple[int, int]
    softcap: float
    chunk: int | None
    """``LayerSpec.attention_chunk_size``: attend over the step's virtual batch."""
    quantized: bool
    q_dtype: torch.dtype
    """What the kernel multiplies in: the cache's fp8 dtype or the compute dtype."""
    page_size: int
    key: tuple[object, ...]
    """What FA3's scheduler metadata depends on besides the batch."""
    latent: int | None = None
    """An MLA layer's kv_lora_rank: q and the cache split there into ``qv`` / latent and
    q / rope (``KVCacheLayout.mla``)."""


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
        wanted = self.options.precompute_scheduler
        self._precompute = self._kernel.scheduler is not None and wanted is not False
        if wanted and self._kernel.scheduler is None:
            raise UnsupportedConfigError(
                "fa3 option precompute_scheduler=True needs the scheduler op of flash_attn_interface",
                [Reason(_CFG, "precompute_scheduler", f"unavailable with {self._kernel.provider}")],
            )

    @property
    def provider(self) -> str:
        """The kernel package in use."""
        return self._kernel.provider

    def unsupported_reasons(
        self,
        layer: LayerSpec | None = None,
        layout: KVCacheLayout | None = None,
        device: torch.device | str | None = None,
    ) -> list[Reason]:
        """``BackendBase``'s, and MLA refused by a provider whose call cannot pass ``qv``."""
        reasons = super().unsupported_reasons(layer, layout, device)
        if is_mla(layer, layout) and not self._kernel.takes_qv:
            reasons.append(
                Reason(
                    _CFG,
                    "mla",
                    f"needs FA3's qv argument, which {self._kernel.provider}'s "
                    f"flash_attn_with_kvcache lacks: use flash_attn_interface ({INSTALL_COMMAND})",
                )
            )
        return sorted(reasons)

    def lse_reasons(
        self, layer: LayerSpec, layout: KVCacheLayout, device: torch.device
    ) -> list[Reason]:
        """A provider's wrapper without ``return_softmax_lse`` cannot hand the lse back."""
        reasons = super().lse_reasons(layer, layout, device)
        if not self._kernel.returns_lse:
            reasons.append(
                Reason(
                    _CFG,
                    "lse",
                    f"needs return_softmax_lse, which {self._kernel.provider}'s "
                    f"flash_attn_with_kvcache lacks: use flash_attn_interface ({INSTALL_COMMAND})",
                )
            )
        return reasons

    def ragged_reasons(self, layer: LayerSpec, device: torch.device | str | None) -> list[Reason]:
        """``BackendBase``'s, this build's head dims, and a provider without FA3's registered op
        (the wrappers' paged entry point takes no dense varlen K/V)."""
        reasons = super().ragged_reasons(layer, device)
        served = _ragged_layer(layer, build_flags())
        reasons += self.environment_reasons(device) + _fa3_reasons(served, None, build_flags())
        if layer.attention_chunk_size is not None:
            reasons.append(
                Reason(
                    _CFG,
                    "attention_chunk_size",
                    "is served in paged steps only (a virtual batch over the page table)",
                )
            )
        if not self._kernel.takes_ragged:
            reasons.append(
                Reason(
                    _CFG,
                    "ragged",
                    f"needs the registered op flash_attn_3::fwd, which {self._kernel.provider} "
                    f"does not expose: use flash_attn_interface ({INSTALL_COMMAND})",
                )
            )
        return sorted(set(reasons))

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
    def extra_reasons(cls, layer: LayerSpec | None, layout: KVCacheLayout | None) -> list[Reason]:
        """What FA3 (or this build of it, read from ``flash_attn_config``) refuses, and chunk
        sizes that are not a multiple of the page size."""
        return _fa3_reasons(layer, layout, build_flags()) + chunk_reasons(layer, layout)

    def layer_state(self, layer: LayerSpec, layout: KVCacheLayout) -> _Static:
        wl = layer.window_left
        # Non-causal windows are symmetric (DESIGN §2); FA3 takes the right edge separately.
        window = (wl, 0 if layer.causal else wl) if wl >= 0 else (-1, -1)
        return _Static(
            scale=layer.softmax_scale,
            causal=layer.causal,
            window=window,
            softcap=float(layer.softcap or 0.0),
            chunk=layer.attention_chunk_size,
            quantized=layout.is_quantized,
            q_dtype=layout.storage_dtype,
            page_size=layout.page_size,
            key=(
                layer.num_heads,
                layer.num_kv_heads,
                layer.head_dim,
                layer.v_dim,
                layer.causal,
                window,
                layer.has_softcap,
                layout.storage_dtype,
                layout.page_size,
                layer.attention_chunk_size,
            ),
            latent=layer.kv_lora_rank,
        )

    # -- per step ---------------------------------------------------------------------------

    def make_plan(self, meta: AttentionMetadata) -> FA3Plan:
        # FA3 reads the metadata tensors as they are; chunked layers need another batch, and a
        # tree step its two passes.
        plan = FA3Plan(meta)
        if meta.tree_mask is not None:
            # The draft pass reads through the page table, in the cache's pages: the recorded
            # page size, else the prepared layouts' (others are planned at their first layer).
            sizes = (
                {meta.page_size} if meta.page_size else {lay.page_size for _, lay in self.prepared}
            )
            for page_size in sizes:
                plan.tree[page_size] = tree_passes(meta, page_size)
        if meta.tree_mask is not None or meta.cross_attention:
            return plan  # chunked layers are refused in these steps
        for chunk, page_size in prepared_chunks(self.prepared, meta):
            plan.virtual[(chunk, page_size)] = virtual_metadata(meta, chunk, page_size)
        return plan

    def plan_for_capture(
        self,
        state: GraphBuffers,
        batch_size: int,
        num_tokens: int,
        *,
        max_query_len: int | None = None,
    ) -> Plan:
        """``GraphHooks.plan_for_capture``; refused for captures of several query tokens per
        sequence when a prepared layer is chunked (``attnsdk.features.chunked.check_capture``)."""
        plan = super().plan_for_capture(state, batch_size, num_tokens, max_query_len=max_query_len)
        if any(layer.attention_chunk_size is not None for layer, _ in self.prepared):
            check_capture(plan.metadata)
        return plan

    # -- per layer --------------------------------------------------------------------------

    def check_step(self, plan: Plan, cache: KVCache) -> None:
        super().check_step(plan, cache)
        if plan.metadata.tree_mask is not None:
            _token_pools(cache)  # before anything is written
            if not self._kernel.returns_lse:
                raise UnsupportedConfigError(
                    "the fa3 backend cannot serve a tree verify step with this FA3 provider:",
                    [Reason(_CFG, "tree_mask",
                            "its two passes are merged by their log-sum-exps, which "
                            f"{self._kernel.provider}'s flash_attn_with_kvcache does not return: "
                            f"use flash_attn_interface ({INSTALL_COMMAND})")],
                )  # fmt: skip

    def attend(
        self,
        q: torch.Tensor,
        cache: KVCache,
        plan: Plan,
        layer: LayerSpec,
        state: _Static,
        *,
        sinks: torch.Tensor | None,
        k_scale: torch.Tensor | None,
        v_scale: torch.Tensor | None,
        out: torch.Tensor,
        lse: torch.Tensor | None,
    ) -> torch.Tensor:
        st = state
        meta = plan.metadata if st.chunk is None else self._virtual(plan, st.chunk, st.page_size)
        dest = out
        if out.stride(-1) != 1:  # FA3 writes each head vector contiguously
            out = torch.empty(
                q.shape[0], layer.num_heads, layer.v_dim, dtype=q.dtype, device=q.device
            )
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
            self._attend_tree(
                q, cache, plan, self._tree(plan, st.page_size), layer, st, sinks, scales, out, lse
            )
        else:
            precompute = self._precompute and st.latent is None  # as SGLang: none for MLA
            scheduler = (
                self._scheduler(plan, meta, layer, st, causal=st.causal, page_size=st.page_size)
                if precompute
                else None
            )
            self._launch(q, cache.k_nhd, cache.v_nhd, out, meta, layer, st, st.causal,
                         sinks, scales, lse, scheduler)  # fmt: skip
        return out if dest is out else dest.copy_(out)

    def attend_ragged(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        plan: Plan,
        layer: LayerSpec,
        key_start_loc: torch.Tensor,
        *,
        sinks: torch.Tensor | None,
        out: torch.Tensor,
        lse: torch.Tensor | None,
    ) -> torch.Tensor:
        """One varlen launch over dense K/V (``flash_attn_varlen_func``'s form of the op).
        V narrower than K on a build without that pair's kernels is zero-padded to K's width
        (``_ragged_layer``) and the output sliced back."""
        meta = plan.metadata
        pad = self._ragged_v_pad.get(layer)
        if pad is None:
            pad = self._ragged_v_pad[layer] = (
                _ragged_layer(layer, build_flags()).v_dim - layer.v_dim
            )
        dest = out
        if out.stride(-1) != 1 or pad:
            out = torch.empty(
                q.shape[0], layer.num_heads, layer.v_dim + pad, dtype=q.dtype, device=q.device
            )
        if meta.num_seqs == 0 or q.shape[0] == 0:
            return dest
        if pad:  # cat with fresh zeros: ~1.6x faster than F.pad on the H200
            v = torch.cat((v, v.new_zeros(*v.shape[:-1], pad)), dim=-1)
        q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
        wl = layer.window_left
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
            window=(wl, 0 if layer.causal else wl) if wl >= 0 else (-1, -1),
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
        st: _Static,
        sinks: torch.Tensor | None,
        scales: tuple[torch.Tensor | None, torch.Tensor | None],
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
            scheduler = (
                self._scheduler(plan, meta, layer, st, causal=False, page_size=page_size, part=name)
                if self._precompute and st.latent is None
                else None
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
        st: _Static,
        causal: bool,
        sinks: torch.Tensor | None,
        scales: tuple[torch.Tensor | None, torch.Tensor | None],
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

    def _tree(self, plan: Plan, page_size: int) -> TreePasses:
        """The tree step's passes over pages of ``page_size``, made once per plan."""
        cache = plan.tree if isinstance(plan, FA3Plan) else {}
        passes = cache.get(page_size)
        if passes is None:
            passes = cache[page_size] = tree_passes(plan.metadata, page_size)
        return passes

    def _virtual(self, plan: Plan, chunk: int, page_size: int) -> AttentionMetadata:
        """The step's virtual batch for chunks of ``chunk`` tokens, made once per plan: by
        ``make_plan`` for prepared layers, at the first layer for others. A captured plan (a
        decode graph) caches it only while capturing, like the scheduler metadata: it is then
        rebuilt inside the graph from the buffers each replay refreshes."""
        meta = plan.metadata
        if plan.graph is not None:
            check_capture(meta)
        # A CPU-only torch raises when asked about capture.
        capturing = (
            plan.graph is not None
            and meta.device.type == "cuda"
            and torch.cuda.is_current_stream_capturing()
        )
        cache = (
            plan.virtual
            if isinstance(plan, FA3Plan) and (plan.graph is None or capturing)
            else None
        )
        found = cache.get((chunk, page_size)) if cache is not None else None
        if found is None:
            found = virtual_metadata(meta, chunk, page_size)
            if cache is not None:
                cache[(chunk, page_size)] = found
        return found

    def _scheduler(
        self,
        plan: Plan,
        meta: AttentionMetadata,
        layer: LayerSpec,
        st: _Static,
        *,
        causal: bool,
        page_size: int,
        part: str = "step",
    ) -> torch.Tensor | None:
        """FA3 scheduler metadata for ``meta`` (the step, or one ``part`` of it: a tree pass)
        and this layer shape, computed once per plan.

        A captured plan caches only while capturing (the computation is then part of the graph
        and reruns on replay); eager calls on a captured plan recompute, because the static
        buffers they read change between steps.
        """
        if not isinstance(plan, FA3Plan) or self._kernel.scheduler is None:
            return None
        capturing = plan.graph is not None and torch.cuda.is_current_stream_capturing()
        cacheable = plan.graph is None or capturing
        key = (part, *st.key)
        found = plan.scheduler.get(key) if cacheable else None
        if found is not None:
            return found
        sched = self._kernel.scheduler(
            meta.num_seqs, meta.max_query_len, meta.page_table.shape[1] * page_size,
            layer.num_heads, layer.num_kv_heads, layer.head_dim, layer.v_dim, st.q_dtype,
            meta.seq_lens, meta.query_start_loc, None, None, None, None, page_size, 0,
            causal, st.window[0], st.window[1], 0, st.softcap > 0,
            self.options.num_splits, self.options.pack_gqa, 0,
        )  # fmt: skip
        if cacheable:
            plan.scheduler[key] = sched
        return sched


def _ragged_layer(layer: LayerSpec, flags: dict[str, bool]) -> LayerSpec:
    """The layer FA3 runs for a ragged call: ``layer``, or, when this build lacks the kernels
    for its narrower V (DeepSeek's 192 / 128 needs HDIMDIFF192), the same layer with V padded
    to ``head_dim``. Zero columns of V add zero columns to the output and change nothing else,
    so the kernel for equal dims serves it exactly (vLLM pads the same way)."""
    if layer.v_dim >= layer.head_dim:
        return layer
    missing = any(r.field == "v_head_dim" for r in _fa3_reasons(layer, None, flags))
    return dataclasses.replace(layer, v_head_dim=layer.head_dim) if missing else layer


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


def _fa3_reasons(
    layer: LayerSpec | None, layout: KVCacheLayout | None, flags: dict[str, bool]
) -> list[Reason]:
    """What FA3 (or this build of it) refuses beyond the generic capabilities."""
    if is_mla(layer, layout):
        return _fa3_mla_reasons(layer, layout, flags)
    reasons: list[Reason] = []
    d = dv = None
    if layer is not None:
        d, dv = layer.head_dim, layer.v_dim
    if layout is not None:
        d, dv = layout.head_dim, layout.v_dim
        if layout.is_quantized and layout.dtype != torch.bfloat16:
            reasons.append(
                Reason(
                    _CFG,
                    "dtype",
                    f"must be torch.bfloat16 with an fp8 KV cache (FA3 returns bf16 for fp8 "
                    f"inputs), found {layout.dtype}",
                )
            )
        if layout.is_quantized and (layout.head_dim % 16 or layout.v_dim % 16):
            reasons.append(
                Reason(
                    _CFG,
                    "head_dim",
                    f"must be a multiple of 16 with fp8 KV, found {layout.head_dim}/{layout.v_dim}",
                )
            )
        if layout.dtype == torch.float16 and flags.get("FLASHATTENTION_DISABLE_FP16"):
            reasons.append(Reason(_CFG, "dtype", "float16 is not compiled into this FA3 build"))
        if layout.is_quantized and flags.get("FLASHATTENTION_DISABLE_FP8"):
            reasons.append(Reason(_CFG, "kv_dtype", "fp8 is not compiled into this FA3 build"))
    if d is not None and dv is not None and d != dv:
        diff192 = 128 < d <= 192 and 96 < dv <= 128
        diff64 = d <= 64 and dv <= 512
        built = (diff192 and not flags.get("FLASH_ATTENTION_DISABLE_HDIMDIFF192")) or (
            diff64 and not flags.get("FLASH_ATTENTION_DISABLE_HDIMDIFF64")
        )
        if not built:
            reasons.append(
                Reason(
                    _CFG,
                    "v_head_dim",
                    f"must equal head_dim={d}, or be in (96, 128] with head_dim in (128, 192] "
                    f"(when compiled in), found {dv}",
                )
            )
    if d is not None:
        built_dims = [
            h for h in (64, 96, 128, 192, 256) if not flags.get(f"FLASHATTENTION_DISABLE_HDIM{h}")
        ]
        if built_dims and max(d, dv or d) > max(built_dims):
            reasons.append(
                Reason(
                    _CFG,
                    "head_dim",
                    f"must be <= {max(built_dims)} in this FA3 build, found {max(d, dv or d)}",
                )
            )
    if layer is not None:
        if layer.has_softcap and flags.get("FLASHATTENTION_DISABLE_SOFTCAP"):
            reasons.append(
                Reason(_CFG, "softcap", "is not compiled into this FA3 build (DISABLE_SOFTCAP)")
            )
        if layer.sliding_window is not None and flags.get("FLASHATTENTION_DISABLE_LOCAL"):
            reasons.append(
                Reason(
                    _CFG, "sliding_window", "is not compiled into this FA3 build (DISABLE_LOCAL)"
                )
            )
    return reasons


def _fa3_mla_reasons(
    layer: LayerSpec | None, layout: KVCacheLayout | None, flags: dict[str, bool]
) -> list[Reason]:
    """An MLA layer (its dims: ``Capabilities.mla_dims``): the qv kernels in this build, and
    what every GPU MLA kernel refuses (``mla_kernel_reasons``)."""
    reasons = []
    if flags.get("FLASH_ATTENTION_DISABLE_HDIMDIFF64"):
        reasons.append(
            Reason(
                _CFG,
                "mla",
                "needs FA3's hdim 64 x 512 (qv) kernels, which this build leaves out "
                "(FLASH_ATTENTION_DISABLE_HDIMDIFF64 in flash_attn_config); sgl-kernel's and "
                "vLLM's FA3 builds have them, or use the flashinfer backend",
            )
        )
    if (
        layout is not None
        and layout.dtype == torch.float16
        and flags.get("FLASHATTENTION_DISABLE_FP16")
    ):
        reasons.append(Reason(_CFG, "dtype", "float16 is not compiled into this FA3 build"))
    fp8 = "SGLang's FA3 path upcasts an fp8 latent without a scale (not served yet)"
    return reasons + mla_kernel_reasons(layer, layout, "FA3's qv path", fp8)
