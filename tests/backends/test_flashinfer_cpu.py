"""What the flashinfer backend promises without a GPU: registration, reasons, options, the CSR
page format, and its planning logic run end to end against a fake ``flashinfer`` module.

The fake wrappers implement the FlashInfer contract the backend relies on (CSR rows, host
``indptr`` / ``last_page_len``, bottom-right causal mask, ``window_left``, soft cap, sinks
through the sink wrappers only, fixed buffers in CUDA-graph mode) in plain PyTorch, so the
backend's CSR building, variant planning, fp8 scaling and graph re-planning are checked against
the reference backend here; tests/gpu/test_flashinfer.py checks the real kernels.
"""

from __future__ import annotations

import dataclasses
import math
import random
import subprocess
import sys
import types
from typing import Any

import pytest
import torch
from pydantic import ValidationError

import attnsdk as A
import attnsdk.contract.capabilities as caps_module
from attnsdk.backends.flashinfer import (
    FlashInferBackend,
    FlashInferOptions,
    PagedCSR,
    build_csr,
    gather_indices,
)
from attnsdk.backends.flashinfer import backend as fi_module
from attnsdk.backends.flashinfer import planner as fi_planner
from attnsdk.backends.flashinfer import refusals as fi_refusals
from attnsdk.backends.reference import ReferenceBackend
from attnsdk.testing import BatchSpec, assert_close_to_reference, make_batch

LAYER = A.LayerSpec(num_heads=8, num_kv_heads=2, head_dim=64)
LAYOUT = A.KVCacheLayout(2, 64, 16)
KERNEL_MODULES = ("flashinfer", "triton", "tvm_ffi")


# -- registration, reasons, options ---------------------------------------------------------


def test_registered_below_fa3_and_above_reference() -> None:
    names = A.backend_names()
    assert "flashinfer" in names
    assert FlashInferBackend.priority == 90
    assert FlashInferBackend.name == "flashinfer"


def test_importing_the_backend_imports_no_kernel_library() -> None:
    code = (
        "import sys, torch; before = set(sys.modules); "
        "import attnsdk, attnsdk.backends.flashinfer as f; "
        "f.FlashInferBackend.environment_reasons('cuda'); "
        f"print(sorted(m for m in set(sys.modules) - before if m.split('.')[0] in {KERNEL_MODULES!r}))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert done.stdout.strip() == "[]"


def test_environment_reasons_name_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(caps_module, "compute_capability", lambda device=None: None)
    monkeypatch.setattr(fi_module, "module_present", lambda name: False)
    reasons = FlashInferBackend.environment_reasons()
    assert all(r.kind is A.ReasonKind.ENVIRONMENT for r in reasons)
    by_field = {r.field: r.message for r in reasons}
    assert "needs a CUDA GPU" in by_field["device"]
    assert "pip install flashinfer-python" in by_field["install"]
    cpu = FlashInferBackend.environment_reasons("cpu")
    assert any("must be one of ['cuda'], found 'cpu'" in r.message for r in cpu)


def test_environment_reasons_by_compute_capability(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fi_module, "module_present", lambda name: True)
    monkeypatch.setattr(caps_module, "compute_capability", lambda device=None: (7, 5))
    reasons = FlashInferBackend.environment_reasons("cuda")
    assert [r.field for r in reasons] == ["compute_capability"]
    assert "must be >= 8.0, found 7.5" in reasons[0].message
    for cc in ((8, 0), (9, 0), (10, 0), (12, 0)):
        monkeypatch.setattr(caps_module, "compute_capability", lambda device=None, cc=cc: cc)
        assert FlashInferBackend.refusals(A.Request(LAYER, LAYOUT, torch.device("cuda"))) == []


def test_create_without_the_library_names_the_install_command(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(fi_module, "module_present", lambda name: False)
    with pytest.raises(A.BackendUnavailableError) as info:
        FlashInferBackend()
    assert info.value.install_command == "pip install flashinfer-python"
    assert isinstance(info.value, ImportError)


def test_auto_does_not_pick_flashinfer_without_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(caps_module, "compute_capability", lambda device=None: None)
    assert A.create_backend("auto").name != "flashinfer"
    with pytest.raises(A.UnsupportedConfigError) as info:
        A.create_backend("flashinfer")
    assert "device" in {r.field for r in info.value.reasons}


@pytest.mark.parametrize(
    ("layer", "layout", "field"),
    [
        (A.LayerSpec(8, 2, 64, causal=False, sliding_window=8), LAYOUT, "sliding_window"),
        (A.LayerSpec(8, 2, 64, has_sinks=True, softcap=30.0), LAYOUT, "softcap"),
        (A.LayerSpec(8, 2, 72), A.KVCacheLayout(2, 72, 16), "head_dim"),
        (A.LayerSpec(8, 2, 512), A.KVCacheLayout(2, 512, 16), "head_dim"),
        (A.LayerSpec(8, 2, 80), A.KVCacheLayout(2, 80, 16), "head_dim"),
        (
            A.LayerSpec(8, 1, 192, v_head_dim=128),
            A.KVCacheLayout(1, 192, 16, v_head_dim=128),
            "head_dim",
        ),
        (LAYER, A.KVCacheLayout(2, 64, 16, dtype=torch.float32), "dtype"),
    ],
)
def test_configuration_reasons(
    monkeypatch: pytest.MonkeyPatch, layer: A.LayerSpec, layout: A.KVCacheLayout, field: str
) -> None:
    monkeypatch.setattr(fi_module, "module_present", lambda name: True)
    monkeypatch.setattr(caps_module, "compute_capability", lambda device=None: (9, 0))
    reasons = FlashInferBackend.refusals(A.Request(layer, layout, torch.device("cuda")))
    assert field in {r.field for r in reasons}, reasons
    assert all(r.kind is A.ReasonKind.CONFIGURATION for r in reasons)


@pytest.mark.parametrize(
    ("layer", "layout"),
    [
        (A.LayerSpec(8, 2, 128, sliding_window=4096, softcap=50.0), A.KVCacheLayout(2, 128, 1)),
        (A.LayerSpec(8, 8, 64, causal=False), A.KVCacheLayout(8, 64, 64, order="HND")),
        (A.LayerSpec(8, 2, 64, has_sinks=True, sliding_window=128), LAYOUT),
        (LAYER, A.KVCacheLayout(2, 64, 16, kv_dtype=torch.float8_e4m3fn)),
        (LAYER, A.KVCacheLayout(2, 64, 16, dtype=torch.float16, kv_dtype=torch.float8_e5m2)),
        (A.LayerSpec(8, 1, 128, v_head_dim=64), A.KVCacheLayout(1, 128, 16, v_head_dim=64)),
    ],
)
def test_served_configurations(
    monkeypatch: pytest.MonkeyPatch, layer: A.LayerSpec, layout: A.KVCacheLayout
) -> None:
    monkeypatch.setattr(fi_module, "module_present", lambda name: True)
    monkeypatch.setattr(caps_module, "compute_capability", lambda device=None: (9, 0))
    assert FlashInferBackend.refusals(A.Request(layer, layout, torch.device("cuda"))) == []


def test_options_validation() -> None:
    assert FlashInferOptions().decode == "tensor_cores"
    assert FlashInferOptions().prefill_backend == "fa2"
    for bad in ({"decode": "xqa"}, {"workspace_mib": 1}, {"prefill_backend": "fa3"}, {"x": 1}):
        with pytest.raises(ValidationError):
            FlashInferOptions(**bad)
    config = A.AttentionConfig(backend="flashinfer", decode="cuda_cores", workspace_mib=256)
    assert config.options == FlashInferOptions(decode="cuda_cores", workspace_mib=256)
    with pytest.raises(A.InvalidInputError):
        A.AttentionConfig(backend="flashinfer", decode="fast")


# -- the CSR page format --------------------------------------------------------------------


def naive_csr(
    q_lens: list[int], s_lens: list[int], p: int, w: int, per_token: bool, rows: int | None
) -> tuple[list[int], list[int], list[int], list[int]]:
    """(qo_indptr, kv_indptr, last_page_len, positions) the slow, obvious way."""
    if per_token:
        owners = [b for b, q in enumerate(q_lens) for _ in range(q)]
        lens = [s_lens[b] for b in owners]
        extra = (rows or len(owners)) - len(owners)
        owners += [0] * extra
        lens += [1] * extra
        qo = list(range(len(owners) + 1))
    else:
        owners, lens = list(range(len(s_lens))), list(s_lens)
        qo = [0]
        for q in q_lens:
            qo.append(qo[-1] + q)
    kv, last, pos = [0], [], []
    for owner, n in zip(owners, lens):
        pages = -(-n // p)
        kv.append(kv[-1] + pages)
        last.append(n - (pages - 1) * p if pages else 0)
        pos += [owner * w + i for i in range(pages)]
    return qo, kv, last, pos


@pytest.mark.parametrize("per_token", [False, True])
def test_build_csr_matches_a_naive_version(per_token: bool) -> None:
    r = random.Random(7)
    for _ in range(200):
        p = r.choice([1, 2, 16, 64])
        b = r.randint(1, 7)
        if per_token:
            q_lens = [r.randint(0, 1) for _ in range(b)]
        else:
            q_lens = [r.randint(0, 9) for _ in range(b)]
        s_lens = [q + r.randint(0, 3 * p + 1) for q in q_lens]
        w = max(-(-s // p) for s in s_lens) + r.randint(0, 2)
        rows = sum(q_lens) + r.randint(0, 3) if per_token and r.random() < 0.5 else None
        qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
        csr = build_csr(
            qsl, torch.tensor(s_lens, dtype=torch.int32), p, w, per_token=per_token, rows=rows
        )
        qo, kv, last, pos = naive_csr(q_lens, s_lens, p, w, per_token, rows)
        assert csr.qo_indptr.tolist() == qo
        assert csr.kv_indptr.tolist() == kv
        assert csr.last_page_len.tolist() == last
        assert csr.positions.tolist() == pos
        for t in (csr.qo_indptr, csr.kv_indptr, csr.last_page_len):
            assert t.dtype == torch.int32
            assert t.device.type == "cpu"


def test_gather_indices_reads_the_page_table() -> None:
    table = torch.tensor([[5, 6, 7], [8, 0, 0], [9, 10, 0]], dtype=torch.int32)
    qsl = torch.tensor([0, 2, 2, 5], dtype=torch.int32)
    csr = build_csr(qsl, torch.tensor([40, 3, 17], dtype=torch.int32), 16, 3, per_token=False)
    assert gather_indices(table, csr).tolist() == [5, 6, 7, 8, 9, 10]
    out = torch.full((9,), -1, dtype=torch.int32)
    staging = torch.zeros(7, dtype=torch.int64)
    got = gather_indices(table.t().contiguous().t(), csr, out=out, staging=staging)
    assert got.tolist() == [5, 6, 7, 8, 9, 10]
    assert out[:6].tolist() == [5, 6, 7, 8, 9, 10]
    assert got.data_ptr() == out.data_ptr()


def test_build_csr_refuses_a_narrow_page_table() -> None:
    qsl = torch.tensor([0, 1], dtype=torch.int32)
    with pytest.raises(A.InvalidMetadataError, match="page_table"):
        build_csr(qsl, torch.tensor([33], dtype=torch.int32), 16, 2, per_token=True)


# -- a fake flashinfer module ---------------------------------------------------------------


class _Calls:
    plans: list[tuple[str, int]] = []  # noqa: RUF012 (test bookkeeping)


def _attend_csr(
    w: Any, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, sinks: Any, scale: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over the CSR the wrapper holds (in its fixed buffers in graph mode), and its
    natural-log log-sum-exp (T, Hq)."""
    qo = w.qo.tolist()
    kv = w.kv_indptr.tolist()
    last = w.last.tolist()
    indices = w.indices
    if w.layout == "HND":
        k_cache, v_cache = k_cache.transpose(1, 2), v_cache.transpose(1, 2)
    p = k_cache.shape[1]
    hq, hkv = w.heads
    sm = w.sm_scale if scale is None else scale
    out = torch.zeros(q.shape[0], hq, v_cache.shape[-1])
    lse = torch.full((q.shape[0], hq), float("-inf"))
    for r in range(len(last)):
        pages = kv[r + 1] - kv[r]
        n = (pages - 1) * p + last[r] if pages else 0
        rows = q[qo[r] : qo[r + 1]].float()
        if not rows.shape[0]:
            continue
        idx = indices[kv[r] : kv[r + 1]].long()
        k = k_cache[idx].reshape(-1, hkv, k_cache.shape[-1])[:n].float()
        v = v_cache[idx].reshape(-1, hkv, v_cache.shape[-1])[:n].float()
        k = k.repeat_interleave(hq // hkv, 1)
        v = v.repeat_interleave(hq // hkv, 1)
        s = torch.einsum("qhd,khd->hqk", rows, k) * sm
        if w.softcap:
            s = w.softcap * torch.tanh(s / w.softcap)
        pos = n - rows.shape[0] + torch.arange(rows.shape[0])[:, None]
        j = torch.arange(n)[None, :]
        keep = torch.ones_like(pos - j, dtype=torch.bool)
        if w.causal:
            keep &= j <= pos
        if w.window_left >= 0:
            keep &= j >= pos - w.window_left
        s = s.masked_fill(~keep, float("-inf"))
        if sinks is not None:
            s = torch.cat([s, sinks.float()[:, None, None].expand(hq, s.shape[1], 1)], -1)
            v = torch.cat([v, torch.zeros(1, hq, v.shape[-1])])
        out[qo[r] : qo[r + 1]] = torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), v)
        lse[qo[r] : qo[r + 1]] = torch.logsumexp(s, -1).t()
    return out, lse


class _FakeWrapper:
    decode = False
    sinks = False

    def __init__(self, ws: torch.Tensor, kv_layout: str = "NHD", **kw: Any) -> None:
        assert ws.dtype == torch.uint8
        self.layout = kv_layout
        self.graph = kw.get("use_cuda_graph", False)
        self.bufs = {
            "qo": kw.get("qo_indptr_buf"),
            "kv_indptr": kw.get("paged_kv_indptr_buf", kw.get("paged_kv_indptr_buffer")),
            "indices": kw.get("paged_kv_indices_buf", kw.get("paged_kv_indices_buffer")),
            "last": kw.get("paged_kv_last_page_len_buf", kw.get("paged_kv_last_page_len_buffer")),
        }
        self.init_kw = kw

    def _keep(self, name: str, value: torch.Tensor) -> None:
        buf = self.bufs.get(name)
        if self.graph and buf is not None:
            buf[: value.shape[0]].copy_(value)
            setattr(self, name, buf)
        else:
            setattr(self, name, value)

    def _plan(self, qo, kv_indptr, indices, last, hq, hkv, d, p, **kw: Any) -> None:  # type: ignore[no-untyped-def]
        # The host twins, never a device tensor that plan() would have to read back.
        for t in (qo, kv_indptr, last):
            assert t.device.type == "cpu"
            assert t.dtype == torch.int32
        assert indices.dtype == torch.int32
        self._keep("qo", qo)
        self._keep("kv_indptr", kv_indptr)
        self._keep("indices", indices)
        self._keep("last", last)
        if self.graph:
            assert len(last) == len(self.bufs["last"]), "batch size is fixed in graph mode"
        self.qo_last = int(qo[-1])
        self.heads = (hq, hkv)
        self.causal = kw.get("causal", False)
        self.window_left = kw["window_left"]
        self.softcap = kw["logits_soft_cap"] or 0.0
        self.sm_scale = kw["sm_scale"]
        self.kv_dtype = kw["kv_data_type"]
        _Calls.plans.append((type(self).__name__, id(self)))

    def run(self, q: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor], *args: Any, **kw: Any):  # type: ignore[no-untyped-def]
        assert q.shape[0] == self.qo_last, (q.shape, self.qo_last)
        assert kv[0].dtype == self.kv_dtype
        assert "k_scale" not in kw
        assert "v_scale" not in kw
        assert "sinks" not in kw
        out = kw["out"]
        assert out.is_contiguous()
        sinks, scale = (args[0], args[1]) if self.sinks else (None, None)
        assert len(args) == (2 if self.sinks else 0)
        result, lse = _attend_csr(self, q, kv[0], kv[1], sinks, scale)
        out.copy_(result)
        if kw.get("return_lse"):  # FlashInfer's is base 2, written into the caller's buffer
            kw["lse"].copy_(lse / math.log(2.0))
            return out, kw["lse"]
        return out


class _FakePrefill(_FakeWrapper):
    def plan(self, qo, kv_indptr, indices, last, hq, hkv, d, p, **kw: Any) -> None:  # type: ignore[no-untyped-def]
        self._plan(qo, kv_indptr, indices, last, hq, hkv, d, p, **kw)


class _FakeDecode(_FakeWrapper):
    decode = True

    def plan(self, kv_indptr, indices, last, hq, hkv, d, p, **kw: Any) -> None:  # type: ignore[no-untyped-def]
        assert "causal" not in kw
        qo = torch.arange(last.shape[0] + 1, dtype=torch.int32)
        self._plan(qo, kv_indptr, indices, last, hq, hkv, d, p, **kw)


class _FakePrefillSink(_FakePrefill):
    sinks = True


class _FakeDecodeSink(_FakeDecode):
    sinks = True


class _FakeMLA:
    """``BatchMLAPagedAttentionWrapper`` as FlashInfer 0.7.4 documents it: a CSR plan per
    sequence with each row's KV length, packed q (T, H, ckv + kpe) and cache (N, P, ckv + kpe),
    bottom-right causal, the lse mode fixed at plan time."""

    def __init__(self, ws: torch.Tensor, use_cuda_graph: bool = False, **kw: Any) -> None:
        assert ws.dtype == torch.uint8
        assert kw.pop("backend") in ("fa2", "fa3", "auto")
        self.graph = use_cuda_graph
        self.bufs = kw
        if use_cuda_graph:
            assert set(kw) == {"qo_indptr", "kv_indptr", "kv_indices", "kv_len_arr"}

    def plan(self, *, metadata: Any, **kw: Any) -> None:
        qo, kv_indptr, indices, kv_len = metadata
        for t in (qo, kv_indptr, kv_len):  # the host twins
            assert t.device.type == "cpu", t.device
            assert t.dtype == torch.int32, t.dtype
        p = kw["page_size"]
        pages = (kv_len.long() + p - 1) // p
        assert torch.equal(pages, (kv_indptr[1:] - kv_indptr[:-1]).long()), "page counts"
        if self.graph:  # FlashInfer checks the static buffers' shapes, then copies into them
            assert self.bufs["qo_indptr"].shape == qo.shape
            assert self.bufs["kv_len_arr"].shape == kv_len.shape
        self.qo, self.kv_indptr, self.indices, self.kv_len = qo, kv_indptr, indices, kv_len
        self.kw = kw
        assert kw["lse_mode"] in ("none", "base2", "basee")
        _Calls.plans.append((type(self).__name__, id(self)))

    def run(self, *, query: torch.Tensor, kv_cache: torch.Tensor, **kw: Any) -> Any:
        ckv = self.kw["head_dim_ckv"]
        assert query.shape[0] == int(self.qo[-1])
        assert query.shape[-1] == kv_cache.shape[-1]
        assert kv_cache.dim() == 3
        assert kv_cache.shape[1] == self.kw["page_size"]
        assert kv_cache.dtype == self.kw["kv_data_type"]
        assert query.dtype == self.kw["q_data_type"]
        scales = (1.0, 1.0)
        if kv_cache.dtype == torch.float8_e4m3fn:  # FlashInfer: host-float scales, bf16 q
            assert query.dtype == torch.bfloat16
            scales = (float(kw.pop("ckv_scale")), float(kw.pop("kpe_scale")))
        else:
            assert kv_cache.dtype == query.dtype
            assert "ckv_scale" not in kw
            assert "kpe_scale" not in kw
        assert kw["return_lse_base_on_e"] == (self.kw["lse_mode"] == "basee")
        out, lse = kw["out"], kw["lse"]
        assert out.is_contiguous()
        assert lse.is_contiguous()
        qo, kv = self.qo.tolist(), self.kv_indptr.tolist()
        for r, n in enumerate(self.kv_len.tolist()):
            rows = query[qo[r] : qo[r + 1]].float()
            if not rows.shape[0]:
                continue
            idx = self.indices[kv[r] : kv[r + 1]].long()
            keys = kv_cache[idx].reshape(-1, kv_cache.shape[-1])[:n].float()
            keys = torch.cat((keys[:, :ckv] * scales[0], keys[:, ckv:] * scales[1]), -1)
            s = torch.einsum("qhd,kd->hqk", rows, keys) * self.kw["sm_scale"]
            if self.kw["causal"]:
                pos = n - rows.shape[0] + torch.arange(rows.shape[0])[:, None]
                s = s.masked_fill(torch.arange(n)[None, :] > pos, float("-inf"))
            out[qo[r] : qo[r + 1]] = torch.einsum(
                "hqk,kd->qhd", torch.softmax(s, -1), keys[:, :ckv]
            ).to(out.dtype)
            lse[qo[r] : qo[r + 1]] = torch.logsumexp(s, -1).t()
        return out, lse


class _FakeRagged:
    """``BatchPrefillWithRaggedKVCacheWrapper`` as FlashInfer 0.7.4 documents it: host indptrs
    for q rows and K/V rows, bottom-right causal, a left window, softcap, base-2 lse. Rows of a
    sequence without keys get NaN and lse 0 (unspecified there), so the backend must set them."""

    def __init__(self, ws: torch.Tensor, kv_layout: str = "NHD", **kw: Any) -> None:
        assert ws.dtype == torch.uint8
        assert kv_layout == "NHD"
        assert kw.pop("backend") in ("fa2", "auto")

    def plan(self, qo, kv_indptr, hq, hkv, d, **kw: Any) -> None:  # type: ignore[no-untyped-def]
        for t in (qo, kv_indptr):  # the host twins
            assert t.device.type == "cpu"
            assert t.dtype == torch.int32
        self.qo, self.kv, self.heads, self.d, self.kw = qo, kv_indptr, (hq, hkv), d, kw
        _Calls.plans.append((type(self).__name__, id(self)))

    def run(self, q, k, v, *, out, lse=None, return_lse=False):  # type: ignore[no-untyped-def]
        hq, hkv = self.heads
        assert q.shape[1:] == (hq, self.d)
        assert k.shape[1:] == (hkv, self.d)
        assert v.shape[-1] == self.kw["head_dim_vo"]
        assert out.is_contiguous()
        assert q.dtype == k.dtype == v.dtype == self.kw["q_data_type"]
        qo, kv = self.qo.tolist(), self.kv.tolist()
        wl, cap = self.kw["window_left"], self.kw["logits_soft_cap"] or 0.0
        for b in range(len(qo) - 1):
            rows, n = q[qo[b] : qo[b + 1]].float(), kv[b + 1] - kv[b]
            if not rows.shape[0]:
                continue
            if n == 0:
                out[qo[b] : qo[b + 1]] = float("nan")
                if return_lse:
                    lse[qo[b] : qo[b + 1]] = 0.0
                continue
            keys = k[kv[b] : kv[b + 1]].float().repeat_interleave(hq // hkv, 1)
            vals = v[kv[b] : kv[b + 1]].float().repeat_interleave(hq // hkv, 1)
            s = torch.einsum("qhd,khd->hqk", rows, keys) * self.kw["sm_scale"]
            if cap:
                s = cap * torch.tanh(s / cap)
            pos = n - rows.shape[0] + torch.arange(rows.shape[0])[:, None]
            j = torch.arange(n)[None, :]
            keep = torch.ones(rows.shape[0], n, dtype=torch.bool)
            if self.kw["causal"]:
                keep &= j <= pos
            if wl >= 0:
                keep &= j >= pos - wl
            s = s.masked_fill(~keep, float("-inf"))
            out[qo[b] : qo[b + 1]] = torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), vals)
            if return_lse:
                lse[qo[b] : qo[b + 1]] = torch.logsumexp(s, -1).t() / math.log(2.0)
        return (out, lse) if return_lse else out


def fake_flashinfer() -> types.ModuleType:
    mod = types.ModuleType("flashinfer")
    mod.BatchMLAPagedAttentionWrapper = _FakeMLA  # type: ignore[attr-defined]
    mod.mla = types.SimpleNamespace(  # type: ignore[attr-defined]
        MLAPlanMetadata=types.SimpleNamespace(csr=lambda *csr: csr)
    )
    mod.BatchPrefillWithPagedKVCacheWrapper = _FakePrefill  # type: ignore[attr-defined]
    mod.BatchDecodeWithPagedKVCacheWrapper = _FakeDecode  # type: ignore[attr-defined]
    mod.BatchAttentionWithAttentionSinkWrapper = _FakePrefillSink  # type: ignore[attr-defined]
    mod.BatchDecodeWithAttentionSinkWrapper = _FakeDecodeSink  # type: ignore[attr-defined]
    mod.BatchPrefillWithRaggedKVCacheWrapper = _FakeRagged  # type: ignore[attr-defined]
    return mod


class CPUFlashInfer(FlashInferBackend):
    """The backend on the CPU (its store then takes ``KVCache.store``), over the fake kernels."""

    capabilities = dataclasses.replace(
        FlashInferBackend.capabilities, devices=frozenset({"cpu"}), min_compute_capability=None
    )


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> CPUFlashInfer:
    monkeypatch.setitem(sys.modules, "flashinfer", fake_flashinfer())
    monkeypatch.setattr(fi_module, "module_present", lambda name: True)
    _Calls.plans = []
    return CPUFlashInfer()


def specs(seed: int) -> list[BatchSpec]:
    r = random.Random(seed)
    return [
        BatchSpec.decode(batch_size=4, max_context=80, seed=seed),
        BatchSpec((1, 0, 1, 0), (9, 0, 30, 5), "decode+empty"),
        BatchSpec.chunked_prefill(batch_size=3, seed=seed),
        BatchSpec.mixed(batch_size=4, max_len=40, seed=seed),
        BatchSpec.decode(batch_size=3, seed=seed).with_padding(rows=2),
        *(BatchSpec.random(r, max_batch=6, max_context=90, max_query=20) for _ in range(3)),
    ]


CONFIGS: dict[str, tuple[dict[str, Any], dict[str, Any], dict[str, Any]]] = {
    "gqa-p16": ({}, {}, {}),
    "mqa-p1-fp16": ({"num_kv_heads": 1}, {"page_size": 1, "dtype": torch.float16}, {}),
    "hnd-p64": ({}, {"order": "HND", "page_size": 64}, {}),
    "window": ({"sliding_window": 7}, {}, {}),
    "softcap": ({"softcap": 5.0}, {}, {}),
    "noncausal": ({"causal": False}, {}, {}),
    "sinks-window": ({"has_sinks": True, "sliding_window": 9}, {}, {}),
    "dv": ({"head_dim": 128, "v_head_dim": 64}, {"v_head_dim": 64}, {}),
    "fp8-head-scales": ({}, {"kv_dtype": torch.float8_e4m3fn}, {"per_head_scales": True}),
    "chunked": ({"attention_chunk_size": 32}, {}, {}),
    "chunked-p1": ({"attention_chunk_size": 7}, {"page_size": 1}, {}),
    "chunked-window": ({"attention_chunk_size": 16, "sliding_window": 7}, {}, {}),
    "chunked-noncausal": ({"attention_chunk_size": 48, "causal": False}, {}, {}),
    "chunked-sinks-dv": (
        {"attention_chunk_size": 32, "has_sinks": True, "head_dim": 128, "v_head_dim": 64},
        {"v_head_dim": 64},
        {},
    ),
}


def _layer_layout(name: str) -> tuple[A.LayerSpec, A.KVCacheLayout, dict[str, Any]]:
    layer_kw, layout_kw, batch_kw = CONFIGS[name]
    layer = A.LayerSpec(**{"num_heads": 8, "num_kv_heads": 2, "head_dim": 64, **layer_kw})
    layout = A.KVCacheLayout(layer.num_kv_heads, layer.head_dim, **{"page_size": 16, **layout_kw})
    return layer, layout, batch_kw


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_fake_kernels_match_reference(fake: CPUFlashInfer, name: str) -> None:
    layer, layout, batch_kw = _layer_layout(name)
    ref = ReferenceBackend()
    for i, spec in enumerate(specs(len(name))):
        batch = make_batch(
            spec, layer, layout, seed=i, pages=("shuffled", "interleaved")[i % 2], **batch_kw
        )
        out, cache = batch.run(fake)
        want, ref_cache = batch.run(ref)
        assert_close_to_reference(out, want)
        assert torch.equal(cache.k.float(), ref_cache.k.float())


def test_decode_steps_use_the_decode_wrapper(fake: CPUFlashInfer) -> None:
    layer, layout, _ = _layer_layout("gqa-p16")
    fake.prepare([layer], layout)
    batch = make_batch(BatchSpec((1, 0, 1), (5, 3, 40), "d"), layer, layout)
    batch.run(fake)
    assert [n for n, _ in _Calls.plans] == ["_FakeDecode"]
    _Calls.plans = []
    batch = make_batch(BatchSpec.mixed(batch_size=3), layer, layout)
    batch.run(fake)
    assert [n for n, _ in _Calls.plans] == ["_FakePrefill"]


def test_sinks_change_the_output_and_use_the_sink_wrappers(fake: CPUFlashInfer) -> None:
    layer, layout, _ = _layer_layout("sinks-window")
    for spec in (BatchSpec.decode(batch_size=3), BatchSpec.mixed(batch_size=3)):
        batch = make_batch(spec, layer, layout, seed=3)
        strong = dataclasses.replace(batch, sinks=torch.full((8,), 4.0))
        out, _ = strong.run(fake)
        without, _ = dataclasses.replace(
            batch, layer=dataclasses.replace(layer, has_sinks=False), sinks=None
        ).run(fake)
        assert (out.float() - without.float()).abs().max() > 0.1
        assert_close_to_reference(out, strong.run(ReferenceBackend())[0])
    assert {n for n, _ in _Calls.plans} <= {
        "_FakePrefillSink",
        "_FakeDecodeSink",
        "_FakePrefill",
        "_FakeDecode",
    }
    assert {"_FakePrefillSink", "_FakeDecodeSink"} <= {n for n, _ in _Calls.plans}


def test_plan_once_per_variant_per_step(fake: CPUFlashInfer) -> None:
    """32 layers of two shapes: two FlashInfer plan() calls per step, none per layer."""
    full, _, _ = _layer_layout("gqa-p16")
    local = dataclasses.replace(full, sliding_window=16)
    layout = A.KVCacheLayout(2, 64, 16)
    layers = [full, local] * 16
    fake.prepare(layers, layout)
    batch = make_batch(BatchSpec.mixed(batch_size=4), full, layout)
    for step in range(3):
        before = fake.plan_calls
        plan = fake.plan(batch.metadata)
        cache = batch.fresh_cache()
        for layer in layers:
            fake.forward(batch.q, batch.k, batch.v, cache, plan, layer)
        assert fake.plan_calls - before == 2, step
    # A layer shape nobody prepared is planned on its first use in a step, once.
    extra = dataclasses.replace(full, softcap=3.0)
    plan = fake.plan(batch.metadata)
    before = fake.plan_calls
    for _ in range(3):
        fake.forward(batch.q, batch.k, batch.v, batch.fresh_cache(), plan, extra)
    assert fake.plan_calls - before == 1


def test_an_old_plan_is_replanned_not_misread(fake: CPUFlashInfer) -> None:
    layer, layout, _ = _layer_layout("gqa-p16")
    fake.prepare([layer], layout)
    a = make_batch(BatchSpec.mixed(batch_size=3, seed=1), layer, layout, seed=1)
    b = make_batch(BatchSpec.mixed(batch_size=5, seed=2), layer, layout, seed=2)
    plan_a = fake.plan(a.metadata)
    fake.plan(b.metadata)  # re-plans the same wrapper for another batch
    out = fake.forward(a.q, a.k, a.v, a.fresh_cache(), plan_a, layer)
    assert_close_to_reference(out, a.run(ReferenceBackend())[0])


@pytest.mark.parametrize("tokens_per_seq", [1, 3])
def test_graph_plans_replan_fixed_buffers(fake: CPUFlashInfer, tokens_per_seq: int) -> None:
    """plan_for_capture / plan_for_replay with the wrappers' fixed buffers, run eagerly."""
    layer, layout, _ = _layer_layout("gqa-p16")
    fake.prepare([layer], layout)
    state = fake.graph_state(8, 8 * tokens_per_seq, 6, page_size=16, device="cpu")
    captured = fake.plan_for_capture(state, 8, 8 * tokens_per_seq, max_query_len=tokens_per_seq)
    ((wrapper, kind),) = captured.wrappers.values()
    assert kind == ("decode" if tokens_per_seq == 1 else "prefill")
    assert wrapper.graph
    r = random.Random(tokens_per_seq)
    ref = ReferenceBackend()
    for b in (1, 3, 8):
        q_lens = [r.randint(0, tokens_per_seq) for _ in range(b)]
        q_lens[0] = max(q_lens[0], 1)
        seq = [q + r.randint(0, 80) for q in q_lens]
        batch = make_batch(BatchSpec(tuple(q_lens), tuple(seq)), layer, layout, seed=b)
        fake.plan_for_replay(captured, batch.metadata)
        t = batch.metadata.num_tokens
        rows = captured.metadata.num_tokens

        def pad(x: torch.Tensor, rows: int = rows) -> torch.Tensor:
            return torch.cat([x, torch.zeros(rows - x.shape[0], *x.shape[1:], dtype=x.dtype)])

        cache = batch.fresh_cache()
        out = fake.forward(pad(batch.q), pad(batch.k), pad(batch.v), cache, captured, layer)
        want, ref_cache = batch.run(ref)
        assert_close_to_reference(out[:t], want)
        assert torch.equal(cache.k, ref_cache.k)
        assert (wrapper, kind) == captured.wrappers[next(iter(captured.wrappers))]


def test_chunked_variants_plan_their_virtual_batch_once_per_step(
    fake: CPUFlashInfer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Full and chunked layers: one plan() per variant and one virtual batch per chunk size
    per step, none per layer; each chunked layer reads its own CSR."""
    made: list[int] = []
    real = fi_planner.virtual_metadata

    def counted(meta: A.AttentionMetadata, chunk: int, page_size: int) -> A.AttentionMetadata:
        made.append(chunk)
        return real(meta, chunk, page_size)

    monkeypatch.setattr(fi_planner, "virtual_metadata", counted)
    full, layout, _ = _layer_layout("gqa-p16")
    c32 = dataclasses.replace(full, attention_chunk_size=32)
    c64 = dataclasses.replace(full, attention_chunk_size=64)
    layers = [c32, c64, c32, full] * 4
    fake.prepare(layers, layout)
    batch = make_batch(BatchSpec((70, 1, 40), (100, 90, 40)), full, layout, seed=2)
    ref = ReferenceBackend()
    for step in range(2):
        before, made[:] = fake.plan_calls, []
        plan = fake.plan(batch.metadata)
        cache = batch.fresh_cache()
        for i, layer in enumerate(layers):
            k, v = (batch.k, batch.v) if i == 0 else (None, None)
            out = fake.forward(batch.q, k, v, cache, plan, layer)
            want, _ = dataclasses.replace(batch, layer=layer).run(ref)
            assert_close_to_reference(out, want)
        assert fake.plan_calls - before == 3, step
        assert sorted(made) == [32, 64], step


@pytest.mark.parametrize("head_dim", [64, 128])
def test_decode_graphs_with_chunked_and_full_variants(fake: CPUFlashInfer, head_dim: int) -> None:
    """One decode capture holds a chunked and a full variant: each keeps its own fixed CSR
    buffers (they read different pages); head_dim 128 with v_head_dim 64 runs the prefill
    wrapper on one row per sequence."""
    full = A.LayerSpec(8, 2, head_dim, v_head_dim=64)
    chunked = dataclasses.replace(full, attention_chunk_size=32)
    layout = A.KVCacheLayout(2, head_dim, 16, v_head_dim=64)
    fake.prepare([full, chunked], layout)
    state = fake.graph_state(8, 8, 8, page_size=16, device="cpu")
    captured = fake.plan_for_capture(state, 8, 8)
    assert len(captured.wrappers) == 2
    r = random.Random(head_dim)
    ref = ReferenceBackend()
    for b in (1, 3, 8):
        seq = [1 + r.randint(0, 127) for _ in range(b)]
        seq[0] = 33  # the first position of a chunk
        batch = make_batch(BatchSpec((1,) * b, tuple(seq)), full, layout, seed=b)
        fake.plan_for_replay(captured, batch.metadata)

        def pad(x: torch.Tensor) -> torch.Tensor:
            return torch.cat([x, torch.zeros(8 - x.shape[0], *x.shape[1:], dtype=x.dtype)])

        cache = batch.fresh_cache()
        for layer in (full, chunked):
            out = fake.forward(pad(batch.q), pad(batch.k), pad(batch.v), cache, captured, layer)
            want, _ = dataclasses.replace(batch, layer=layer).run(ref)
            assert_close_to_reference(out[:b], want)
    with pytest.raises(A.UnsupportedConfigError, match="attention_chunk_size"):
        fake.plan_for_capture(state, 2, 6)


def test_an_unprepared_chunked_layer_in_a_verify_graph_is_refused(fake: CPUFlashInfer) -> None:
    """A chunked layer first seen by a multi-token capture (not prepared) is refused with the
    reason, never planned over a virtual batch larger than the capture's fixed buffers."""
    full, layout, _ = _layer_layout("gqa-p16")
    fake.prepare([full], layout)
    state = fake.graph_state(4, 12, 8, page_size=16, device="cpu")
    captured = fake.plan_for_capture(state, 4, 12, max_query_len=3)
    chunked = dataclasses.replace(full, attention_chunk_size=32)
    q = torch.zeros(12, 8, 64, dtype=torch.bfloat16)
    with pytest.raises(A.UnsupportedConfigError, match="attention_chunk_size"):
        fake.forward(q, None, None, layout.allocate(9), captured, chunked)


def test_chunk_sizes_off_the_page_size_are_refused(fake: CPUFlashInfer) -> None:
    layer = A.LayerSpec(8, 2, 64, attention_chunk_size=40)
    reasons = fake.unsupported_reasons(layer, A.KVCacheLayout(2, 64, 16), "cpu")
    assert [r.field for r in reasons] == ["attention_chunk_size"]
    assert fake.unsupported_reasons(layer, A.KVCacheLayout(2, 64, 8), "cpu") == []


def test_graph_state_type_is_checked(fake: CPUFlashInfer) -> None:
    from attnsdk.contract.plan import GraphBuffers

    with pytest.raises(A.InvalidInputError, match="state"):
        fake.plan_for_capture(GraphBuffers(2, 2, 2, page_size=16, device="cpu"), 2, 2)


def test_empty_step_plans_nothing(fake: CPUFlashInfer) -> None:
    layer, layout, _ = _layer_layout("gqa-p16")
    fake.prepare([layer], layout)
    meta = A.AttentionMetadata.from_seqlens([0, 0], [0, 3], [[0], [1]], page_size=16)
    plan = fake.plan(meta)
    assert _Calls.plans == []
    q = torch.zeros(0, 8, 64, dtype=torch.bfloat16)
    out = fake.forward(q, None, None, layout.allocate(2), plan, layer)
    assert out.shape == (0, 8, 64)


def test_cuda_core_decode_reasons(fake: CPUFlashInfer, monkeypatch: pytest.MonkeyPatch) -> None:
    backend = CPUFlashInfer(FlashInferOptions(decode="cuda_cores"))
    odd = A.LayerSpec(num_heads=10, num_kv_heads=2, head_dim=64)
    assert [r.field for r in backend.unsupported_reasons(odd, LAYOUT, "cpu")] == ["num_heads"]
    d80 = A.LayerSpec(num_heads=8, num_kv_heads=2, head_dim=80)
    layout80 = A.KVCacheLayout(2, 80, 16)
    assert [r.field for r in backend.unsupported_reasons(d80, layout80, "cpu")] == [
        "head_dim",
        "v_head_dim",
    ]
    assert backend.unsupported_reasons(LAYER, LAYOUT, "cpu") == []
    assert fake.unsupported_reasons(odd, LAYOUT, "cpu") == []


def test_paged_csr_properties() -> None:
    csr = PagedCSR(
        qo_indptr=torch.tensor([0, 1, 1], dtype=torch.int32),
        kv_indptr=torch.tensor([0, 2, 2], dtype=torch.int32),
        last_page_len=torch.tensor([3, 0], dtype=torch.int32),
        seq_of_row=torch.tensor([1, 0]),
        width=4,
    )
    assert (csr.num_rows, csr.num_q_rows, csr.nnz) == (2, 1, 2)
    assert csr.positions.tolist() == [4, 5]


def test_variants_of_another_page_size_are_not_planned(fake: CPUFlashInfer) -> None:
    layer, _, _ = _layer_layout("gqa-p16")
    fake.prepare([layer], A.KVCacheLayout(2, 64, 16))
    fake.prepare([layer], A.KVCacheLayout(2, 64, 64))
    batch = make_batch(BatchSpec.mixed(batch_size=3), layer, A.KVCacheLayout(2, 64, 16))
    before = fake.plan_calls
    fake.plan(batch.metadata)
    assert fake.plan_calls - before == 1


def test_ragged_steps_plan_once_per_variant_and_nothing_paged(fake: CPUFlashInfer) -> None:
    """``forward_ragged``: one ragged plan() per step and variant, however many layers run,
    none before the first call, and no paged wrapper for a ragged step."""
    from attnsdk.testing.conformance._ragged import ragged_step

    layer = A.LayerSpec(num_heads=4, num_kv_heads=4, head_dim=192, v_head_dim=128)
    step = ragged_step(layer, "extend", 0, torch.bfloat16)
    plan = fake.plan(step.metadata)
    assert _Calls.plans == []
    outs = [fake.forward_ragged(step.q, step.k, step.v, plan, layer) for _ in range(3)]
    assert [name for name, _ in _Calls.plans] == ["_FakeRagged"]
    assert all(torch.equal(o, outs[0]) for o in outs)
    other = dataclasses.replace(layer, causal=False)
    fake.forward_ragged(step.q, step.k, step.v, plan, other)
    fake.forward_ragged(step.q, step.k, step.v, fake.plan(step.metadata), layer)
    assert len(_Calls.plans) == 3  # a new variant, then a new step


def _prefix_chunks(layer: A.LayerSpec, n: int) -> list[tuple[Any, ...]]:
    """``n`` ragged steps (metadata, q, k, v) of one variant: a chunked prefix's chunks, the
    same three query rows per sequence over chunks of different lengths (one empty)."""
    gen = torch.Generator().manual_seed(n)
    steps = []
    for i in range(n):
        keys = [5 + 7 * i, 0, 3 + 11 * i]
        meta = A.AttentionMetadata.for_ragged([3, 3, 3], keys, cross_attention=True)
        q, k, v = (
            torch.randn(rows, h, d, generator=gen).to(torch.bfloat16)
            for rows, h, d in (
                (9, layer.num_heads, layer.head_dim),
                (sum(keys), layer.num_kv_heads, layer.head_dim),
                (sum(keys), layer.num_kv_heads, layer.v_dim),
            )
        )
        steps.append((meta, q, k, v))
    return steps


def test_ragged_plans_used_in_turn_keep_their_own_schedules(fake: CPUFlashInfer) -> None:
    """SGLang's chunked prefix: one plan per chunk, every layer running chunk 0, 1, ... in turn.
    Each plan keeps a wrapper of its own, so no chunk runs on another chunk's indptrs, and
    each is planned once however many layers run."""
    layer = A.LayerSpec(num_heads=4, num_kv_heads=2, head_dim=192, v_head_dim=128, causal=False)
    steps = _prefix_chunks(layer, 3)
    plans = [fake.plan(meta) for meta, *_ in steps]
    ref = ReferenceBackend()
    want = [ref.forward_ragged(q, k, v, ref.plan(meta), layer) for meta, q, k, v in steps]
    for _ in range(3):  # layers
        for (_, q, k, v), plan, w in zip(steps, plans, want, strict=True):
            assert_close_to_reference(fake.forward_ragged(q, k, v, plan, layer), w)
    assert len(_Calls.plans) == 3
    assert len({wrapper for _, wrapper in _Calls.plans}) == 3


def test_ragged_wrappers_of_dropped_plans_are_reused(fake: CPUFlashInfer) -> None:
    """A wrapper whose plan is gone serves the next plan: steps after steps create none."""
    layer = A.LayerSpec(num_heads=4, num_kv_heads=2, head_dim=192, v_head_dim=128, causal=False)
    steps = _prefix_chunks(layer, 2)
    for _ in range(4):  # steps, each dropping the previous step's plans
        plans = [fake.plan(meta) for meta, *_ in steps]
        for (_, q, k, v), plan in zip(steps, plans, strict=True):
            fake.forward_ragged(q, k, v, plan, layer)
    assert len(_Calls.plans) == 8
    assert len({wrapper for _, wrapper in _Calls.plans}) == 2


def test_more_live_ragged_plans_than_the_pool_replan_correctly(
    fake: CPUFlashInfer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past the pool's size a plan's wrapper is taken over; the plan re-plans, never misreads."""
    monkeypatch.setattr(fi_planner, "_RAGGED_POOL", 2)
    layer = A.LayerSpec(num_heads=4, num_kv_heads=2, head_dim=192, v_head_dim=128, causal=False)
    steps = _prefix_chunks(layer, 3)
    plans = [fake.plan(meta) for meta, *_ in steps]
    ref = ReferenceBackend()
    want = [ref.forward_ragged(q, k, v, ref.plan(meta), layer) for meta, q, k, v in steps]
    for _ in range(2):
        for (_, q, k, v), plan, w in zip(steps, plans, want, strict=True):
            assert_close_to_reference(fake.forward_ragged(q, k, v, plan, layer), w)
    assert len({wrapper for _, wrapper in _Calls.plans}) == 2
    assert len(_Calls.plans) == 6  # three live plans over two wrappers: every use re-plans


def test_fp8_mla_is_served_on_hopper_with_bf16_queries(monkeypatch: pytest.MonkeyPatch) -> None:
    """FlashInfer's MLA wrapper reads an e4m3 latent on Hopper with bf16 queries only: off
    Hopper, with fp16 queries or an e5m2 latent the layer is refused naming the field."""
    monkeypatch.setattr(fi_module, "module_present", lambda name: True)
    layer = A.LayerSpec.for_mla(16)

    def reasons(cc: tuple[int, int], dtype: torch.dtype, kv: torch.dtype) -> set[str]:
        monkeypatch.setattr(caps_module, "compute_capability", lambda device=None: cc)
        monkeypatch.setattr(fi_refusals, "compute_capability", lambda device=None: cc)
        layout = A.KVCacheLayout.for_mla(64, dtype=dtype, kv_dtype=kv)
        return {
            r.field
            for r in FlashInferBackend.refusals(A.Request(layer, layout, torch.device("cuda")))
        }

    e4m3, bf16 = torch.float8_e4m3fn, torch.bfloat16
    assert reasons((9, 0), bf16, e4m3) == set()
    assert reasons((9, 0), bf16, bf16) == set()
    assert reasons((10, 0), bf16, e4m3) == {"kv_dtype"}
    assert reasons((10, 0), bf16, bf16) == set()
    assert reasons((9, 0), torch.float16, e4m3) == {"dtype"}
    assert reasons((9, 0), bf16, torch.float8_e5m2) == {"kv_dtype"}
