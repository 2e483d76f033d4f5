"""The fa3 backend's own logic on the CPU, against a fake FA3 kernel (tests/fake_fa3.py).

What the backend hands the kernel, the virtual batch of chunked layers above all, is checked
against the reference backend here; tests/gpu/ checks the real kernel.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import pytest
import torch
from fake_fa3 import CPUFA3, FakeKernel, fake_fa3

import attnsdk as A
from attnsdk.backends.fa3 import FA3Options
from attnsdk.backends.fa3 import backend as fa3
from attnsdk.backends.fa3 import planner as fa3_planner
from attnsdk.backends.reference import ReferenceBackend
from attnsdk.testing import BatchSpec, assert_close_to_reference, make_batch

reference = ReferenceBackend()


@pytest.fixture
def kernel(monkeypatch: pytest.MonkeyPatch) -> FakeKernel:
    return fake_fa3(monkeypatch)


def layer_and_layout(page_size: int = 16, **layer: Any) -> tuple[A.LayerSpec, A.KVCacheLayout]:
    spec = A.LayerSpec(**{"num_heads": 8, "num_kv_heads": 2, "head_dim": 64, **layer})
    return spec, A.KVCacheLayout(2, 64, page_size, dtype=torch.bfloat16)


def specs(chunk: int, seed: int) -> list[BatchSpec]:
    r = random.Random(seed)
    c = chunk
    return [
        BatchSpec((1, 1, 1, c + 2, 3 * c + 1, 0), (c + 1, 2 * c, 3 * c + 1, 2 * c + 1, 3 * c + 1, c)),
        BatchSpec.decode(batch_size=5, max_context=4 * c, seed=seed).with_padding(2),
        BatchSpec.mixed(batch_size=5, max_len=3 * c, seed=seed),
        BatchSpec(*zip(*((q, q + r.randint(0, 3 * c)) for q in (r.randint(0, 2 * c) for _ in range(4))))),
    ]  # fmt: skip


LAYERS = {
    "chunked": {"attention_chunk_size": 32},
    "chunked-page": {"attention_chunk_size": 16},
    "chunked-window": {"attention_chunk_size": 32, "sliding_window": 9},
    "chunked-noncausal": {"attention_chunk_size": 48, "causal": False},
    "chunked-noncausal-window": {"attention_chunk_size": 32, "causal": False, "sliding_window": 5},
    "chunked-sinks-softcap": {"attention_chunk_size": 32, "has_sinks": True, "softcap": 4.0},
    "plain": {},
}


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_matches_the_reference(kernel: FakeKernel, name: str) -> None:
    layer, layout = layer_and_layout(**LAYERS[name])
    backend = CPUFA3()
    for seed, spec in enumerate(specs(layer.attention_chunk_size or 32, len(name))):
        batch = make_batch(
            spec, layer, layout, seed=seed, pages=("shuffled", "interleaved")[seed % 2]
        )
        out, cache = batch.run(backend)
        want, ref_cache = batch.run(reference)
        assert_close_to_reference(out, want)
        assert torch.equal(cache.k.float(), ref_cache.k.float())


def test_chunked_layers_run_the_virtual_batch_made_once_per_step(
    kernel: FakeKernel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two chunk sizes among eight layers: two virtual batches per step, made in plan()."""
    made: list[int] = []
    real = fa3_planner.virtual_metadata

    def counted(meta: A.AttentionMetadata, chunk: int, page_size: int) -> A.AttentionMetadata:
        made.append(chunk)
        return real(meta, chunk, page_size)

    monkeypatch.setattr(fa3_planner, "virtual_metadata", counted)
    plain, layout = layer_and_layout()
    c32 = dataclasses.replace(plain, attention_chunk_size=32)
    c64 = dataclasses.replace(plain, attention_chunk_size=64)
    layers = [c32, c32, c64, plain] * 2
    backend = CPUFA3()
    backend.prepare(layers, layout)
    batch = make_batch(BatchSpec((70, 1), (100, 90)), plain, layout, seed=1)
    plan = backend.plan(batch.metadata)
    assert sorted(made) == [32, 64]
    cache = batch.fresh_cache()
    for layer in layers:
        backend.forward(batch.q, batch.k, batch.v, cache, plan, layer)
    assert sorted(made) == [32, 64], "a layer rebuilt the virtual batch"
    # The first sequence (positions 30..99) spans chunks 0..3 of 32 and 0..1 of 64.
    assert kernel.batch_sizes == [5, 5, 3, 2] * 2
    # A chunked layer nobody prepared is served too, building its batch at each call: the
    # plan holds what make_plan made for the declared model, nothing filled in later.
    c48 = dataclasses.replace(plain, attention_chunk_size=48)
    for _ in range(3):
        backend.forward(batch.q, None, None, cache, plan, c48)
    assert sorted(made) == [32, 48, 48, 48, 64]


def test_a_chunk_size_not_a_multiple_of_the_page_size_is_refused(kernel: FakeKernel) -> None:
    layer, layout = layer_and_layout(attention_chunk_size=24)
    reasons = CPUFA3.refusals(A.Request(layer, layout, torch.device("cpu")))
    assert [r.field for r in reasons] == ["attention_chunk_size"]
    batch = make_batch(BatchSpec((3,), (30,)), layer, layout)
    cache = batch.fresh_cache()
    with pytest.raises(A.UnsupportedConfigError, match="page_size=16"):
        batch.run(CPUFA3(), cache)
    assert torch.equal(cache.k, batch.cache.k)


def test_decode_graphs_serve_chunked_layers(kernel: FakeKernel) -> None:
    """plan_for_capture / plan_for_replay run eagerly: the captured plan's virtual batch is
    rebuilt from the graph buffers each replay refreshes."""
    layer, layout = layer_and_layout(attention_chunk_size=32)
    backend = CPUFA3()
    backend.prepare([layer], layout)
    state = backend.graph_state(8, 8, 8, page_size=16, device="cpu")
    captured = backend.plan_for_capture(state, 8, 8)
    r = random.Random(0)
    for b in (1, 3, 8):
        seq = [1 + r.randint(0, 127) for _ in range(b)]
        seq[0] = 33  # the first position of a chunk
        batch = make_batch(BatchSpec((1,) * b, tuple(seq)), layer, layout, seed=b)
        backend.plan_for_replay(captured, batch.metadata)
        rows = captured.metadata.num_tokens

        def pad(x: torch.Tensor, rows: int = rows) -> torch.Tensor:
            return torch.cat([x, torch.zeros(rows - x.shape[0], *x.shape[1:], dtype=x.dtype)])

        cache = batch.fresh_cache()
        out = backend.forward(pad(batch.q), pad(batch.k), pad(batch.v), cache, captured, layer)
        want, _ = batch.run(reference)
        assert_close_to_reference(out[:b], want)
    with pytest.raises(A.UnsupportedConfigError, match="attention_chunk_size"):
        backend.plan_for_capture(state, 2, 6)


# -- ragged (forward_ragged) ---------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["prefill", "extend", "prefix"])
def test_ragged_pads_v_on_a_build_without_the_192_128_kernels(
    kernel: FakeKernel, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """DeepSeek's expanded prefill (192 / 128) on an FA3 build with HDIMDIFF192 off (ours on
    the H200): V goes to the hdim-192 kernel zero-padded, and the output is the reference's."""
    from attnsdk.testing.conformance._ragged import ragged_step

    monkeypatch.setattr(fa3, "build_flags", lambda: {"FLASH_ATTENTION_DISABLE_HDIMDIFF192": True})
    layer = A.LayerSpec(num_heads=4, num_kv_heads=4, head_dim=192, v_head_dim=128)
    layer = dataclasses.replace(layer, causal=kind != "prefix")
    backend = CPUFA3()
    assert backend.unsupported_reasons(layer, None, "cpu", uses=(A.Feature.RAGGED,)) == []
    layout = A.KVCacheLayout(4, 192, 16, v_head_dim=128, dtype=torch.bfloat16)
    assert [r.field for r in backend.unsupported_reasons(layer, layout)] == ["v_head_dim"]
    for seed in range(4):
        step = ragged_step(layer, kind, seed, torch.bfloat16)
        lse, ref_lse = (torch.empty(step.metadata.num_tokens, 4) for _ in range(2))
        args = (step.q, step.k, step.v)
        out = backend.forward_ragged(*args, backend.plan(step.metadata), layer, lse=lse)
        ref = reference.forward_ragged(*args, reference.plan(step.metadata), layer, lse=ref_lse)
        assert out.shape == ref.shape == (step.metadata.num_tokens, 4, 128)
        assert_close_to_reference(out, ref)
        seen_rows = ~torch.isneginf(ref_lse)
        assert torch.equal(torch.isneginf(lse), ~seen_rows)
        assert_close_to_reference(lse[seen_rows], ref_lse[seen_rows], atol=5e-3, rtol=1e-3)
    assert kernel.v_dims, "the kernel never ran"
    assert set(kernel.v_dims) == {192}, "V reached the kernel unpadded"


def test_scheduler_metadata_is_never_asked_for_an_empty_step(
    kernel: FakeKernel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """FA3's ``get_scheduler_metadata`` ends the process on a batch of 0 (an SGLang IDLE step
    planned on the H100 did): a step with no sequence plans no scheduler metadata, and the
    other steps still get theirs from the op, once per layer shape."""
    calls: list[int] = []

    def scheduler_op(num_seqs: int, *args: Any) -> torch.Tensor:
        if num_seqs == 0:
            raise AssertionError("scheduler metadata asked for a batch of 0")
        calls.append(num_seqs)
        return torch.zeros(num_seqs + 1, dtype=torch.int32)

    monkeypatch.setattr(kernel, "scheduler", scheduler_op, raising=False)
    layer, layout = layer_and_layout()
    backend = CPUFA3(FA3Options(precompute_scheduler=True))
    backend.prepare([layer], layout)
    empty = make_batch(BatchSpec((), ()), layer, layout, seed=0)
    out, _ = empty.run(backend)
    assert out.shape[0] == 0
    assert calls == []
    batch = make_batch(BatchSpec.decode(batch_size=3, max_context=40, seed=1), layer, layout)
    out, _ = batch.run(backend)
    want, _ = batch.run(reference)
    assert_close_to_reference(out, want)
    assert calls == [3]
