"""The SGLang drop-in backend on fa3 against the reference backend (H200 / sm90 only).

The CPU suite (tests/adapters/test_sglang_*.py) checks the adapter against a float64 oracle;
here the same page-edge cases run on fa3 in bf16 and fp16, and a real CUDA graph is captured
and replayed through SGLang's hooks.
"""

from __future__ import annotations

import pytest
import torch

from attnsdk import KVCacheLayout, LayerSpec, UnsupportedConfigError, explain
from attnsdk.adapters.sglang import SGLangAttentionBackend
from attnsdk.adapters.sglang.testing import (
    ForwardMode,
    MockCudaGraphRunner,
    VerifyInput,
    make_sglang_batch,
)
from attnsdk.testing import BatchSpec, assert_close_to_reference

pytestmark = [pytest.mark.gpu, pytest.mark.sm90, pytest.mark.fa3]

M = ForwardMode
DEV = "cuda"
CASES = [
    ("decode@14/15/16", M.DECODE, (1, 1, 1), (15, 16, 17)),
    ("extend2@15", M.EXTEND, (2,), (17,)),
    ("prefill15/16/17", M.EXTEND, (15, 16, 17), (15, 16, 17)),
    ("ragged0/8/16+15/8/1", M.EXTEND, (15, 8, 1), (15, 16, 17)),
    ("mixed", M.MIXED, (1, 15, 2, 1), (16, 15, 17, 33)),
    ("verify4@14/15/16", M.TARGET_VERIFY, (4, 4, 4), (18, 19, 20)),
    ("draft_extend", M.DRAFT_EXTEND_V2, (2, 4, 1), (17, 32, 16)),
    ("idle", M.IDLE, (), ()),
]
HEADS = {"gqa": (8, 2), "mqa": (8, 1)}


def fa3_or_skip(layer: LayerSpec, page_size: int, dtype: torch.dtype) -> None:
    """Skip, with fa3's own reasons, the combinations its capabilities exclude."""
    layout = KVCacheLayout(layer.num_kv_heads, layer.head_dim, page_size, dtype)
    reasons = explain("fa3", layer, layout, DEV)["fa3"]
    if reasons:
        pytest.skip("; ".join(str(r) for r in reasons))


def run(batch, backend, *, save_kv_cache=True):
    dropin = SGLangAttentionBackend(batch.model_runner, backend)
    dropin.init_forward_metadata(batch.forward_batch)
    out = dropin.forward(batch.q, batch.k, batch.v, batch.layer, batch.forward_batch, save_kv_cache)
    torch.cuda.synchronize()
    return out


def compare(batch, layer, *, save_kv_cache=True):
    """fa3 and reference on copies of the same step: outputs close, KV buffers identical."""
    ref_batch = batch.clone()
    out = run(batch, "fa3", save_kv_cache=save_kv_cache)
    ref = run(ref_batch, "reference", save_kv_cache=save_kv_cache)
    real = batch.real_tokens.to(DEV)
    assert out.shape == ref.shape
    assert out.dtype == batch.q.dtype
    assert_close_to_reference(out[real], ref[real])
    for got, want in (
        (
            batch.model_runner.token_to_kv_pool.k_buffer[0],
            ref_batch.model_runner.token_to_kv_pool.k_buffer[0],
        ),
        (
            batch.model_runner.token_to_kv_pool.v_buffer[0],
            ref_batch.model_runner.token_to_kv_pool.v_buffer[0],
        ),
    ):
        assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("page_size", [1, 16, 32])
@pytest.mark.parametrize("heads", list(HEADS))
@pytest.mark.parametrize(("name", "mode", "q", "s"), CASES, ids=[c[0] for c in CASES])
def test_every_mode_matches_reference(name, mode, q, s, heads, page_size, dtype):
    hq, hkv = HEADS[heads]
    layer = LayerSpec(num_heads=hq, num_kv_heads=hkv, head_dim=128)
    fa3_or_skip(layer, page_size, dtype)
    order = ("contiguous", "shuffled", "interleaved")[(len(name) + page_size) % 3]
    batch = make_sglang_batch(
        BatchSpec(q, s), layer, mode, page_size=page_size, pages=order, dtype=dtype, device=DEV
    )
    compare(batch, layer)


SEMANTICS = {
    "window-sglang-4": LayerSpec(num_heads=8, num_kv_heads=2, head_dim=128, sliding_window=5),
    "softcap": LayerSpec(num_heads=8, num_kv_heads=2, head_dim=128, softcap=30.0),
    "encoder-only": LayerSpec(num_heads=8, num_kv_heads=8, head_dim=64, causal=False),
}
# Encoder-only layers run prefill batches only.
SEMANTIC_CASES = [
    (layer_id, *case)
    for layer_id, layer in SEMANTICS.items()
    for case in CASES[:6]
    if layer.causal or case[1] is M.EXTEND
]


@pytest.mark.parametrize(
    ("layer_id", "name", "mode", "q", "s"),
    SEMANTIC_CASES,
    ids=[f"{c[0]}-{c[1]}" for c in SEMANTIC_CASES],
)
def test_layer_semantics_match_reference(layer_id, name, mode, q, s):
    """Served exactly when fa3 declares the feature; refused with the reason when its build
    lacks it (softcap is an FA3 build option)."""
    layer = SEMANTICS[layer_id]
    layout = KVCacheLayout(layer.num_kv_heads, layer.head_dim, 16, torch.bfloat16)
    reasons = explain("fa3", layer, layout, DEV)["fa3"]
    batch = make_sglang_batch(
        BatchSpec(q, s), layer, mode, page_size=16, dtype=torch.bfloat16, device=DEV
    )
    if not reasons:
        compare(batch, layer)
        return
    assert layer.has_softcap, reasons
    assert [r.field for r in reasons] == ["softcap"]
    with pytest.raises(UnsupportedConfigError, match="softcap"):
        run(batch, "fa3")


def test_save_kv_cache_false_leaves_buffers():
    layer = LayerSpec(num_heads=8, num_kv_heads=2, head_dim=128)
    fa3_or_skip(layer, 16, torch.bfloat16)
    spec = BatchSpec((15, 8, 1), (15, 16, 17))
    batch = make_sglang_batch(spec, layer, M.EXTEND, page_size=16, dtype=torch.bfloat16, device=DEV)
    before = batch.model_runner.token_to_kv_pool.k_buffer[0].clone()
    compare(batch, layer, save_kv_cache=False)
    assert torch.equal(batch.model_runner.token_to_kv_pool.k_buffer[0], before)


@pytest.mark.parametrize(
    ("mode", "spec", "spec_info", "capture"),
    [
        (M.DECODE, BatchSpec((1,) * 5, (15, 16, 17, 31, 40)), None, [2, 4, 8]),
        (M.TARGET_VERIFY, BatchSpec((3,) * 3, (17, 18, 35)), VerifyInput(3), [1, 4]),
    ],
    ids=["decode", "verify"],
)
@pytest.mark.parametrize("hooks", ["out_graph", "legacy"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_replay_hooks_with_padding_match_eager(mode, spec, spec_info, capture, page_size, hooks):
    layer = LayerSpec(num_heads=8, num_kv_heads=2, head_dim=128, sliding_window=9)
    fa3_or_skip(layer, page_size, torch.bfloat16)
    batch = make_sglang_batch(
        spec, layer, mode, page_size=page_size, dtype=torch.bfloat16, device=DEV, seed=5
    )
    ref_batch = batch.clone()
    ref = run(ref_batch, "reference")
    dropin = SGLangAttentionBackend(batch.model_runner, "fa3")
    runner = MockCudaGraphRunner(dropin, batch.model_runner, capture, mode, spec_info, hooks=hooks)
    static = runner.replay_prepare(batch.forward_batch)
    q, k, v = (runner.pad_tokens(x, static.batch_size) for x in (batch.q, batch.k, batch.v))
    out = dropin.forward(q, k, v, batch.layer, static)[: batch.q.shape[0]]
    torch.cuda.synchronize()
    assert_close_to_reference(out, ref)
    got = batch.model_runner.token_to_kv_pool.k_buffer[0]
    want = ref_batch.model_runner.token_to_kv_pool.k_buffer[0]
    assert torch.equal(got[page_size:], want[page_size:]), "padding wrote outside page 0"


@pytest.mark.parametrize("hooks", ["out_graph", "legacy"])
def test_cuda_graph_capture_and_replay_decode(hooks):
    """A real torch.cuda.graph over the drop-in's forward, replayed for a smaller batch."""
    layer = LayerSpec(num_heads=8, num_kv_heads=2, head_dim=128)
    fa3_or_skip(layer, 16, torch.bfloat16)
    spec = BatchSpec((1,) * 5, (15, 16, 17, 31, 40))
    batch = make_sglang_batch(spec, layer, M.DECODE, page_size=16, dtype=torch.bfloat16, device=DEV)
    ref_batch = batch.clone()
    ref = run(ref_batch, "reference")
    dropin = SGLangAttentionBackend(batch.model_runner, "fa3")
    runner = MockCudaGraphRunner(dropin, batch.model_runner, [8], hooks=hooks)
    static = runner.static_batch(8)
    q = torch.zeros(8, batch.q.shape[1], dtype=torch.bfloat16, device=DEV)
    k = torch.zeros(8, batch.k.shape[1], dtype=torch.bfloat16, device=DEV)
    v = torch.zeros(8, batch.v.shape[1], dtype=torch.bfloat16, device=DEV)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # SGLang warms up twice before capturing
            dropin.forward(q, k, v, batch.layer, static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = dropin.forward(q, k, v, batch.layer, static)
    runner.replay_prepare(batch.forward_batch)
    for static_x, x in ((q, batch.q), (k, batch.k), (v, batch.v)):
        static_x.zero_()
        static_x[: x.shape[0]].copy_(x)
    graph.replay()
    torch.cuda.synchronize()
    assert_close_to_reference(out[:5], ref)
    got = batch.model_runner.token_to_kv_pool.k_buffer[0]
    want = ref_batch.model_runner.token_to_kv_pool.k_buffer[0]
    assert torch.equal(got[16:], want[16:])
