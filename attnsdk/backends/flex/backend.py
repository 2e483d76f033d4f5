"""``flex``: paged attention on ``torch.nn.attention.flex_attention`` (CPU and CUDA, no extra package).

How a step maps onto FlexAttention: the whole page pool of an NHD cache is one KV sequence
(``_pool``: a view, no gather copy); ``mask`` builds the step's block mask, which lists per
sequence and query block only the pages its rows may see, and the tensors ``mask_mod`` reads
(once per plan and layer mask kind); ``kernel`` is the flex call for one layer kind (masks,
softcap, sinks, the log-sum-exp).

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
buckets itself. ``compile_stats`` records each bucket's compile time. Uncompiled flex (the CPU
default: a CPU compile takes seconds per bucket) runs torch's unfused implementation, which
materialises scores over the whole pool: fine for tests and small CPU pools, slow for large
ones (``kernel`` says why its warning is silenced). Compiled flex on CPU returns no
log-sum-exp (torch 2.13: "return_lse is not supported yet"), so sinks and ``lse=`` on a
compiled CPU path are refused.
"""

from __future__ import annotations

import itertools
import time
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from attnsdk.backends.flex.kernel import attention_function
from attnsdk.backends.flex.mask import (
    LayerKind,
    StepMask,
    bad_page,
    build_mask,
    check_shared_pages,
)
from attnsdk.backends.flex.options import FlexOptions, compiles
from attnsdk.backends.gpu import DeviceStoreBackend
from attnsdk.contract.capabilities import Capabilities, Feature, GraphSupport, default_device
from attnsdk.contract.errors import InvalidInputError, Reason, ReasonKind
from attnsdk.contract.kv import KVOrder
from attnsdk.contract.plan import Plan
from attnsdk.contract.validate import check_pages
from attnsdk.kernels.store import DeviceFlag

if TYPE_CHECKING:
    from collections.abc import Callable

    from attnsdk.backends.base import AttendArgs
    from attnsdk.backends.flex.kernel import Result
    from attnsdk.contract.capabilities import Request
    from attnsdk.contract.kv import KVCache, KVCacheLayout
    from attnsdk.contract.layer import LayerSpec

__all__ = ["FlexBackend", "FlexPlan"]

_CFG = ReasonKind.CONFIGURATION


@dataclass(frozen=True, slots=True)
class FlexPlan(Plan):
    """``Plan`` plus the step's block masks, built lazily per (layer mask kind, pool size)."""

    masks: dict[tuple[object, ...], StepMask] = field(default_factory=dict)


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
        self._functions: dict[tuple[object, ...], Callable[..., Result]] = {}
        self._buckets: set[tuple[object, ...]] = set()
        self.compile_stats: list[CompileRecord] = []
        """Every shape bucket compiled so far, in order (empty when nothing compiles)."""

    @classmethod
    def refusals(cls, request: Request) -> list[Reason]:
        """``BackendBase``'s, page sizes flex's GPU tiles cannot divide (the capabilities hold
        only a minimum and a multiple), and what compiled flex cannot do where it compiles: no
        log-sum-exp on CPU (so no ``lse=`` and no sinks there), no fp32 on CUDA."""
        reasons = super().refusals(request)
        layer, layout = request.layer, request.layout
        if layout is not None and layout.page_size & (layout.page_size - 1):
            reasons.append(
                Reason(
                    _CFG,
                    "page_size",
                    f"must be a power of two >= 16 (flex tiles KV pages in power-of-two blocks), "
                    f"found {layout.page_size}",
                )
            )
        device = request.device or default_device(cls.capabilities)
        if not compiles(cls.options_of(request), device):
            return sorted(set(reasons))
        if device.type == "cpu":
            no_lse = "needs the log-sum-exp, which compiled flex does not return on CPU: use "
            no_lse += "FlexOptions(compile=False) on CPU"
            if layer is not None and layer.has_sinks:
                reasons.append(Reason(_CFG, "has_sinks", no_lse))
            if Feature.LSE in request.uses:
                reasons.append(Reason(_CFG, "lse", no_lse))
        fp32 = (layout.dtype if layout is not None else request.dtype) == torch.float32
        if fp32 and device.type == "cuda":
            reasons.append(
                Reason(
                    _CFG,
                    "dtype",
                    "torch.float32 has no compiled flex kernel for page-sized KV tiles on "
                    "CUDA (measured on an H200, torch 2.11: NoValidChoicesError): use bf16 "
                    "or fp16, or FlexOptions(compile=False)",
                )
            )
        return sorted(set(reasons))

    def _compiles(self, device: torch.device) -> bool:
        return compiles(self.options, device)

    def layer_state(self, layer: LayerSpec, layout: KVCacheLayout) -> LayerKind:
        return LayerKind.of(layer, layout)

    # -- per step ---------------------------------------------------------------------------

    def poll(self, device: torch.device) -> None:
        """The KV store's flag, then the page check's (``mask.build_mask``)."""
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
        """Where CUDA steps report a page they cannot read right (see ``mask.build_mask``)."""
        flag = self._page_flags.get(device)
        if flag is None:
            flag = self._page_flags[device] = DeviceFlag(device, bad_page)
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
            check_shared_pages(plan.metadata, cache.layout.page_size, cache.num_pages)

    # -- per layer --------------------------------------------------------------------------

    def attend(self, call: AttendArgs) -> torch.Tensor:
        q, cache, plan, layer, state = call.q, call.cache, call.plan, call.layer, call.state
        sinks, out, lse = call.sinks, call.out, call.lse
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
        fn: Callable[..., Result],
        args: tuple[Any, ...],
        compiled: bool,
    ) -> Result:
        if compiled and _capturing(args[0].device):
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
        self, state: LayerKind, compiled: bool, device: torch.device
    ) -> Callable[..., Result]:
        fkey = (state, compiled, device.type)
        fn = self._functions.get(fkey)
        if fn is None:
            # Compiled flex returns no log-sum-exp on CPU (lse= and sinks are refused there).
            with_lse = not (compiled and device.type == "cpu")
            fn = attention_function(state, compiled, device.type == "cuda", with_lse)
            if compiled:
                fn = torch.compile(fn, dynamic=False, fullgraph=True)
            self._functions[fkey] = fn
        return fn

    def _step_mask(self, plan: Plan, state: LayerKind, num_pages: int, t: int) -> StepMask:
        """This step's block mask for the layer's mask kind, built once per plan (like fa3's
        scheduler metadata: a captured plan caches only while capturing, since the buffers it
        reads change between replays)."""
        key = (state.page_size, state.causal, state.window_left, state.chunk, num_pages, t)
        masks = None
        if isinstance(plan, FlexPlan) and (plan.graph is None or _capturing(plan.metadata.device)):
            masks = plan.masks
            found = masks.get(key)
            if found is not None:
                return found
        meta = plan.metadata
        flag = self._page_flag(meta.device).flag if meta.device.type == "cuda" else None
        built = build_mask(meta, state, num_pages, t, flag)
        if masks is not None:
            masks[key] = built
        return built


_LIMIT = (
    "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"
)
_COMPILES_IN_PROCESS = itertools.count(1)
"""Shape buckets compiled by every FlexBackend in this process (dynamo's limits count them all)."""


def _capturing(device: torch.device) -> bool:
    """Whether the current stream is capturing a CUDA graph (a CPU-only torch raises when
    asked, so only CUDA devices ask)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


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
