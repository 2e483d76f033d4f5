"""fa3 on the CPU over a fake FA3 kernel, for the tests that run the backend without a GPU.

``FakeKernel`` implements the contract the backend relies on (``flash_attn_with_kvcache`` over a
paged cache: ``cu_seqlens_q``, ``cache_seqlens``, ``page_table``, bottom-right causal mask,
``window_size``, softcap, sinks, fp8 descales, the log-sum-exp) in plain PyTorch; ``fake_fa3`` patches the fa3
module so that ``CPUFA3()`` runs on it.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch

import attnsdk.contract.capabilities as caps_module
from attnsdk.backends.fa3 import FA3Backend
from attnsdk.backends.fa3 import backend as fa3

if TYPE_CHECKING:
    import pytest

    from attnsdk.testing import Batch


def fa3_rounding(batch: Batch) -> Batch:
    """The batch the reference runs to model what FA3 documents it computes with: q cast to
    fp8 (clamped) when the KV cache is fp8, and sinks read as bf16. The fake conformance and
    tests/gpu/test_conformance_fa3.py both compare with it."""
    q = batch.q
    if batch.cache.layout.is_quantized:
        fp8 = torch.float8_e4m3fn
        fp8_max = torch.finfo(fp8).max
        q = q.clamp(-fp8_max, fp8_max).to(fp8).to(q.dtype)
    sinks = None if batch.sinks is None else batch.sinks.to(torch.bfloat16).float()
    return dataclasses.replace(batch, q=q, sinks=sinks)


class FakeKernel:
    """``KernelCall``'s interface, computed on the CPU; records each launch's batch size."""

    provider = "flash_attn_interface"
    scheduler = None
    returns_lse = True
    takes_qv = True
    takes_ragged = True

    def __init__(self) -> None:
        self.batch_sizes: list[int] = []
        self.v_dims: list[int] = []

    def __call__(self, q, k_cache, v_cache, out, **kw: Any) -> torch.Tensor | None:  # type: ignore[no-untyped-def]
        if kw.get("cu_seqlens_k") is not None:  # dense varlen K/V (flash_attn_varlen_func)
            assert kw["page_table"] is None
            assert kw["cache_seqlens"] is None
            ksl = kw["cu_seqlens_k"]
            assert ksl.dtype == torch.int32
            lens = (ksl[1:] - ksl[:-1]).tolist()
            assert max(lens, default=0) <= kw["max_seqlen_k"]
            # Each sequence's keys as one page of the longest length: the paged math below.
            width = max(max(lens, default=0), 1)
            k_cache, v_cache = (_as_pages(x, ksl, lens, width) for x in (k_cache, v_cache))
            table = torch.arange(len(lens), dtype=torch.int32)[:, None]
        else:
            lens, table = kw["cache_seqlens"].tolist(), kw["page_table"]
            assert kw["cache_seqlens"].dtype == torch.int32
        qsl = kw["cu_seqlens_q"].tolist()
        assert table.dtype == torch.int32
        assert table.stride(-1) == 1
        self.batch_sizes.append(len(lens))
        self.v_dims.append(v_cache.shape[-1])
        p, hq, hkv = k_cache.shape[1], q.shape[1], k_cache.shape[2]
        # FA3's own softmax_lse is (Hq, total_q); return_lse hands it back as a (T, Hq) view.
        # Rows no sequence covers stay NaN: nothing may read them.
        native = torch.full((hq, q.shape[0]), float("nan")) if kw.get("return_lse") else None
        wl, wr = kw["window"]
        for b, length in enumerate(lens):
            q0, q1 = qsl[b], qsl[b + 1]
            n = q1 - q0
            if n == 0:
                continue
            assert n <= kw["max_seqlen_q"], (n, kw["max_seqlen_q"])
            assert n <= length or not kw["causal"], (n, length)  # a tree's context pass: n > L
            assert -(-length // p) <= table.shape[1], "a sequence reads past its page-table row"
            pages = table[b, : -(-length // p)].long()
            k = k_cache[pages].flatten(0, 1)[:length].float()
            v = v_cache[pages].flatten(0, 1)[:length].float()
            if kw["k_descale"] is not None:  # (B, Hkv): fp8 caches
                k = k * kw["k_descale"][b].float()[:, None]
            if kw["v_descale"] is not None:
                v = v * kw["v_descale"][b].float()[:, None]
            k, v = k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1)
            s = torch.einsum("qhd,khd->hqk", q[q0:q1].float(), k)
            if kw.get("qv") is not None:  # MLA: the latent query against V (hdim 64 x 512)
                s = s + torch.einsum("qhd,khd->hqk", kw["qv"][q0:q1].float(), v)
            s = s * kw["softmax_scale"]
            if kw["softcap"]:
                s = kw["softcap"] * torch.tanh(s / kw["softcap"])
            pos = length - n + torch.arange(n)[:, None]
            j = torch.arange(length)[None, :]
            keep = torch.ones(n, length, dtype=torch.bool)
            if kw["causal"]:
                keep &= j <= pos
            if wl >= 0:
                keep &= (j >= pos - wl) & (j <= pos + wr)
            s = s.masked_fill(~keep, float("-inf"))
            if kw["sinks"] is not None:
                sink = kw["sinks"].float()[:, None, None].expand(hq, n, 1)
                s = torch.cat([s, sink], -1)
                v = torch.cat([v, torch.zeros(1, hq, v.shape[-1])])
            out[q0:q1] = torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), v).to(out.dtype)
            if kw.get("lse") is not None:  # (T, Hq), natural log, the sink column included
                kw["lse"][q0:q1] = torch.logsumexp(s, -1).t()
            if native is not None:
                native[:, q0:q1] = torch.logsumexp(s, -1)
        return None if native is None else native.t()


def _as_pages(x: torch.Tensor, starts: torch.Tensor, lens: list[int], width: int) -> torch.Tensor:
    """Dense varlen rows (Tk, H, D) as (B, width, H, D) pages, sequence b's in page b."""
    pages = x.new_zeros(len(lens), width, *x.shape[1:])
    for b, n in enumerate(lens):
        pages[b, :n] = x[int(starts[b]) : int(starts[b]) + n]
    return pages


class CPUFA3(FA3Backend):
    """The backend on the CPU (its store then takes ``KVCache.store``), over the fake kernel."""

    capabilities = dataclasses.replace(
        FA3Backend.capabilities,
        devices=frozenset({"cpu"}),
        min_compute_capability=None,
        max_compute_capability=None,
    )


def fake_fa3(mp: pytest.MonkeyPatch) -> FakeKernel:
    """Patch the fa3 module (kernel, provider, build flags; no GPU) and return the kernel."""
    fake = FakeKernel()
    mp.setattr(fa3, "load_kernel", lambda provider: fake)
    mp.setattr(fa3, "find_provider", lambda pinned="auto": "flash_attn_interface")
    mp.setattr(fa3, "build_flags", dict)
    mp.setattr(caps_module, "compute_capability", lambda device=None: None)
    return fake
