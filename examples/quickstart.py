"""Quick start: one mixed decode + prefill step through attnsdk on the CPU (reference backend).

Run it as is: ``python examples/quickstart.py``. The same code runs on a GPU with
``device="cuda"`` and ``create_backend("fa3")``.
"""

import torch

import attnsdk as A

device = "cpu"
layout = A.KVCacheLayout(num_kv_heads=2, head_dim=64, page_size=16, dtype=torch.bfloat16)
cache = layout.allocate(num_pages=64, device=device)  # page 0 stays reserved for padding
layer = A.LayerSpec(num_heads=8, num_kv_heads=2, head_dim=64)

# Sequence 0 decodes one token after 40 cached ones; sequence 1 prefills a 20-token prompt.
query_lens, seq_lens = [1, 20], [41, 20]
page_table = torch.tensor([[1, 2, 3], [4, 5, 0]], dtype=torch.int32)
meta = A.AttentionMetadata.from_seqlens(
    query_lens, seq_lens, page_table=page_table, page_size=16, device=device
)

backend = A.create_backend("reference")  # or "auto", or A.AttentionConfig(...)
plan = backend.plan(meta)  # once per step, shared by every layer

t = meta.num_tokens
q = torch.randn(t, layer.num_heads, layer.head_dim, dtype=torch.bfloat16, device=device)
k = torch.randn(t, layer.num_kv_heads, layer.head_dim, dtype=torch.bfloat16, device=device)
v = torch.randn(t, layer.num_kv_heads, layer.head_dim, dtype=torch.bfloat16, device=device)
out = backend.forward(q, k, v, cache, plan, layer)  # writes k/v at meta.slot_mapping, then attends

print(f"backend {backend.name}: q {tuple(q.shape)} -> out {tuple(out.shape)}")
print(f"slot_mapping {meta.slot_mapping.tolist()[:3]}... cache.k {tuple(cache.k.shape)}")
