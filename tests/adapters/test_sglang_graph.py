"""SGLang's CUDA-graph protocol through the drop-in backend (run eagerly on the reference backend).

The mock graph runner pads like SGLang's CudaGraphRunner; replayed real rows must equal an eager
run, padding may only touch the padding page, and replay must refresh the captured buffers in
place.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from sglang_dense import expected_step
from test_sglang_adapter import BlockTableAdapter

from attnsdk import InvalidInputError, LayerSpec, UnsupportedConfigError
from attnsdk.adapters.sglang import SGLangAdapter, SGLangAttentionBackend
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
    state = dropin._graph.buffers
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
    state = dropin._graph.buffers
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
    state = dropin._graph.buffers
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


def spy_replays(monkeypatch, backend, *, run=True):
    """The metadata every ``plan_for_replay`` receives (and, with ``run``, still refreshes)."""
    seen = []
    real = backend.plan_for_replay

    def spy(plan, meta):
        seen.append(meta)
        if run:
            real(plan, meta)

    monkeypatch.setattr(backend, "plan_for_replay", spy)
    return seen


@pytest.mark.parametrize("hooks", ["out_graph", "legacy"])
@pytest.mark.parametrize(
    ("mode", "spec", "spec_info"),
    [
        (M.DECODE, BatchSpec((1,) * 3, (15, 16, 40)), None),
        (M.TARGET_VERIFY, BatchSpec((3,) * 3, (17, 18, 35)), VerifyInput(3)),
    ],
    ids=["decode", "verify"],
)
def test_replay_hands_the_real_rows_to_plan_for_replay(monkeypatch, hooks, mode, spec, spec_info):
    """The replayed metadata describes the batch's real rows only, built straight from the
    hook's arguments; plan_for_replay pads the captured size itself (GraphBuffers)."""
    batch = make_sglang_batch(spec, LAYER, mode, page_size=16, seed=3)
    dropin = SGLangAttentionBackend(batch.model_runner, "reference")
    runner = MockCudaGraphRunner(dropin, batch.model_runner, [2, 8], mode, spec_info, hooks=hooks)
    seen = spy_replays(monkeypatch, dropin.backend)
    static = runner.replay_prepare(batch.forward_batch)
    (meta,) = seen
    per_row = runner.per_row
    assert static.batch_size == 8
    assert meta.num_seqs == 3
    assert meta.seq_lens_cpu.tolist() == list(spec.seq_lens)  # drafts included in a verify
    assert meta.seq_lens.tolist() == list(spec.seq_lens)
    assert meta.query_start_loc_cpu.tolist() == [0, per_row, 2 * per_row, 3 * per_row]
    assert meta.max_query_len == per_row
    assert meta.max_seq_len == max(spec.seq_lens)
    assert bool((meta.slot_mapping == -1).all())  # the captured forward writes through the pool
    r2t = batch.model_runner.req_to_token_pool.req_to_token
    rows = batch.forward_batch.req_pool_indices
    assert torch.equal(meta.page_table, (r2t[rows, ::16][:, : meta.page_table.shape[1]] // 16))
    # The captured plan: the real rows, then padding rows on the padding page.
    captured = dropin._plan.metadata
    assert captured.seq_lens_cpu[:3].tolist() == list(spec.seq_lens)
    assert bool((captured.page_table[3:] == 0).all())


def test_legacy_replay_without_the_live_batch_takes_every_row_as_real(monkeypatch):
    """SGLang <= 0.5.12 says how many rows are real only through ``_replay_forward_batch``;
    without it the padded rows are replayed as they are (seq_len 1 through their row)."""
    batch = make_sglang_batch(BatchSpec((1,) * 3, (15, 16, 40)), LAYER, M.DECODE, page_size=16)
    dropin = SGLangAttentionBackend(batch.model_runner, "reference")
    MockCudaGraphRunner(dropin, batch.model_runner, [4], hooks="legacy")
    seen = spy_replays(monkeypatch, dropin.backend)
    fb = batch.forward_batch
    rows = torch.cat([fb.req_pool_indices, torch.zeros(1, dtype=torch.int64)])
    seq = torch.cat([fb.seq_lens, torch.ones(1, dtype=torch.int64)])
    dropin.init_forward_metadata_replay_cuda_graph(4, rows, seq, 0, None, M.DECODE, None, seq)
    assert seen[0].seq_lens_cpu.tolist() == [15, 16, 40, 1]


def test_replay_reads_no_device_value(monkeypatch):
    """The replay path never reads a device tensor's values (a sync on a GPU): with the graph
    runner's device inputs and req_to_token on the "meta" device, which has no values, the
    real rows' metadata is still built, from the host lengths alone."""
    spec = BatchSpec((1,) * 3, (15, 16, 40))
    batch = make_sglang_batch(spec, LAYER, M.DECODE, page_size=16)
    r2t = batch.model_runner.req_to_token_pool.req_to_token
    adapter = SGLangAdapter(req_to_token=r2t.to("meta"), page_size=16)
    dropin = SGLangAttentionBackend(batch.model_runner, "reference", adapter=adapter)
    MockCudaGraphRunner(dropin, batch.model_runner, [4])
    seen = spy_replays(monkeypatch, dropin.backend, run=False)
    host = torch.tensor([15, 16, 40, 1])
    view = SimpleNamespace(
        batch_size=4,
        forward_mode=M.DECODE,
        num_padding=1,
        req_pool_indices=torch.zeros(4, dtype=torch.int64, device="meta"),
        seq_lens=torch.zeros(4, dtype=torch.int64, device="meta"),
        seq_lens_cpu=host,
        out_cache_loc=torch.zeros(3, dtype=torch.int64, device="meta"),
        spec_info=None,
    )
    dropin.init_forward_metadata_out_graph(view)
    (meta,) = seen
    assert meta.num_seqs == 3
    assert meta.seq_lens_cpu.tolist() == [15, 16, 40]
    assert meta.page_table.device.type == "meta"
    assert meta.page_table.shape == (3, 3)


def test_replay_reads_the_page_table_through_the_adapters_hook():
    """An integrator's ``page_table`` hook serves replays too (its own block table here: the
    request pool is zeroed, so the default derivation would read page 0 everywhere)."""
    spec = BatchSpec((1,) * 3, (15, 16, 40))
    batch = make_sglang_batch(spec, LAYER, M.DECODE, page_size=16, seed=6)
    expected = expected_step(batch, LAYER)
    r2t = batch.model_runner.req_to_token_pool.req_to_token
    adapter = BlockTableAdapter(
        req_to_token=r2t.clone(), page_size=16, block_table=(r2t[:, ::16] // 16).to(torch.int32)
    )
    adapter.req_to_token.zero_()
    dropin = SGLangAttentionBackend(batch.model_runner, "reference", adapter=adapter)
    runner = MockCudaGraphRunner(dropin, batch.model_runner, [4])
    out, _ = replay(batch, runner, dropin)
    assert adapter.calls == 1
    torch.testing.assert_close(out.double(), expected.out, atol=1e-4, rtol=1e-4)
