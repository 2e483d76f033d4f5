"""DeepSeek-style multi-head latent attention (MLA) through attnsdk, absorbed form.

One latent per token (kv_lora_rank 512 + rope 64) is cached; each query head is absorbed into
latent space (q_nope @ W_UK) and the output leaves it through W_UV. A prompt step writes the
latents, then a decode step attends over them. On a GPU it runs on flashinfer (or fa3 where the
FA3 build has its MLA kernels), on a CPU on the reference backend; docs/kv_layout.md, "MLA".

    python examples/mla.py
"""

from __future__ import annotations

import torch

import attnsdk as A

RANK, ROPE, NOPE, V_DIM, HEADS, PAGE = 512, 64, 128, 128, 16, 64
device = "cuda" if torch.cuda.is_available() else "cpu"
dtype = torch.bfloat16 if device == "cuda" else torch.float32

layer = A.LayerSpec.for_mla(HEADS, kv_lora_rank=RANK, rope_dim=ROPE, scale=(NOPE + ROPE) ** -0.5)
layout = A.KVCacheLayout.for_mla(PAGE, kv_lora_rank=RANK, rope_dim=ROPE, dtype=dtype)
# Given the model, auto skips a backend that cannot serve MLA here and prepares the one it picks.
backend = A.create_backend("auto", device=device, layers=[layer], layout=layout)
cache = layout.allocate(num_pages=8, device=device)
w_uk = torch.randn(HEADS, NOPE, RANK, device=device, dtype=dtype) / RANK**0.5
w_uv = torch.randn(HEADS, RANK, V_DIM, device=device, dtype=dtype) / RANK**0.5


def attention(
    q_nope: torch.Tensor, q_rope: torch.Tensor, latent: torch.Tensor, meta: A.AttentionMetadata
) -> torch.Tensor:
    """(T, H, 128) nope and (T, H, 64) rope queries, (T, 1, 576) new latents -> (T, H, 128)."""
    q = torch.cat([torch.einsum("thn,hnr->thr", q_nope, w_uk), q_rope], dim=-1)
    out = backend.forward(q, latent, None, cache, backend.plan(meta), layer)  # (T, H, 512)
    return torch.einsum("thr,hrv->thv", out, w_uv)


def rand(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, device=device, dtype=dtype)


prompt = A.AttentionMetadata.from_seqlens([100], [100], [[1, 2]], PAGE, device=device)
attention(rand(100, HEADS, NOPE), rand(100, HEADS, ROPE), rand(100, 1, RANK + ROPE), prompt)
step = A.AttentionMetadata.from_seqlens([1], [101], [[1, 2]], PAGE, device=device)
out = attention(rand(1, HEADS, NOPE), rand(1, HEADS, ROPE), rand(1, 1, RANK + ROPE), step)
print(f"{backend.name}: decode output {tuple(out.shape)}, latent cache {tuple(cache.k.shape)}")
