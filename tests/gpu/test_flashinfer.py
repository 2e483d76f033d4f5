"""flashinfer against the reference backend on random paged batches (a GPU of sm 8.0 or newer).

Every case compares the output (dtype-derived tolerance) and the cache after the KV write. The
first run JIT-compiles each FlashInfer variant that is not ahead-of-time compiled (8-30 s each).
"""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
import torch

import attnsdk as A
from attnsdk.backends.flashinfer import FlashInferBackend, FlashInferOptions
from attnsdk.backends.reference import ReferenceBackend
from attnsdk.testing import (
    Batch,
    BatchSpec,
    assert_close_to_reference,
    forbid_device_sync,
    make_batch,
)

pytestmark = [pytest.mark.gpu, pytest.mark.flashinfer]

FP8 = torch.float8_e4m3fn
DEV = "cuda"


@pytest.fixture(scope="module")
def fi() -> FlashInferBackend:
    backend = A.create_backend("flashinfer")
    assert isinstance(backend, FlashInferBackend)
    return backend


@pytest.fixture(scope="module")
def ref() -> A.Backend:
    return ReferenceBackend()


def specs(seed: int) -> list[BatchSpec]:
    r = random.Random(seed)
    return [
        BatchSpec.decode(batch_size=r.randint(1, 9), max_context=400, seed=seed),
        BatchSpec((1, 0, 1, 0, 1), (9, 0, 130, 7, 1), "decode+empty"),
        BatchSpec.chunked_prefill(seed=seed),
        BatchSpec.prefill(seed=seed),
        BatchSpec.mixed(seed=seed),
        BatchSpec.verify(seed=seed),
        BatchSpec.with_empty_rows(seed=seed),
        BatchSpec.decode(batch_size=3, seed=seed).with_padding(rows=2),
        BatchSpec.mixed(batch_size=4, seed=seed).with_padding(rows=1, query_len=3),
        *(BatchSpec.random(r) for _ in range(3)),
    ]


# name -> (LayerSpec kwargs, KVCacheLayout kwargs, make_batch kwargs)
CONFIGS: dict[str, tuple[dict, dict, dict]] = {
    "gqa-d128-bf16-p16": ({"num_heads": 8, "num_kv_heads": 2, "head_dim": 128}, {}, {}),
    "gqa-d128-bf16-p1": (
        {"num_heads": 8, "num_kv_heads": 2, "head_dim": 128},
        {"page_size": 1},
        {},
    ),
    "mqa-d64-fp16-p1": (
        {"num_heads": 8, "num_kv_heads": 1, "head_dim": 64},
        {"page_size": 1, "dtype": torch.float16},
        {},
    ),
    "mha-d256-bf16-p64": (
        {"num_heads": 4, "num_kv_heads": 4, "head_dim": 256},
        {"page_size": 64},
        {},
    ),
    "gqa3-d64-p16": ({"num_heads": 6, "num_kv_heads": 2, "head_dim": 64}, {}, {}),
    "window-causal": (
        {"num_heads": 8, "num_kv_heads": 2, "head_dim": 128, "sliding_window": 19},
        {},
        {},
    ),
    "window-1": ({"num_heads": 4, "num_kv_heads": 2, "head_dim": 64, "sliding_window": 1}, {}, {}),
    "softcap": ({"num_heads": 8, "num_kv_heads": 2, "head_dim": 128, "softcap": 20.0}, {}, {}),
    "noncausal": ({"num_heads": 8, "num_kv_heads": 4, "head_dim": 64, "causal": False}, {}, {}),
    "sinks-bf16": ({"num_heads": 8, "num_kv_heads": 2, "head_dim": 64, "has_sinks": True}, {}, {}),
    "sinks-fp16-window-hnd": (
        {
            "num_heads": 8,
            "num_kv_heads": 2,
            "head_dim": 128,
            "has_sinks": True,
            "sliding_window": 33,
        },
        {"dtype": torch.float16, "order": "HND"},
        {},
    ),
    "scale": ({"num_heads": 4, "num_kv_heads": 2, "head_dim": 128, "scale": 0.05}, {}, {}),
    "v-head-dim": (
        {"num_heads": 8, "num_kv_heads": 2, "head_dim": 128, "v_head_dim": 64},
        {"v_head_dim": 64},
        {},
    ),
    "hnd-p16": ({"num_heads": 8, "num_kv_heads": 2, "head_dim": 128}, {"order": "HND"}, {}),
    "hnd-p64-mqa": (
        {"num_heads": 8, "num_kv_heads": 1, "head_dim": 64},
        {"order": "HND", "page_size": 64},
        {},
    ),
    "fp8-tensor-scale": (
        {"num_heads": 8, "num_kv_heads": 2, "head_dim": 128},
        {"kv_dtype": FP8},
        {},
    ),
    "fp8-head-scale-p64-hnd": (
        {"num_heads": 8, "num_kv_heads": 4, "head_dim": 64},
        {"kv_dtype": FP8, "page_size": 64, "order": "HND"},
        {"per_head_scales": True},
    ),
}


def _build(name: str, spec: BatchSpec, seed: int) -> Batch:
    layer_kw, layout_kw, batch_kw = CONFIGS[name]
    layer = A.LayerSpec(**layer_kw)
    layout = A.KVCacheLayout(
        layer.num_kv_heads,
        layer.head_dim,
        **{"page_size": 16, **layout_kw},
    )
    pages = ("shuffled", "contiguous", "interleaved")[seed % 3]
    return make_batch(spec, layer, layout, pages=pages, seed=seed, device=DEV, **batch_kw)


def check(fi: A.Backend, ref: A.Backend, batch: Batch) -> None:
    out, cache = batch.run(fi)
    ref_out, ref_cache = batch.run(ref)
    layout = batch.cache.layout
    assert_close_to_reference(out, ref_out, kv_dtype=layout.storage_dtype)
    if layout.is_quantized:
        for got, want in ((cache.k, ref_cache.k), (cache.v, ref_cache.v)):
            # Triton's fp32 division may differ from torch's by an ulp before rounding to fp8.
            torch.testing.assert_close(got.float(), want.float(), rtol=2**-3, atol=2**-9)
    else:
        assert torch.equal(cache.k, ref_cache.k), "K cache differs after the write"
        assert torch.equal(cache.v, ref_cache.v), "V cache differs after the write"


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_matches_reference(fi: A.Backend, ref: A.Backend, name: str, seed: int) -> None:
    for i, spec in enumerate(specs(seed * 100 + len(name))):
        check(fi, ref, _build(name, spec, seed * 1000 + i))


def test_cuda_core_decode(ref: A.Backend) -> None:
    backend = FlashInferBackend(FlashInferOptions(decode="cuda_cores"))
    for i, spec in enumerate([BatchSpec.decode(8, 300, seed=3), BatchSpec.mixed(seed=3)]):
        check(backend, ref, _build("gqa-d128-bf16-p16", spec, i))


def test_long_context_and_large_batch(fi: A.Backend, ref: A.Backend) -> None:
    layer = A.LayerSpec(num_heads=32, num_kv_heads=8, head_dim=128)
    layout = A.KVCacheLayout(8, 128, 16)
    for seed, spec in enumerate(
        [BatchSpec.long_context(batch_size=4, context=5000), BatchSpec.decode(64, 2000, seed=3)]
    ):
        check(fi, ref, make_batch(spec, layer, layout, seed=seed, device=DEV))


def test_sinks_change_the_output(fi: A.Backend, ref: A.Backend) -> None:
    """FlashInfer's plain wrappers ignore sinks=; the backend must route sinks to the sink
    wrappers, so strong sinks move the output, and it matches the reference."""
    for spec in (BatchSpec.decode(6, 200, seed=1), BatchSpec.mixed(seed=1)):
        batch = _build("sinks-bf16", spec, 1)
        strong = dataclasses.replace(
            batch, sinks=torch.linspace(2.0, 6.0, batch.layer.num_heads, device=DEV)
        )
        out, _ = strong.run(fi)
        plain = dataclasses.replace(
            batch, layer=dataclasses.replace(batch.layer, has_sinks=False), sinks=None
        )
        without, _ = plain.run(fi)
        assert float((out.float() - without.float()).abs().max()) > 0.1, spec.name
        ref_out, _ = strong.run(ref)
        assert_close_to_reference(out, ref_out)


@pytest.mark.parametrize(
    "name", ["gqa-d128-bf16-p16", "sinks-bf16", "sinks-fp16-window-hnd", "softcap", "v-head-dim"]
)
def test_lse_is_the_natural_log_with_the_sink(fi: A.Backend, ref: A.Backend, name: str) -> None:
    """FlashInfer's base-2 lse times ln 2, on every wrapper (decode, prefill, their sink
    variants); the sink variants fold the sink term in."""
    cuda_cores = FlashInferBackend(FlashInferOptions(decode="cuda_cores"))
    specs = [BatchSpec.decode(6, 300, seed=2), BatchSpec.mixed(seed=2).with_padding(rows=2)]
    for i, spec in enumerate(specs):
        batch = _build(name, spec, i)
        if batch.layer.has_sinks:
            heads = batch.layer.num_heads
            batch = dataclasses.replace(batch, sinks=torch.linspace(-2.0, 7.0, heads, device=DEV))
        _, want, _ = batch.run_with_lse(ref)
        for backend in (fi, cuda_cores) if name == "gqa-d128-bf16-p16" else (fi,):
            out, lse, _ = batch.run_with_lse(backend)
            plain, _ = batch.run(backend)
            assert torch.equal(out, plain), f"{name}/{spec.name}: lse= changed the output"
            err = float((lse - want).abs().max())
            unscaled = float((lse / math.log(2.0) - want).abs().max())
            assert err < 5e-3, (
                f"{name}/{spec.name}: lse differs from the reference's by {err:.3g}; divided "
                f"by ln 2 by {unscaled:.3g} (near 0: FlashInfer's lse is already natural)"
            )


def test_kv_already_written(fi: A.Backend, ref: A.Backend) -> None:
    """k = v = None: the caller wrote the cache; flashinfer only attends."""
    batch = _build("gqa-d128-bf16-p16", BatchSpec.mixed(seed=5), 5)
    cache = batch.fresh_cache()
    ref.forward(batch.q, batch.k, batch.v, cache, ref.plan(batch.metadata), batch.layer)
    out = fi.forward(batch.q, None, None, cache, fi.plan(batch.metadata), batch.layer)
    expected, _ = batch.run(ref)
    assert_close_to_reference(out[: batch.metadata.num_tokens], expected)


def test_packed_kv_views(fi: A.Backend, ref: A.Backend) -> None:
    """vLLM's [N, Hkv, P, 2D] cache: K and V are strided HND halves of one tensor."""
    layer = A.LayerSpec(num_heads=8, num_kv_heads=2, head_dim=128)
    layout = A.KVCacheLayout(2, 128, 16, order="HND")
    for spec in (BatchSpec.mixed(seed=8), BatchSpec.decode(5, seed=8)):
        batch = make_batch(spec, layer, layout, seed=8, device=DEV)
        packed = torch.cat([batch.cache.k, batch.cache.v], dim=-1)
        cache = layout.wrap(packed[..., :128], packed[..., 128:])
        out, cache = batch.run(fi, cache)
        ref_out, ref_cache = batch.run(ref)
        assert_close_to_reference(out, ref_out)
        assert torch.equal(cache.k, ref_cache.k)
        assert torch.equal(cache.v, ref_cache.v)


def test_strided_out(fi: A.Backend, ref: A.Backend) -> None:
    batch = _build("gqa-d128-bf16-p16", BatchSpec.mixed(seed=9), 9)
    t, hq, dv = batch.q.shape[0], batch.layer.num_heads, batch.layer.v_dim
    wide = torch.full((t, hq, 2 * dv), float("nan"), dtype=batch.q.dtype, device=DEV)
    out = wide[..., :dv]
    fi.forward(
        batch.q, batch.k, batch.v, batch.fresh_cache(), fi.plan(batch.metadata), batch.layer,
        out=out,
    )  # fmt: skip
    assert_close_to_reference(out[: batch.metadata.num_tokens], batch.run(ref)[0])


def test_plan_once_per_variant_per_step(ref: A.Backend) -> None:
    """32 layers of two shapes: two FlashInfer plan() calls per step (~390 µs each), never one
    per layer; an unprepared shape costs one more plan() at its first forward in a step."""
    backend = FlashInferBackend()
    full = A.LayerSpec(num_heads=8, num_kv_heads=2, head_dim=128)
    local = dataclasses.replace(full, sliding_window=64)
    layout = A.KVCacheLayout(2, 128, 16)
    layers = [full, local] * 16
    backend.prepare(layers, layout, DEV)
    for i, spec in enumerate([BatchSpec.decode(8, seed=1), BatchSpec.mixed(seed=1)]):
        batch = make_batch(spec, full, layout, seed=i, device=DEV)
        before = backend.plan_calls
        plan = backend.plan(batch.metadata)
        cache = batch.fresh_cache()
        for layer in layers:
            backend.forward(batch.q, batch.k, batch.v, cache, plan, layer)
        assert backend.plan_calls - before == 2, spec.name
    extra = dataclasses.replace(full, softcap=30.0)
    plan = backend.plan(batch.metadata)
    before = backend.plan_calls
    for _ in range(3):
        out = backend.forward(batch.q, batch.k, batch.v, batch.fresh_cache(), plan, extra)
    assert backend.plan_calls - before == 1
    want, _ = dataclasses.replace(batch, layer=extra).run(ref)
    assert_close_to_reference(out[: batch.metadata.num_tokens], want)


def test_an_old_plan_is_replanned_not_misread(fi: A.Backend, ref: A.Backend) -> None:
    a = _build("gqa-d128-bf16-p16", BatchSpec.mixed(batch_size=3, seed=1), 1)
    b = _build("gqa-d128-bf16-p16", BatchSpec.mixed(batch_size=6, seed=2), 2)
    plan_a = fi.plan(a.metadata)
    fi.plan(b.metadata)  # re-plans the shared wrapper for another batch
    out = fi.forward(a.q, a.k, a.v, a.fresh_cache(), plan_a, a.layer)
    assert_close_to_reference(out[: a.metadata.num_tokens], a.run(ref)[0])


@pytest.mark.parametrize("tokens_per_seq", [1, 3])
@pytest.mark.parametrize("name", ["gqa-d128-bf16-p16", "sinks-bf16", "fp8-tensor-scale"])
def test_graph_replay_equals_eager(name: str, tokens_per_seq: int) -> None:
    """Captured decode (tokens_per_seq 1: the decode wrapper) and mixed (the prefill wrapper)
    graphs, replayed on random smaller batches with empty rows, equal eager execution."""
    backend = FlashInferBackend()
    layer_kw, layout_kw, _ = CONFIGS[name]
    layer = A.LayerSpec(**layer_kw)
    layout = A.KVCacheLayout(layer.num_kv_heads, layer.head_dim, **{"page_size": 16, **layout_kw})
    backend.prepare([layer], layout, DEV)
    num_pages, max_pages = 300, 12
    gen = torch.Generator().manual_seed(tokens_per_seq)
    graph_caches = [layout.allocate(num_pages, DEV) for _ in range(2)]
    for c in graph_caches:
        for x in (c.k, c.v):
            x.copy_(torch.randn(x.shape, generator=gen).to(DEV).to(x.dtype))
    eager_caches = [layout.wrap(c.k.clone(), c.v.clone()) for c in graph_caches]
    sinks = torch.randn(layer.num_heads, generator=gen).to(DEV) if layer.has_sinks else None
    scale = torch.full((), 0.5, device=DEV) if layout.is_quantized else None
    kw = {"sinks": sinks, "k_scale": scale, "v_scale": scale}

    def two_layers(caches: list[A.KVCache]):  # type: ignore[no-untyped-def]
        def step(plan: A.Plan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            h = backend.forward(q, k, v, caches[0], plan, layer, **kw)
            return backend.forward(h, k, v, caches[1], plan, layer, **kw)

        return step

    runner = A.GraphRunner(
        backend, two_layers(graph_caches), batch_sizes=[1, 4, 8], max_pages=max_pages,
        page_size=16, tokens_per_seq=tokens_per_seq, device=DEV,
    )  # fmt: skip
    rows = 8 * tokens_per_seq

    def rand(t: int, h: int, d: int) -> torch.Tensor:
        return torch.randn(t, h, d, generator=gen).to(DEV, layout.dtype)

    hq, hkv, d, dv = layer.num_heads, layer.num_kv_heads, layer.head_dim, layer.v_dim
    runner.capture(rand(rows, hq, d), rand(rows, hkv, d), rand(rows, hkv, dv))
    eager = two_layers(eager_caches)
    r = random.Random(tokens_per_seq)
    free = list(range(1, num_pages))
    for _ in range(12):
        b = r.randint(1, 8)
        q_lens = [r.randint(0, tokens_per_seq) for _ in range(b)]
        q_lens[0] = max(q_lens[0], 1)
        seq = [q + r.randint(0, max_pages * 16 - q) for q in q_lens]
        table = torch.tensor(r.sample(free, b * max_pages), dtype=torch.int32).view(b, max_pages)
        meta = A.AttentionMetadata.from_seqlens(q_lens, seq, table, 16, device=DEV)
        t = meta.num_tokens
        q, k, v = rand(t, hq, d), rand(t, hkv, d), rand(t, hkv, dv)
        got = runner(meta, q, k, v).clone()
        want = eager(backend.plan(meta), q, k, v)[:t]
        assert_close_to_reference(got, want, kv_dtype=layout.storage_dtype)
        for g, e in zip(graph_caches, eager_caches):
            assert torch.equal(g.k, e.k)
            assert torch.equal(g.v, e.v)


def test_capture_before_prepare_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """A layer shape unknown at plan_for_capture cannot be planned inside the capture (plan()
    copies from pageable host memory): it is refused with what to do."""
    backend = FlashInferBackend()
    layer = A.LayerSpec(num_heads=8, num_kv_heads=2, head_dim=128)
    layout = A.KVCacheLayout(2, 128, 16)
    cache = layout.allocate(8, DEV)
    state = backend.graph_state(2, 2, 2, page_size=16, device=DEV)
    plan = backend.plan_for_capture(state, 2, 2)
    q = torch.zeros(2, 8, 128, dtype=torch.bfloat16, device=DEV)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(A.InvalidInputError, match="prepare"):
        backend.forward(q, None, None, cache, plan, layer)


def test_no_device_sync(fi: A.Backend) -> None:
    """plan (CSR from the host twins, FlashInfer's plan), forward and plan_for_replay never
    synchronise the device."""
    batch = _build("fp8-head-scale-p64-hnd", BatchSpec.mixed(batch_size=4, max_len=30, seed=6), 6)
    cache = batch.fresh_cache()
    kw = {"k_scale": batch.k_scale, "v_scale": batch.v_scale}
    fi.prepare([batch.layer], batch.cache.layout, DEV)
    fi.forward(batch.q, batch.k, batch.v, cache, fi.plan(batch.metadata), batch.layer, **kw)
    state = fi.graph_state(8, 64, 32, page_size=64, device=DEV)
    captured = fi.plan_for_capture(state, 8, 64)
    lse = torch.empty(batch.q.shape[0], batch.layer.num_heads, device=DEV)
    with forbid_device_sync():
        plan = fi.plan(batch.metadata)
        fi.forward(batch.q, batch.k, batch.v, cache, plan, batch.layer, **kw)
        fi.forward(batch.q, None, None, cache, plan, batch.layer, lse=lse, **kw)
        fi.plan_for_replay(captured, batch.metadata)
    torch.cuda.synchronize()


def test_refusals(fi: A.Backend) -> None:
    batch = _build("gqa-d128-bf16-p16", BatchSpec.decode(seed=1), 1)
    plan = fi.plan(batch.metadata)
    for layer in (
        dataclasses.replace(batch.layer, causal=False, sliding_window=8),
        dataclasses.replace(batch.layer, has_sinks=True, softcap=10.0),
    ):
        cache = batch.fresh_cache()
        sinks = torch.zeros(8, device=DEV) if layer.has_sinks else None
        with pytest.raises(A.UnsupportedConfigError):
            fi.forward(batch.q, batch.k, batch.v, cache, plan, layer, sinks=sinks)
        assert torch.equal(cache.k, batch.cache.k), "a refused layer wrote the cache"
