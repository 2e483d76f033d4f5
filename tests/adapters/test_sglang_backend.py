"""The drop-in SGLang backend on the reference backend, against an independent float64 oracle.

Every forward mode, page sizes 1/16/32 at page edges, GQA and MQA, SGLang's window convention,
softcap, encoder-only layers, sinks; outputs and the layer's KV buffers are both checked.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from backend_variants import NoTreesBackend
from sglang_dense import expected_step

from attnsdk import (
    AttentionConfig,
    Feature,
    InvalidInputError,
    InvalidMetadataError,
    LayerSpec,
    UnsupportedConfigError,
    create_backend,
    tree_mask_from_parents,
)
from attnsdk.adapters.sglang import SGLangAttentionBackend
from attnsdk.adapters.sglang.testing import (
    ForwardMode,
    MockKVPool,
    MockModel,
    MockRadixAttention,
    make_sglang_batch,
)
from attnsdk.backends.reference import ReferenceBackend
from attnsdk.testing import BatchSpec, tolerance

M = ForwardMode

# (name, mode, query_lens, seq_lens): page-edge shapes. TARGET_VERIFY seq_lens include the drafts.
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
HEADS = {"gqa": (4, 2), "mqa": (4, 1)}
ORDERS = ("contiguous", "shuffled", "interleaved")


def run(batch, backend="reference", *, save_kv_cache=True, sinks=None, k=..., v=...):
    """What SGLang does per step: init_forward_metadata once, then forward for the layer."""
    dropin = SGLangAttentionBackend(batch.model_runner, backend)
    fb = batch.forward_batch
    dropin.init_forward_metadata(fb)
    k = batch.k if k is ... else k
    v = batch.v if v is ... else v
    return dropin.forward(batch.q, k, v, batch.layer, fb, save_kv_cache, sinks=sinks)


def check(batch, layer, out, *, expected):
    """``out`` and the layer's buffers after the step equal the oracle's (taken before it)."""
    exp = expected
    real = batch.real_tokens
    assert out.shape == (batch.q.shape[0], layer.num_heads * layer.v_dim)
    assert out.dtype == batch.q.dtype
    atol, rtol = tolerance(batch.q.dtype)
    torch.testing.assert_close(out[real].double(), exp.out[real], atol=atol, rtol=rtol)
    pool = batch.model_runner.token_to_kv_pool
    assert torch.equal(pool.k_buffer[0], exp.k_buffer), "K buffer differs from the oracle"
    assert torch.equal(pool.v_buffer[0], exp.v_buffer), "V buffer differs from the oracle"


@pytest.mark.parametrize("page_size", [1, 16, 32])
@pytest.mark.parametrize("heads", list(HEADS))
@pytest.mark.parametrize(("name", "mode", "q", "s"), CASES, ids=[c[0] for c in CASES])
def test_every_mode_matches_oracle(name, mode, q, s, heads, page_size):
    hq, hkv = HEADS[heads]
    layer = LayerSpec(num_heads=hq, num_kv_heads=hkv, head_dim=16)
    order = ORDERS[(len(name) + page_size) % 3]
    batch = make_sglang_batch(BatchSpec(q, s), layer, mode, page_size=page_size, pages=order)
    expected = expected_step(batch, layer)
    out = run(batch)
    check(batch, layer, out, expected=expected)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize(("name", "mode", "q", "s"), CASES[:6], ids=[c[0] for c in CASES[:6]])
def test_sliding_window_in_sglang_convention(name, mode, q, s, page_size):
    layer = LayerSpec(num_heads=4, num_kv_heads=2, head_dim=16, sliding_window=5)
    batch = make_sglang_batch(BatchSpec(q, s), layer, mode, page_size=page_size, seed=3)
    # SGLang stores W - 1, FlashAttention's left window; the adapter must add the 1 back.
    assert batch.layer.sliding_window_size == 4
    expected = expected_step(batch, layer)
    check(batch, layer, run(batch), expected=expected)


def test_window_off_in_sglang_is_minus_one():
    layer = LayerSpec(num_heads=4, num_kv_heads=2, head_dim=16)
    batch = make_sglang_batch(BatchSpec((3,), (40,)), layer, M.EXTEND, page_size=16)
    assert batch.layer.sliding_window_size == -1
    windowed = LayerSpec(num_heads=4, num_kv_heads=2, head_dim=16, sliding_window=3)
    with_window = expected_step(batch, windowed).out
    expected = expected_step(batch, layer)
    out = run(batch)
    assert not torch.allclose(out.double(), with_window, atol=1e-3)
    check(batch, layer, out, expected=expected)


@pytest.mark.parametrize(
    "layer",
    [
        LayerSpec(num_heads=4, num_kv_heads=2, head_dim=16, softcap=2.0),
        LayerSpec(num_heads=4, num_kv_heads=1, head_dim=16, v_head_dim=8, scale=0.5),
        LayerSpec(num_heads=2, num_kv_heads=2, head_dim=16, causal=False),
        LayerSpec(num_heads=2, num_kv_heads=1, head_dim=16, causal=False, sliding_window=4),
    ],
    ids=["softcap", "mqa-dv8-scale", "encoder-only", "encoder-only-window"],
)
def test_layer_semantics(layer):
    batch = make_sglang_batch(BatchSpec((15, 8, 1), (15, 16, 17)), layer, M.EXTEND, page_size=16)
    expected = expected_step(batch, layer)
    check(batch, layer, run(batch), expected=expected)


def test_sinks_pass_through():
    layer = LayerSpec(num_heads=4, num_kv_heads=2, head_dim=16, has_sinks=True)
    batch = make_sglang_batch(BatchSpec((1, 1), (16, 33)), layer, M.DECODE, page_size=16)
    sinks = torch.randn(4)
    expected = expected_step(batch, layer, sinks=sinks)
    check(batch, layer, run(batch, sinks=sinks), expected=expected)


def test_bf16_decode_within_dtype_tolerance():
    layer = LayerSpec(num_heads=4, num_kv_heads=2, head_dim=16)
    spec = BatchSpec((1, 1, 1), (15, 16, 17))
    batch = make_sglang_batch(spec, layer, M.DECODE, page_size=16, dtype=torch.bfloat16)
    expected = expected_step(batch, layer)
    check(batch, layer, run(batch), expected=expected)


@pytest.mark.parametrize("how", ["save_kv_cache=False", "k=v=None"])
def test_no_kv_write(how):
    layer = LayerSpec(num_heads=4, num_kv_heads=2, head_dim=16)
    batch = make_sglang_batch(BatchSpec((2, 1), (17, 16)), layer, M.EXTEND, page_size=16)
    expected = expected_step(batch, layer, write=False)
    out = run(batch, k=None, v=None) if how == "k=v=None" else run(batch, save_kv_cache=False)
    check(batch, layer, out, expected=expected)


@pytest.mark.parametrize(
    "backend",
    [
        "reference",
        AttentionConfig(backend="reference"),
        create_backend("reference"),
        "auto",
    ],
    ids=["name", "config", "instance", "auto"],
)
def test_backend_argument_forms(backend):
    layer = LayerSpec(num_heads=4, num_kv_heads=2, head_dim=16)
    batch = make_sglang_batch(BatchSpec((1,), (20,)), layer, M.DECODE, page_size=16)
    expected = expected_step(batch, layer)
    check(batch, layer, run(batch, backend), expected=expected)


def test_bad_backend_argument():
    batch = make_sglang_batch(BatchSpec((1,), (2,)), LayerSpec(2, 1, 16), M.DECODE, page_size=1)
    with pytest.raises(InvalidInputError, match="backend"):
        SGLangAttentionBackend(batch.model_runner, 3)  # type: ignore[arg-type]


def test_unservable_model_fails_at_construction():
    """A runner without model layers (SGLang's kit) is checked from its config."""
    batch = make_sglang_batch(BatchSpec((1,), (2,)), LayerSpec(2, 1, 16), M.DECODE, page_size=1)
    config = dataclasses.replace(batch.model_runner.model_config, head_dim=2048)
    runner = dataclasses.replace(batch.model_runner, model_config=config, model=None)
    with pytest.raises(UnsupportedConfigError, match="head_dim"):
        SGLangAttentionBackend(runner, "reference")


MODEL = [  # one decoder's layers: global, sliding window, softcap, bidirectional, global again
    LayerSpec(num_heads=4, num_kv_heads=2, head_dim=16),
    LayerSpec(num_heads=4, num_kv_heads=2, head_dim=16, sliding_window=9),
    LayerSpec(num_heads=4, num_kv_heads=2, head_dim=16, scale=1.0, softcap=3.0),
    LayerSpec(num_heads=4, num_kv_heads=2, head_dim=16, causal=False),
    LayerSpec(num_heads=4, num_kv_heads=2, head_dim=16),
]


def with_model(batch, specs):
    """``batch``'s runner whose model has a RadixAttention per spec, each over its own buffers
    in the pool (copies of the batch's)."""
    runner = batch.model_runner
    k, v = runner.token_to_kv_pool.k_buffer[0], runner.token_to_kv_pool.v_buffer[0]
    layers = [MockRadixAttention.from_layer_spec(spec, layer_id=i) for i, spec in enumerate(specs)]
    pool = MockKVPool([k.clone() for _ in specs], [v.clone() for _ in specs])
    return dataclasses.replace(runner, token_to_kv_pool=pool, model=MockModel(layers)), layers


class NoSoftcap(ReferenceBackend):
    capabilities = dataclasses.replace(
        ReferenceBackend.capabilities,
        features=ReferenceBackend.capabilities.features - {Feature.SOFTCAP},
    )


def test_the_model_is_declared_at_start_up():
    """Construction prepares every distinct layer shape with the pool's layout; the layers'
    forwards then run on what was prepared, adding nothing."""
    batch = make_sglang_batch(BatchSpec((1, 1), (20, 33)), MODEL[0], M.DECODE, page_size=16)
    runner, layers = with_model(batch, MODEL)
    backend = create_backend("reference")
    dropin = SGLangAttentionBackend(runner, backend)
    pool = runner.token_to_kv_pool
    layout = dropin.adapter.kv_cache(pool.k_buffer[0], pool.v_buffer[0]).layout
    specs = [dropin.adapter.layer_spec(layer) for layer in layers]
    assert len(set(specs)) == 4
    assert backend.prepared == [(spec, layout) for spec in dict.fromkeys(specs)]
    assert [spec.softcap for spec, _ in backend.prepared] == [None, None, 3.0, None]
    dropin.init_forward_metadata(batch.forward_batch)
    for layer in layers:
        dropin.forward(batch.q, batch.k, batch.v, layer, batch.forward_batch)
    assert backend.prepared == [(spec, layout) for spec in dict.fromkeys(specs)]


def test_a_model_the_backend_cannot_serve_fails_at_start_up_naming_its_layers():
    batch = make_sglang_batch(BatchSpec((1,), (20,)), MODEL[0], M.DECODE, page_size=16)
    capped = [*MODEL, MODEL[2]]  # layers 2 and 5 have a softcap
    runner, _ = with_model(batch, capped)
    backend = NoSoftcap()
    with pytest.raises(UnsupportedConfigError) as info:
        SGLangAttentionBackend(runner, backend)
    assert [r.field for r in info.value.reasons] == ["layers[2], layers[5].softcap"]
    assert "SGLangAttentionBackend: the reference backend cannot serve this model" in str(
        info.value
    )
    assert backend.prepared == []  # all or nothing


def test_layers_attnsdk_cannot_map_are_named_beside_the_backends_reasons():
    batch = make_sglang_batch(BatchSpec((1,), (20,)), MODEL[0], M.DECODE, page_size=16)
    runner, layers = with_model(batch, MODEL[:3])
    layers[1].is_cross_attention = True
    with pytest.raises(UnsupportedConfigError) as info:
        SGLangAttentionBackend(runner, NoSoftcap())
    assert {r.field for r in info.value.reasons} == {
        "layers[1].is_cross_attention",
        "layers[2].softcap",
    }


def test_sinks_are_prepared_at_the_first_forward():
    """SGLang passes a layer's sinks per call (RadixAttention has none): the layer is declared
    without them at start-up, and its first forward with sinks prepares that variant."""
    layer = MODEL[0]
    batch = make_sglang_batch(BatchSpec((1,), (20,)), layer, M.DECODE, page_size=16)
    backend = create_backend("reference")
    dropin = SGLangAttentionBackend(batch.model_runner, backend)
    assert [spec.has_sinks for spec, _ in backend.prepared] == [False]
    dropin.init_forward_metadata(batch.forward_batch)
    sinks = torch.zeros(layer.num_heads)
    dropin.forward(batch.q, batch.k, batch.v, batch.layer, batch.forward_batch, sinks=sinks)
    assert [spec.has_sinks for spec, _ in backend.prepared] == [False, True]


def test_forward_before_metadata_raises():
    layer = LayerSpec(num_heads=2, num_kv_heads=1, head_dim=16)
    batch = make_sglang_batch(BatchSpec((1,), (2,)), layer, M.DECODE, page_size=1)
    dropin = SGLangAttentionBackend(batch.model_runner, "reference")
    with pytest.raises(InvalidInputError, match="init_forward_metadata"):
        dropin.forward(batch.q, batch.k, batch.v, batch.layer, batch.forward_batch)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"is_cross_attention": True}, "is_cross_attention"),
        ({"attn_type": "decoder_fancy"}, "attn_type"),
    ],
)
def test_unmapped_layer_semantics_raise(change, field):
    layer = LayerSpec(num_heads=2, num_kv_heads=1, head_dim=16)
    batch = make_sglang_batch(BatchSpec((1,), (2,)), layer, M.DECODE, page_size=1)
    bad = dataclasses.replace(MockRadixAttention.from_layer_spec(layer), **change)
    dropin = SGLangAttentionBackend(batch.model_runner, "reference")
    dropin.init_forward_metadata(batch.forward_batch)
    with pytest.raises(UnsupportedConfigError, match=field):
        dropin.forward(batch.q, batch.k, batch.v, bad, batch.forward_batch)


def test_idle_returns_zero_rows():
    layer = LayerSpec(num_heads=4, num_kv_heads=2, head_dim=16, v_head_dim=8)
    batch = make_sglang_batch(BatchSpec((), ()), layer, M.IDLE, page_size=16)
    out = run(batch)
    assert out.shape == (0, 32)


def test_idle_after_a_step_never_reuses_its_plan():
    # SGLang runs IDLE steps (batch_size 0) without init_forward_metadata: the previous step's
    # plan must not be used, and nothing may be written.
    layer = LayerSpec(num_heads=4, num_kv_heads=2, head_dim=16)
    batch = make_sglang_batch(BatchSpec((1, 1), (20, 9)), layer, M.DECODE, page_size=16)
    dropin = SGLangAttentionBackend(batch.model_runner, "reference")
    dropin.init_forward_metadata(batch.forward_batch)
    dropin.forward(batch.q, batch.k, batch.v, batch.layer, batch.forward_batch)
    idle = dataclasses.replace(
        batch.forward_batch,
        forward_mode=M.IDLE,
        batch_size=0,
        req_pool_indices=batch.forward_batch.req_pool_indices[:0],
        seq_lens=batch.forward_batch.seq_lens[:0],
        seq_lens_cpu=batch.forward_batch.seq_lens_cpu[:0],
        out_cache_loc=batch.forward_batch.out_cache_loc[:0],
    )
    pool = batch.model_runner.token_to_kv_pool
    before = pool.k_buffer[0].clone()
    out = dropin.forward(batch.q[:0], batch.k[:0], batch.v[:0], batch.layer, idle)
    assert out.shape == (0, 4 * 16)
    assert torch.equal(pool.k_buffer[0], before)


@pytest.mark.parametrize(
    ("kwarg", "value"),
    [
        ("q_rope", torch.zeros(1)),
        ("k_descale", torch.ones(1)),
        ("score_mod", lambda s: s),
        ("a_future_option", 3),
    ],
)
def test_keyword_arguments_not_served_are_refused(kwarg, value):
    layer = LayerSpec(num_heads=2, num_kv_heads=1, head_dim=16)
    batch = make_sglang_batch(BatchSpec((1,), (2,)), layer, M.DECODE, page_size=1)
    dropin = SGLangAttentionBackend(batch.model_runner, "reference")
    dropin.init_forward_metadata(batch.forward_batch)
    with pytest.raises(UnsupportedConfigError, match=rf"forward: {kwarg} is not served \(found "):
        dropin.forward(
            batch.q, batch.k, batch.v, batch.layer, batch.forward_batch, **{kwarg: value}
        )


@pytest.mark.parametrize("how", ["return_lse", "mha_return_lse"])
@pytest.mark.parametrize("sinks", [False, True])
def test_lse_is_returned_as_sglangs_fa3_backend_returns_it(how, sinks):
    """``return_lse=True`` (or ``ForwardBatch.mha_return_lse``): ``(output, lse)``, lse
    ``[T, Hq]`` fp32, natural log, the sink included; the output as without it."""
    layer = LayerSpec(num_heads=4, num_kv_heads=2, head_dim=16, has_sinks=sinks)
    batch = make_sglang_batch(BatchSpec((1, 5, 0), (9, 12, 1)), layer, M.EXTEND, page_size=4)
    sink = torch.linspace(-1.0, 2.0, 4) if sinks else None
    expected = expected_step(batch, layer, sinks=sink)
    fb = batch.forward_batch
    kwargs: dict[str, Any] = {"sinks": sink} if sinks else {}
    if how == "return_lse":
        kwargs["return_lse"] = True
    else:
        fb = SimpleNamespace(**{f.name: getattr(fb, f.name) for f in dataclasses.fields(fb)})
        fb.mha_return_lse = True
    dropin = SGLangAttentionBackend(batch.model_runner, "reference")
    dropin.init_forward_metadata(batch.forward_batch)
    out, lse = dropin.forward(batch.q, batch.k, batch.v, batch.layer, fb, **kwargs)
    check(batch, layer, out, expected=expected)
    assert lse.shape == (batch.q.shape[0], 4)
    assert lse.dtype == torch.float32
    real = batch.real_tokens
    torch.testing.assert_close(lse[real].double(), expected.lse[real], atol=1e-4, rtol=1e-5)


def test_keyword_arguments_at_their_defaults_are_accepted():
    layer = LayerSpec(num_heads=2, num_kv_heads=1, head_dim=16)
    batch = make_sglang_batch(BatchSpec((1,), (9,)), layer, M.DECODE, page_size=4)
    expected = expected_step(batch, layer)
    dropin = SGLangAttentionBackend(batch.model_runner, "reference")
    dropin.init_forward_metadata(batch.forward_batch)
    out = dropin.forward(
        batch.q, batch.k, batch.v, batch.layer, batch.forward_batch,
        return_lse=False, q_rope=None, k_descale=None, score_mod=None,
    )  # fmt: skip
    check(batch, layer, out, expected=expected)


class NgramVerifyInput:
    """SGLang's NGRAM verify input: a token tree, and no ``topk`` attribute."""

    def __init__(self, draft_token_num, custom_mask):
        self.draft_token_num = draft_token_num
        self.custom_mask = custom_mask


TREES = [[-1, 0, 0, 1], [-1, 0, 1, 1]]  # per row: root, then branches; D = 4


@pytest.mark.parametrize("backend", ["reference", "flex"])
@pytest.mark.parametrize("kind", ["eagle", "ngram"])
def test_tree_verify_is_served_with_its_mask(kind, backend):
    """EAGLE topk > 1 and NGRAM verify: the drafts see their ancestors, read from SGLang's
    custom_mask by the oracle itself (not the adapter's gather), and the step differs from a
    chain's."""
    layer = LayerSpec(num_heads=4, num_kv_heads=2, head_dim=16)
    tree = tree_mask_from_parents(TREES)
    spec = BatchSpec((4, 4), (21, 35))
    batch = make_sglang_batch(spec, layer, M.TARGET_VERIFY, page_size=16, tree_mask=tree, seed=4)
    if kind == "ngram":
        eagle = batch.forward_batch.spec_info
        ngram = NgramVerifyInput(eagle.draft_token_num, eagle.custom_mask)
        batch = dataclasses.replace(
            batch, forward_batch=dataclasses.replace(batch.forward_batch, spec_info=ngram)
        )
    expected = expected_step(batch, layer)
    chain = make_sglang_batch(spec, layer, M.TARGET_VERIFY, page_size=16, seed=4)
    chain_out = expected_step(chain, layer).out
    out = run(batch, backend)
    check(batch, layer, out, expected=expected)
    assert float((expected.out - chain_out).abs().max()) > 1e-2  # the tree matters here


def test_tree_verify_on_a_backend_without_tree_masks_is_refused_at_start_up():
    layer = LayerSpec(num_heads=2, num_kv_heads=1, head_dim=16)
    batch = make_sglang_batch(BatchSpec((1,), (10,)), layer, M.DECODE, page_size=4)
    args = SimpleNamespace(speculative_algorithm="EAGLE", speculative_eagle_topk=4)
    runner = SimpleNamespace(
        **{
            f.name: getattr(batch.model_runner, f.name)
            for f in dataclasses.fields(batch.model_runner)
        },
        server_args=args,
    )
    with pytest.raises(UnsupportedConfigError, match="tree masks"):
        SGLangAttentionBackend(runner, NoTreesBackend())
    SGLangAttentionBackend(runner, "reference")  # serves trees: accepted


def test_data_parallel_padded_extend_serves_the_real_tokens():
    # ForwardBatch._pad_inputs_to_size pads an EXTEND batch with extra tokens (slot 0) that no
    # sequence owns; RadixAttention hands the backend the real rows.
    layer = LayerSpec(num_heads=4, num_kv_heads=2, head_dim=16)
    batch = make_sglang_batch(BatchSpec((3, 2), (9, 2)), layer, M.EXTEND, page_size=4, seed=3)
    expected = expected_step(batch, layer)
    fb = batch.forward_batch
    padded = dataclasses.replace(
        fb, out_cache_loc=torch.cat([fb.out_cache_loc, torch.zeros(3, dtype=torch.int64)])
    )
    dropin = SGLangAttentionBackend(batch.model_runner, "reference")
    dropin.init_forward_metadata(padded)
    out = dropin.forward(batch.q, batch.k, batch.v, batch.layer, padded)
    check(batch, layer, out, expected=expected)


def test_pools_are_read_from_the_model_runner_not_the_batch():
    # SGLang 0.5.13+ ForwardBatch has no token_to_kv_pool; forward_context reads the pools off
    # the attention backend.
    layer = LayerSpec(num_heads=2, num_kv_heads=1, head_dim=16)
    batch = make_sglang_batch(BatchSpec((1,), (5,)), layer, M.DECODE, page_size=4)
    dropin = SGLangAttentionBackend(batch.model_runner, "reference")
    assert dropin.token_to_kv_pool is batch.model_runner.token_to_kv_pool
    assert dropin.req_to_token_pool is batch.model_runner.req_to_token_pool
    assert not hasattr(batch.forward_batch, "token_to_kv_pool")


def test_a_reallocated_pool_is_wrapped_again():
    layer = LayerSpec(num_heads=2, num_kv_heads=1, head_dim=16)
    batch = make_sglang_batch(BatchSpec((1,), (5,)), layer, M.DECODE, page_size=4, seed=1)
    dropin = SGLangAttentionBackend(batch.model_runner, "reference")
    dropin.init_forward_metadata(batch.forward_batch)
    dropin.forward(batch.q, batch.k, batch.v, batch.layer, batch.forward_batch)
    pool = batch.model_runner.token_to_kv_pool
    fresh = batch.clone()
    pool.k_buffer[0] = fresh.model_runner.token_to_kv_pool.k_buffer[0]
    pool.v_buffer[0] = fresh.model_runner.token_to_kv_pool.v_buffer[0]
    expected = expected_step(fresh, layer)
    out = dropin.forward(fresh.q, fresh.k, fresh.v, fresh.layer, fresh.forward_batch)
    check(fresh, layer, out, expected=expected)


def test_q_of_the_wrong_width_is_a_typed_error():
    layer = LayerSpec(num_heads=2, num_kv_heads=1, head_dim=16)
    batch = make_sglang_batch(BatchSpec((1,), (5,)), layer, M.DECODE, page_size=4)
    dropin = SGLangAttentionBackend(batch.model_runner, "reference")
    dropin.init_forward_metadata(batch.forward_batch)
    with pytest.raises(InvalidInputError, match=r"^q\.shape: expected"):
        dropin.forward(batch.q[:, :-1], batch.k, batch.v, batch.layer, batch.forward_batch)


def test_out_of_range_request_row_is_a_typed_error():
    layer = LayerSpec(num_heads=2, num_kv_heads=1, head_dim=16)
    batch = make_sglang_batch(BatchSpec((1,), (5,)), layer, M.DECODE, page_size=4)
    fb = dataclasses.replace(batch.forward_batch, req_pool_indices=torch.tensor([999]))
    dropin = SGLangAttentionBackend(batch.model_runner, "reference")
    with pytest.raises(InvalidMetadataError, match=r"req_pool_indices\[0\]"):
        dropin.init_forward_metadata(fb)
