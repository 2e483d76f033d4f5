"""The log-sum-exp (``lse=``, docs/kv_layout.md): the reference's on every preset and feature,
the output bit for bit as without it, and split-and-merge (the cascade / shared-prefix use)
equal to one pass."""

from __future__ import annotations

import dataclasses
import random
from typing import TYPE_CHECKING, Any

import pytest
import torch

from attnsdk.contract.capabilities import Feature, step_uses
from attnsdk.contract.metadata import AttentionMetadata
from attnsdk.kernels.merge import merge_states
from attnsdk.testing._spec import BatchSpec
from attnsdk.testing.conformance._cache import assert_same_cache
from attnsdk.testing.conformance._cases import LSE_FEATURES, PRESETS, SPLIT_FEATURES, mixed
from attnsdk.testing.conformance._harness import Harness, refused, skip_declared, without_sinks

if TYPE_CHECKING:
    from attnsdk.contract.backend import Backend
    from attnsdk.contract.layer import LayerSpec
    from attnsdk.testing._batch import Batch


class LseCases(Harness):
    """``lse=`` against the reference's, and attention split in two passes merged by
    ``attnsdk.merge_states`` against one pass."""

    @pytest.mark.parametrize(
        ("feature", "preset"),
        [("mha", p) for p in sorted(PRESETS)] + [(f, "mixed") for f in LSE_FEATURES],
        ids=[f"mha-{p}" for p in sorted(PRESETS)] + list(LSE_FEATURES),
    )
    def test_lse(self, subject: Backend, oracle: Backend, feature: str, preset: str) -> None:
        """``lse=`` matches the reference's log-sum-exp; the output is bit for bit the one
        without it; refusals (``unsupported_reasons(..., uses=(Feature.LSE,))``) write nothing."""
        for batch in self._batches(subject, feature, PRESETS.get(preset, mixed)):
            layout = batch.cache.layout
            self._require_lse(subject, batch)
            out, lse, cache = batch.run_with_lse(subject)
            plain, _ = batch.run(subject)
            ref_out, ref_lse, ref_cache = self.reference_batch(batch).run_with_lse(oracle)
            self._assert_output(out, ref_out, layout)
            assert torch.equal(out, plain), "asking for lse= changed the output"
            self._assert_lse(lse, ref_lse, layout)
            assert_same_cache(cache, ref_cache, batch.metadata, exact=not layout.is_quantized)
            if batch.layer.has_sinks and batch.metadata.num_tokens:
                _, without, _ = self.reference_batch(without_sinks(batch)).run_with_lse(oracle)
                gap = float((ref_lse - without).abs().max())
                assert gap > 10 * self.lse_tolerance(layout)[0], f"sinks moved lse by {gap:.3g}"

    @pytest.mark.parametrize("kind", ["decode", "extend"])
    @pytest.mark.parametrize("feature", SPLIT_FEATURES)
    def test_lse_split_and_merge_equals_one_pass(
        self, subject: Backend, feature: str, kind: str
    ) -> None:
        """Cascade attention: a non-causal pass over the first pages of each sequence and a
        causal pass over the rest (the sinks in that one only), merged with
        ``attnsdk.merge_states``, equal one pass over all keys, output and lse."""
        layer, layout = self._case(subject, feature)
        prefix_layer = dataclasses.replace(layer, causal=False, has_sinks=False)
        dev = torch.device(self.device)
        reasons = [
            *subject.unsupported_reasons(layer, layout, dev, uses=(Feature.LSE,)),
            *subject.unsupported_reasons(prefix_layer, layout, dev, uses=(Feature.LSE,)),
        ]
        if reasons:
            skip_declared(sorted(set(reasons)))
        p = layout.page_size
        r = random.Random(f"{feature}-{kind}")
        n = [1 if kind == "decode" else r.randint(1, 7) for _ in range(5)]
        prefix_pages = [max(r.randint(1, 3), -(-q // p)) for q in n]  # prefix_len >= query_len
        suffix = [q + r.randint(0, 2 * p) for q in n]  # the new tokens sit in the suffix
        seq = [m * p + s for m, s in zip(prefix_pages, suffix)]
        batch = self._batch(layer, layout, BatchSpec(tuple(n), tuple(seq)), seed=len(feature))
        cache = batch.fresh_cache()
        sinks = {"sinks": batch.sinks} if layer.has_sinks else {}

        def attend(
            lens: list[int], table: torch.Tensor, spec: LayerSpec, *, write: bool, **kw: Any
        ) -> tuple[torch.Tensor, torch.Tensor]:
            meta = AttentionMetadata.from_seqlens(n, lens, table, p, device=dev)
            lse = torch.full((batch.q.shape[0], spec.num_heads), float("nan"), device=dev)
            k, v = (batch.k, batch.v) if write else (None, None)
            out = subject.forward(batch.q, k, v, cache, subject.plan(meta), spec, lse=lse, **kw)
            return out, lse

        table = batch.metadata.page_table.cpu()
        full, full_lse = attend(seq, table, layer, write=True, **sinks)
        # The parts read the cache the full pass wrote: each its own page table and lengths.
        prefix_table = _rows(table, [(0, m) for m in prefix_pages])
        suffix_table = _rows(table, [(m, m + -(-s // p)) for m, s in zip(prefix_pages, suffix)])
        prefix_lens = [m * p for m in prefix_pages]
        out_a, lse_a = attend(prefix_lens, prefix_table, prefix_layer, write=False)
        out_b, lse_b = attend(suffix, suffix_table, layer, write=False, **sinks)
        out, lse = merge_states(out_a, lse_a, out_b, lse_b)
        self._assert_output(out, full, layout)
        self._assert_lse(lse, full_lse, layout)

    def _require_lse(self, subject: Backend, batch: Batch) -> None:
        """Skip, with its reasons, a case whose ``lse=`` the backend declares it cannot fill,
        after checking that forward refuses it and writes nothing."""
        dev = torch.device(self.device)
        uses = step_uses(batch.metadata, lse=True)
        reasons = subject.unsupported_reasons(batch.layer, batch.cache.layout, dev, uses=uses)
        refused(reasons, subject, batch, with_lse=True)


def _rows(table: torch.Tensor, spans: list[tuple[int, int]]) -> torch.Tensor:
    """A page table whose row b is ``table[b, start:stop]``, padded with the reserved page 0."""
    width = max(1, *(stop - start for start, stop in spans))
    rows = torch.zeros(len(spans), width, dtype=table.dtype)
    for b, (start, stop) in enumerate(spans):
        rows[b, : stop - start] = table[b, start:stop]
    return rows
