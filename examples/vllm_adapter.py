"""vLLM adapter: one padded mixed step through the drop-in classes, in each of vLLM's layouts.

Runs as is on the CPU with the mock vLLM objects from ``attnsdk.adapters.vllm.testing`` (no vllm
install needed): ``python examples/vllm_adapter.py``. In a server, vLLM itself builds the
``CommonAttentionMetadata`` and the KV tensors and calls these classes (docs/adapters/vllm.md).
"""

import torch

from attnsdk.adapters.vllm import AttnSDKAttentionBackend, VLLMAdapter
from attnsdk.adapters.vllm.testing import PHYSICAL_LAYOUTS, mock_vllm_batch
from attnsdk.testing import BatchSpec


class ReferenceBackend(AttnSDKAttentionBackend):
    attnsdk_backend = "reference"  # "fa3" on an H200; None reads ATTNSDK_BACKEND, else "auto"


# A decode after 40 cached tokens, a 7-token chunk after 20, a 12-token prompt; two CUDA-graph
# padding requests and three padding token rows, blocks of 16 shuffled after the null block 0.
# vLLM hands each layer a [blocks, Hkv, 16, 2 * 64] view (K‖V) over memory in one of its
# physical layouts; the drop-in reads any of them in place.
spec = BatchSpec((1, 7, 12), (41, 27, 12))
builder = ReferenceBackend.get_builder_cls()(
    None, ["model.layers.0.attn"], None, torch.device("cpu")
)
impl = ReferenceBackend.get_impl_cls()(4, 64, 64**-0.5, 2, None, 32, "auto")  # window W = 32
for physical in PHYSICAL_LAYOUTS:
    step = mock_vllm_batch(spec, physical=physical, pad_requests=2, pad_tokens=3, seed=1)

    attn_metadata = builder.build(0, step.common_attn_metadata)  # once per step
    output = torch.empty(step.query.shape[0], 4 * 64)
    before = step.kv_cache.clone()
    impl.forward(step.layer, step.query, step.key, step.value, step.kv_cache, attn_metadata, output)

    # Which blocks changed, read through zero-copy views of vLLM's tensor before and after.
    views = [VLLMAdapter().kv_cache(t, 2, 64) for t in (before, step.kv_cache)]
    written = (views[0].k != views[1].k).flatten(1).any(1).nonzero().flatten().tolist()
    n = attn_metadata.num_actual_tokens
    print(
        f"{physical} cache {tuple(step.kv_cache.shape)} strides {step.kv_cache.stride()}: "
        f"{n} real rows, finite {bool(output[:n].isfinite().all())}, blocks written {written}"
    )

meta = VLLMAdapter().build_metadata(step.common_attn_metadata)
print(f"query_start_loc {meta.query_start_loc_cpu.tolist()}  seq_lens {meta.seq_lens_cpu.tolist()}")
print(f"block table {meta.page_table.tolist()}")
