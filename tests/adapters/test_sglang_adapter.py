"""``SGLangAdapter``: ForwardBatch → AttentionMetadata field by field, KV views, invariants, hooks."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from sglang_dense import expected_step

from attnsdk import (
    InvalidInputError,
    InvalidMetadataError,
    LayerSpec,
    UnsupportedConfigError,
    tree_mask_from_parents,
)
from attnsdk.adapters import sglang
from attnsdk.adapters.sglang import SGLangAdapter, SGLangAttentionBackend, StepKind, step_kind
from attnsdk.adapters.sglang.testing import (
    AttentionType,
    ForwardMode,
    MockRadixAttention,
    VerifyInput,
    make_sglang_batch,
)
from attnsdk.testing import BatchSpec

M = ForwardMode
LAYER = LayerSpec(num_heads=4, num_kv_heads=2, head_dim=16)


def adapter_of(batch):
    runner = batch.model_runner
    return SGLangAdapter(
        req_to_token=runner.req_to_token_pool.req_to_token, page_size=runner.page_size
    )


def cache_of(batch, adapter):
    pool = batch.model_runner.token_to_kv_pool
    return adapter.kv_cache(pool.get_key_buffer(0), pool.get_value_buffer(0))


def test_public_names_are_pinned_and_importable():
    # ruff (RUF022) keeps the order; this pins the set.
    assert set(sglang.__all__) == {
        "SGLANG_VERSIONS",
        "Lengths",
        "SGLangAdapter",
        "SGLangAttentionBackend",
        "StepKind",
        "step_kind",
    }
    for name in sglang.__all__:
        assert getattr(sglang, name) is not None


@pytest.mark.parametrize(
    ("mode", "kind"),
    [
        (M.DECODE, StepKind.DECODE),
        (M.IDLE, StepKind.DECODE),
        (M.EXTEND, StepKind.EXTEND),
        (M.MIXED, StepKind.EXTEND),
        (M.DRAFT_EXTEND_V2, StepKind.EXTEND),
        (M.TARGET_VERIFY, StepKind.TARGET_VERIFY),
    ],
)
def test_step_kind_uses_sglang_predicates(mode, kind):
    assert step_kind(mode) is kind


@pytest.mark.parametrize("mode", [M.DLLM_EXTEND, M.PREBUILT, M.SPLIT_PREFILL])
def test_modes_with_other_semantics_are_refused(mode):
    with pytest.raises(UnsupportedConfigError, match="forward_mode: expected"):
        step_kind(mode)


def test_unknown_mode_names_the_field():
    class SplitPrefill:  # a mode from another SGLang version: no predicate matches
        def is_decode(self):
            return False

    with pytest.raises(UnsupportedConfigError, match="forward_mode"):
        step_kind(SplitPrefill())


@pytest.mark.parametrize("page_size", [1, 16, 32])
def test_decode_fields(page_size):
    batch = make_sglang_batch(
        BatchSpec((1, 1, 1), (15, 16, 17)), LAYER, M.DECODE, page_size=page_size
    )
    fb = batch.forward_batch
    meta = adapter_of(batch).build_metadata(fb)
    assert meta.query_start_loc.tolist() == [0, 1, 2, 3]
    assert meta.seq_lens.tolist() == [15, 16, 17]
    assert meta.seq_lens_cpu.tolist() == [15, 16, 17]
    assert meta.slot_mapping.tolist() == fb.out_cache_loc.tolist()
    assert (meta.max_query_len, meta.max_seq_len, meta.num_tokens) == (1, 17, 3)
    r2t = batch.model_runner.req_to_token_pool.req_to_token
    width = -(-17 // page_size)
    assert meta.page_table.shape == (3, width)
    for b, row in enumerate(fb.req_pool_indices.tolist()):
        expected = [int(r2t[row, i * page_size]) // page_size for i in range(width)]
        assert meta.page_table[b].tolist() == expected
    assert meta.page_table.dtype == torch.int32
    assert meta.slot_mapping.dtype == torch.int64


def test_extend_fields_use_extend_seq_lens():
    spec = BatchSpec((15, 8, 1), (15, 16, 17))
    batch = make_sglang_batch(spec, LAYER, M.EXTEND, page_size=16)
    meta = adapter_of(batch).build_metadata(batch.forward_batch)
    assert meta.query_start_loc_cpu.tolist() == [0, 15, 23, 24]
    assert meta.query_start_loc.tolist() == [0, 15, 23, 24]
    assert meta.seq_lens.tolist() == [15, 16, 17]
    assert meta.max_query_len == 15


def test_target_verify_appends_drafts_to_seq_lens():
    spec = BatchSpec((3, 3), (17, 33))
    batch = make_sglang_batch(spec, LAYER, M.TARGET_VERIFY, page_size=16)
    fb = batch.forward_batch
    assert fb.seq_lens.tolist() == [14, 30]  # SGLang's seq_lens exclude the drafts
    meta = adapter_of(batch).build_metadata(fb)
    assert meta.seq_lens.tolist() == [17, 33]
    assert meta.seq_lens_cpu.tolist() == [17, 33]
    assert meta.query_start_loc.tolist() == [0, 3, 6]
    assert meta.page_table.shape[1] == 3


def test_idle_is_an_empty_batch():
    batch = make_sglang_batch(BatchSpec((), ()), LAYER, M.IDLE, page_size=16)
    meta = adapter_of(batch).build_metadata(batch.forward_batch)
    assert (meta.num_seqs, meta.num_tokens, meta.max_seq_len) == (0, 0, 0)
    assert meta.query_start_loc.tolist() == [0]


@pytest.mark.parametrize("pages", ["contiguous", "shuffled", "interleaved"])
@pytest.mark.parametrize("page_size", [1, 16, 32])
def test_valid_batches_pass_validate(pages, page_size):
    spec = BatchSpec((1, 15, 2, 1), (16, 15, 17, 33))
    batch = make_sglang_batch(spec, LAYER, M.MIXED, page_size=page_size, pages=pages)
    adapter = adapter_of(batch)
    meta = adapter.validate(batch.forward_batch, cache_of(batch, adapter))
    assert meta.num_tokens == 19


def test_slot_outside_its_page_fails_core_validate():
    # Prefix 15 + extend 2 at page size 16: token 16 opens a new page at offset 0. Move it.
    batch = make_sglang_batch(BatchSpec((2,), (17,)), LAYER, M.EXTEND, page_size=16)
    fb = batch.forward_batch
    bad_loc = fb.out_cache_loc.clone()
    bad_loc[1] += 1  # offset 1 of its page: not page-contiguous
    bad = dataclasses.replace(fb, out_cache_loc=bad_loc)
    adapter = adapter_of(batch)
    meta = adapter.build_metadata(bad)
    with pytest.raises(InvalidMetadataError, match=r"slot_mapping\[1\]") as err:
        meta.validate(cache_of(batch, adapter))
    assert err.value.found == int(bad_loc[1])


def test_noncontiguous_cached_prefix_fails_adapter_validate():
    batch = make_sglang_batch(BatchSpec((1,), (20,)), LAYER, M.DECODE, page_size=16, spare_pages=4)
    fb = batch.forward_batch
    r2t = batch.model_runner.req_to_token_pool.req_to_token
    row = int(fb.req_pool_indices[0])
    r2t[row, 5] += 16  # position 5 now lives on another page than position 0
    adapter = adapter_of(batch)
    with pytest.raises(InvalidMetadataError, match=rf"req_to_token\[{row}, 5\]"):
        adapter.validate(fb, cache_of(batch, adapter))


def test_two_requests_writing_one_page_fail_adapter_validate():
    # Request A extends positions 16..31 of its page x; request B's first token is put at
    # offset 0 of page x too. Every slot agrees with its own row's page table and no slot is
    # written twice, so only the page-ownership check can catch it.
    batch = make_sglang_batch(BatchSpec((16, 1), (32, 1)), LAYER, M.EXTEND, page_size=32)
    fb = batch.forward_batch
    r2t = batch.model_runner.req_to_token_pool.req_to_token
    a, b = fb.req_pool_indices.tolist()
    r2t[b, 0] = r2t[a, 0]
    loc = fb.out_cache_loc.clone()
    loc[16] = r2t[b, 0]
    bad = dataclasses.replace(fb, out_cache_loc=loc)
    adapter = adapter_of(batch)
    with pytest.raises(InvalidMetadataError, match="written by one request"):
        adapter.validate(bad, cache_of(batch, adapter))


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"seq_lens_cpu": None}, "seq_lens_cpu"),
        ({"extend_seq_lens_cpu": None}, "extend_seq_lens_cpu"),
        ({"extend_prefix_lens_cpu": [0, 0]}, r"extend_prefix_lens_cpu\[1\]"),
        ({"out_cache_loc": torch.zeros(3, dtype=torch.int64)}, "out_cache_loc"),
        ({"seq_lens_cpu": torch.tensor([4, 5])}, r"seq_lens\[0\]"),
        ({"seq_lens": torch.tensor([4, 5, 6])}, "seq_lens"),
    ],
)
def test_malformed_batches_name_the_field(change, field):
    batch = make_sglang_batch(BatchSpec((5, 2), (5, 7)), LAYER, M.EXTEND, page_size=16)
    bad = dataclasses.replace(batch.forward_batch, **change)
    with pytest.raises(InvalidMetadataError, match=field):
        adapter_of(batch).build_metadata(bad)


def test_tree_verify_maps_custom_mask_to_the_drafts_tree_mask():
    # Row 0: drafts 1 and 2 branch off 0; row 1: a chain. SGLang's custom_mask per row is
    # D x (prefix + D); the metadata keeps the drafts' columns.
    tree = tree_mask_from_parents([[-1, 0, 0], [-1, 0, 1]])
    spec = BatchSpec((3, 3), (9, 20))
    batch = make_sglang_batch(spec, LAYER, M.TARGET_VERIFY, page_size=16, tree_mask=tree)
    custom = batch.forward_batch.spec_info.custom_mask
    assert custom.numel() == 3 * 9 + 3 * 20  # D x (prefix + D) per row, prefixes 6 and 17
    meta = adapter_of(batch).build_metadata(batch.forward_batch)
    assert torch.equal(meta.tree_mask, tree)
    meta.validate(16, reserved_page=None)  # every draft sees itself, page ids in place
    chain = make_sglang_batch(spec, LAYER, M.TARGET_VERIFY, page_size=16)
    assert adapter_of(chain).build_metadata(chain.forward_batch).tree_mask is None


def test_draft_decode_is_refused():
    dec = make_sglang_batch(BatchSpec((1,), (9,)), LAYER, M.DECODE, page_size=16)
    draft = dataclasses.replace(dec.forward_batch, spec_info=VerifyInput(2))
    with pytest.raises(UnsupportedConfigError, match="spec_info"):
        adapter_of(dec).build_metadata(draft)


def test_page_table_wider_than_req_to_token_raises():
    batch = make_sglang_batch(BatchSpec((1,), (40,)), LAYER, M.DECODE, page_size=16)
    narrow = SGLangAdapter(
        req_to_token=batch.model_runner.req_to_token_pool.req_to_token[:, :16], page_size=16
    )
    with pytest.raises(InvalidMetadataError, match="page_table"):
        narrow.build_metadata(batch.forward_batch)


def test_kv_cache_is_a_view_of_sglang_buffers():
    batch = make_sglang_batch(BatchSpec((1,), (20,)), LAYER, M.DECODE, page_size=16)
    adapter = adapter_of(batch)
    k_buf = batch.model_runner.token_to_kv_pool.get_key_buffer(0)
    cache = cache_of(batch, adapter)
    assert cache.k.shape == (k_buf.shape[0] // 16, 16, 2, 16)
    assert cache.k.data_ptr() == k_buf.data_ptr()
    cache.k[3, 5] = 7.0  # page 3, offset 5 is slot 53 of SGLang's buffer
    assert torch.all(k_buf[3 * 16 + 5] == 7.0)


def test_kv_cache_rejects_partial_pages_and_needs_dtype_for_fp8():
    adapter = SGLangAdapter(req_to_token=torch.zeros(2, 64, dtype=torch.int32), page_size=16)
    with pytest.raises(InvalidInputError, match=r"k_buffer.shape\[0\]"):
        adapter.kv_cache(torch.zeros(40, 2, 8), torch.zeros(40, 2, 8))
    fp8 = torch.zeros(64, 2, 8, dtype=torch.float8_e4m3fn)
    with pytest.raises(InvalidInputError, match="dtype"):
        adapter.kv_cache(fp8, fp8)
    cache = adapter.kv_cache(fp8, fp8, dtype=torch.bfloat16)
    assert cache.layout.is_quantized
    assert cache.layout.dtype == torch.bfloat16


def test_bad_constructor_arguments():
    with pytest.raises(InvalidInputError, match="page_size"):
        SGLangAdapter(req_to_token=torch.zeros(2, 8, dtype=torch.int32), page_size=0)
    with pytest.raises(InvalidInputError, match="req_to_token"):
        SGLangAdapter(req_to_token=torch.zeros(8, dtype=torch.int32), page_size=1)


@pytest.mark.parametrize(
    ("window", "expected"), [(-1, None), (None, None), (0, 1), (4, 5), (4095, 4096)]
)
def test_layer_spec_window_convention(window, expected):
    layer = radix(4, 2, 16, 16, 0.25, sliding_window_size=window)
    spec = SGLangAdapter.layer_spec(adapter_of_empty(), layer)
    assert spec.sliding_window == expected
    assert (spec.num_heads, spec.num_kv_heads, spec.scale) == (4, 2, 0.25)


def test_layer_spec_maps_logit_cap_and_encoder_only():
    layer = radix(4, 1, 16, 8, 0.25, logit_cap=30.0, attn_type=AttentionType.ENCODER_ONLY)
    spec = adapter_of_empty().layer_spec(layer, has_sinks=True)
    assert (spec.softcap, spec.causal, spec.v_dim, spec.has_sinks) == (30.0, False, 8, True)


def test_decoder_bidirectional_is_non_causal():
    layer = radix(4, 2, 16, 16, 0.25, attn_type=AttentionType.DECODER_BIDIRECTIONAL)
    assert adapter_of_empty().layer_spec(layer).causal is False


def radix(hq, hkv, d, dv, scaling, **kwargs):
    return MockRadixAttention(
        tp_q_head_num=hq,
        tp_k_head_num=hkv,
        tp_v_head_num=hkv,
        head_dim=d,
        qk_head_dim=d,
        v_head_dim=dv,
        scaling=scaling,
        **kwargs,
    )


def adapter_of_empty():
    return SGLangAdapter(req_to_token=torch.zeros(2, 8, dtype=torch.int32), page_size=1)


class BlockTableAdapter(SGLangAdapter):
    """An engine fork that keeps its own per-request page table instead of deriving it."""

    def __init__(self, *, req_to_token, page_size, block_table):
        super().__init__(req_to_token=req_to_token, page_size=page_size)
        self.block_table = block_table
        self.calls = 0

    def page_table(self, req_pool_indices, width):
        self.calls += 1
        return self.block_table[req_pool_indices, :width]


def test_subclass_overriding_one_hook():
    spec = BatchSpec((15, 8, 1), (15, 16, 17))
    batch = make_sglang_batch(spec, LAYER, M.EXTEND, page_size=16)
    r2t = batch.model_runner.req_to_token_pool.req_to_token
    block_table = (r2t[:, ::16] // 16).to(torch.int32)
    expected = expected_step(batch, LAYER)
    # Only the subclass's table is right now: the default hook would read page 0 everywhere.
    adapter = BlockTableAdapter(req_to_token=r2t.clone(), page_size=16, block_table=block_table)
    adapter.req_to_token.zero_()
    dropin = SGLangAttentionBackend(batch.model_runner, "reference", adapter=adapter)
    dropin.init_forward_metadata(batch.forward_batch)
    out = dropin.forward(batch.q, batch.k, batch.v, batch.layer, batch.forward_batch)
    assert adapter.calls == 1
    torch.testing.assert_close(out.double(), expected.out, atol=1e-4, rtol=1e-4)
    assert torch.equal(batch.model_runner.token_to_kv_pool.k_buffer[0], expected.k_buffer)


@pytest.mark.parametrize(
    ("mode", "q", "s"),
    [
        (M.DECODE, (1, 1), (16, 33)),
        (M.EXTEND, (15, 2), (15, 17)),
        (M.TARGET_VERIFY, (3, 3), (17, 20)),
    ],
)
def test_build_metadata_never_reads_device_values(mode, q, s):
    # On the "meta" device a tensor has no values: any .item(), .tolist() or host copy of a
    # device tensor (a device sync on a GPU) raises. Host lengths must come from the *_cpu twins.
    batch = make_sglang_batch(BatchSpec(q, s), LAYER, mode, page_size=16)
    fb = batch.forward_batch
    on_meta = {
        name: getattr(fb, name).to("meta")
        for name in ("req_pool_indices", "seq_lens", "out_cache_loc", "extend_seq_lens")
        if getattr(fb, name) is not None
    }
    meta_fb = dataclasses.replace(fb, **on_meta)
    r2t = batch.model_runner.req_to_token_pool.req_to_token.to("meta")
    meta = SGLangAdapter(req_to_token=r2t, page_size=16).build_metadata(meta_fb)
    assert meta.page_table.device.type == "meta"
    assert meta.query_start_loc_cpu.tolist()[-1] == sum(q)
    assert meta.max_seq_len == max(s)
