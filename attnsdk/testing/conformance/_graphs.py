"""CUDA graphs: ``GraphRunner`` capture (graph_state / plan_for_capture / plan_for_replay), then
replays of smaller batches, against eager execution, with and without ``lse=``."""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any

import pytest
import torch

from attnsdk.backends.base import BackendBase
from attnsdk.backends.graphs import GraphRunner
from attnsdk.contract.capabilities import Feature, GraphSupport
from attnsdk.contract.errors import UnsupportedConfigError
from attnsdk.contract.metadata import AttentionMetadata
from attnsdk.selection.create import create_backend
from attnsdk.testing.conformance._cache import assert_same_cache, copy_cache
from attnsdk.testing.conformance._harness import Harness, skip_declared

if TYPE_CHECKING:
    from attnsdk.contract.backend import Backend
    from attnsdk.contract.kv import KVCacheLayout
    from attnsdk.contract.layer import LayerSpec


class GraphCases(Harness):
    """CUDA-graph replay equals eager execution, at the ``graph_support`` level declared."""

    @pytest.mark.parametrize("with_lse", [False, True], ids=["out", "out+lse"])
    @pytest.mark.parametrize("feature", ["gqa", "chunked", "mla", "mla-small", "mla-fp8"])
    @pytest.mark.parametrize("tokens_per_seq", [1, 3])
    def test_graph_replay_equals_eager(
        self, subject: Backend, tokens_per_seq: int, feature: str, with_lse: bool
    ) -> None:
        """CUDA-graph capture (``GraphRunner`` over graph_state / plan_for_capture /
        plan_for_replay) then replay of smaller batches equals eager execution (also the
        ``lse=`` a captured step writes into a static buffer), on a fresh backend prepared for
        the one layer. A capture of several tokens per sequence may refuse a chunked layer
        (virtual-batch backends serve chunks in decode graphs only), with reasons naming
        ``attention_chunk_size``; it is then skipped with them."""
        if torch.device(self.device).type != "cuda":
            pytest.skip(f"CUDA graphs need a CUDA device; this class runs on {self.device}")
        level = subject.capabilities.graph_support
        needed = GraphSupport.DECODE_ONLY if tokens_per_seq == 1 else GraphSupport.UNIFORM_BATCH
        if level < needed:
            pytest.skip(
                f"{subject.name} declares graph_support={level.name}, this needs {needed.name}"
            )
        layer, layout = self._case(subject, feature)
        uses = (Feature.LSE,) if with_lse else ()
        reasons = subject.unsupported_reasons(layer, layout, self.device, uses=uses)
        if reasons:
            skip_declared(reasons)
        # Layers other tests prepared (chunked ones among them) must not decide this capture.
        fresh = self._fresh(subject)
        if isinstance(fresh, BackendBase):
            fresh.prepare([layer], layout, self.device)
        try:
            self._graph_vs_eager(fresh, layer, layout, tokens_per_seq, level, with_lse)
        except UnsupportedConfigError as exc:
            chunked = {r.field for r in exc.reasons} == {"attention_chunk_size"}
            if tokens_per_seq == 1 or layer.attention_chunk_size is None or not chunked:
                raise
            pytest.skip("refused: " + "; ".join(map(str, exc.reasons)))

    def _fresh(self, subject: Backend) -> Backend:
        """A new backend like ``subject``, which no other case has prepared layers on."""
        return create_backend(self.backend, device=torch.device(self.device))

    def _graph_vs_eager(
        self,
        subject: Backend,
        layer: LayerSpec,
        layout: KVCacheLayout,
        tokens_per_seq: int,
        level: GraphSupport,
        with_lse: bool,
    ) -> None:
        dev, p, max_pages, num_pages = torch.device(self.device), layout.page_size, 8, 200
        gen = torch.Generator().manual_seed(tokens_per_seq)
        graph_cache = layout.allocate(num_pages, dev)
        for x in (graph_cache.k,) if layout.mla else (graph_cache.k, graph_cache.v):
            x.copy_(torch.randn(x.shape, generator=gen).to(x.dtype))
        eager_cache = copy_cache(graph_cache)

        sizes = [1, 3, 8]
        # The captured steps write each row's lse into one static buffer (a prefix per size).
        static_lse = torch.full(
            (sizes[-1] * tokens_per_seq, layer.num_heads), float("nan"), device=dev
        )

        def step(plan: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            lse = {"lse": static_lse[: q.shape[0]]} if with_lse else {}
            values = None if layout.mla else v  # an MLA layer's V is the latent part of k
            return subject.forward(q, k, values, graph_cache, plan, layer, **lse)

        runner = GraphRunner(
            subject, step, batch_sizes=sizes, max_pages=max_pages, page_size=p,
            tokens_per_seq=tokens_per_seq, device=dev,
        )  # fmt: skip

        def rand(t: int, h: int, d: int) -> torch.Tensor:
            return torch.randn(t, h, d, generator=gen).to(dev, layout.dtype)

        rows = sizes[-1] * tokens_per_seq
        hq, hkv, d, dv = layer.num_heads, layer.num_kv_heads, layer.head_dim, layer.v_dim
        runner.capture(rand(rows, hq, d), rand(rows, hkv, d), rand(rows, hkv, dv))
        # An eager step larger than every capture, on a cache of its own, before the replays:
        # what a backend allocates for it must not move what the captured steps write into.
        big = 5 * rows
        big_pages = -(-big // p)
        table = torch.arange(1, big_pages + 1, dtype=torch.int32)[None, :]
        meta = AttentionMetadata.from_seqlens([big], [big], table, p, device=dev)
        values = None if layout.mla else rand(big, hkv, dv)
        subject.forward(rand(big, hq, d), rand(big, hkv, d), values,
                        layout.allocate(big_pages + 1, dev), subject.plan(meta), layer)  # fmt: skip
        r = random.Random(tokens_per_seq)
        for b in (1, 2, 3, 5, 8):
            if level >= GraphSupport.ANY_BATCH:
                q_lens = [r.randint(0, tokens_per_seq) for _ in range(b)]
                q_lens[0] = max(q_lens[0], 1)
            else:
                q_lens = [tokens_per_seq] * b
            seq = [q + r.randint(0, max_pages * p - q) for q in q_lens]
            pages = r.sample(range(1, num_pages), b * max_pages)
            table = torch.tensor(pages, dtype=torch.int32).view(b, max_pages)
            meta = AttentionMetadata.from_seqlens(q_lens, seq, table, p, device=dev)
            t = meta.num_tokens
            q, k, v = rand(t, hq, d), rand(t, hkv, d), rand(t, hkv, dv)
            got = runner(meta, q, k, v).clone()
            eager_lse = torch.full((t, layer.num_heads), float("nan"), device=dev)
            lse = {"lse": eager_lse} if with_lse else {}
            values = None if layout.mla else v
            plan = subject.plan(meta)
            want = subject.forward(q, k, values, eager_cache, plan, layer, **lse)[:t]
            self._assert_output(got, want, layout)
            if with_lse:
                self._assert_lse(static_lse[:t], eager_lse, layout)
            assert_same_cache(graph_cache, eager_cache, meta, exact=True)
