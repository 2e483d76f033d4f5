"""The bad-input matrix, engine-adapter half: SGLang and vLLM batches, layers, caches, hooks.

Every case feeds an adapter what an engine (or an integrator's fork of one) could hand it with
one thing wrong, and must be refused with a typed ``AttnSDKError`` naming the field
(tests/bad_input_kit.py). Where a call reaches the engine's KV buffers, they must come out
bit for bit untouched; where it reaches captured CUDA-graph buffers, those too. The baselines at
the end run the unchanged calls. tests/core/test_bad_input_matrix.py is the core half.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import pytest
import torch
from backend_variants import NoTreesBackend
from bad_input_kit import Case, assert_refused, params

from attnsdk import (
    AttnSDKError,
    InvalidInputError,
    InvalidMetadataError,
    LayerSpec,
    UnsupportedConfigError,
)
from attnsdk.adapters.sglang import SGLangAdapter, SGLangAttentionBackend
from attnsdk.adapters.sglang.testing import (
    ForwardMode,
    MockKVPool,
    MockModel,
    MockRadixAttention,
    SGLangBatch,
    VerifyInput,
    make_sglang_batch,
)
from attnsdk.adapters.vllm import AttnSDKAttentionBackend, VLLMAdapter
from attnsdk.adapters.vllm.testing import (
    FullAttentionSpec,
    VLLMMockBatch,
    make_kv_cache,
    mock_vllm_batch,
    mock_vllm_config,
)
from attnsdk.backends.reference import ReferenceOptions
from attnsdk.testing import BatchSpec

if TYPE_CHECKING:
    from collections.abc import Callable

IIE, IME, UCE = InvalidInputError, InvalidMetadataError, UnsupportedConfigError
E4M3 = torch.float8_e4m3fn
Err = type[AttnSDKError]


def namespace(obj: Any, **extra: Any) -> SimpleNamespace:
    """A mutable copy of a (frozen, slotted) mock with extra attributes a newer engine has."""
    values = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
    return SimpleNamespace(**{**values, **extra})


# =================================== SGLang ========================================================

M = ForwardMode
P = 4
SG_LAYER = LayerSpec(num_heads=4, num_kv_heads=2, head_dim=16)
SG_SPECS = {
    M.EXTEND: BatchSpec((3, 2), (9, 2)),
    M.MIXED: BatchSpec((1, 3), (9, 3)),
    M.DECODE: BatchSpec((1, 1), (9, 5)),
    M.TARGET_VERIFY: BatchSpec((3, 3), (10, 12)),
}


def sg_batch(mode: ForwardMode = M.EXTEND) -> SGLangBatch:
    return make_sglang_batch(SG_SPECS[mode], SG_LAYER, mode, page_size=P, seed=5)


def sg_buffers(batch: SGLangBatch) -> tuple[torch.Tensor, ...]:
    pool = batch.model_runner.token_to_kv_pool
    return (pool.k_buffer[0], pool.v_buffer[0])


def sg_adapter(batch: SGLangBatch) -> SGLangAdapter:
    return SGLangAdapter(
        req_to_token=batch.model_runner.req_to_token_pool.req_to_token, page_size=P
    )


def fb_with(**changes: Any) -> Callable[[SGLangBatch], Any]:
    return lambda b: dataclasses.replace(b.forward_batch, **changes)


def fb_case(
    name: str,
    field: str,
    change: Callable[[SGLangBatch], Any],
    error: Err = IME,
    *,
    mode: ForwardMode = M.EXTEND,
    via: str = "adapter",
    match: str | None = None,
) -> Case:
    """A malformed ``ForwardBatch`` through ``build_metadata``, ``validate`` or the drop-in."""
    batch = sg_batch(mode)
    fb = change(batch)
    watch = sg_buffers(batch)
    if via == "adapter":
        adapter = sg_adapter(batch)
        call: Callable[[], object] = lambda: adapter.build_metadata(fb)  # noqa: E731
    elif via == "validate":
        adapter = sg_adapter(batch)
        cache = adapter.kv_cache(*watch)
        call = lambda: adapter.validate(fb, cache)  # noqa: E731
    else:
        dropin = SGLangAttentionBackend(batch.model_runner, "reference")
        call = lambda: dropin.init_forward_metadata(fb)  # noqa: E731
    return Case(f"sglang/{via}-{name}", call, error, field, watch, match)


def with_rows(b: SGLangBatch, *rows: int) -> Any:
    return dataclasses.replace(b.forward_batch, req_pool_indices=torch.tensor(rows))


def shifted_seq_lens(b: SGLangBatch, row: int, value: int) -> Any:
    fb = b.forward_batch
    seq, seq_cpu = fb.seq_lens.clone(), fb.seq_lens_cpu.clone()
    seq[row] = seq_cpu[row] = value
    return dataclasses.replace(fb, seq_lens=seq, seq_lens_cpu=seq_cpu)


def spec_info(**fields: Any) -> Callable[[SGLangBatch], Any]:
    return fb_with(spec_info=SimpleNamespace(**fields))


def slot_past_pool(b: SGLangBatch) -> Any:
    loc = b.forward_batch.out_cache_loc.clone()
    loc[0] = sg_buffers(b)[0].shape[0] + 1
    return dataclasses.replace(b.forward_batch, out_cache_loc=loc)


SG_BATCH_CASES = [
    fb_case(
        "seq-lens-below-extend-lens",
        "forward_batch.seq_lens[1]",
        lambda b: shifted_seq_lens(b, 1, 1),
    ),
    fb_case(
        "extend-lens-cpu-missing",
        "forward_batch.extend_seq_lens_cpu",
        fb_with(extend_seq_lens_cpu=None),
    ),
    fb_case("extend-lens-missing", "forward_batch.extend_seq_lens", fb_with(extend_seq_lens=None)),
    fb_case(
        "extend-lens-cpu-short",
        "forward_batch.extend_seq_lens_cpu",
        fb_with(extend_seq_lens_cpu=[3]),
    ),
    fb_case(
        "extend-lens-long",
        "forward_batch.extend_seq_lens",
        fb_with(extend_seq_lens=torch.tensor([3, 2, 1], dtype=torch.int32)),
    ),
    fb_case(
        "extend-lens-cpu-on-device",
        "forward_batch.extend_seq_lens_cpu.device",
        fb_with(extend_seq_lens_cpu=torch.tensor([3, 2], device="meta")),
    ),
    fb_case(
        "extend-lens-cpu-floats",
        "forward_batch.extend_seq_lens_cpu",
        fb_with(extend_seq_lens_cpu=[3.5, 2]),
    ),
    fb_case(
        "extend-lens-cpu-words",
        "forward_batch.extend_seq_lens_cpu",
        fb_with(extend_seq_lens_cpu=["a", 2]),
    ),
    fb_case(
        "extend-lens-cpu-an-int",
        "forward_batch.extend_seq_lens_cpu",
        fb_with(extend_seq_lens_cpu=3),
    ),
    fb_case("seq-lens-cpu-missing", "forward_batch.seq_lens_cpu", fb_with(seq_lens_cpu=None)),
    fb_case(
        "seq-lens-cpu-short", "forward_batch.seq_lens_cpu", fb_with(seq_lens_cpu=torch.tensor([9]))
    ),
    fb_case(
        "seq-lens-cpu-float",
        "forward_batch.seq_lens_cpu",
        lambda b: dataclasses.replace(
            b.forward_batch, seq_lens_cpu=b.forward_batch.seq_lens_cpu.float()
        ),
    ),
    fb_case("seq-lens-missing", "forward_batch.seq_lens", fb_with(seq_lens=None)),
    fb_case(
        "seq-lens-float",
        "forward_batch.seq_lens",
        lambda b: dataclasses.replace(b.forward_batch, seq_lens=b.forward_batch.seq_lens.float()),
    ),
    fb_case(
        "prefix-inconsistent",
        "forward_batch.extend_prefix_lens_cpu[0]",
        fb_with(extend_prefix_lens_cpu=[5, 0]),
    ),
    fb_case(
        "prefix-short", "forward_batch.extend_prefix_lens_cpu", fb_with(extend_prefix_lens_cpu=[6])
    ),
    fb_case(
        "prefix-floats",
        "forward_batch.extend_prefix_lens_cpu",
        fb_with(extend_prefix_lens_cpu=[6.0, 0.0]),
    ),
    fb_case(
        "out-cache-loc-short",
        "forward_batch.out_cache_loc",
        lambda b: dataclasses.replace(
            b.forward_batch, out_cache_loc=b.forward_batch.out_cache_loc[:-1]
        ),
    ),
    fb_case("out-cache-loc-missing", "forward_batch.out_cache_loc", fb_with(out_cache_loc=None)),
    fb_case(
        "out-cache-loc-float",
        "forward_batch.out_cache_loc",
        lambda b: dataclasses.replace(
            b.forward_batch, out_cache_loc=b.forward_batch.out_cache_loc.float()
        ),
    ),
    fb_case(
        "out-cache-loc-2d",
        "forward_batch.out_cache_loc",
        lambda b: dataclasses.replace(
            b.forward_batch, out_cache_loc=b.forward_batch.out_cache_loc[None]
        ),
    ),
    fb_case(
        "req-row-past-pool", "forward_batch.req_pool_indices[0]", lambda b: with_rows(b, 999, 1)
    ),
    fb_case("req-row-negative", "forward_batch.req_pool_indices[1]", lambda b: with_rows(b, 1, -1)),
    fb_case(
        "req-rows-float",
        "forward_batch.req_pool_indices",
        lambda b: dataclasses.replace(
            b.forward_batch, req_pool_indices=b.forward_batch.req_pool_indices.float()
        ),
    ),
    fb_case(
        "req-rows-one-extra", "forward_batch.req_pool_indices", lambda b: with_rows(b, 1, 2, 3)
    ),
    fb_case("req-rows-missing", "forward_batch.req_pool_indices", fb_with(req_pool_indices=None)),
    fb_case(
        "req-row-host-twin-past-pool",
        "forward_batch.req_pool_indices[0]",
        lambda b: namespace(b.forward_batch, req_pool_indices_cpu=torch.tensor([999, 1])),
    ),
    fb_case("batch-size-none", "forward_batch.batch_size", fb_with(batch_size=None)),
    fb_case("batch-size-negative", "forward_batch.batch_size", fb_with(batch_size=-1)),
    fb_case("batch-size-str", "forward_batch.batch_size", fb_with(batch_size="2")),
    fb_case("mode-prebuilt", "forward_mode", fb_with(forward_mode=M.PREBUILT), UCE),
    fb_case("mode-split-prefill", "forward_mode", fb_with(forward_mode=M.SPLIT_PREFILL), UCE),
    fb_case("mode-dllm-extend", "forward_mode", fb_with(forward_mode=M.DLLM_EXTEND), UCE),
    fb_case("mode-none", "forward_mode", fb_with(forward_mode=None), UCE),
    fb_case("mode-a-string", "forward_mode", fb_with(forward_mode="extend"), UCE),
    fb_case(
        "mixed-prefix-inconsistent",
        "forward_batch.extend_prefix_lens_cpu[1]",
        fb_with(extend_prefix_lens_cpu=[8, 1]),
        mode=M.MIXED,
    ),
    fb_case(
        "decode-with-spec-info", "spec_info", fb_with(spec_info=VerifyInput(2)), UCE, mode=M.DECODE
    ),
    fb_case(
        "decode-seq-lens-cpu-on-device",
        "forward_batch.seq_lens_cpu.device",
        lambda b: dataclasses.replace(
            b.forward_batch, seq_lens_cpu=b.forward_batch.seq_lens_cpu.to("meta")
        ),
        mode=M.DECODE,
    ),
    fb_case(
        "verify-spec-info-missing",
        "forward_batch.spec_info",
        fb_with(spec_info=None),
        mode=M.TARGET_VERIFY,
    ),
    fb_case(
        "verify-ngram-without-mask",
        "forward_batch.spec_info.custom_mask",
        spec_info(draft_token_num=3),
        mode=M.TARGET_VERIFY,
    ),
    fb_case(
        "verify-tree-without-mask",
        "forward_batch.spec_info.custom_mask",
        fb_with(spec_info=VerifyInput(3, topk=4)),
        mode=M.TARGET_VERIFY,
    ),
    fb_case(
        "verify-tree-mask-short",
        "forward_batch.spec_info.custom_mask",
        fb_with(spec_info=VerifyInput(3, topk=4, custom_mask=torch.ones(5, dtype=torch.bool))),
        mode=M.TARGET_VERIFY,
    ),
    fb_case(
        "verify-tree-mask-int",
        "forward_batch.spec_info.custom_mask",
        fb_with(spec_info=VerifyInput(3, topk=4, custom_mask=torch.ones(999, dtype=torch.int8))),
        mode=M.TARGET_VERIFY,
    ),
    fb_case(
        "verify-topk-word",
        "forward_batch.spec_info.topk",
        spec_info(topk="x", draft_token_num=3),
        mode=M.TARGET_VERIFY,
    ),
    fb_case(
        "verify-dflash-ragged",
        "ragged_verify_layout",
        spec_info(topk=1, draft_token_num=3, ragged_verify_layout=object()),
        UCE,
        mode=M.TARGET_VERIFY,
    ),
    fb_case(
        "verify-zero-drafts",
        "forward_batch.spec_info.draft_token_num",
        fb_with(spec_info=VerifyInput(0)),
        mode=M.TARGET_VERIFY,
    ),
    fb_case(
        "verify-drafts-str",
        "forward_batch.spec_info.draft_token_num",
        spec_info(topk=1, draft_token_num="3"),
        mode=M.TARGET_VERIFY,
    ),
    fb_case(
        "verify-drafts-bool",
        "forward_batch.spec_info.draft_token_num",
        spec_info(topk=1, draft_token_num=True),
        mode=M.TARGET_VERIFY,
    ),
    # SGLangAdapter.validate: the host checks first, then the device values.
    fb_case(
        "req-row-past-pool",
        "forward_batch.req_pool_indices[0]",
        lambda b: with_rows(b, 999, 1),
        via="validate",
    ),
    fb_case("slot-past-pool", "slot_mapping[0]", slot_past_pool, via="validate"),
    fb_case(
        "seq-lens-below-extend-lens",
        "forward_batch.seq_lens[0]",
        lambda b: shifted_seq_lens(b, 0, 2),
        via="validate",
    ),
    # The drop-in's init_forward_metadata.
    fb_case(
        "req-row-negative",
        "forward_batch.req_pool_indices[0]",
        lambda b: with_rows(b, -1, 1),
        via="dropin",
    ),
    fb_case("mode-prebuilt", "forward_mode", fb_with(forward_mode=M.PREBUILT), UCE, via="dropin"),
    fb_case(
        "verify-tree-topk-2-without-mask",
        "forward_batch.spec_info.custom_mask",
        fb_with(spec_info=VerifyInput(3, topk=2)),
        mode=M.TARGET_VERIFY,
        via="dropin",
    ),
    fb_case(
        "extend-lens-cpu-missing",
        "forward_batch.extend_seq_lens_cpu",
        fb_with(extend_seq_lens_cpu=None),
        via="dropin",
    ),
    fb_case(
        "batch-size-none",
        "forward_batch.batch_size",
        fb_with(batch_size=None),
        mode=M.DECODE,
        via="dropin",
    ),
]


def page_past_pool(batch: SGLangBatch) -> None:
    """Request 0's pages renumbered past the pool (slots stay page-contiguous)."""
    r2t = batch.model_runner.req_to_token_pool.req_to_token
    row = int(batch.forward_batch.req_pool_indices[0])
    r2t[row] += sg_buffers(batch)[0].shape[0]


def page_negative(batch: SGLangBatch) -> None:
    r2t = batch.model_runner.req_to_token_pool.req_to_token
    row = int(batch.forward_batch.req_pool_indices[0])
    r2t[row, :P] = torch.arange(-P, 0, dtype=r2t.dtype)


def validate_page_case(name: str, field: str, corrupt: Callable[[SGLangBatch], None]) -> Case:
    batch = sg_batch()
    corrupt(batch)
    adapter = sg_adapter(batch)
    watch = sg_buffers(batch)
    cache = adapter.kv_cache(*watch)
    return Case(
        f"sglang/validate-{name}",
        lambda: adapter.validate(batch.forward_batch, cache),
        IME,
        field,
        watch,
    )


def fwd_case(
    name: str,
    field: str,
    change: Callable[[SGLangBatch], dict[str, Any]] = lambda b: {},
    error: Err = IIE,
    *,
    mode: ForwardMode = M.EXTEND,
    method: str = "forward",
    corrupt: Callable[[SGLangBatch], Any] | None = None,
    init: bool = True,
    match: str | None = None,
) -> Case:
    """One layer's forward through the drop-in after a valid (or corrupted) step setup."""
    batch = sg_batch(mode)
    fb = batch.forward_batch
    if corrupt is not None:
        fb = corrupt(batch) or fb
    dropin = SGLangAttentionBackend(batch.model_runner, "reference")
    if init:
        dropin.init_forward_metadata(fb)
    args: dict[str, Any] = {
        "q": batch.q,
        "k": batch.k,
        "v": batch.v,
        "layer": batch.layer,
        "forward_batch": fb,
        **change(batch),
    }
    fn = getattr(dropin, method)
    return Case(
        f"sglang/{method}-{name}", lambda: fn(**args), error, field, sg_buffers(batch), match
    )


def radix(b: SGLangBatch, **changes: Any) -> MockRadixAttention:
    return dataclasses.replace(b.layer, **changes)


SG_FORWARD_CASES = [
    validate_page_case("page-past-pool", "page_table[0, 0]", page_past_pool),
    validate_page_case("page-negative", "page_table[0, 0]", page_negative),
    fwd_case("before-init", "init_forward_metadata", init=False, method="forward_extend"),
    fwd_case(
        "before-init", "init_forward_metadata", init=False, method="forward_decode", mode=M.DECODE
    ),
    fwd_case("k-wrong-width", "k.shape", lambda b: {"k": b.k[:, :-1]}),
    fwd_case("v-wrong-width", "v.shape", lambda b: {"v": torch.cat([b.v, b.v[:, :1]], 1)}),
    fwd_case("q-1d", "q.shape", lambda b: {"q": b.q.flatten()}),
    fwd_case(
        "q-one-column-short",
        "q.shape",
        lambda b: {"q": b.q[:, 1:]},
        method="forward_decode",
        mode=M.DECODE,
    ),
    fwd_case("q-extra-head", "q.shape", lambda b: {"q": torch.zeros(b.q.shape[0], 5, 16)}),
    fwd_case("k-4d", "k.shape", lambda b: {"k": b.k[None]}),
    fwd_case("k-without-v", "k/v", lambda b: {"v": None}),
    fwd_case("v-without-k", "k/v", lambda b: {"k": None}, method="forward_extend"),
    fwd_case("kwarg-k-rope", "k_rope", lambda b: {"k_rope": torch.zeros(1)}, UCE),
    fwd_case("kwarg-q-descale", "q_descale", lambda b: {"q_descale": torch.ones(1)}, UCE),
    fwd_case("kwarg-v-descale", "v_descale", lambda b: {"v_descale": torch.ones(1)}, UCE),
    fwd_case("kwarg-rel-bias", "rel_bias", lambda b: {"rel_bias": torch.zeros(4)}, UCE),
    fwd_case(
        "kwarg-causal",
        "causal",
        lambda b: {"causal": True},
        UCE,
        method="forward_decode",
        mode=M.DECODE,
    ),
    fwd_case("sinks-list", "sinks", lambda b: {"sinks": [0.0] * 4}),
    fwd_case("sinks-per-kv-head", "sinks.shape", lambda b: {"sinks": torch.zeros(2)}),
    fwd_case("sinks-fp16", "sinks.dtype", lambda b: {"sinks": torch.zeros(4, dtype=torch.float16)}),
    fwd_case(
        "layer-non-tanh-capping",
        "logit_capping_method",
        lambda b: {"layer": radix(b, logit_cap=30.0, logit_capping_method="relu")},
        UCE,
    ),
    fwd_case("layer-attn-type-int", "attn_type", lambda b: {"layer": radix(b, attn_type=3)}, UCE),
    fwd_case(
        "layer-cross-attention",
        "is_cross_attention",
        lambda b: {"layer": radix(b, is_cross_attention=True)},
        UCE,
        method="forward_extend",
    ),
    fwd_case("layer-scaling-word", "layer.scaling", lambda b: {"layer": radix(b, scaling="x")}),
    fwd_case(
        "layer-window-str",
        "layer.sliding_window_size",
        lambda b: {"layer": radix(b, sliding_window_size="4")},
    ),
    fwd_case(
        "layer-heads-none", "LayerSpec.num_heads", lambda b: {"layer": radix(b, tp_q_head_num=None)}
    ),
    fwd_case(
        "layer-kv-heads-not-dividing",
        "LayerSpec.num_heads",
        lambda b: {"layer": radix(b, tp_k_head_num=3)},
    ),
    fwd_case(
        "layer-v-head-dim-zero", "LayerSpec.v_head_dim", lambda b: {"layer": radix(b, v_head_dim=0)}
    ),
    # What reaches the KV buffers: checked before anything is written.
    fwd_case("slot-past-pool", "slot_mapping[0]", lambda b: {}, IME, corrupt=slot_past_pool),
    fwd_case("page-past-pool", "page_table[0, 0]", lambda b: {}, IME, corrupt=page_past_pool),
    fwd_case("page-negative", "page_table[0, 0]", lambda b: {}, IME, corrupt=page_negative),
    fwd_case(
        "decode-page-past-pool",
        "page_table[0, 0]",
        lambda b: {},
        IME,
        corrupt=page_past_pool,
        mode=M.DECODE,
    ),
    fwd_case(
        "verify-slot-past-pool",
        "slot_mapping[0]",
        lambda b: {},
        IME,
        corrupt=slot_past_pool,
        mode=M.TARGET_VERIFY,
    ),
]


def fp8_case(name: str, field: str, **scales: Any) -> Case:
    """An fp8 KV pool whose layer scales are malformed (SGLang hands them to the backend)."""
    batch = sg_batch()
    pool = batch.model_runner.token_to_kv_pool
    fp8 = MockKVPool([pool.k_buffer[0].to(E4M3)], [pool.v_buffer[0].to(E4M3)])
    runner = dataclasses.replace(batch.model_runner, token_to_kv_pool=fp8, kv_cache_dtype=E4M3)
    dropin = SGLangAttentionBackend(runner, "reference")
    dropin.init_forward_metadata(batch.forward_batch)
    layer = radix(batch, k_scale=torch.ones(()), v_scale=torch.ones(()))
    layer = dataclasses.replace(layer, **scales)
    return Case(
        f"sglang/fp8-{name}",
        lambda: dropin.forward(batch.q, batch.k, batch.v, layer, batch.forward_batch),
        IIE,
        field,
        (fp8.k_buffer[0], fp8.v_buffer[0]),
    )


SG_FP8_CASES = [
    fp8_case("k-scale-wrong-size", "k_scale", k_scale=torch.ones(3)),
    fp8_case("v-scale-float64", "v_scale.dtype", v_scale=torch.ones((), dtype=torch.float64)),
    fp8_case("v-scale-on-device", "v_scale.device", v_scale=torch.ones((), device="meta")),
]


def ctor_case(
    name: str,
    field: str,
    runner: Callable[[SGLangBatch], Any] = lambda b: b.model_runner,
    error: Err = IIE,
    *,
    backend: Any = "reference",
    adapter: Callable[[SGLangBatch], Any] | None = None,
) -> Case:
    batch = sg_batch()
    run = runner(batch)
    kwargs = {} if adapter is None else {"adapter": adapter(batch)}
    return Case(
        f"sglang/construct-{name}",
        lambda: SGLangAttentionBackend(run, backend, **kwargs),
        error,
        field,
    )


def model(b: SGLangBatch, **changes: Any) -> Any:
    """A runner without model layers (SGLang's attention kit): the config describes the model."""
    return dataclasses.replace(
        b.model_runner,
        model_config=dataclasses.replace(b.model_runner.model_config, **changes),
        model=None,
    )


def unloaded(b: SGLangBatch) -> Any:
    """``b``'s runner without model layers: the drop-in reads the model's shape off its config."""
    return dataclasses.replace(b.model_runner, model=None)


def with_layers(b: SGLangBatch, **changes: Any) -> Any:
    """``b``'s runner whose model layer has ``changes`` (its attributes as SGLang names them)."""
    layer = dataclasses.replace(b.layer, **changes)
    return dataclasses.replace(b.model_runner, model=MockModel([layer]))


def swa_pool(b: SGLangBatch) -> Any:
    pool = b.model_runner.token_to_kv_pool.clone()
    pool.swa_layer_nums = 2  # type: ignore[attr-defined]
    return dataclasses.replace(b.model_runner, token_to_kv_pool=pool)


SG_CONSTRUCT_CASES = [
    ctor_case("backend-unknown", "backend", error=UCE, backend="nope"),
    ctor_case("backend-options-model", "backend", backend=ReferenceOptions()),
    ctor_case(
        "adapter-page-size",
        "adapter.page_size",
        adapter=lambda b: SGLangAdapter(
            req_to_token=b.model_runner.req_to_token_pool.req_to_token, page_size=8
        ),
    ),
    ctor_case("adapter-a-string", "adapter", adapter=lambda b: "adapter"),
    ctor_case(
        "page-size-zero", "page_size", lambda b: dataclasses.replace(b.model_runner, page_size=0)
    ),
    ctor_case(
        "mla-model-without-kv-lora-rank",
        "model_config.kv_lora_rank",
        lambda b: dataclasses.replace(
            b.model_runner,
            model_config=namespace(
                b.model_runner.model_config, attention_arch=SimpleNamespace(name="MLA")
            ),
        ),
        IIE,
    ),
    ctor_case(
        "mla-model-on-flex-at-deepseek-dims",
        "head_dim",
        lambda b: dataclasses.replace(
            unloaded(b),
            model_config=namespace(
                b.model_runner.model_config,
                attention_arch=SimpleNamespace(name="MLA"),
                kv_lora_rank=512,
                qk_rope_head_dim=64,
            ),
        ),
        UCE,
        backend="flex",
    ),
    ctor_case(
        "virtual-kv-indices",
        "kv_index_translator",
        lambda b: dataclasses.replace(
            b.model_runner, kv_index_translator=SimpleNamespace(is_translating=True)
        ),
        UCE,
    ),
    ctor_case("hybrid-swa-pool", "token_to_kv_pool", swa_pool, UCE),
    ctor_case(
        "ngram-speculation",
        "speculative_eagle_topk",
        lambda b: namespace(
            b.model_runner, server_args=SimpleNamespace(speculative_algorithm="NGRAM")
        ),
        UCE,
        backend=NoTreesBackend(),
    ),
    ctor_case(
        "eagle-tree-speculation",
        "speculative_eagle_topk",
        lambda b: namespace(
            b.model_runner,
            server_args=SimpleNamespace(speculative_algorithm="EAGLE", speculative_eagle_topk=4),
        ),
        UCE,
        backend=NoTreesBackend(),
    ),
    ctor_case(
        "model-float64",
        "KVCacheLayout.dtype",
        lambda b: dataclasses.replace(b.model_runner, dtype=torch.float64),
    ),
    ctor_case(
        "kv-cache-int8",
        "KVCacheLayout.kv_dtype",
        lambda b: dataclasses.replace(unloaded(b), kv_cache_dtype=torch.int8),
    ),
    ctor_case(
        "heads-not-dividing", "LayerSpec.num_heads", lambda b: model(b, num_attention_heads=3)
    ),
    ctor_case("head-dim-zero", "LayerSpec.head_dim", lambda b: model(b, head_dim=0)),
    ctor_case("head-dim-past-backend", "head_dim", lambda b: model(b, head_dim=2048), UCE),
    # A runner with model layers declares each one (Backend.prepare), named by its layer_id.
    ctor_case(
        "model-layer-cross-attention",
        "layers[0].is_cross_attention",
        lambda b: with_layers(b, is_cross_attention=True),
        UCE,
    ),
    ctor_case(
        "model-layer-capping-method",
        "layers[0].logit_capping_method",
        lambda b: with_layers(b, logit_cap=2.0, logit_capping_method="idk"),
        UCE,
    ),
    ctor_case(
        "model-layer-on-flex", "layers[0].page_size", lambda b: b.model_runner, UCE, backend="flex"
    ),
    ctor_case(
        "model-layer-heads-word", "layer.tp_q_head_num", lambda b: with_layers(b, tp_q_head_num="4")
    ),
]


def adapter_case(
    name: str, field: str, call: Callable[[SGLangBatch, SGLangAdapter], object], error: Err = IIE
) -> Case:
    batch = sg_batch()
    adapter = sg_adapter(batch)
    return Case(f"sglang/adapter-{name}", lambda: call(batch, adapter), error, field)


def k_buf(b: SGLangBatch) -> torch.Tensor:
    return sg_buffers(b)[0]


SG_ADAPTER_CASES = [
    adapter_case(
        "page-size-bool",
        "page_size",
        lambda b, a: SGLangAdapter(req_to_token=a.req_to_token, page_size=True),
    ),
    adapter_case(
        "page-size-str",
        "page_size",
        lambda b, a: SGLangAdapter(req_to_token=a.req_to_token, page_size="4"),
    ),
    adapter_case(
        "req-to-token-1d",
        "req_to_token",
        lambda b, a: SGLangAdapter(req_to_token=a.req_to_token[0], page_size=P),
    ),
    adapter_case(
        "req-to-token-list",
        "req_to_token",
        lambda b, a: SGLangAdapter(req_to_token=[[0]], page_size=P),
    ),
    adapter_case(
        "req-to-token-float",
        "req_to_token.dtype",
        lambda b, a: SGLangAdapter(req_to_token=a.req_to_token.float(), page_size=P),
    ),
    adapter_case(
        "req-to-token-bool",
        "req_to_token.dtype",
        lambda b, a: SGLangAdapter(req_to_token=a.req_to_token.bool(), page_size=P),
    ),
    adapter_case(
        "k-buffer-2d", "k_buffer.shape", lambda b, a: a.kv_cache(k_buf(b).flatten(1), k_buf(b))
    ),
    adapter_case("v-buffer-none", "v_buffer.shape", lambda b, a: a.kv_cache(k_buf(b), None)),
    adapter_case(
        "k-buffer-partial-page",
        "k_buffer.shape[0]",
        lambda b, a: a.kv_cache(k_buf(b)[:-1], k_buf(b)),
    ),
    adapter_case(
        "v-buffer-partial-page",
        "v_buffer.shape[0]",
        lambda b, a: a.kv_cache(k_buf(b), k_buf(b)[:-2]),
    ),
    adapter_case(
        "v-buffer-fewer-pages", "v.shape[0]", lambda b, a: a.kv_cache(k_buf(b), k_buf(b)[:-P])
    ),
    adapter_case(
        "v-buffer-other-dtype", "v.dtype", lambda b, a: a.kv_cache(k_buf(b), k_buf(b).half())
    ),
    adapter_case(
        "v-buffer-other-heads", "v.shape", lambda b, a: a.kv_cache(k_buf(b), k_buf(b)[:, :1])
    ),
    adapter_case(
        "fp8-without-dtype", "dtype", lambda b, a: a.kv_cache(k_buf(b).to(E4M3), k_buf(b).to(E4M3))
    ),
    adapter_case(
        "int8-buffers",
        "KVCacheLayout.kv_dtype",
        lambda b, a: a.kv_cache(
            k_buf(b).to(torch.int8), k_buf(b).to(torch.int8), dtype=torch.bfloat16
        ),
    ),
    adapter_case(
        "dtype-float64",
        "KVCacheLayout.dtype",
        lambda b, a: a.kv_cache(k_buf(b), k_buf(b), dtype=torch.float64),
    ),
    adapter_case(
        "layer-cross-attention",
        "is_cross_attention",
        lambda b, a: a.layer_spec(radix(b, is_cross_attention=True)),
        UCE,
    ),
    adapter_case(
        "layer-attn-type-unknown",
        "attn_type",
        lambda b, a: a.layer_spec(radix(b, attn_type="encoder_decoder")),
        UCE,
    ),
    adapter_case(
        "layer-capping-method",
        "logit_capping_method",
        lambda b, a: a.layer_spec(radix(b, logit_cap=5.0, logit_capping_method="clip")),
        UCE,
    ),
    adapter_case(
        "layer-logit-cap-word",
        "layer.logit_cap",
        lambda b, a: a.layer_spec(radix(b, logit_cap="x")),
    ),
    adapter_case(
        "layer-head-dim-float", "layer.head_dim", lambda b, a: a.layer_spec(radix(b, head_dim=16.0))
    ),
    adapter_case(
        "layer-kv-heads-str",
        "layer.tp_k_head_num",
        lambda b, a: a.layer_spec(radix(b, tp_k_head_num="2")),
    ),
    adapter_case(
        "layer-scaling-zero", "LayerSpec.scale", lambda b, a: a.layer_spec(radix(b, scaling=0.0))
    ),
]


def graph_case(
    name: str,
    field: str,
    call: Callable[[Any, SGLangBatch], object],
    error: Err = IIE,
    *,
    state: tuple[int, int] | None = (4, 12),
    capture: tuple[int, ...] = (2,),
    mode: ForwardMode = M.DECODE,
    match: str | None = None,
) -> Case:
    """A graph hook misused; the KV buffers and the captured static buffers stay untouched."""
    batch = sg_batch(mode)
    dropin = SGLangAttentionBackend(batch.model_runner, "reference")
    watch = sg_buffers(batch)
    if state is not None:
        dropin.init_cuda_graph_state(*state)
        spec_info = batch.forward_batch.spec_info
        per_row = spec_info.draft_token_num if spec_info is not None else 1
        rpi = torch.zeros(state[0], dtype=torch.int64)
        seq = torch.ones(state[0], dtype=torch.int64)
        for bs in capture:
            dropin.init_forward_metadata_capture_cuda_graph(
                bs, bs * per_row, rpi, seq, None, mode, spec_info
            )
        buffers = dropin._graph.buffers
        watch += tuple(
            getattr(buffers, n)
            for n in ("query_start_loc", "seq_lens", "page_table", "slot_mapping", "seq_lens_cpu")
        )
    return Case(f"sglang/graph-{name}", lambda: call(dropin, batch), error, field, watch, match)


def legacy_replay(
    bs: int, *, seq_cpu: Any = ..., rows: Any = None, mode: ForwardMode = M.DECODE, spec: Any = None
) -> Callable[[Any, SGLangBatch], object]:
    def call(dropin: Any, b: SGLangBatch) -> object:
        fb = b.forward_batch
        rpi = fb.req_pool_indices if rows is None else rows
        host = fb.seq_lens_cpu if seq_cpu is ... else seq_cpu
        return dropin.init_forward_metadata_replay_cuda_graph(
            bs, rpi, fb.seq_lens, 0, None, mode, spec, host
        )

    return call


def out_graph(
    fb_change: Callable[[SGLangBatch], Any], in_capture: bool = False
) -> Callable[[Any, SGLangBatch], object]:
    return lambda dropin, b: dropin.init_forward_metadata_out_graph(
        fb_change(b), in_capture=in_capture
    )


SG_GRAPH_CASES = [
    graph_case(
        "capture-before-state",
        "init_cuda_graph_state",
        out_graph(lambda b: b.forward_batch, True),
        state=None,
    ),
    graph_case(
        "replay-before-state",
        "init_cuda_graph_state",
        out_graph(lambda b: b.forward_batch),
        state=None,
    ),
    graph_case("legacy-replay-before-state", "init_cuda_graph_state", legacy_replay(2), state=None),
    graph_case(
        "state-zero-batch", "max_batch", lambda d, b: d.init_cuda_graph_state(0, 0), state=None
    ),
    graph_case(
        "state-batch-str", "max_batch", lambda d, b: d.init_cuda_graph_state("4", 4), state=None
    ),
    graph_case(
        "state-zero-tokens", "max_tokens", lambda d, b: d.init_cuda_graph_state(4, 0), state=None
    ),
    graph_case(
        "capture-extend",
        "forward_mode",
        out_graph(lambda b: dataclasses.replace(b.forward_batch, forward_mode=M.EXTEND), True),
        UCE,
        match="under CUDA graphs",
    ),
    graph_case(
        "capture-encoder-lens",
        "encoder_lens",
        lambda d, b: d.init_forward_metadata_capture_cuda_graph(
            2,
            2,
            b.forward_batch.req_pool_indices,
            b.forward_batch.seq_lens,
            torch.ones(2),
            M.DECODE,
            None,
        ),
        UCE,
    ),
    graph_case(
        "capture-tokens-per-row",
        "num_tokens",
        out_graph(
            lambda b: dataclasses.replace(
                b.forward_batch, out_cache_loc=torch.zeros(3, dtype=torch.int64)
            ),
            True,
        ),
    ),
    graph_case(
        "capture-draft-decode",
        "spec_info",
        out_graph(lambda b: dataclasses.replace(b.forward_batch, spec_info=VerifyInput(2)), True),
        UCE,
        match="EAGLE draft decode",
    ),
    graph_case(
        "capture-verify-without-spec-info",
        "forward_batch.spec_info",
        out_graph(lambda b: dataclasses.replace(b.forward_batch, spec_info=None), True),
        IME,
        mode=M.TARGET_VERIFY,
    ),
    graph_case(
        "replay-uncaptured-bs",
        "bs",
        out_graph(
            lambda b: dataclasses.replace(
                b.forward_batch,
                batch_size=1,
                req_pool_indices=b.forward_batch.req_pool_indices[:1],
                seq_lens=b.forward_batch.seq_lens[:1],
                seq_lens_cpu=b.forward_batch.seq_lens_cpu[:1],
            )
        ),
    ),
    graph_case("legacy-replay-uncaptured-bs", "bs", legacy_replay(4), state=(4, 4), capture=(2,)),
    graph_case(
        "replay-verify-on-decode-graph",
        "bs",
        legacy_replay(2, mode=M.TARGET_VERIFY, spec=VerifyInput(3)),
    ),
    graph_case(
        "replay-without-host-lens",
        "seq_lens_cpu",
        out_graph(lambda b: dataclasses.replace(b.forward_batch, seq_lens_cpu=None)),
    ),
    graph_case("legacy-replay-without-host-lens", "seq_lens_cpu", legacy_replay(2, seq_cpu=None)),
    graph_case(
        "replay-short-host-lens",
        "seq_lens_cpu",
        legacy_replay(2, seq_cpu=torch.tensor([9])),
        IME,
    ),
    graph_case(
        "replay-row-past-pool",
        "req_pool_indices[1]",
        legacy_replay(2, rows=torch.tensor([1, 999])),
        IME,
    ),
    graph_case(
        "replay-seq-past-context",
        "page_table",
        legacy_replay(2, seq_cpu=torch.tensor([9, 10_000])),
        IME,
    ),
]


# An engine object without an attribute the drop-in reads (a release that renamed it, a thin
# mock): a typed error naming the object and the attribute, never a bare AttributeError.


def without(obj: Any, name: str) -> SimpleNamespace:
    """``namespace(obj)`` less the attribute ``name``, keeping the mock's public methods."""
    copy = namespace(obj)
    delattr(copy, name)
    for attr in dir(type(obj)):
        if not attr.startswith("_") and attr != name and not hasattr(copy, attr):
            setattr(copy, attr, getattr(obj, attr))
    return copy


def runner_without(name: str) -> Callable[[SGLangBatch], Any]:
    return lambda b: without(b.model_runner, name)


def config_without(name: str) -> Callable[[SGLangBatch], Any]:
    return lambda b: dataclasses.replace(
        b.model_runner, model_config=without(b.model_runner.model_config, name)
    )


SG_MISSING_CASES = [
    ctor_case(
        "runner-no-model-config", "model_runner.model_config", runner_without("model_config")
    ),
    ctor_case(
        "runner-no-req-to-token-pool",
        "model_runner.req_to_token_pool",
        runner_without("req_to_token_pool"),
    ),
    ctor_case(
        "runner-no-token-to-kv-pool",
        "model_runner.token_to_kv_pool",
        runner_without("token_to_kv_pool"),
    ),
    ctor_case("runner-no-page-size", "model_runner.page_size", runner_without("page_size")),
    ctor_case("runner-no-device", "model_runner.device", runner_without("device")),
    ctor_case(
        "runner-no-kv-cache-dtype",
        "model_runner.kv_cache_dtype",
        lambda b: without(unloaded(b), "kv_cache_dtype"),
    ),
    ctor_case(
        "config-no-head-dim",
        "model_config.head_dim",
        lambda b: dataclasses.replace(
            unloaded(b), model_config=without(b.model_runner.model_config, "head_dim")
        ),
    ),
    ctor_case("config-no-context-len", "model_config.context_len", config_without("context_len")),
    ctor_case(
        "pool-no-req-to-token",
        "req_to_token_pool.req_to_token",
        lambda b: dataclasses.replace(b.model_runner, req_to_token_pool=SimpleNamespace()),
    ),
    fb_case(
        "no-spec-info",
        "forward_batch.spec_info",
        lambda b: without(b.forward_batch, "spec_info"),
        IIE,
        mode=M.DECODE,
        via="dropin",
    ),
    *(
        fb_case(
            f"no-{name.replace('_', '-')}",
            f"forward_batch.{name}",
            lambda b, name=name: without(b.forward_batch, name),
            IIE,
            mode=mode,
            via=via,
        )
        for name, mode, via in [
            ("forward_mode", M.EXTEND, "dropin"),
            ("batch_size", M.EXTEND, "adapter"),
            ("seq_lens_cpu", M.DECODE, "adapter"),
            ("extend_seq_lens_cpu", M.EXTEND, "adapter"),
            ("req_pool_indices", M.MIXED, "dropin"),
            ("out_cache_loc", M.EXTEND, "adapter"),
            ("spec_info", M.TARGET_VERIFY, "adapter"),
        ]
    ),
    fwd_case(
        "layer-no-tp-q-head-num",
        "layer.tp_q_head_num",
        lambda b: {"layer": without(b.layer, "tp_q_head_num")},
    ),
    fwd_case(
        "layer-no-layer-id", "layer.layer_id", lambda b: {"layer": without(b.layer, "layer_id")}
    ),
    fwd_case("layer-no-scaling", "layer.scaling", lambda b: {"layer": without(b.layer, "scaling")}),
    fwd_case(
        "idle-layer-no-v-head-dim",
        "layer.v_head_dim",
        lambda b: {
            "layer": without(b.layer, "v_head_dim"),
            "forward_batch": dataclasses.replace(b.forward_batch, forward_mode=M.IDLE),
        },
        init=False,
    ),
    fwd_case(
        "batch-no-forward-mode",
        "forward_batch.forward_mode",
        lambda b: {"forward_batch": without(b.forward_batch, "forward_mode")},
    ),
    graph_case(
        "out-graph-no-seq-lens-cpu",
        "forward_batch.seq_lens_cpu",
        out_graph(lambda b: without(b.forward_batch, "seq_lens_cpu")),
    ),
    graph_case(
        "out-graph-capture-no-spec-info",
        "forward_batch.spec_info",
        out_graph(lambda b: without(b.forward_batch, "spec_info"), True),
    ),
]

SGLANG_CASES = [
    *SG_BATCH_CASES,
    *SG_FORWARD_CASES,
    *SG_FP8_CASES,
    *SG_CONSTRUCT_CASES,
    *SG_ADAPTER_CASES,
    *SG_GRAPH_CASES,
    *SG_MISSING_CASES,
]


# =================================== vLLM ==========================================================

HQ, HKV, D = 4, 2, 32
V_SPEC = BatchSpec((1, 3, 2), (12, 3, 40))
RefVLLM = type("MatrixVLLMBackend", (AttnSDKAttentionBackend,), {"attnsdk_backend": "reference"})


def v_batch(**kwargs: Any) -> VLLMMockBatch:
    return mock_vllm_batch(V_SPEC, num_heads=HQ, num_kv_heads=HKV, head_size=D, seed=6, **kwargs)


def v_builder(backend: type = RefVLLM) -> Any:
    return backend.get_builder_cls()(None, ["layers.0.attn"], None, torch.device("cpu"))


def v_impl(backend: type = RefVLLM, **kwargs: Any) -> Any:
    args: dict[str, Any] = {"num_heads": HQ, "head_size": D, "scale": D**-0.5, "num_kv_heads": HKV}
    return backend.get_impl_cls()(**{**args, **kwargs})


def cm_with(**changes: Any) -> Callable[[Any], Any]:
    return lambda cm: dataclasses.replace(cm, **changes)


def cm_case(
    name: str,
    field: str,
    change: Callable[[Any], Any],
    error: Err = IME,
    *,
    via: str = "builder",
) -> Case:
    """A malformed ``CommonAttentionMetadata`` through the builder (vLLM's path) or the adapter."""
    cm = change(v_batch().common_attn_metadata)
    if via == "builder":
        builder = v_builder()
        call: Callable[[], object] = lambda: builder.build(0, cm)  # noqa: E731
    else:
        call = lambda: VLLMAdapter().build_metadata(cm)  # noqa: E731
    return Case(f"vllm/{via}-{name}", call, error, field)


def on_device(cm: Any, **changes: Any) -> Any:
    """Device tensors on the "meta" device (a stand-in GPU whose values cannot be read)."""
    moved = {
        name: getattr(cm, name).to("meta")
        for name in ("query_start_loc", "seq_lens", "block_table_tensor", "slot_mapping")
    }
    return dataclasses.replace(cm, **{**moved, **changes})


def grow(cm: Any, name: str, extra: int) -> Any:
    t = getattr(cm, name)
    return dataclasses.replace(cm, **{name: torch.cat([t, t[-1:].expand(extra)])})


V_METADATA_CASES = [
    cm_case(
        "block-table-fewer-rows",
        "block_table_tensor",
        lambda cm: cm_with(block_table_tensor=cm.block_table_tensor[:2])(cm),
    ),
    cm_case(
        "block-table-float",
        "block_table_tensor",
        lambda cm: cm_with(block_table_tensor=cm.block_table_tensor.float())(cm),
    ),
    cm_case("block-table-none", "block_table_tensor", cm_with(block_table_tensor=None)),
    cm_case(
        "block-table-3d",
        "block_table_tensor",
        lambda cm: cm_with(block_table_tensor=cm.block_table_tensor[None])(cm),
    ),
    cm_case("num-reqs-past-query-start-loc", "query_start_loc_cpu", cm_with(num_reqs=4)),
    cm_case(
        "num-reqs-past-seq-lens",
        "seq_lens",
        lambda cm: cm_with(num_reqs=4)(grow(cm, "query_start_loc_cpu", 1)),
    ),
    cm_case("num-reqs-float", "num_reqs", cm_with(num_reqs=3.0)),
    cm_case("num-reqs-bool", "num_reqs", cm_with(num_reqs=True)),
    cm_case("num-reqs-negative", "num_reqs", cm_with(num_reqs=-1)),
    cm_case("num-reqs-str", "num_reqs", cm_with(num_reqs="3")),
    cm_case("num-actual-tokens-below-requests", "num_actual_tokens", cm_with(num_actual_tokens=2)),
    cm_case("num-actual-tokens-past-slots", "num_actual_tokens", cm_with(num_actual_tokens=99)),
    cm_case("num-actual-tokens-str", "num_actual_tokens", cm_with(num_actual_tokens="6")),
    cm_case("num-actual-tokens-negative", "num_actual_tokens", cm_with(num_actual_tokens=-6)),
    cm_case("max-query-len-none", "max_query_len", cm_with(max_query_len=None)),
    cm_case("max-query-len-too-small", "max_query_len", cm_with(max_query_len=1)),
    cm_case("max-seq-len-negative", "max_seq_len", cm_with(max_seq_len=-1)),
    cm_case("max-seq-len-too-small", "max_seq_len", cm_with(max_seq_len=12)),
    cm_case(
        "device-seq-lens-without-host-copy",
        "seq_lens_cpu_upper_bound",
        lambda cm: on_device(cm, seq_lens_cpu_upper_bound=None),
    ),
    cm_case(
        "host-copy-on-device",
        "seq_lens_cpu_upper_bound.device",
        lambda cm: on_device(cm, seq_lens_cpu_upper_bound=cm.seq_lens_cpu_upper_bound.to("meta")),
    ),
    cm_case(
        "host-copy-short",
        "seq_lens_cpu_upper_bound",
        lambda cm: on_device(cm, seq_lens_cpu_upper_bound=cm.seq_lens_cpu_upper_bound[:2]),
    ),
    cm_case(
        "host-copy-float",
        "seq_lens_cpu_upper_bound",
        lambda cm: on_device(cm, seq_lens_cpu_upper_bound=cm.seq_lens_cpu_upper_bound.float()),
    ),
    cm_case(
        "host-copy-str",
        "seq_lens_cpu_upper_bound",
        lambda cm: on_device(cm, seq_lens_cpu_upper_bound="12,3,40"),
    ),
    cm_case(
        "query-start-loc-cpu-on-device",
        "query_start_loc_cpu.device",
        lambda cm: cm_with(query_start_loc_cpu=cm.query_start_loc_cpu.to("meta"))(cm),
    ),
    cm_case("query-start-loc-none", "query_start_loc", cm_with(query_start_loc=None)),
    cm_case(
        "query-start-loc-float",
        "query_start_loc",
        lambda cm: cm_with(query_start_loc=cm.query_start_loc.float())(cm),
    ),
    cm_case("slot-mapping-none", "slot_mapping", cm_with(slot_mapping=None)),
    cm_case(
        "slot-mapping-float",
        "slot_mapping",
        lambda cm: cm_with(slot_mapping=cm.slot_mapping.float())(cm),
    ),
    cm_case("seq-lens-short", "seq_lens", lambda cm: cm_with(seq_lens=cm.seq_lens[:2])(cm)),
    cm_case(
        "seq-lens-float",
        "seq_lens",
        lambda cm: cm_with(seq_lens=cm.seq_lens.float(), seq_lens_cpu_upper_bound=None)(cm),
    ),
    cm_case("causal-not-uniform", "causal", cm_with(causal=torch.tensor([True, False, True]))),
    cm_case(
        "causal-on-device", "causal", cm_with(causal=torch.ones(3, dtype=torch.bool, device="meta"))
    ),
    cm_case("causal-none", "causal", cm_with(causal=None)),
    cm_case("causal-word", "causal", cm_with(causal="no")),
    cm_case("causal-int", "causal", cm_with(causal=0)),
    cm_case(
        "block-table-fewer-rows",
        "block_table_tensor",
        lambda cm: cm_with(block_table_tensor=cm.block_table_tensor[:1])(cm),
        via="adapter",
    ),
    cm_case(
        "num-actual-tokens-below-requests",
        "num_actual_tokens",
        cm_with(num_actual_tokens=5),
        via="adapter",
    ),
    cm_case(
        "host-copy-short",
        "seq_lens_cpu_upper_bound",
        lambda cm: on_device(cm, seq_lens_cpu_upper_bound=cm.seq_lens_cpu_upper_bound[:1]),
        via="adapter",
    ),
]


def construct_case(
    name: str, field: str, error: Err = IIE, backend: type = RefVLLM, **kwargs: Any
) -> Case:
    return Case(f"vllm/impl-{name}", lambda: v_impl(backend, **kwargs), error, field)


def group_case(
    name: str,
    field: str,
    error: Err = UCE,
    backend: type = RefVLLM,
    *,
    block_size: int = 16,
    **kwargs: Any,
) -> Case:
    """A layer the backend cannot serve, refused when vLLM builds its group's builder at
    start-up (the impl alone does not ask the backend), naming the layer."""
    impl = v_impl(backend, **kwargs)
    config = mock_vllm_config({"model.layers.0.attn": impl})
    spec = FullAttentionSpec(
        block_size=block_size, num_kv_heads=HKV, head_size=impl.head_size, dtype=torch.float32
    )
    build = backend.get_builder_cls()
    return Case(
        f"vllm/group-{name}",
        lambda: build(spec, ["model.layers.0.attn"], config, torch.device("cpu")),
        error,
        field,
    )


def backend_class(spec: Any, **attrs: Any) -> type:
    return type("MatrixVLLMBackend", (AttnSDKAttentionBackend,), {"attnsdk_backend": spec, **attrs})


DCP = backend_class("reference")
DCP.impl_cls = type("DCPImpl", (DCP.impl_cls,), {"dcp_world_size": 2})

V_CONSTRUCT_CASES = [
    construct_case("alibi", "alibi_slopes", UCE, alibi_slopes=[0.5] * HQ),
    construct_case("attn-type-unknown", "attn_type", UCE, attn_type="mamba"),
    construct_case("attn-type-int", "attn_type", UCE, attn_type=5),
    construct_case("extra-flex-block-size", "flex_block_size", UCE, flex_block_size=64),
    construct_case("sinks-list", "sinks", sinks=[0.0] * HQ),
    construct_case("sinks-0d", "sinks.shape", sinks=torch.tensor(0.0)),
    construct_case("sinks-2d", "sinks.shape", sinks=torch.zeros(HQ, 1)),
    construct_case("scale-word", "scale", scale="x"),
    construct_case("scale-none", "scale", scale=None),
    construct_case("scale-zero", "scale", scale=0.0),
    construct_case("scale-nan", "scale", scale=float("nan")),
    construct_case("heads-not-dividing", "LayerSpec.num_heads", num_heads=3),
    construct_case("head-size-zero", "LayerSpec.head_dim", head_size=0),
    group_case("head-size-past-backend", "model.layers.0.attn.head_dim", head_size=2048, scale=0.1),
    group_case(
        "block-size-on-flex",
        "model.layers.0.attn.page_size",
        backend=backend_class("flex"),
        block_size=4,
        head_size=64,
    ),
    group_case(
        "encoder-on-flex",
        "model.layers.0.attn.ragged",
        backend=backend_class("flex"),
        head_size=64,
        attn_type="encoder_only",
    ),
    construct_case("window-zero", "LayerSpec.sliding_window", sliding_window=0),
    construct_case("soft-cap-negative", "LayerSpec.softcap", logits_soft_cap=-1.0),
    construct_case("kv-cache-dtype-unknown", "kv_cache_dtype", kv_cache_dtype="int4"),
    construct_case("kv-cache-dtype-fp4", "kv_cache_dtype", kv_cache_dtype="nvfp4"),
    construct_case("dcp", "decode_context_parallel_size", UCE, DCP),
    Case("vllm/impl-backend-unknown", lambda: v_impl(backend_class("nope")), UCE, "backend"),
    Case("vllm/impl-backend-int", lambda: v_impl(backend_class(123)), IIE, "backend"),
    Case("vllm/builder-backend-unknown", lambda: v_builder(backend_class("nope")), UCE, "backend"),
    Case("vllm/builder-backend-int", lambda: v_builder(backend_class(3.5)), IIE, "backend"),
]


def v_forward_case(
    name: str,
    field: str,
    change: Callable[[VLLMMockBatch], dict[str, Any]] = lambda b: {},
    error: Err = IIE,
    *,
    cm: Callable[[Any], Any] | None = None,
    kv_cache_dtype: str = "auto",
    impl_kwargs: dict[str, Any] | None = None,
    method: str = "forward",
) -> Case:
    """One layer's forward (or split KV update) after a valid build; vLLM's cache is watched."""
    fp8 = kv_cache_dtype != "auto"
    batch = v_batch(kv_cache_dtype=kv_cache_dtype, dtype=torch.bfloat16 if fp8 else torch.float32)
    common = batch.common_attn_metadata if cm is None else cm(batch.common_attn_metadata)
    impl = v_impl(kv_cache_dtype=kv_cache_dtype, **(impl_kwargs or {}))
    rows = batch.query.shape[0]
    if method == "forward":
        args: dict[str, Any] = {
            "layer": batch.layer,
            "query": batch.query,
            "key": batch.key,
            "value": batch.value,
            "kv_cache": batch.kv_cache,
            "attn_metadata": v_builder().build(0, common),
            "output": torch.zeros(rows, HQ * D, dtype=batch.query.dtype),
        }
    else:
        args = {
            "layer": batch.layer,
            "key": batch.key,
            "value": batch.value,
            "kv_cache": batch.kv_cache,
            "slot_mapping": common.slot_mapping,
        }
    args.update(change(batch))
    watch = (batch.kv_cache,) if batch.kv_cache.device.type != "meta" else ()
    fn = getattr(impl, method)
    return Case(f"vllm/{method}-{name}", lambda: fn(**args), error, field, watch)


def entry(t: torch.Tensor, index: tuple[int, ...], value: int) -> torch.Tensor:
    out = t.clone()
    out[index] = value
    return out


NUM_BLOCKS = v_batch().kv_cache.shape[0]


def packed_cache(b: VLLMMockBatch, heads: int = HKV, stride2: bool = False) -> torch.Tensor:
    n, _, p, _ = b.kv_cache.shape
    if stride2:
        return torch.zeros(n, heads, p, 4 * D)[..., ::2]
    return torch.zeros(n, heads, p, 2 * D)


V_FORWARD_CASES = [
    v_forward_case(
        "metadata-is-the-plan",
        "attn_metadata",
        lambda b: {"attn_metadata": v_builder().build(0, b.common_attn_metadata).plan},
    ),
    v_forward_case(
        "metadata-is-a-dict",
        "attn_metadata",
        lambda b: {
            "attn_metadata": {"layers.0.attn": v_builder().build(0, b.common_attn_metadata)}
        },
    ),
    v_forward_case("output-none", "output", lambda b: {"output": None}),
    v_forward_case("output-list", "output", lambda b: {"output": [0.0]}),
    v_forward_case("output-scale", "output_scale", lambda b: {"output_scale": torch.ones(())}, UCE),
    v_forward_case(
        "output-block-scale",
        "output_block_scale",
        lambda b: {"output_block_scale": torch.ones(1)},
        UCE,
    ),
    v_forward_case(
        "output-wrong-shape",
        "output.shape",
        lambda b: {"output": torch.zeros(b.query.shape[0], HQ, D + 1)},
    ),
    v_forward_case(
        "query-wrong-heads", "query.shape", lambda b: {"query": torch.zeros(b.query.shape[0], 3, D)}
    ),
    v_forward_case("key-wrong-width", "key.shape", lambda b: {"key": b.key.flatten(1)[:, :-1]}),
    v_forward_case(
        "value-wrong-heads",
        "value.shape",
        lambda b: {"value": torch.zeros(b.value.shape[0], HKV + 1, D)},
    ),
    v_forward_case("key-without-value", "key/value", lambda b: {"value": None}),
    v_forward_case("query-fewer-rows", "q.shape[0]", lambda b: {"query": b.query[:2]}),
    v_forward_case("kv-cache-list", "kv_cache", lambda b: {"kv_cache": [0.0]}),
    v_forward_case("kv-cache-3d", "kv_cache.shape", lambda b: {"kv_cache": b.kv_cache[0]}),
    v_forward_case(
        "kv-cache-other-heads",
        "kv_cache.shape",
        lambda b: {"kv_cache": packed_cache(b, heads=HKV + 1)},
    ),
    v_forward_case(
        "kv-cache-two-blocks-ambiguous",
        "kv_cache.shape",
        lambda b: {"kv_cache": torch.zeros(2, 2, 16, HKV, D)},
    ),
    v_forward_case(
        "kv-cache-physical-order",
        "kv_cache.shape",
        lambda b: {"kv_cache": b.kv_cache.transpose(1, 2)},
    ),
    v_forward_case(
        "kv-cache-strided-head-dim",
        "kv_cache.stride()",
        lambda b: {"kv_cache": packed_cache(b, stride2=True)},
    ),
    v_forward_case(
        "kv-cache-int32",
        "KVCacheLayout.kv_dtype",
        lambda b: {"kv_cache": b.kv_cache.to(torch.int32)},
    ),
    v_forward_case(
        "kv-cache-fp16-for-fp32-model",
        "KVCacheLayout.kv_dtype",
        lambda b: {"kv_cache": b.kv_cache.half()},
    ),
    v_forward_case(
        "kv-cache-uint8-without-fp8-dtype",
        "kv_cache_dtype",
        lambda b: {"kv_cache": b.kv_cache.to(torch.uint8)},
    ),
    v_forward_case(
        "fp8-name-fp16-tensor",
        "kv_cache.dtype",
        lambda b: {"kv_cache": b.kv_cache.view(E4M3).to(torch.float16)},
        kv_cache_dtype="fp8",
    ),
    v_forward_case(
        "fp8-without-layer-scales",
        "layer._k_scale / layer._v_scale",
        lambda b: {"layer": SimpleNamespace()},
        kv_cache_dtype="fp8",
    ),
    v_forward_case(
        "fp8-scales-floats",
        "layer._k_scale / layer._v_scale",
        lambda b: {"layer": SimpleNamespace(_k_scale=1.0, _v_scale=1.0)},
        kv_cache_dtype="fp8",
    ),
    v_forward_case(
        "fp8-k-scale-wrong-size",
        "k_scale",
        lambda b: {"layer": SimpleNamespace(_k_scale=torch.ones(3), _v_scale=torch.ones(()))},
        kv_cache_dtype="fp8_e4m3",
    ),
    v_forward_case(
        "fp8-v-scale-on-device",
        "v_scale.device",
        lambda b: {
            "layer": SimpleNamespace(
                _k_scale=torch.ones(()), _v_scale=torch.ones((), device="meta")
            )
        },
        kv_cache_dtype="fp8",
    ),
    v_forward_case(
        "e5m2-name-e4m3-tensor",
        "kv_cache.dtype",
        lambda b: {"kv_cache": b.kv_cache.view(E4M3)},
        kv_cache_dtype="fp8_e5m2",
    ),
    v_forward_case(
        "encoder-without-key",
        "key/value",
        lambda b: {"key": None, "value": None, "kv_cache": torch.empty(0)},
        impl_kwargs={"attn_type": "encoder_only"},
    ),
    # What reaches vLLM's cache: checked before anything is written.
    v_forward_case(
        "slot-past-cache",
        "slot_mapping[1]",
        cm=lambda cm: cm_with(slot_mapping=entry(cm.slot_mapping, (1,), NUM_BLOCKS * 16))(cm),
        error=IME,
    ),
    v_forward_case(
        "block-past-cache",
        "page_table[2, 2]",
        cm=lambda cm: cm_with(block_table_tensor=entry(cm.block_table_tensor, (2, 2), NUM_BLOCKS))(
            cm
        ),
        error=IME,
    ),
    v_forward_case(
        "block-negative",
        "page_table[0, 0]",
        cm=lambda cm: cm_with(block_table_tensor=entry(cm.block_table_tensor, (0, 0), -1))(cm),
        error=IME,
    ),
    v_forward_case(
        "split-update-slot-past-cache",
        "slot_mapping[4]",
        lambda b: {
            "slot_mapping": entry(b.common_attn_metadata.slot_mapping, (4,), NUM_BLOCKS * 16 + 3)
        },
        IME,
        method="do_kv_cache_update",
    ),
    v_forward_case(
        "split-update-slots-float",
        "slot_mapping",
        lambda b: {"slot_mapping": b.common_attn_metadata.slot_mapping.float()},
        IME,
        method="do_kv_cache_update",
    ),
    v_forward_case(
        "split-update-more-slots-than-keys",
        "k.shape",
        lambda b: {"key": b.key[:2], "value": b.value[:2]},
        method="do_kv_cache_update",
    ),
    v_forward_case(
        "split-update-key-wrong-width",
        "key.shape",
        lambda b: {"key": b.key[:, :, :-1]},
        method="do_kv_cache_update",
    ),
]


def kv_cache_case(
    name: str, field: str, tensor: Callable[[VLLMMockBatch], Any], **kwargs: Any
) -> Case:
    batch = v_batch()
    t = tensor(batch)
    return Case(
        f"vllm/kv_cache-{name}", lambda: VLLMAdapter().kv_cache(t, HKV, D, **kwargs), IIE, field
    )


V_KV_CACHE_CASES = [
    kv_cache_case("none", "kv_cache", lambda b: None),
    kv_cache_case("layout-bogus", "layout", lambda b: b.kv_cache, layout="bogus"),
    kv_cache_case("layout-mismatch", "kv_cache.shape", lambda b: b.kv_cache, layout="KV_BLOCKS"),
    kv_cache_case(
        "kv-blocks-strided-head-dim",
        "kv_cache.stride()",
        lambda b: torch.zeros(2, 5, 16, HKV, 2 * D)[..., ::2],
        layout="KV_BLOCKS",
    ),
    kv_cache_case(
        "uint8-dtype-int",
        "kv_cache_dtype",
        lambda b: b.kv_cache.to(torch.uint8),
        kv_cache_dtype="int8",
    ),
    kv_cache_case(
        "fp8-without-compute-dtype",
        "dtype",
        lambda b: make_kv_cache(
            torch.zeros(3, 16, HKV, D, dtype=E4M3), torch.zeros(3, 16, HKV, D, dtype=E4M3)
        ),
        kv_cache_dtype="fp8",
    ),
]

VLLM_CASES = [*V_METADATA_CASES, *V_CONSTRUCT_CASES, *V_FORWARD_CASES, *V_KV_CACHE_CASES]


@pytest.mark.parametrize("case", params([*SGLANG_CASES, *VLLM_CASES]))
def test_refused(case: Case) -> None:
    assert_refused(case)


# --- baselines: the unchanged calls are valid -------------------------------------------------


@pytest.mark.parametrize("mode", list(SG_SPECS), ids=[m.name for m in SG_SPECS])
def test_sglang_baseline(mode: ForwardMode) -> None:
    batch = sg_batch(mode)
    adapter = sg_adapter(batch)
    adapter.validate(batch.forward_batch, adapter.kv_cache(*sg_buffers(batch)))
    dropin = SGLangAttentionBackend(batch.model_runner, "reference")
    dropin.init_forward_metadata(batch.forward_batch)
    dropin.forward(batch.q, batch.k, batch.v, batch.layer, batch.forward_batch)


def test_sglang_graph_baseline() -> None:
    for mode in (M.DECODE, M.TARGET_VERIFY):
        batch = sg_batch(mode)
        dropin = SGLangAttentionBackend(batch.model_runner, "reference")
        dropin.init_cuda_graph_state(4, 12)
        fb = batch.forward_batch
        per_row = 1 if fb.spec_info is None else fb.spec_info.draft_token_num
        rpi, seq = torch.zeros(4, dtype=torch.int64), torch.ones(4, dtype=torch.int64)
        dropin.init_forward_metadata_capture_cuda_graph(
            2, 2 * per_row, rpi, seq, None, mode, fb.spec_info
        )
        dropin.init_forward_metadata_replay_cuda_graph(
            2, fb.req_pool_indices, fb.seq_lens, 0, None, mode, fb.spec_info, fb.seq_lens_cpu
        )
        dropin.init_forward_metadata_out_graph(fb)


def test_vllm_baseline() -> None:
    for kv_cache_dtype in ("auto", "fp8"):
        fp8 = kv_cache_dtype != "auto"
        batch = v_batch(
            kv_cache_dtype=kv_cache_dtype, dtype=torch.bfloat16 if fp8 else torch.float32
        )
        cm = batch.common_attn_metadata
        VLLMAdapter().build_metadata(on_device(cm))
        impl = v_impl(kv_cache_dtype=kv_cache_dtype, sinks=torch.zeros(HQ))
        output = torch.zeros(batch.query.shape[0], HQ * D, dtype=batch.query.dtype)
        impl.forward(
            batch.layer,
            batch.query,
            batch.key,
            batch.value,
            batch.kv_cache,
            v_builder().build(0, cm),
            output,
        )
        impl.do_kv_cache_update(
            batch.layer, batch.key, batch.value, batch.kv_cache, cm.slot_mapping
        )
    VLLMAdapter().kv_cache(torch.zeros(2, 5, 16, HKV, D), HKV, D, layout="KV_BLOCKS")
