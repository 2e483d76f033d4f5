"""``flex``: paged attention on ``torch.nn.attention.flex_attention`` (CPU and CUDA, no extra package).

How a step maps onto FlexAttention (shape legend of ``attnsdk.contract.backend``; Bb, Lb, Wb are buckets):

- **KV straight from the cache, no gather copy.** The whole page pool of an NHD cache is one KV
  sequence: ``k_nhd`` (N, P, Hkv, D) is viewed as (1, Hkv, N*P, D) (a permute, no copy; its
  strides are fixed per cache, so they never cause a recompile). A ``BlockMask`` whose KV block
  size is the page size lists, per sequence and per 128-row query block, only the pages that
  hold keys some row of that block may see (pages below a sliding window are left out, which
  also keeps vLLM's null block out of real rows). The kernel reads nothing else.
- **Positions through a per-page table.** ``mask_mod`` needs each key's logical position:
  ``page_pos[n]`` (N + 1 int32, built per step on the device by one scatter from the page table,
  no host sync) holds the logical index of physical page n. ``mask_mod`` also checks that
  ``page_table[b, page_pos[n]] == n``, so a row never counts another sequence's page (the eager
  path ignores block sparsity, so the mask must be complete on its own). A page read by two
  sequences of one step must therefore sit at the same logical index in both, which prefix
  sharing (SGLang's radix cache, vLLM's prefix caching) does (a page table that breaks the rule
  is refused on the CPU, where checking costs no sync; on CUDA it is not checked yet); a [B, N] table would lift that
  rule but costs B*N*4 bytes per step (1 GiB at B=256 and a million pages).
- **Queries: one row per sequence**, (Bb, Hq, Lb, D) with Lb = next power of two >= the longest
  query. This suits decode and speculative verify (on CUDA flex uses its split-KV decoding kernel
  for Lb < 128). Mixed batches with one long prefill pad every row to that prefill's length: the
  padded query blocks list no page so they cost a launch slot, not FLOPs, but q and the output
  staging buffer grow to Bb*Lb rows.
- **Semantics**: bottom-right causal, HF sliding window (non-causal: symmetric), chunked local
  attention (in ``mask_mod``; the block mask leaves out pages outside a query block's chunks),
  GQA through ``enable_gqa``, softcap in ``score_mod``, sinks from the log-sum-exp flex returns:
  ``out * sigmoid(lse - sink)`` (= out * e^lse / (e^lse + e^sink); a row that sees no key has
  lse = -inf and stays 0, like the reference). ``lse=`` is that log-sum-exp (natural log: the
  public flex API converts its kernels' base-2 statistics), plus the sink term
  ``logaddexp(lse, sink)`` on sink layers. flex is always asked for its log-sum-exp where it
  can return one (everywhere but compiled CPU): one compiled function per layer kind, and an
  output that is bit for bit the same with and without ``lse=`` (the conformance suite checks
  it); writing (Bb, Hq, Lb) fp32 values costs next to nothing beside the output.

Refused, with reasons: fp8 KV (flex's CPU kernel needs one dtype for q/k/v; dequantising a copy
of the pool per layer would defeat the no-copy design), HND caches (an (N, Hkv, P, D) pool is
not one strided KV sequence), and page sizes that are not a power of two >= 16 (flex's GPU
kernels tile KV in power-of-two blocks of at least 16 that must divide the page; one rule on
every device, so the CPU CI tests what CUDA serves).

Compilation (``FlexOptions.compile``; None = on CUDA only): ``torch.compile(dynamic=False)``
per layer kind, specialised per shape bucket (Bb, Lb, Wb, pool size), so steady-state steps and
CUDA-graph replays never recompile; dynamic shapes are avoided on purpose (torch 2.11 failed to
lower flex at a symbolic length). Dynamo's recompile limit (8 per code object, and every layer
kind of every flex backend in a process compiles one inner function) is lifted only while a new
bucket compiles, to twice the process's compiled buckets, because this backend bounds its
buckets itself. ``compile_stats`` records
each bucket's compile time. Uncompiled flex (the CPU default: a CPU compile takes seconds per
bucket) runs torch's unfused implementation, which materialises scores over the whole pool:
fine for tests and small CPU pools, slow for large ones; its "called without torch.compile"
warning is the documented consequence of ``compile=False`` and is filtered for that call only.
Compiled flex on CPU returns no log-sum-exp (torch 2.13: "return_lse is not supported yet"), so
sinks and ``lse=`` on a compiled CPU path are refused.
"""

from __future__ import annotations

import itertools
import math
import time
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from pydantic import BaseModel, ConfigDict

from attnsdk.backends.gpu import DeviceStoreBackend
from attnsdk.contract.capabilities import Capabilities, Feature, GraphSupport
from attnsdk.contract.errors import InvalidInputError, InvalidMetadataError, Reason, ReasonKind
from attnsdk.contract.kv import KVOrder
from attnsdk.contract.plan import Plan
from attnsdk.contract.validate import check_pages
from attnsdk.kernels.store import DeviceFlag

if TYPE_CHECKING:
    from collections.abc import Callable

    from attnsdk.contract.kv import KVCache, KVCacheLayout
    from attnsdk.contract.layer import LayerSpec
    from attnsdk.contract.metadata import AttentionMetadata

__all__ = ["FlexBackend", "FlexOptions", "FlexPlan"]

_CFG = ReasonKind.CONFIGURATION
_Q_BLOCK = 128
"""Query rows per BlockMask block: a multiple of every forward BLOCK_M flex picks on CUDA."""
_UNCOMPILED = "flex_attention called without torch.compile"
_Result = tuple[torch.Tensor, torch.Tensor | None]
"""What a step's flex function returns: the output and, when asked for, the log-sum-exp."""


class FlexOptions(BaseModel):
    """Options of the ``flex`` backend."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    compile: bool | None = None
    """``torch.compile`` flex per shape bucket. None (default): on CUDA, off on CPU (a CPU
    compile takes seconds per bucket; see docs/backends.md). False runs the unfused eager flex,
    which materialises scores over the whole page pool (tests and debugging)."""


@dataclass(frozen=True, slots=True)
class FlexPlan(Plan):
    """``Plan`` plus the step's block masks, built lazily per (layer mask kind, pool size)."""

    masks: dict[tuple[object, ...], _StepMask] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class _StepMask:
    """One step's BlockMask inputs and the tensors ``mask_mod`` reads (all on the device)."""

    kv_num_blocks: torch.Tensor
    """(Bb, 1, nq) int32: pages listed per sequence and query block."""
    kv_indices: torch.Tensor
    """(Bb, 1, nq, Wb) int32: physical pages, in logical order."""
    page_pos: torch.Tensor
    """(N + 1,) int32: logical index of each physical page (entry N: sink of unused columns)."""
    page_table: torch.Tensor
    """(Bb, Wpt) int32: the page table, padding rows -1."""
    seq_lens: torch.Tensor
    """(Bb,) int32: KV lengths, padding rows 0."""
    q_start: torch.Tensor
    """(Bb,) int32: KV position of each row's first query."""
    q_index: torch.Tensor
    """(Bb * Lb,) int64: token row of q gathered into each padded query row."""
    out_row: torch.Tensor
    """(T,) int64: padded row (b * Lb + j) each token's output is read from."""
    tree: torch.Tensor | None
    """(Bb, Lb, Lb) bool: the step's tree mask by padded row and new-token column, or None."""


@dataclass(frozen=True, slots=True)
class _Static:
    """Per (layer, layout): what the masks and the compiled function depend on."""

    page_size: int
    causal: bool
    window_left: int
    chunk: int
    """Chunked local attention C, 0 = off."""
    softcap: float
    scale: float
    sinks: bool
    gqa_pow2: bool


@dataclass(frozen=True, slots=True)
class CompileRecord:
    """One compiled shape bucket: its key and the wall time of its first (compiling) call."""

    key: tuple[object, ...]
    seconds: float


class FlexBackend(DeviceStoreBackend):
    """Paged attention on torch FlexAttention. See the module docstring."""

    name = "flex"
    priority = -10
    capabilities = Capabilities(
        devices=frozenset({"cpu", "cuda"}),
        dtypes=frozenset({torch.float16, torch.bfloat16, torch.float32}),
        kv_dtypes=frozenset(),
        max_head_dim=256,
        head_dim_multiple=16,
        min_page_size=16,
        page_size_multiple=16,
        orders=frozenset({KVOrder.NHD}),
        features=frozenset(Feature) - {Feature.FP8_KV, Feature.RAGGED},
        graph_support=GraphSupport.UNIFORM_BATCH,
    )
    Options = FlexOptions
    plan_type = FlexPlan
    options: FlexOptions

    def __init__(self, options: FlexOptions | None = None) -> None:
        super().__init__(options)
        self._page_flags: dict[torch.device, DeviceFlag] = {}
        self._functions: dict[tuple[object, ...], Callable[..., _Result]] = {}
        self._buckets: set[tuple[object, ...]] = set()
        self.compile_stats: list[CompileRecord] = []
        """Every shape bucket compiled so far, in order (empty when nothing compiles)."""

    @classmethod
    def extra_reasons(cls, layer: LayerSpec | None, layout: KVCacheLayout | None) -> list[Reason]:
        """Page sizes flex's GPU tiles cannot divide (capabilities hold only min and multiple)."""
        if layout is not None and layout.page_size & (layout.page_size - 1):
            return [
                Reason(
                    _CFG,
                    "page_size",
                    f"must be a power of two >= 16 (flex tiles KV pages in power-of-two blocks), "
                    f"found {layout.page_size}",
                )
            ]
        return []

    @classmethod
    def option_reasons(
        cls,
        options: FlexOptions,
        layer: LayerSpec | None,
        layout: KVCacheLayout | None,
        device: torch.device,
    ) -> list[Reason]:
        """What compiled flex cannot do where it compiles."""
        reasons = []
        compiles = _compiles(options, device)
        if layer is not None and layer.has_sinks and device.type == "cpu" and compiles:
            reasons.append(
                Reason(
                    _CFG,
                    "has_sinks",
                    "needs the log-sum-exp, which compiled flex does not return on CPU: "
                    "use FlexOptions(compile=False) on CPU",
                )
            )
        fp32 = layout is not None and layout.dtype == torch.float32
        if fp32 and device.type == "cuda" and compiles:
            reasons.append(
                Reason(
                    _CFG,
                    "dtype",
                    "torch.float32 has no compiled flex kernel for page-sized KV tiles on "
                    "CUDA (measured on an H200, torch 2.11: NoValidChoicesError): use bf16 "
                    "or fp16, or FlexOptions(compile=False)",
                )
            )
        return reasons

    def _compiles(self, device: torch.device) -> bool:
        return _compiles(self.options, device)

    def lse_reasons(
        self, layer: LayerSpec, layout: KVCacheLayout, device: torch.device
    ) -> list[Reason]:
        """Compiled flex returns no log-sum-exp on CPU."""
        reasons = super().lse_reasons(layer, layout, device)
        if device.type == "cpu" and self._compiles(device):
            reasons.append(
                Reason(
                    _CFG,
                    "lse",
                    "needs the log-sum-exp, which compiled flex does not return on CPU: "
                    "use FlexOptions(compile=False) on CPU",
                )
            )
        return reasons

    def layer_state(self, layer: LayerSpec, layout: KVCacheLayout) -> _Static:
        g = layer.group_size
        return _Static(
            page_size=layout.page_size,
            causal=layer.causal,
            window_left=layer.window_left,
            chunk=layer.attention_chunk_size or 0,
            softcap=float(layer.softcap or 0.0),
            scale=layer.softmax_scale,
            sinks=layer.has_sinks,
            gqa_pow2=g & (g - 1) == 0,
        )

    # -- per step ---------------------------------------------------------------------------

    def poll(self, device: torch.device) -> None:
        """The KV store's flag, then the page check's (``_build_mask``)."""
        super().poll(device)
        if device.type == "cuda":
            self._page_flag(device).poll()

    def sync_check(self, device: torch.device) -> None:
        """Raise now, with a device sync, what the KV store or the page check recorded (debug
        mode calls it)."""
        super().sync_check(device)
        if device.type == "cuda":
            self._page_flag(device).check_now()

    def _page_flag(self, device: torch.device) -> DeviceFlag:
        """Where CUDA steps report a page they cannot read right (see ``_build_mask``)."""
        flag = self._page_flags.get(device)
        if flag is None:
            flag = self._page_flags[device] = DeviceFlag(device, _bad_page)
        return flag

    def check_step(self, plan: Plan, cache: KVCache) -> None:
        # The pool must be viewable as one KV sequence (an interleaved [N, 2, P, H, D] cache is
        # not): refused here, before the store writes anything.
        _pool(cache.k_nhd, 0)
        _pool(cache.v_nhd, 0)
        # A CPU check costs no device sync: every page read is checked before any write. On
        # CUDA page ids are clamped into the pool instead (no read outside the cache).
        if cache.device.type == "cpu":
            check_pages(plan.metadata, cache.layout.page_size, cache.num_pages)
            _check_shared_pages(plan.metadata, cache.layout.page_size, cache.num_pages)

    # -- per layer --------------------------------------------------------------------------

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
        meta = plan.metadata
        t = q.shape[0]
        if meta.num_seqs == 0 or t == 0 or meta.max_query_len == 0:
            return out
        p, n = cache.layout.page_size, cache.num_pages
        mask = self._step_mask(plan, state, n, t)
        bb, wb = mask.kv_indices.shape[0], mask.kv_indices.shape[-1]
        lb = mask.q_index.shape[0] // bb
        hq, d = layer.num_heads, layer.head_dim
        k_pool = _pool(cache.k_nhd, n * p)
        v_pool = _pool(cache.v_nhd, n * p)
        qp = q.index_select(0, mask.q_index).view(bb, lb, hq, d).transpose(1, 2)
        compiled = self._compiles(q.device)
        key = (
            state, q.device.type, q.dtype, tuple(k_pool.shape), k_pool.stride(),
            tuple(v_pool.shape), v_pool.stride(), hq, d, bb, lb, wb, mask.page_table.shape[1],
            mask.tree is not None, compiled,
        )  # fmt: skip
        fn = self._function(state, compiled, q.device)
        args = (
            qp, k_pool, v_pool, mask.kv_num_blocks, mask.kv_indices, mask.page_pos,
            mask.page_table, mask.seq_lens, mask.q_start, mask.tree, sinks,
        )  # fmt: skip
        res, res_lse = (
            fn(*args) if key in self._buckets else self._first_call(key, fn, args, compiled)
        )
        # res: (Bb, Hq, Lb, Dv) -> token rows of out; res_lse: (Bb, Hq, Lb) -> rows of lse.
        flat = res.transpose(1, 2).reshape(bb * lb, hq, layer.v_dim)
        out[:t].copy_(flat.index_select(0, mask.out_row))
        if lse is not None and res_lse is not None:
            lse[:t].copy_(
                res_lse.transpose(1, 2).reshape(bb * lb, hq).index_select(0, mask.out_row)
            )
        return out

    def _first_call(
        self,
        key: tuple[object, ...],
        fn: Callable[..., _Result],
        args: tuple[Any, ...],
        compiled: bool,
    ) -> _Result:
        if compiled and q_capturing(args[0]):
            raise InvalidInputError(
                "plan",
                "a shape bucket compiled before CUDA-graph capture (run one eager step of the "
                "captured batch size first; GraphRunner's warm-up does)",
                f"a new bucket (rows, query length, pages) = {key[-6:-3]} during capture",
            )
        start = time.perf_counter()
        if compiled:
            # One torch.compile per layer kind serves every bucket. Buckets are powers of two,
            # so they grow only logarithmically; dynamo's recompile limit (8) must not refuse a
            # new one. Dynamo counts per code object: every layer kind of every FlexBackend in
            # the process compiles the same inner function, so the count is process-wide
            # (measured: a limit from one backend's buckets failed after ~100 tests on an H200).
            limit = max(64, 2 * next(_COMPILES_IN_PROCESS) + 8)
            patch: dict[str, int] = {_LIMIT: limit}
            if hasattr(torch._dynamo.config, "accumulated_recompile_limit"):  # its safeguard
                patch["accumulated_recompile_limit"] = max(256, 2 * limit)
            with torch._dynamo.config.patch(patch), warnings.catch_warnings():
                # Inductor's first import runs deprecated torch.jit code of torch's own.
                warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"torch\.")
                res = fn(*args)
        else:
            res = fn(*args)
        self._buckets.add(key)
        if compiled:
            self.compile_stats.append(CompileRecord(key, time.perf_counter() - start))
        return res

    def _function(
        self, state: _Static, compiled: bool, device: torch.device
    ) -> Callable[..., _Result]:
        fkey = (state, compiled, device.type)
        fn = self._functions.get(fkey)
        if fn is None:
            # Compiled flex returns no log-sum-exp on CPU (lse= and sinks are refused there).
            with_lse = not (compiled and device.type == "cpu")
            fn = _attention_function(state, compiled, device.type == "cuda", with_lse)
            if compiled:
                fn = torch.compile(fn, dynamic=False, fullgraph=True)
            self._functions[fkey] = fn
        return fn

    def _step_mask(self, plan: Plan, state: _Static, num_pages: int, t: int) -> _StepMask:
        """This step's block mask for the layer's mask kind, built once per plan (like fa3's
        scheduler metadata: a captured plan caches only while capturing, since the buffers it
        reads change between replays)."""
        key = (state.page_size, state.causal, state.window_left, state.chunk, num_pages, t)
        masks = None
        if isinstance(plan, FlexPlan) and (
            plan.graph is None or torch.cuda.is_current_stream_capturing()
        ):
            masks = plan.masks
            found = masks.get(key)
            if found is not None:
                return found
        meta = plan.metadata
        bad_page = self._page_flag(meta.device).flag if meta.device.type == "cuda" else None
        built = _build_mask(meta, state, num_pages, t, bad_page)
        if masks is not None:
            masks[key] = built
        return built


_LIMIT = (
    "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"
)
_COMPILES_IN_PROCESS = itertools.count(1)
"""Shape buckets compiled by every FlexBackend in this process (dynamo's limits count them all)."""


def q_capturing(q: torch.Tensor) -> bool:
    return q.device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _pool(x: torch.Tensor, tokens: int) -> torch.Tensor:
    """(N, P, Hkv, D) pages as one (1, Hkv, N*P, D) KV sequence, without a copy."""
    _, p, h, d = x.shape
    if x.stride(0) != p * x.stride(1):
        raise InvalidInputError(
            "cache.k / cache.v",
            "pages at a stride of page_size token rows (the flex backend views the pool as one "
            "sequence)",
            x.stride(),
        )
    return x.as_strided((1, h, tokens, d), (0, x.stride(2), x.stride(1), x.stride(3)))


def _next_pow2(x: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(1, x))))


def _build_mask(
    meta: AttentionMetadata, st: _Static, n: int, t: int, bad_page: torch.Tensor | None
) -> _StepMask:
    """Per-step block mask inputs, on the device, from the metadata alone (no host sync).

    ``bad_page`` (CUDA): the ``DeviceFlag`` tensor that a page read wrongly is reported into.
    """
    dev = meta.device
    p = st.page_size
    b = meta.num_seqs
    bb = _next_pow2(b)
    lb = _next_pow2(max(1, meta.max_query_len))
    nq = -(-lb // _Q_BLOCK)
    # The CPU kernel wants one index column per pool page; CUDA only as many as a row reads.
    wb = n if dev.type == "cpu" else min(n, _next_pow2(-(-max(1, meta.max_seq_len) // p)))
    i32 = torch.int32
    qsl = meta.query_start_loc.to(i32)
    seq = meta.seq_lens.to(i32)
    qlen = qsl[1:] - qsl[:-1]
    pad = bb - b
    seq_p = torch.nn.functional.pad(seq, (0, pad))
    qlen_p = torch.nn.functional.pad(qlen, (0, pad))
    qsl_p = torch.nn.functional.pad(qsl[:-1], (0, pad))
    q_start = seq_p - qlen_p
    pt = meta.page_table.to(i32).clamp(0, n - 1)
    wpt = pt.shape[1]
    # mask_mod reads the table: its width is bucketed too, or every new width would recompile.
    pt_p = torch.nn.functional.pad(pt, (0, _next_pow2(wpt) - wpt, 0, pad), value=-1)

    # Logical index of every page the batch maps (unused columns scatter into entry n).
    cols = torch.arange(wpt, device=dev, dtype=i32)
    used = cols[None, :] < ((seq + p - 1) // p)[:, None]
    page_pos = torch.zeros(n + 1, dtype=i32, device=dev)
    target = torch.where(used, pt, n).long().flatten()
    page_pos.scatter_(0, target, cols.expand(b, wpt).flatten())
    if bad_page is not None:
        # Ids are clamped into the pool and page_pos holds one logical index per page, so a
        # page id outside the pool, or a page at two logical indices, would be read as some
        # other key: reported through the flag instead (the CPU checks it before any write).
        raw = meta.page_table.long()
        wrong = used & (
            (raw < 0) | (raw >= n) | (page_pos.gather(0, pt.flatten()).view_as(pt) != cols)
        )
        code = torch.where(raw < 0, _NEGATIVE - raw, raw)
        bad_page.copy_(torch.maximum(bad_page, torch.where(wrong, code, -1).amax().view(1)))

    # Pages each (row, query block) may see, in logical order.
    j0 = torch.arange(nq, device=dev, dtype=i32)[None, :] * _Q_BLOCK  # (1, nq)
    real = (qlen_p[:, None] - j0).clamp(0, min(_Q_BLOCK, lb))  # rows of the block in use
    first_pos = q_start[:, None] + j0
    last_pos = first_pos + real - 1
    hi = (seq_p - 1)[:, None].expand_as(last_pos)
    wl = st.window_left
    if st.causal:
        hi = torch.minimum(hi, last_pos)
    elif wl >= 0:
        hi = torch.minimum(hi, last_pos + wl)
    lo = (first_pos - wl).clamp_min(0) if wl >= 0 else torch.zeros_like(first_pos)
    if st.chunk:
        # The block's rows see nothing before its first row's chunk or after its last row's.
        lo = torch.maximum(lo, first_pos // st.chunk * st.chunk)
        hi = torch.minimum(hi, (last_pos // st.chunk + 1) * st.chunk - 1)
    first_page = lo // p
    count = torch.where((real > 0) & (hi >= lo), hi.clamp_min(0) // p - first_page + 1, 0)
    count = count.clamp(0, wb)
    ramp = torch.arange(wb, device=dev, dtype=i32)
    col = (first_page[..., None] + ramp).clamp(0, wpt - 1).long()  # (Bb, nq, Wb)
    rows = torch.arange(bb, device=dev)[:, None, None].clamp(max=b - 1)
    indices = torch.where(ramp < count[..., None], pt[rows, col], 0)

    # Query gather (padded rows repeat a real row: finite, discarded) and output scatter.
    j = torch.arange(lb, device=dev, dtype=torch.int64)
    q_index = qsl_p.long()[:, None] + j.clamp_max(qlen_p.long()[:, None] - 1).clamp_min(0)
    # Rows past num_tokens (allowed, unspecified) are never gathered: the tree mask has
    # only num_tokens rows for sure.
    q_index = q_index.clamp(0, max(1, min(t, meta.num_tokens)) - 1).flatten()
    tok = torch.arange(t, device=dev, dtype=i32)
    seq_of = torch.searchsorted(qsl[1:], tok, right=True).clamp_max(b - 1)
    out_row = seq_of.long() * lb + (tok - qsl[seq_of]).long().clamp(0, lb - 1)
    return _StepMask(
        kv_num_blocks=count.view(bb, 1, nq).to(i32).contiguous(),
        kv_indices=indices.view(bb, 1, nq, wb).to(i32).contiguous(),
        page_pos=page_pos,
        page_table=pt_p,
        seq_lens=seq_p,
        q_start=q_start,
        q_index=q_index,
        out_row=out_row,
        tree=None if meta.tree_mask is None else _tree_rows(meta.tree_mask, q_index, bb, lb),
    )


def _tree_rows(mask: torch.Tensor, q_index: torch.Tensor, bb: int, lb: int) -> torch.Tensor:
    """The tree mask as (Bb, Lb, Lb): padded query row by new-token column (False past M)."""
    rows = mask.index_select(0, q_index)[:, :lb]
    if rows.shape[1] < lb:
        rows = torch.nn.functional.pad(rows, (0, lb - rows.shape[1]), value=False)
    return rows.reshape(bb, lb, lb).contiguous()


def _attention_function(
    st: _Static, compiled: bool, cuda: bool, with_lse: bool
) -> Callable[..., _Result]:
    """flex over one step for one layer kind; returns the output (Bb, Hq, Lb, Dv) and, when
    ``with_lse``, the fp32 log-sum-exp (Bb, Hq, Lb) with the sink term (else None)."""
    from torch.nn.attention import flex_attention as fa

    p, wl, causal, cap, chunk = st.page_size, st.window_left, st.causal, st.softcap, st.chunk
    aux = getattr(fa, "AuxRequest", None)
    kernel_options: dict[str, Any] | None = None
    # The main kernel instead of flex's split-KV decoding kernel (CUDA).
    main_kernel: dict[str, Any] | None = None
    if cuda:
        # Each KV block is one page: the kernel's KV tile must divide it (measured on an H200:
        # the default 64/128-wide tile fails to lower for 16-token pages).
        kernel_options = {"BLOCK_N": min(st.page_size, 64)}
        main_kernel = {**kernel_options, "FORCE_USE_FLEX_ATTENTION": True}
        # The decoding kernel packs a KV head's query heads only for power-of-two groups.
        if not st.gqa_pow2:
            kernel_options = main_kernel

    def run(
        qp: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        kv_num_blocks: torch.Tensor,
        kv_indices: torch.Tensor,
        page_pos: torch.Tensor,
        page_table: torch.Tensor,
        seq_lens: torch.Tensor,
        q_start: torch.Tensor,
        tree: torch.Tensor | None,
        sinks: torch.Tensor | None,
    ) -> _Result:
        wpt = page_table.shape[1]

        def mask_mod(b: Any, h: Any, qi: Any, ki: Any) -> Any:
            page = ki // p
            logical = page_pos[page]
            own = page_table[b, logical.clamp(0, wpt - 1)] == page
            kpos = logical * p + ki % p
            qpos = q_start[b] + qi
            ok = own & (kpos < seq_lens[b])
            if causal:
                ok = ok & (kpos <= qpos)
            if tree is not None:
                # New token j = kpos - q_start is visible when it is an ancestor (or qi itself);
                # causality above already keeps j <= qi.
                j = kpos - q_start[b]
                ok = ok & ((j < 0) | tree[b, qi, j.clamp(0, tree.shape[-1] - 1)])
            if wl >= 0:
                ok = ok & (kpos >= qpos - wl)
                if not causal:
                    ok = ok & (kpos <= qpos + wl)
            if chunk:
                ok = ok & (kpos // chunk == qpos // chunk)
            return ok

        def softcap(score: Any, b: Any, h: Any, qi: Any, ki: Any) -> Any:
            return torch.tanh(score / cap) * cap

        lq = qp.shape[2]
        options = kernel_options
        if main_kernel is not None and lq * (qp.shape[1] // k_pool.shape[1]) > _Q_BLOCK:
            # The decoding kernel tiles a KV head's query rows times its query heads as one
            # block that must divide the 128-row query block (no valid config otherwise:
            # measured, 32 rows x 8 heads per KV head on an H200, torch 2.11).
            options = main_kernel
        block_mask = fa.BlockMask.from_kv_blocks(
            kv_num_blocks,
            kv_indices,
            BLOCK_SIZE=(_Q_BLOCK, p),
            mask_mod=mask_mod,
            seq_lengths=(lq, k_pool.shape[2]),
            compute_q_blocks=False,
        )
        kwargs: dict[str, Any] = {
            "score_mod": softcap if cap > 0 else None,
            "block_mask": block_mask,
            "scale": st.scale,
            "enable_gqa": True,
            "kernel_options": options,
        }
        if sinks is None and not with_lse:
            return fa.flex_attention(qp, k_pool, v_pool, **kwargs), None
        if aux is not None:
            out, extra = fa.flex_attention(qp, k_pool, v_pool, return_aux=aux(lse=True), **kwargs)
            lse = extra.lse.float()
        else:  # torch < 2.9
            out, lse = fa.flex_attention(qp, k_pool, v_pool, return_lse=True, **kwargs)
            lse = lse.float()
        if sinks is not None:
            sink = sinks.float().view(1, -1, 1)
            out = (out.float() * torch.sigmoid(lse - sink)[..., None]).to(out.dtype)
            lse = torch.logaddexp(lse, sink)  # the sink is one more term of the denominator
        return out, lse if with_lse else None

    if compiled:
        return run

    def eager(*args: Any) -> _Result:
        # compile=False is the choice that warning describes: silence it for this call only.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_UNCOMPILED, category=UserWarning)
            return run(*args)

    return eager


def _compiles(options: FlexOptions, device: torch.device) -> bool:
    """Whether flex runs compiled on ``device`` with ``options`` (None: on CUDA only)."""
    return device.type == "cuda" if options.compile is None else options.compile


_NEGATIVE = 1 << 40
"""Flag code of a negative page id ``p``: ``_NEGATIVE - p`` (the flag keeps the largest code)."""


def _bad_page(code: int, when: str) -> Exception:
    page = -(code - _NEGATIVE) if code >= _NEGATIVE else code
    return InvalidMetadataError(
        "page_table",
        "page ids in [0, num_pages), each at one logical index in every sequence that reads it "
        "(the flex backend maps a page to one position per step)",
        f"page {page}",
        f"That step's output was computed from other keys ({when})",
    )


def _check_shared_pages(meta: AttentionMetadata, page_size: int, num_pages: int) -> None:
    """A page two sequences read must sit at one logical index in both (``page_pos`` holds one
    index per page). Checked where it costs no device sync (CPU); on CUDA it is the documented
    rule of this backend."""
    seq = meta.seq_lens_cpu.long()
    pt = meta.page_table.long()
    cols = torch.arange(pt.shape[1])
    used = cols[None, :] < ((seq + page_size - 1) // page_size)[:, None]
    pages, logical = pt[used], cols.expand_as(pt)[used]
    first = torch.full((num_pages,), -1, dtype=torch.long)
    first.scatter_(0, pages, logical)
    clash = first[pages] != logical
    if bool(clash.any()):
        page = int(pages[clash][0])
        raise InvalidMetadataError(
            "page_table",
            "each page at one logical index in every sequence that reads it (the flex backend "
            "maps a page to one position per step)",
            f"page {page} at logical indices {sorted(set(logical[pages == page].tolist()))}",
        )
