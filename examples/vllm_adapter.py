"""vLLM adapter: one padded mixed step through the drop-in classes, in each KV layout.

Runs as is on the CPU with the mock vLLM objects from ``attnsdk.adapters.vllm.testing`` (no vllm
install needed): ``python examples/vllm_adapter.py``. In a server, vLLM itself builds the
``CommonAttentionMetadata`` and the KV tensors and calls these classes (docs/adapters/vllm.md).
"""

import torch

from attnsdk.adapters.vllm import AttnSDKAttentionBackend, VLLMAdapter, VLLMKVLayout
from attnsdk.adapters.vllm.testing import mock_vllm_batch
from attnsdk.testing import BatchSpec


class ReferenceBackend(AttnSDKAttentionBackend):
    attnsdk_backend = "reference"  # "fa3" on an H200; None reads ATTNSDK_BACKEND, else "auto"


# A decode after 40 cached tokens, a 7-token chunk after 20, a 12-token prompt; two CUDA-graph
# padding requests and three padding token rows, blocks of 16 shuffled after the null block 0.
spec = BatchSpec((1, 7, 12), (41, 27, 12))
for layout in VLLMKVLayout:
    step = mock_vllm_batch(spec, layout=layout, pad_requests=2, pad_tokens=3, seed=1)
    backend = type(f"Ref{layout.name}", (ReferenceBackend,), {"kv_cache_layout": layout})
    builder = backend.get_builder_cls()(None, ["model.layers.0.attn"], None, torch.device("cpu"))
    impl = backend.get_impl_cls()(4, 64, 64**-0.5, 2, None, 32, "auto")  # sliding window W = 32

    attn_metadata = builder.build(0, step.common_attn_metadata)  # once per step
    output = torch.empty(step.query.shape[0], 4 * 64)
    before = step.kv_cache.clone()
    impl.forward(step.layer, step.query, step.key, step.value, step.kv_cache, attn_metadata, output)

    # Which blocks changed, read through zero-copy views of vLLM's tensor before and after.
    views = [VLLMAdapter().kv_cache(t, 2, 64) for t in (before, step.kv_cache)]
    written = (views[0].k != views[1].k).flatten(1).any(1).nonzero().flatten().tolist()
    n = attn_metadata.num_actual_tokens
    print(
        f"{layout.name:9} {layout.value:17} cache {tuple(step.kv_cache.shape)}: {n} real rows, "
        f"finite {bool(output[:n].isfinite().all())}, blocks written {written}"
    )

meta = VLLMAdapter().build_metadata(step.common_attn_metadata)
print(f"query_start_loc {meta.query_start_loc_cpu.tolist()}  seq_lens {meta.seq_lens_cpu.tolist()}")
print(f"block table {meta.page_table.tolist()}")
