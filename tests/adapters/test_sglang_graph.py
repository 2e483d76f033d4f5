"""SGLang's CUDA-graph protocol through the drop-in backend (run eagerly on the reference backend).

The mock graph runner pads like SGLang's CudaGraphRunner; replayed real rows must equal an eager
run, padding may only touch the padding page, and replay must refresh the captured buffers in
place.
"""

from __future__ import annotations

import pytest
import torch
from sglang_dense import expected_step

from attnsdk import InvalidInputError, LayerSpec, UnsupportedConfigError
from attnsdk.adapters.sglang import SGLangAttentionBackend
from attnsdk.adapters.sglang.testing import (
    ForwardMode,
    MockCudaGraphRunner,
    VerifyInput,
    make_sglang_batch,
)
from attnsdk.testing import BatchSpec

M = ForwardMode
LAYER = LayerSpec(num_heads=4, num_kv_heads=2, head_dim=16, sliding_window=9)


def eager(batch):
    dropin = SGLangAttentionBackend(batch.model_runner, "reference")
    dropin.init_forward_metadata(batch.forward_batch)
    return dropin.forward(batch.q, batch.k, batch.v, batch.layer, batch.forward_batch)


def replay(batch, runner, dropin):
    """Replay ``batch`` through the graph runner; returns (out for real tokens, static batch)."""
    static = runner.replay_prepare(batch.forward_batch)
    q, k, v = (runner.pad_tokens(x, static.batch_size) for x in (batch.q, batch.k, batch.v))
    out = dropin.forward(q, k, v, batch.layer, static)
    return out[: batch.q.shape[0]], static


def static_buffers(state):
    return {
        name: getattr(state, name).data_ptr()
        for name in ("query_start_loc", "seq_lens", "page_table", "slot_mapping", "seq_lens_cpu")
    }


def outside_padding_page(buf, page_size):
    return buf[page_size:]


CASES = [
    ("decode", M.DECODE, BatchSpec((1,) * 5, (15, 16, 17, 31, 40)), None, [2, 4, 8]),
    ("verify", M.TARGET_VERIFY, BatchSpec((3,) * 3, (17, 18, 35)), VerifyInput(3), [1, 4]),
]


@pytest.mark.parametrize("hooks", ["out_graph", "legacy"])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize(
    ("name", "mode", "spec", "spec_info", "capture"), CASES, ids=[c[0] for c in CASES]
)
def test_replay_with_padding_equals_eager(name, mode, spec, spec_info, capture, page_size, hooks):
    batch = make_sglang_batch(spec, LAYER, mode, page_size=page_size, seed=5)
    reference = batch.clone()
    expected = expected_step(batch, LAYER)
    eager_out = eager(reference)

    dropin = SGLangAttentionBackend(batch.model_runner, "reference")
    runner = MockCudaGraphRunner(dropin, batch.model_runner, capture, mode, spec_info, hooks=hooks)
    state = dropin._graph[0]
    before = static_buffers(state)
    captured = dict(dropin._graph_plans)
    out, static = replay(batch, runner, dropin)

    assert static.batch_size > spec.num_seqs, "the case must exercise padding rows"
    torch.testing.assert_close(out, eager_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.double(), expected.out, atol=1e-4, rtol=1e-4)
    # No allocation in replay: same static buffers, same captured plan objects.
    assert static_buffers(state) == before
    assert dropin._graph_plans == captured
    assert dropin._plan is captured[(static.batch_size, runner.per_row)]
    # Padding rows only ever write the padding page (slots 0..P-1).
    pool, ref_pool = batch.model_runner.token_to_kv_pool, reference.model_runner.token_to_kv_pool
    for got, want in (
        (pool.k_buffer[0], ref_pool.k_buffer[0]),
        (pool.v_buffer[0], ref_pool.v_buffer[0]),
    ):
        assert torch.equal(
            outside_padding_page(got, page_size), outside_padding_page(want, page_size)
        )


def test_capture_binds_views_sized_for_max_bs():
    batch = make_sglang_batch(BatchSpec((1,), (20,)), LAYER, M.DECODE, page_size=16)
    dropin = SGLangAttentionBackend(batch.model_runner, "reference")
    MockCudaGraphRunner(dropin, batch.model_runner, [1, 3, 8])
    state = dropin._graph[0]
    context = batch.model_runner.req_to_token_pool.req_to_token.shape[1]
    assert (state.max_batch, state.max_tokens, state.max_pages) == (8, 8, -(-context // 16))
    for bs in (1, 3, 8):
        meta = dropin._graph_plans[(bs, 1)].metadata
        assert meta.seq_lens.shape == (bs,)
        assert meta.slot_mapping.shape == (bs,)
        assert meta.page_table.shape == (bs, state.max_pages)
        assert meta.seq_lens.data_ptr() == state.seq_lens.data_ptr()
        assert meta.page_table.data_ptr() == state.page_table.data_ptr()
    assert dropin.get_cuda_graph_seq_len_fill_value() == 1


def test_stale_request_rows_in_padding_never_write_real_pages():
    # SGLang copies only the real rows into its static req_pool_indices: padding rows keep the
    # row of an earlier, larger batch. Their writes must still go to the padding page.
    spec = BatchSpec((1, 1, 1), (15, 16, 17))
    batch = make_sglang_batch(spec, LAYER, M.DECODE, page_size=16, seed=9)
    reference = batch.clone()
    eager_out = eager(reference)
    dropin = SGLangAttentionBackend(batch.model_runner, "reference")
    runner = MockCudaGraphRunner(dropin, batch.model_runner, [4, 8], hooks="legacy")
    runner.req_pool_indices[3:].copy_(batch.forward_batch.req_pool_indices[0])
    out, static = replay(batch, runner, dropin)
    assert static.batch_size == 4
    torch.testing.assert_close(out, eager_out, atol=1e-5, rtol=1e-5)
    got = batch.model_runner.token_to_kv_pool.k_buffer[0]
    want = reference.model_runner.token_to_kv_pool.k_buffer[0]
    assert torch.equal(got[16:], want[16:])


@pytest.mark.parametrize("hooks", ["out_graph", "legacy"])
def test_successive_replays_reuse_the_buffers(hooks):
    spec = BatchSpec((1,) * 4, (15, 16, 17, 33))
    batch = make_sglang_batch(spec, LAYER, M.DECODE, page_size=16, seed=2)
    dropin = SGLangAttentionBackend(batch.model_runner, "reference")
    runner = MockCudaGraphRunner(dropin, batch.model_runner, [2, 4], hooks=hooks)
    state = dropin._graph[0]
    before = static_buffers(state)
    for rows in (4, 1, 3, 2):
        step = batch.first_rows(rows)
        expected = expected_step(step, LAYER)
        out, static = replay(step, runner, dropin)
        assert static.batch_size == (2 if rows <= 2 else 4)
        torch.testing.assert_close(out.double(), expected.out, atol=1e-4, rtol=1e-4)
    assert static_buffers(state) == before


def test_graph_protocol_errors():
    batch = make_sglang_batch(BatchSpec((1,), (20,)), LAYER, M.DECODE, page_size=16)
    dropin = SGLangAttentionBackend(batch.model_runner, "reference")
    rpi, seq = torch.zeros(2, dtype=torch.int32), torch.ones(2, dtype=torch.int32)
    with pytest.raises(InvalidInputError, match="init_cuda_graph_state"):
        dropin.init_forward_metadata_capture_cuda_graph(2, 2, rpi, seq, None, M.DECODE, None)
    dropin.init_cuda_graph_state(4, 4)
    with pytest.raises(UnsupportedConfigError, match="CUDA graphs"):
        dropin.init_forward_metadata_capture_cuda_graph(2, 2, rpi, seq, None, M.EXTEND, None)
    with pytest.raises(InvalidInputError, match="num_tokens"):
        dropin.init_forward_metadata_capture_cuda_graph(2, 3, rpi, seq, None, M.DECODE, None)
    dropin.init_forward_metadata_capture_cuda_graph(2, 2, rpi, seq, None, M.DECODE, None)
    with pytest.raises(InvalidInputError, match="bs"):
        dropin.init_forward_metadata_replay_cuda_graph(3, rpi, seq, 2, None, M.DECODE, None, seq)
    with pytest.raises(InvalidInputError, match="seq_lens_cpu"):
        dropin.init_forward_metadata_replay_cuda_graph(2, rpi, seq, 2, None, M.DECODE, None, None)
