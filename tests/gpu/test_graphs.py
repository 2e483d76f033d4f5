"""CUDA-graph capture and replay of the fa3 backend equals eager execution (H200 / sm90 only)."""

from __future__ import annotations

import random

import pytest
import torch

import attnsdk as A
from attnsdk.backends.fa3 import FA3Options
from attnsdk.testing import BatchSpec, assert_close_to_reference, make_batch

pytestmark = [pytest.mark.gpu, pytest.mark.sm90, pytest.mark.fa3]

DEV = "cuda"
LAYER = A.LayerSpec(num_heads=8, num_kv_heads=2, head_dim=128)
LAYOUT = A.KVCacheLayout(2, 128, 16)
MAX_PAGES = 24


def _two_layer_step(backend: A.Backend, caches: list[A.KVCache], layer: A.LayerSpec):
    """A step with two attention layers (each its own cache), like a model's layer loop."""

    def step(plan: A.Plan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        h = backend.forward(q, k, v, caches[0], plan, layer)
        return backend.forward(h, k, v, caches[1], plan, layer)

    return step


@pytest.mark.parametrize("precompute", [True, False])
@pytest.mark.parametrize("tokens_per_seq", [1, 4])
def test_replay_equals_eager(precompute: bool, tokens_per_seq: int) -> None:
    backend = A.create_backend(A.AttentionConfig(backend="fa3", precompute_scheduler=precompute))
    r = random.Random(tokens_per_seq * 7 + precompute)
    num_pages = 400
    graph_caches = [LAYOUT.allocate(num_pages, DEV) for _ in range(2)]
    for c in graph_caches:
        c.k.normal_()
        c.v.normal_()
    eager_caches = [LAYOUT.wrap(c.k.clone(), c.v.clone()) for c in graph_caches]
    runner = A.GraphRunner(
        backend,
        _two_layer_step(backend, graph_caches, LAYER),
        batch_sizes=[1, 3, 8, 16],
        max_pages=MAX_PAGES,
        page_size=16,
        tokens_per_seq=tokens_per_seq,
    )
    rows = 16 * tokens_per_seq
    runner.capture(
        torch.randn(rows, 8, 128, device=DEV, dtype=torch.bfloat16),
        torch.randn(rows, 2, 128, device=DEV, dtype=torch.bfloat16),
        torch.randn(rows, 2, 128, device=DEV, dtype=torch.bfloat16),
    )
    eager_step = _two_layer_step(backend, eager_caches, LAYER)
    free_pages = list(range(1, num_pages))
    for step in range(25):
        b = r.randint(1, 16)
        # Mixed rows: any query length up to the captured tokens per row (the runner refuses
        # longer rows: the graph's kernels were sized for that many).
        q_lens = [r.randint(1, tokens_per_seq) for _ in range(b)]
        if r.random() < 0.2:
            q_lens[r.randrange(b)] = 0  # an idle row
        seq = [q + r.randint(0, 300) for q in q_lens]
        r.shuffle(free_pages)
        table = torch.zeros(b, MAX_PAGES, dtype=torch.int32)
        used = 0
        for i, s in enumerate(seq):
            n = -(-s // 16)
            table[i, :n] = torch.tensor(free_pages[used : used + n])
            used += n
        meta = A.AttentionMetadata.from_seqlens(q_lens, seq, table, 16, device=DEV)
        t = meta.num_tokens
        q = torch.randn(t, 8, 128, device=DEV, dtype=torch.bfloat16)
        k = torch.randn(t, 2, 128, device=DEV, dtype=torch.bfloat16)
        v = torch.randn(t, 2, 128, device=DEV, dtype=torch.bfloat16)
        got = runner(meta, q, k, v).clone()
        want = eager_step(backend.plan(meta), q, k, v)[:t]
        assert_close_to_reference(got, want, atol=1e-2, rtol=1e-2)
        for g, e in zip(graph_caches, eager_caches):
            assert torch.equal(g.k, e.k), f"step {step}: K caches differ"
            assert torch.equal(g.v, e.v), f"step {step}: V caches differ"


def test_runner_rejects_too_large_batch() -> None:
    backend = A.create_backend(A.AttentionConfig(backend="fa3", options=FA3Options()))
    cache = LAYOUT.allocate(64, DEV)
    runner = A.GraphRunner(
        backend, _two_layer_step(backend, [cache, cache], LAYER), batch_sizes=[2],
        max_pages=4, page_size=16,
    )  # fmt: skip
    x = torch.zeros(2, 8, 128, device=DEV, dtype=torch.bfloat16)
    kv = torch.zeros(2, 2, 128, device=DEV, dtype=torch.bfloat16)
    with pytest.raises(A.InvalidInputError, match="GraphRunner"):
        runner(make_batch(BatchSpec.decode(1), LAYER, LAYOUT, device=DEV).metadata, x, kv, kv)
    runner.capture(x, kv, kv)
    big = make_batch(BatchSpec.decode(3, max_context=20), LAYER, LAYOUT, device=DEV)
    with pytest.raises(A.InvalidInputError, match="largest capture"):
        runner(big.metadata, big.q, big.k, big.v)
