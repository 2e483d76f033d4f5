"""The raw kernels ``attnsdk bench`` compares each backend with: what an engine writes by hand.

Each raw baseline writes the new K and V with two ``index_copy_`` calls into the flattened cache
(what an engine without attnsdk does), then calls the library's public entry point on the same
paged cache, page table and lengths the SDK saw:

- ``fa3``: ``flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=, page_table=,
  cu_seqlens_q=, max_seqlen_q=, causal=True)`` from ``flash_attn_interface`` (or
  ``sgl_kernel.flash_attn``); nothing to plan.
- ``flashinfer``: decode steps ``BatchDecodeWithPagedKVCacheWrapper(use_tensor_cores=True,
  backend="fa2")``, any other step ``BatchPrefillWithPagedKVCacheWrapper(backend="fa2")`` with
  ``causal=True``; the CSR page lists are built once (setup), ``plan()`` is timed on its own as
  host µs per step, never inside the kernel time. Graph replay uses a second wrapper made with
  ``use_cuda_graph=True`` and fixed buffers, as engines do.

Flex has no separate raw baseline: a hand-written flex call needs the same block mask and
compiled function the backend builds, so it would measure the backend again.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from attnsdk.backends.fa3.kernels import PROVIDERS, find_provider

if TYPE_CHECKING:
    from collections.abc import Callable

    from attnsdk._bench.common import Case
    from attnsdk.contract.kv import KVCache
    from attnsdk.contract.layer import LayerSpec
    from attnsdk.contract.metadata import AttentionMetadata

__all__ = ["RAW_FAMILY", "RawKernel", "raw_kernel"]

RAW_FAMILY = {"fa3": "fa3", "flashinfer": "flashinfer"}
"""Backend name -> the raw kernel family it is compared with (others have none)."""

_WORKSPACE = 128 << 20


@dataclass(frozen=True, slots=True)
class RawKernel:
    """One raw baseline, set up for one case."""

    kernel: str
    """What is called, e.g. ``flash_attn_interface.flash_attn_with_kvcache``."""
    attend: Callable[[KVCache], torch.Tensor]
    """One layer's attention over ``cache`` (new K/V already written): (T, Hq, D)."""
    plan: Callable[[], None] | None = None
    """The library's per-step planning (host), or None when it has none."""
    graph_attend: Callable[[KVCache], torch.Tensor] | None = None
    """``attend`` on graph-capturable state (planned); None: ``attend`` itself captures."""


def write_kv(cache: KVCache, meta: AttentionMetadata, k: torch.Tensor, v: torch.Tensor) -> None:
    """The engine's hand-written KV store: two ``index_copy_`` into the flattened NHD cache."""
    t = meta.num_tokens
    cache.k.view(-1, *cache.k.shape[2:]).index_copy_(0, meta.slot_mapping[:t], k[:t])
    cache.v.view(-1, *cache.v.shape[2:]).index_copy_(0, meta.slot_mapping[:t], v[:t])


def raw_kernel(
    family: str, case: Case, meta: AttentionMetadata, q: torch.Tensor, layer: LayerSpec
) -> RawKernel:
    """The raw baseline of ``family`` for ``case``; raises when its library is missing."""
    if family == "fa3":
        return _fa3(meta, q)
    if family == "flashinfer":
        return _flashinfer(case, meta, q, layer)
    raise ValueError(f"no raw kernel family {family!r}")


def _fa3(meta: AttentionMetadata, q: torch.Tensor) -> RawKernel:
    provider = find_provider()
    if provider not in ("flash_attn_interface", "sgl_kernel"):
        raise RuntimeError("raw fa3 needs flash_attn_interface or sgl_kernel.flash_attn")
    module = PROVIDERS[provider]
    fn = importlib.import_module(module).flash_attn_with_kvcache

    def attend(cache: KVCache) -> torch.Tensor:
        out = fn(
            q, cache.k, cache.v, cache_seqlens=meta.seq_lens, page_table=meta.page_table,
            cu_seqlens_q=meta.query_start_loc, max_seqlen_q=meta.max_query_len, causal=True,
        )  # fmt: skip
        return out[0] if isinstance(out, tuple) else out

    return RawKernel(f"{module}.flash_attn_with_kvcache", attend)


def _csr(meta: AttentionMetadata, page: int) -> dict[str, torch.Tensor]:
    """FlashInfer's page lists of ``meta``: host ``indptr`` / ``last_page_len`` / ``qo_indptr``
    (its ``plan()`` reads them on the host) and device ``indices``."""
    seq = meta.seq_lens_cpu.long()
    pages = (seq + page - 1) // page
    indptr = torch.zeros(len(seq) + 1, dtype=torch.int32)
    torch.cumsum(pages, 0, out=indptr[1:])
    table = meta.page_table.cpu()
    indices = torch.cat([table[b, : int(n)] for b, n in enumerate(pages)]).to(torch.int32)
    return {
        "qo_indptr": meta.query_start_loc_cpu.to(torch.int32),
        "kv_indptr": indptr,
        "indices": indices.to(meta.device),
        "last_page_len": (seq - (pages - 1) * page).to(torch.int32),
    }


def _flashinfer(
    case: Case, meta: AttentionMetadata, q: torch.Tensor, layer: LayerSpec
) -> RawKernel:
    fi = importlib.import_module("flashinfer")
    dev = q.device
    page = meta.page_size or 16
    csr = _csr(meta, page)
    heads = (layer.num_heads, layer.num_kv_heads, layer.head_dim, page)
    dtypes = {"q_data_type": q.dtype, "kv_data_type": q.dtype}
    decode = case.max_query_len == 1
    b, nnz = meta.num_seqs, int(csr["indices"].numel())

    def buffers() -> dict[str, torch.Tensor]:
        i32 = torch.int32
        return {
            "qo_indptr": csr["qo_indptr"].to(dev),
            "kv_indptr": torch.empty(b + 1, dtype=i32, device=dev),
            "indices": torch.empty(nnz, dtype=i32, device=dev),
            "last_page_len": torch.empty(b, dtype=i32, device=dev),
        }

    def make(graph: bool) -> tuple[Any, Callable[[], None]]:
        ws = torch.zeros(_WORKSPACE, dtype=torch.uint8, device=dev)
        kw: dict[str, Any] = {}
        if decode:
            if graph:
                bufs = buffers()
                kw = {
                    "use_cuda_graph": True,
                    "paged_kv_indptr_buffer": bufs["kv_indptr"],
                    "paged_kv_indices_buffer": bufs["indices"],
                    "paged_kv_last_page_len_buffer": bufs["last_page_len"],
                }
            w = fi.BatchDecodeWithPagedKVCacheWrapper(
                ws, "NHD", use_tensor_cores=True, backend="fa2", **kw
            )

            def plan_decode() -> None:
                w.plan(csr["kv_indptr"], csr["indices"], csr["last_page_len"], *heads, **dtypes)

            return w, plan_decode
        if graph:
            bufs = buffers()
            kw = {
                "use_cuda_graph": True,
                "qo_indptr_buf": bufs["qo_indptr"],
                "paged_kv_indptr_buf": bufs["kv_indptr"],
                "paged_kv_indices_buf": bufs["indices"],
                "paged_kv_last_page_len_buf": bufs["last_page_len"],
                "max_total_num_rows": meta.num_tokens,
            }
        w = fi.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend="fa2", **kw)

        def plan_prefill() -> None:
            w.plan(
                csr["qo_indptr"], csr["kv_indptr"], csr["indices"], csr["last_page_len"],
                *heads, causal=True, **dtypes,
            )  # fmt: skip

        return w, plan_prefill

    eager, plan = make(graph=False)
    plan()
    captured: list[Any] = []

    def attend(cache: KVCache) -> torch.Tensor:
        return eager.run(q, (cache.k, cache.v))

    def graph_attend(cache: KVCache) -> torch.Tensor:
        if not captured:  # made and planned on first use, outside any capture (warm-up call)
            w, graph_plan = make(graph=True)
            graph_plan()
            captured.append(w)
        return captured[0].run(q, (cache.k, cache.v))

    kind = (
        "BatchDecodeWithPagedKVCacheWrapper(use_tensor_cores=True"
        if decode
        else ("BatchPrefillWithPagedKVCacheWrapper(causal=True")
    )
    return RawKernel(f"flashinfer.{kind}, backend='fa2')", attend, plan, graph_attend)
