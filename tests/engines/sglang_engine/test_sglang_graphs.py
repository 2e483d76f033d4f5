"""SGLang's CUDA-graph protocol around the drop-in backend, on a CPU (no graphs are recorded).

- ``GraphRunner`` drives the installed release's hooks with its decode graph runner's real static
  inputs and calls: 0.5.12.post1's ``DecodeInputBuffers.populate_from_forward_batch`` and
  ``init_forward_metadata_capture_cuda_graph`` / ``..._replay_cuda_graph`` (padding rows keep a
  stale request row), 0.5.23's ``build_decode_registry(...).fill_from``,
  ``build_replay_fb_view`` and ``init_forward_metadata_out_graph`` / ``..._in_graph``. A replay
  re-runs the layers on the batch captured for the padded size, as a graph replays them on its
  static inputs: real rows must equal an eager run and the float64 oracle, pages other than the
  padding page must hold exactly the expected K/V, and each replay must refresh the captured
  plan of its size in place (never ``Backend.plan``) with the metadata of the real rows only.
- Every member SGLang's runners, layers, batches and EAGLE verify read off the target's
  ``attn_backend`` exists on the drop-in (callable where they call it). SGLang's own kit runs
  its CUDA-graph decode flow on the drop-in in test_sglang_kit.py.
"""

from __future__ import annotations

import bisect
import re
from pathlib import Path

import pytest
import sglang
import torch
from real_sglang import (
    DROPIN,
    NEW_HOOKS,
    Engine,
    EngineRunner,
    attend,
    chain_verify_input,
    create_backend,
    expected_step,
    random_qkv,
    tolerance,
    twin_batch,
)
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.model_executor.forward_batch_info import (
    CaptureHiddenMode,
    ForwardBatch,
    ForwardMode,
)
from sglang.srt.speculative.eagle_info import EagleVerifyInput

if NEW_HOOKS:
    from sglang.srt.model_executor.cuda_graph_buffer_registry import build_decode_registry
    from sglang.srt.model_executor.runner.decode_cuda_graph_runner import build_replay_fb_view
    from sglang.srt.model_executor.runner_utils.buffers import DecodeInputBuffers
    from sglang.srt.runtime_context import get_parallel
else:
    from sglang.srt.model_executor.cuda_graph_runner import DecodeInputBuffers


class GraphRunner:
    """The release's decode CUDA-graph runner around a backend, minus the graphs: its static
    inputs (SGLang's classes), and its capture and replay calls with their arguments."""

    def __init__(
        self, engine: Engine, capture_bs: list[int], mode, per_row: int, inputs=None
    ) -> None:
        """``inputs(layer, n)``: the warm-up forwards' ``(args, kwargs)`` for ``attend``
        (default: random dense q, k, v)."""
        self.engine, self.backend, self.mode, self.per_row = engine, engine.dropin, mode, per_row
        self.inputs = inputs or (
            lambda layer, n: (random_qkv(n, engine.pools.dtype, engine.gen), {})
        )
        self.capture_bs = sorted(capture_bs)
        max_bs = self.capture_bs[-1]
        tokens = max_bs * per_row
        self.fill = self.backend.get_cuda_graph_seq_len_fill_value()
        self.backend.init_cuda_graph_state(max_bs, tokens)
        common = dict(
            device="cpu",
            max_bs=max_bs,
            max_num_token=tokens,
            hidden_size=8,
            dtype=torch.float32,
            pp_size=1,
            is_encoder_decoder=False,
            require_mlp_tp_gather=False,
            seq_len_fill_value=self.fill,
            encoder_len_fill_value=0,
            cache_loc_dtype=torch.int64,
            enable_mamba_track=False,
        )
        if NEW_HOOKS:
            # A single rank without expert parallelism (the buffers ask the MoE layout).
            with get_parallel().override(moe_ep_size=1):
                self.buffers = DecodeInputBuffers.create(
                    **common,
                    num_dp_ranks=1,
                    num_tokens_per_req=per_row,
                    next_token_logits_buffer=torch.zeros(tokens, 8),
                )
            self.registry = build_decode_registry(
                device=torch.device("cpu"),
                max_bs=max_bs,
                max_num_token=tokens,
                seq_len_fill_value=self.fill,
                cache_loc_dtype=torch.int64,
                source=self.buffers,
                share_pool=False,
            )
        else:
            self.buffers = DecodeInputBuffers.create(
                **common, vocab_size=8, dp_size=1, num_tokens_per_bs=per_row
            )
        self.static = {bs: self._capture(bs) for bs in reversed(self.capture_bs)}

    def _capture(self, bs: int) -> ForwardBatch:
        b, n = self.buffers, bs * self.per_row
        if NEW_HOOKS:  # DecodeCudaGraphRunner._capture resets the inputs first
            b.seq_lens.fill_(self.fill), b.seq_lens_cpu.fill_(self.fill)
            b.reset_index_buffers()
        spec_info = None
        if self.mode.is_target_verify():  # the runner's get_spec_info
            spec_info = EagleVerifyInput(
                draft_token=None,
                custom_mask=b.custom_mask,
                positions=None,
                retrieve_index=None,
                retrieve_next_token=None,
                retrieve_next_sibling=None,
                retrieve_cum_len=None,
                spec_steps=self.per_row - 1,
                topk=1,
                draft_token_num=self.per_row,
                capture_hidden_mode=CaptureHiddenMode.FULL,
                seq_lens_sum=None,
                seq_lens_cpu=None,
            )
        fb = ForwardBatch(
            forward_mode=self.mode,
            batch_size=bs,
            input_ids=b.input_ids[:n],
            req_pool_indices=b.req_pool_indices[:bs],
            seq_lens=b.seq_lens[:bs],
            seq_lens_cpu=b.seq_lens_cpu[:bs],
            out_cache_loc=b.out_cache_loc[:n],
            seq_lens_sum=int(b.seq_lens[:bs].sum()),
            positions=b.positions[:n],
            spec_info=spec_info,
        )
        if NEW_HOOKS:
            self.engine.dropin.model_runner.kv_index_translator.bind_runner_slots(fb)
            self.backend.init_forward_metadata_out_graph(fb, in_capture=True)
            self.backend.init_forward_metadata_in_graph(fb)
        else:
            fb.req_to_token_pool = self.engine.pools.req_to_token_pool
            fb.token_to_kv_pool = self.engine.pools.kv_pool
            self.backend.init_forward_metadata_capture_cuda_graph(
                bs, n, fb.req_pool_indices, fb.seq_lens, None, fb.forward_mode, fb.spec_info
            )
        for _ in range(2):  # the warm-up forwards before capture (the output is discarded)
            for layer in self.engine.layers:
                args, kwargs = self.inputs(layer, n)
                attend(self.backend, layer, *args, fb, **kwargs)
            self.backend.on_after_cuda_graph_warmup()
        return fb

    def replay_prepare(self, live: ForwardBatch) -> ForwardBatch:
        """Pad ``live`` into the static inputs, run the replay hook; the captured batch."""
        raw = live.batch_size
        bs = self.capture_bs[bisect.bisect_left(self.capture_bs, raw)]
        raw_n, n = raw * self.per_row, bs * self.per_row
        if NEW_HOOKS:  # DecodeCudaGraphRunner.load_batch / _init_replay_attn_metadata
            self.registry.fill_from(
                live, raw_bs=raw, padded_bs=bs, raw_num_tokens=raw_n, padded_num_tokens=n
            )
            view = build_replay_fb_view(
                live, self.buffers, bs, raw, n, None, self.fill, self.mode, False
            )
            self.backend.init_forward_metadata_out_graph(view)
        else:  # CudaGraphRunner.replay_prepare
            b = self.buffers
            b.populate_from_forward_batch(
                forward_batch=live,
                raw_bs=raw,
                raw_num_token=raw_n,
                bs=bs,
                seq_len_fill_value=self.fill,
                require_gathered_buffer=False,
                num_tokens_per_bs=self.per_row,
                nsa_enable_prefill_cp=False,
                enable_num_token_non_padded_flag=False,
            )
            self.backend._replay_forward_batch = live  # as the runner does
            self.backend.init_forward_metadata_replay_cuda_graph(
                bs,
                b.req_pool_indices[:bs],
                b.seq_lens[:bs],
                live.seq_lens_sum + (bs - raw) * self.fill,
                None,
                self.mode,
                live.spec_info,
                seq_lens_cpu=b.seq_lens_cpu[:bs],
            )
            self.backend._replay_forward_batch = None
        return self.static[bs]


class Spy:
    """Records the plans the drop-in hands its attnsdk backend."""

    def __init__(self, backend, monkeypatch) -> None:
        self.captured, self.replayed, self.forwarded, self.planned = [], [], [], 0
        self.replayed_metadata = []
        for name in ("plan_for_capture", "plan_for_replay", "forward", "plan"):
            monkeypatch.setattr(backend, name, self._wrap(name, getattr(backend, name)))

    def _wrap(self, name, real):
        def call(*args, **kwargs):
            result = real(*args, **kwargs)
            if name == "plan_for_capture":
                self.captured.append(result)
            elif name == "plan_for_replay":
                self.replayed.append(args[0])
                self.replayed_metadata.append(args[1])
            elif name == "forward":
                self.forwarded.append(args[4])
            else:
                self.planned += 1
            return result

        return call


def warm_engine(page_size: int, dtype: torch.dtype, lengths: list[int]) -> tuple[Engine, list]:
    e = Engine(page_size, dtype, rows=6)
    reqs = [e.table.admit() for _ in lengths]
    items = list(zip(reqs, lengths))
    e.run(e.table.batch(ForwardMode.EXTEND, items), native=False)
    for req, n in items:
        req.length = n
    return e, reqs


GRAPH_CASES = [  # (mode, tokens per row, captured sizes, rows of each replay)
    (ForwardMode.DECODE, 1, [1, 2, 4, 8], [5, 3]),
    (ForwardMode.TARGET_VERIFY, 3, [2, 4], [3, 1]),
]


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize(
    ("mode", "per_row", "capture_bs", "replays"), GRAPH_CASES, ids=["decode", "verify"]
)
def test_padded_replay_equals_eager(mode, per_row, capture_bs, replays, page_size, monkeypatch):
    dtype = torch.float32
    e, reqs = warm_engine(page_size, dtype, [19, 33, 5, 16, 40])
    eager = create_backend(EngineRunner(e.pools, kv_pool=e.twin), DROPIN)
    spy = Spy(e.dropin.backend, monkeypatch)
    runner = GraphRunner(e, capture_bs, mode, per_row)
    plans = dict(zip(reversed(runner.capture_bs), spy.captured, strict=True))
    pointers = {bs: p.metadata.page_table.data_ptr() for bs, p in plans.items()}
    p = e.pools.page_size
    r2t = e.pools.req_to_token_pool.req_to_token
    for rows in replays:
        items = [(req, per_row) for req in reqs[:rows]]
        verify = mode.is_target_verify()
        live = e.table.batch(mode, items, spec_info=chain_verify_input(items) if verify else None)
        query_lens, seq_lens = [per_row] * rows, [r.length + per_row for r in reqs[:rows]]
        before = [(k.clone(), v.clone()) for k, v in e.pools.buffers()]
        for (k, v), (k0, v0) in zip(e.pools.buffers(e.twin), before):
            k.copy_(k0), v.copy_(v0)
        twin = twin_batch(live, e.twin)
        eager.init_forward_metadata(twin)
        spy.planned = 0
        del spy.replayed[:], spy.forwarded[:], spy.replayed_metadata[:]
        static = runner.replay_prepare(live)
        bs, n = static.batch_size, rows * per_row
        assert bs > rows, "the replay must be padded"
        for layer, buffers in zip(e.layers, before):
            qkv = random_qkv(n, dtype, e.gen)
            padded = [torch.cat([x, x.new_zeros(bs * per_row - n, x.shape[1])]) for x in qkv]
            got = attend(e.dropin, layer, *padded, static)[:n]
            want, want_k, want_v = expected_step(
                layer, qkv, buffers, r2t, live, query_lens, seq_lens
            )
            torch.testing.assert_close(got.double(), want, **tolerance(dtype))
            torch.testing.assert_close(got, attend(eager, layer, *qkv, twin), atol=0, rtol=0)
            for buf, ref in zip(e.pools.kv_pool.get_kv_buffer(layer.layer_id), (want_k, want_v)):
                assert torch.equal(buf[p:], ref[p:]), "padding rows wrote outside page 0"
        # In place: the captured plan of this size, refreshed once, its buffers not reallocated,
        # with the real rows' metadata built from the hook's arguments (0.5.23's view says how
        # many rows are padding, 0.5.12's runner sets the live batch on the backend).
        assert spy.replayed == [plans[bs]]
        (meta,) = spy.replayed_metadata
        assert meta.num_seqs == rows
        assert meta.seq_lens_cpu.tolist() == seq_lens
        assert spy.planned == 0
        graph = [plan for plan in spy.forwarded if plan.graph is not None]  # not the eager run's
        assert graph == [plans[bs]] * len(e.layers)
        assert plans[bs].metadata.page_table.data_ptr() == pointers[bs]
        for req, _ in items:
            req.length += per_row


RUNNER_SOURCES = [
    "layers/radix_attention.py",
    "model_executor/forward_batch_info.py",
    *(
        [
            "model_executor/runner/decode_cuda_graph_runner.py",
            "model_executor/runner/base_cuda_graph_runner.py",
            "model_executor/runner/base_runner.py",
            "model_executor/runner/eager_runner.py",
            "model_executor/forward_context.py",
            "speculative/eagle_worker_common.py",
            "speculative/eagle_worker_v2.py",
        ]
        if NEW_HOOKS
        else [
            "model_executor/cuda_graph_runner.py",
            "model_executor/model_runner.py",
            "speculative/eagle_worker.py",
            "speculative/eagle_worker_v2.py",
        ]
    ),
]
"""Where SGLang reads the target model's ``attn_backend``: layers, batches, the runners and
EAGLE's verify (the drop-in serves chain verify)."""
NOT_ON_THE_BASE = {
    "enable_early_verify_metadata": "DSV4.1 early verify metadata (opt-in env var)",
    "get_cpu_graph_seq_len_fill_value": "SGLang's CPU engine (SGLANG_USE_CPU_ENGINE=1)",
    "attn_backends": "the draft model's multi-step backend list",
    "update_mamba_state_after_mtp_verify": "hybrid Mamba targets",
}
"""Read only on paths that do not reach a dense MHA target backend; SGLang's own base
``AttentionBackend`` does not define them either (asserted below)."""


def test_runners_find_every_member_they_read():
    root = Path(sglang.__file__).parent / "srt"
    reads: dict[str, bool] = {}
    for rel in RUNNER_SOURCES:
        text = (root / rel).read_text()
        pattern = r"(?:attn_backend|get_attn_backend\(\))\.(\w+)(\s*\()?(\s*=(?!=))?"
        for name, call, assign in re.findall(pattern, text):
            if not assign:
                reads[name] = reads.get(name, False) or bool(call)
    assert {"init_cuda_graph_state", "get_cuda_graph_seq_len_fill_value"} <= reads.keys()
    e = Engine(16, torch.bfloat16)
    absent = set()
    for name, called in sorted(reads.items()):
        if not hasattr(e.dropin, name):
            absent.add(name)
            continue
        assert not called or callable(getattr(e.dropin, name)), f"SGLang calls {name}()"
    assert absent <= NOT_ON_THE_BASE.keys(), f"the drop-in lacks {absent - NOT_ON_THE_BASE.keys()}"
    assert not any(hasattr(AttentionBackend, name) for name in absent)
    if NEW_HOOKS:
        assert e.dropin.dllm_attention is None  # read when the decode graph runner is built
        assert e.dropin.token_to_kv_pool is e.pools.kv_pool  # forward_context reads the pools
