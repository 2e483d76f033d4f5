"""DeepSeek-style multi-head latent attention (MLA) through attnsdk: expanded prefill, absorbed
decode.

One latent per token (kv_lora_rank 512 + rope 64) is cached. The prompt runs expanded, as
engines run long prompts: per-head K (nope + rope, 192 dims) and V (128) up-projected from the
latents and attended without the cache (``forward_ragged``), while the latents are stored for
later steps. Decodes run absorbed: each query head moves into latent space (q_nope @ W_UK),
attends over the cached latents, and leaves through W_UV. Both forms give the same attention.
On a GPU it runs on flashinfer (or fa3 where the FA3 build has its MLA kernels), on a CPU on the
reference backend; docs/kv_layout.md, "MLA" and "Ragged attention".

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


expanded = A.LayerSpec(
    num_heads=HEADS,
    num_kv_heads=HEADS,
    head_dim=NOPE + ROPE,
    v_head_dim=V_DIM,
    scale=(NOPE + ROPE) ** -0.5,
)


def prefill(
    q_nope: torch.Tensor, q_rope: torch.Tensor, latent: torch.Tensor, meta: A.AttentionMetadata
) -> torch.Tensor:
    """The expanded form: per-head K / V from the new latents, no cache read; the latents are
    stored for the decodes. Same shapes as ``attention``."""
    c, k_rope = latent[:, 0, :RANK], latent[:, :, RANK:]
    k = torch.cat([torch.einsum("tr,hnr->thn", c, w_uk), k_rope.expand(-1, HEADS, -1)], dim=-1)
    v = torch.einsum("tr,hrv->thv", c, w_uv)
    cache.store(latent, None, meta.slot_mapping)
    q = torch.cat([q_nope, q_rope], dim=-1)
    return backend.forward_ragged(q, k, v, backend.plan(meta), expanded)


def rand(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, device=device, dtype=dtype)


prompt = A.AttentionMetadata.from_seqlens([100], [100], [[1, 2]], PAGE, device=device)
q_nope, q_rope, latent = rand(100, HEADS, NOPE), rand(100, HEADS, ROPE), rand(100, 1, RANK + ROPE)
first = prefill(q_nope, q_rope, latent, prompt)
gap = (first - attention(q_nope, q_rope, latent, prompt)).abs().max()  # absorbed, same prompt
step = A.AttentionMetadata.from_seqlens([1], [101], [[1, 2]], PAGE, device=device)
out = attention(rand(1, HEADS, NOPE), rand(1, HEADS, ROPE), rand(1, 1, RANK + ROPE), step)
print(
    f"{backend.name}: prefill {tuple(first.shape)} (expanded vs absorbed: max gap {gap:.1e}), "
    f"decode {tuple(out.shape)}, latent cache {tuple(cache.k.shape)}"
)
