"""SGLang adapter: a mixed step and a padded CUDA-graph decode through the drop-in backend.

Runs as is on the CPU with the mock SGLang objects from ``attnsdk.adapters.sglang.testing``
(no sglang install needed): ``python examples/sglang_adapter.py``. In a server, the
``model_runner`` and ``forward_batch`` are SGLang's own (docs/adapters/sglang.md).
"""

from attnsdk import LayerSpec
from attnsdk.adapters.sglang import SGLangAttentionBackend
from attnsdk.adapters.sglang.testing import ForwardMode, MockCudaGraphRunner, make_sglang_batch
from attnsdk.testing import BatchSpec

layer = LayerSpec(num_heads=8, num_kv_heads=2, head_dim=64, sliding_window=4096)

# A MIXED step: a decode row after 40 cached tokens and a 20-token prompt, pages of 16 slots.
step = make_sglang_batch(BatchSpec((1, 20), (41, 20)), layer, ForwardMode.MIXED, page_size=16)
runner, fb = step.model_runner, step.forward_batch
attn = SGLangAttentionBackend(runner, backend="reference")  # "auto" picks fa3 on an H200

attn.init_forward_metadata(fb)  # once per step
out = attn.forward(step.q, step.k, step.v, step.layer, fb)  # once per layer
meta = attn.adapter.build_metadata(fb)
print(f"MIXED step: q {tuple(step.q.shape)} -> out {tuple(out.shape)} {out.dtype}")
print(f"  seq_lens {meta.seq_lens.tolist()}, page_table {meta.page_table.tolist()}")
print(
    f"  SGLang window W-1 = {step.layer.sliding_window_size} -> LayerSpec W = {layer.sliding_window}"
)

# Decode under CUDA graphs: 3 real rows replayed in the graph captured for 4 (one padding row).
dec = make_sglang_batch(BatchSpec((1, 1, 1), (17, 32, 5)), layer, ForwardMode.DECODE, page_size=16)
eager = dec.clone()  # the same step on a copy of the KV buffers, to run eagerly below
attn = SGLangAttentionBackend(dec.model_runner, backend="reference")
graphs = MockCudaGraphRunner(attn, dec.model_runner, capture_bs=[1, 2, 4])
static = graphs.replay_prepare(dec.forward_batch)  # pads, then calls the replay hook
q, k, v = (graphs.pad_tokens(x, static.batch_size) for x in (dec.q, dec.k, dec.v))
replayed = attn.forward(q, k, v, dec.layer, static)[:3]

eager_attn = SGLangAttentionBackend(eager.model_runner, backend="reference")
eager_attn.init_forward_metadata(eager.forward_batch)
expected = eager_attn.forward(eager.q, eager.k, eager.v, eager.layer, eager.forward_batch)
print(f"graph replay: bs {static.batch_size} for 3 rows, seq_lens {static.seq_lens.tolist()}")
print(f"  max |replay - eager| = {(replayed - expected).abs().max().item():.2e}")
