"""Chunked local attention through the SGLang drop-in (Llama 4's iRoPE layers).

SGLang keeps the chunk size on the model runner (``model_runner.attention_chunk_size``, from the
model config) and marks the chunked layers with ``RadixAttention.use_irope``; its FA3 backend
applies the chunks to those layers only. The drop-in maps the same pair to
``LayerSpec.attention_chunk_size`` and is checked here against the float64 SGLang oracle.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from fake_fa3 import CPUFA3, fake_fa3
from sglang_dense import expected_step
from test_sglang_backend import check, run
from test_sglang_graph import replay

from attnsdk import Feature, InvalidInputError, LayerSpec, UnsupportedConfigError
from attnsdk.adapters.sglang import SGLangAttentionBackend
from attnsdk.adapters.sglang.testing import (
    ForwardMode,
    MockCudaGraphRunner,
    VerifyInput,
    make_sglang_batch,
)
from attnsdk.backends.reference import ReferenceBackend
from attnsdk.testing import BatchSpec

M = ForwardMode
BF16 = torch.bfloat16
CHUNKED = LayerSpec(num_heads=4, num_kv_heads=2, head_dim=16, attention_chunk_size=16)
PLAIN = dataclasses.replace(CHUNKED, attention_chunk_size=None)

# (name, mode, query_lens, seq_lens) around chunks of 16; TARGET_VERIFY seq_lens include drafts.
CASES = [
    ("decode@16/15/47", M.DECODE, (1, 1, 1), (17, 16, 48)),
    ("extend-across", M.EXTEND, (5, 20), (19, 40)),
    ("prefill-3-chunks", M.EXTEND, (40,), (40,)),
    ("mixed", M.MIXED, (1, 18, 2, 1), (33, 18, 17, 64)),
    ("verify-across", M.TARGET_VERIFY, (4, 4), (18, 34)),
]


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize(("name", "mode", "q", "s"), CASES, ids=[c[0] for c in CASES])
def test_use_irope_layers_run_the_models_chunks(name, mode, q, s, page_size):
    batch = make_sglang_batch(BatchSpec(q, s), CHUNKED, mode, page_size=page_size, seed=2)
    assert batch.model_runner.attention_chunk_size == 16
    assert batch.layer.use_irope
    expected = expected_step(batch, CHUNKED)
    out = run(batch)
    check(batch, CHUNKED, out, expected=expected)
    assert not torch.allclose(out.double(), expected_step(batch, PLAIN).out, atol=1e-3)


def test_other_layers_of_the_model_are_global():
    """Llama 4's NoPE layers (use_irope False) attend over everything, same model runner."""
    batch = make_sglang_batch(BatchSpec((5, 20), (19, 40)), CHUNKED, M.EXTEND, page_size=16)
    nope = dataclasses.replace(batch.layer, use_irope=False)
    batch = dataclasses.replace(batch, layer=nope)
    expected = expected_step(batch, PLAIN)
    check(batch, PLAIN, run(batch), expected=expected)


def test_use_irope_without_a_model_chunk_size_is_global():
    batch = make_sglang_batch(BatchSpec((5, 20), (19, 40)), CHUNKED, M.EXTEND, page_size=16)
    runner = dataclasses.replace(batch.model_runner, attention_chunk_size=None)
    batch = dataclasses.replace(batch, model_runner=runner)
    expected = expected_step(batch, PLAIN)
    check(batch, PLAIN, run(batch), expected=expected)


def test_a_bad_model_chunk_size_is_a_typed_error():
    batch = make_sglang_batch(BatchSpec((1,), (20,)), CHUNKED, M.DECODE, page_size=16)
    runner = dataclasses.replace(batch.model_runner, attention_chunk_size=0)
    with pytest.raises(InvalidInputError, match=r"model_runner\.attention_chunk_size"):
        SGLangAttentionBackend(runner, "reference")


class NoChunks(ReferenceBackend):
    capabilities = dataclasses.replace(
        ReferenceBackend.capabilities,
        features=ReferenceBackend.capabilities.features - {Feature.CHUNKED_LOCAL},
    )


def test_a_backend_without_chunks_is_refused_at_construction():
    batch = make_sglang_batch(BatchSpec((1,), (20,)), CHUNKED, M.DECODE, page_size=16)
    with pytest.raises(UnsupportedConfigError, match="attention_chunk_size"):
        SGLangAttentionBackend(batch.model_runner, NoChunks())
    plain = dataclasses.replace(batch.model_runner, attention_chunk_size=None)
    SGLangAttentionBackend(plain, NoChunks())


@pytest.fixture
def cpu_fa3(monkeypatch: pytest.MonkeyPatch) -> type[CPUFA3]:
    """fa3 on the CPU over its fake kernel (tests/fake_fa3.py)."""
    fake_fa3(monkeypatch)
    return CPUFA3


@pytest.mark.parametrize("hooks", ["out_graph", "legacy"])
def test_decode_graphs_on_fa3_run_the_virtual_batch(cpu_fa3, hooks):
    """SGLang's decode graphs with chunked layers on fa3 (its captured virtual batch rebuilt
    from the graph buffers), replayed eagerly with padding rows."""
    spec = BatchSpec((1,) * 5, (17, 16, 33, 48, 5))
    batch = make_sglang_batch(spec, CHUNKED, M.DECODE, page_size=16, seed=4, dtype=BF16)
    expected = expected_step(batch, CHUNKED)
    dropin = SGLangAttentionBackend(batch.model_runner, cpu_fa3())
    runner = MockCudaGraphRunner(dropin, batch.model_runner, [2, 8], hooks=hooks)
    out, static = replay(batch, runner, dropin)
    assert static.batch_size == 8
    torch.testing.assert_close(out.double(), expected.out, atol=2e-2, rtol=2e-2)


def test_verify_graphs_on_fa3_refuse_chunked_layers(cpu_fa3):
    spec = BatchSpec((3,) * 2, (17, 35))
    batch = make_sglang_batch(spec, CHUNKED, M.TARGET_VERIFY, page_size=16, dtype=BF16)
    dropin = SGLangAttentionBackend(batch.model_runner, cpu_fa3())
    # The chunked layers are declared at start-up, so the capture itself is refused.
    with pytest.raises(UnsupportedConfigError, match="attention_chunk_size"):
        MockCudaGraphRunner(dropin, batch.model_runner, [2], M.TARGET_VERIFY, VerifyInput(3))
