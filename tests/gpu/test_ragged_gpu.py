"""Ragged steps on the serving path: built and run without a device sync (H200).

An engine builds a ragged step's metadata every step (vLLM's MLA prefill: the new tokens and
each context chunk), ahead of the GPU. ``AttentionMetadata.for_ragged`` on a CUDA device, the
backend's ``plan`` and ``forward_ragged`` must therefore never wait for queued GPU work; the
outputs are checked against the reference backend on the same inputs.
"""

from __future__ import annotations

import pytest
import torch

import attnsdk as A
from attnsdk.testing import assert_close_to_reference, forbid_device_sync

pytestmark = [pytest.mark.gpu]

DEV = "cuda"
HEADS, QK, V = 16, 192, 128  # DeepSeek's expanded prefill per rank: nope 128 + rope 64, v 128


@pytest.mark.parametrize(
    "name",
    [
        pytest.param("fa3", marks=[pytest.mark.sm90, pytest.mark.fa3]),
        pytest.param("flashinfer", marks=pytest.mark.flashinfer),
    ],
)
@pytest.mark.parametrize("kind", ["new", "prefix"])
def test_ragged_step_builds_and_runs_without_a_sync(name: str, kind: str) -> None:
    backend = A.create_backend(name)
    reference = A.create_backend("reference")
    cross = kind == "prefix"  # a context chunk: every query sees all of its sequence's keys
    query_lens = [5, 33, 1]
    seq_lens = [40, 7, 64] if cross else query_lens
    layer = A.LayerSpec(HEADS, HEADS, QK, v_head_dim=V, causal=not cross)
    gen = torch.Generator(device=DEV).manual_seed(0)
    t, tk = sum(query_lens), sum(seq_lens)
    q = torch.randn(t, HEADS, QK, device=DEV, dtype=torch.bfloat16, generator=gen)
    k = torch.randn(tk, HEADS, QK, device=DEV, dtype=torch.bfloat16, generator=gen)
    v = torch.randn(tk, HEADS, V, device=DEV, dtype=torch.bfloat16, generator=gen)
    lse = torch.empty(t, HEADS, device=DEV)

    def step() -> torch.Tensor:
        meta = A.AttentionMetadata.for_ragged(
            query_lens, seq_lens, device=DEV, cross_attention=cross
        )
        return backend.forward_ragged(q, k, v, backend.plan(meta), layer, lse=lse)

    step()  # first use: kernels load (FlashInfer JIT) outside the judged block
    with forbid_device_sync():  # a blocking copy (pageable host memory) raises here
        out = step()
    torch.cuda.synchronize()
    meta = A.AttentionMetadata.for_ragged(query_lens, seq_lens, device=DEV, cross_attention=cross)
    want_lse = torch.empty_like(lse)
    want = reference.forward_ragged(q, k, v, reference.plan(meta), layer, lse=want_lse)
    assert_close_to_reference(out, want, atol=2e-2, rtol=2e-2)
    assert_close_to_reference(lse, want_lse, atol=2e-3, rtol=1e-3)
