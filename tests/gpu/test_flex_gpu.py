"""The flex backend on CUDA (compiled): features against the reference, no recompiles within a
bucket, no host sync per forward, and CUDA-graph replay of decode / verify against eager."""

from __future__ import annotations

import contextlib
import random

import pytest
import torch

import attnsdk as A
from attnsdk.backends.flex import FlexBackend, FlexOptions
from attnsdk.backends.reference import ReferenceBackend
from attnsdk.testing import BatchSpec, assert_close_to_reference, forbid_device_sync, make_batch

pytestmark = pytest.mark.gpu

DEV = "cuda"
reference = ReferenceBackend()

FEATURES: dict[str, dict[str, object]] = {
    "plain": {},
    "gqa-4": {"num_heads": 32, "num_kv_heads": 8},
    "gqa-3": {"num_heads": 24, "num_kv_heads": 8},
    "mha": {"num_heads": 8, "num_kv_heads": 8},
    "window": {"sliding_window": 37},
    "noncausal-window": {"causal": False, "sliding_window": 20},
    "noncausal": {"causal": False},
    "softcap": {"softcap": 20.0},
    "sinks": {"has_sinks": True},
    "sinks-window": {"has_sinks": True, "sliding_window": 9},
    "v-head-dim": {"v_head_dim": 64},
    "head-dim-64": {"head_dim": 64},
    "head-dim-80": {"head_dim": 80},
    "head-dim-256": {"head_dim": 256},
}


def _layer_layout(
    dtype: torch.dtype, page_size: int, **kw: object
) -> tuple[A.LayerSpec, A.KVCacheLayout]:
    hq = int(kw.pop("num_heads", 16))  # type: ignore[call-overload]
    hkv = int(kw.pop("num_kv_heads", 4))  # type: ignore[call-overload]
    d = int(kw.pop("head_dim", 128))  # type: ignore[call-overload]
    dv = kw.pop("v_head_dim", None)
    layer = A.LayerSpec(hq, hkv, d, v_head_dim=dv, **kw)  # type: ignore[arg-type]
    layout = A.KVCacheLayout(hkv, d, page_size, dtype=dtype, v_head_dim=dv)  # type: ignore[arg-type]
    return layer, layout


CASES = [(f, torch.bfloat16, 16) for f in sorted(FEATURES)]
CASES += [("plain", torch.float16, 16), ("plain", torch.bfloat16, 64), ("gqa-4", torch.float16, 32)]


# Each case compiles two buckets (a few seconds each): the sweep is kept to one dtype and page
# size per feature.
@pytest.mark.parametrize(("feature", "dtype", "page_size"), CASES)
def test_features(feature: str, dtype: torch.dtype, page_size: int) -> None:
    backend = FlexBackend()  # compile=None: compiled on CUDA
    layer, layout = _layer_layout(dtype, page_size, **FEATURES[feature])
    specs = [
        BatchSpec.mixed(batch_size=5, max_len=300, seed=page_size).with_padding(),
        BatchSpec.verify(seed=page_size),
    ]
    for seed, spec in enumerate(specs):
        batch = make_batch(spec, layer, layout, seed=seed, device=DEV)
        out, cache = batch.run(backend)
        expected, ref_cache = batch.run(reference)
        assert_close_to_reference(out, expected)
        assert torch.equal(cache.k, ref_cache.k)
        assert torch.equal(cache.v, ref_cache.v)
    assert backend.compile_stats, "compile=None must compile on CUDA"


def test_float32_is_refused_compiled_and_served_uncompiled() -> None:
    layer, layout = _layer_layout(torch.float32, 16)
    assert [r.field for r in FlexBackend().unsupported_reasons(layer, layout, DEV)] == ["dtype"]
    backend = FlexBackend(FlexOptions(compile=False))
    batch = make_batch(BatchSpec.mixed(seed=3), layer, layout, seed=3, device=DEV)
    out, _ = batch.run(backend)
    expected, _ = batch.run(reference)
    assert_close_to_reference(out, expected)


def test_steady_state_does_not_recompile_or_sync() -> None:
    from torch._dynamo.utils import counters

    backend = FlexBackend()
    layer, layout = _layer_layout(torch.bfloat16, 16, num_heads=32, num_kv_heads=8)
    cache = layout.allocate(4096, DEV)  # up to 64 sequences x 63 pages
    cache.k.normal_()
    cache.v.normal_()
    r = random.Random(0)
    graphs = None
    for step in range(12):
        seqs = [r.randint(100, 1000) for _ in range(r.randint(33, 64))]  # Bb = 64 throughout
        pages = r.sample(range(1, 4096), sum(-(-s // 16) for s in seqs))
        table, start = [], 0
        for s in seqs:
            n = -(-s // 16)
            table.append(pages[start : start + n] + [0] * (64 - n))
            start += n
        meta = A.AttentionMetadata.from_seqlens([1] * len(seqs), seqs, table, 16, device=DEV)
        q = torch.randn(len(seqs), 32, 128, device=DEV, dtype=torch.bfloat16)
        k = torch.randn(len(seqs), 8, 128, device=DEV, dtype=torch.bfloat16)
        plan = backend.plan(meta)
        if step == 1:
            graphs = counters["stats"]["unique_graphs"]
        with forbid_device_sync() if step >= 1 else contextlib.nullcontext():
            backend.forward(q, k, k, cache, plan, layer)
    assert counters["stats"]["unique_graphs"] == graphs
    assert len(backend.compile_stats) == 1
    print("flex compile times (s):", [round(c.seconds, 1) for c in backend.compile_stats])


@pytest.mark.parametrize("tokens_per_seq", [1, 3])
def test_graph_replay_equals_eager(tokens_per_seq: int) -> None:
    backend = FlexBackend()
    layer, layout = _layer_layout(torch.bfloat16, 16, num_heads=16, num_kv_heads=4)
    num_pages, max_pages = 400, 24
    graph_cache = layout.allocate(num_pages, DEV)
    graph_cache.k.normal_()
    graph_cache.v.normal_()
    eager_cache = layout.wrap(graph_cache.k.clone(), graph_cache.v.clone())

    def step(plan: A.Plan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return backend.forward(q, k, v, graph_cache, plan, layer)

    runner = A.GraphRunner(
        backend,
        step,
        batch_sizes=[1, 4, 16],
        max_pages=max_pages,
        page_size=16,
        tokens_per_seq=tokens_per_seq,
    )
    rows = 16 * tokens_per_seq
    runner.capture(
        torch.randn(rows, 16, 128, device=DEV, dtype=torch.bfloat16),
        torch.randn(rows, 4, 128, device=DEV, dtype=torch.bfloat16),
        torch.randn(rows, 4, 128, device=DEV, dtype=torch.bfloat16),
    )
    r = random.Random(tokens_per_seq)
    for _ in range(10):
        b = r.randint(1, 16)
        seqs = [r.randint(tokens_per_seq, max_pages * 16) for _ in range(b)]
        pages = r.sample(range(1, num_pages), sum(-(-s // 16) for s in seqs))
        table, start = [], 0
        for s in seqs:
            n = -(-s // 16)
            table.append(pages[start : start + n] + [0] * (max_pages - n))
            start += n
        meta = A.AttentionMetadata.from_seqlens([tokens_per_seq] * b, seqs, table, 16, device=DEV)
        t = meta.num_tokens
        q = torch.randn(t, 16, 128, device=DEV, dtype=torch.bfloat16)
        k = torch.randn(t, 4, 128, device=DEV, dtype=torch.bfloat16)
        v = torch.randn(t, 4, 128, device=DEV, dtype=torch.bfloat16)
        replayed = runner(meta, q, k, v).clone()
        eager = backend.forward(q, k, v, eager_cache, backend.plan(meta), layer)
        assert_close_to_reference(replayed, eager)


@pytest.mark.parametrize(
    "page", [5, 400, -3], ids=["page-at-two-indices", "page-past-the-pool", "negative-page"]
)
def test_a_page_read_wrongly_is_reported_by_a_later_plan(page: int) -> None:
    from attnsdk.kernels.store import DeviceFlag

    backend = FlexBackend()
    layer, layout = _layer_layout(torch.bfloat16, 16)
    cache = layout.allocate(64, DEV)
    meta = A.AttentionMetadata.from_seqlens([1, 1], [20, 20], [[5, 6], [9, 7]], 16, device=DEV)
    meta.page_table[1, 1] = page  # the engine's table, changed after the metadata was built
    q = torch.randn(2, 16, 128, device=DEV, dtype=torch.bfloat16)
    with pytest.raises(A.InvalidMetadataError, match=rf"page_table.*page {page}\b"):  # noqa: PT012
        for _ in range(2 * DeviceFlag.POLL_EVERY + 1):
            plan = backend.plan(meta)
            backend.forward(q, None, None, cache, plan, layer)  # k = v = None: nothing written
            torch.cuda.synchronize()


def test_a_shared_prefix_page_is_not_reported() -> None:
    backend = FlexBackend()
    layer, layout = _layer_layout(torch.bfloat16, 16)
    cache = layout.allocate(64, DEV)
    meta = A.AttentionMetadata.from_seqlens([1, 1], [20, 20], [[5, 6], [5, 7]], 16, device=DEV)
    q = torch.randn(2, 16, 128, device=DEV, dtype=torch.bfloat16)
    for _ in range(40):
        backend.forward(q, None, None, cache, backend.plan(meta), layer)
    backend.sync_check(torch.device(DEV))  # raises what the flag holds
