"""Steps and layers past the matrix: speculative-tree verify, cross-attention and multi-head
latent attention (MLA), each refused before anything is written by a backend that does not
declare it."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import pytest
import torch

from attnsdk.contract.capabilities import step_uses
from attnsdk.testing._spec import BatchSpec
from attnsdk.testing.conformance._cases import (
    CROSS_FEATURES,
    MLA_FEATURES,
    MLA_PRESETS,
    PRESETS,
    TREE_FEATURES,
    TREE_PRESETS,
)
from attnsdk.testing.conformance._harness import Harness, refused

if TYPE_CHECKING:
    from attnsdk.contract.backend import Backend
    from attnsdk.contract.metadata import AttentionMetadata
    from attnsdk.testing._batch import Batch


class StepCases(Harness):
    """Tree verify, cross-attention and MLA: output, log-sum-exp and cache as the reference's."""

    @pytest.mark.parametrize("preset", TREE_PRESETS)
    @pytest.mark.parametrize("feature", TREE_FEATURES)
    def test_tree_verify(
        self, subject: Backend, oracle: Backend, feature: str, preset: str
    ) -> None:
        """Speculative-tree verify (``AttentionMetadata.tree_mask``, random draft trees):
        output, log-sum-exp and cache match the reference, and the tree moves the output away
        from a causal chain's (a backend that ignores the mask fails). A backend without
        ``Feature.TREE_MASK`` must refuse the step before writing; the case is then skipped."""
        for batch in self._batches(subject, feature, PRESETS[preset], tree=True):
            self._require_step(subject, batch)
            self._compare_with_lse(subject, oracle, batch)
            # Every tree preset has a sequence of several draft tokens, and _batch makes two of
            # them siblings; ignoring the mask must then fail the comparison above by a margin:
            # the causal chain's output is off by twice the tolerance somewhere.
            assert _branches(batch.metadata), "the tree is a causal chain: it proves nothing"
            chain = dataclasses.replace(batch.metadata, tree_mask=None)
            ref, _ = self.reference_batch(batch).run(oracle)
            causal, _ = self.reference_batch(dataclasses.replace(batch, metadata=chain)).run(oracle)
            atol, rtol = self.tolerance(batch.cache.layout)
            gap = (causal.float() - ref.float()).abs() - 2 * (atol + rtol * ref.float().abs())
            assert float(gap.max()) > 0, "a causal chain is within twice the tolerance"

    @pytest.mark.parametrize("feature", CROSS_FEATURES)
    def test_cross_attention(self, subject: Backend, oracle: Backend, feature: str) -> None:
        """Cross-attention (``AttentionMetadata.cross_attention``): decoder rows over an
        encoder's keys, with more queries than keys and an empty encoder among them: output and
        log-sum-exp match the reference and the cache is untouched. A backend without
        ``Feature.CROSS_ATTENTION`` must refuse the step before writing; it is then skipped."""
        for batch in self._batches(subject, feature, _cross_attention):
            self._require_step(subject, batch)
            self._compare_with_lse(subject, oracle, batch)

    @pytest.mark.parametrize("preset", MLA_PRESETS)
    @pytest.mark.parametrize("feature", MLA_FEATURES)
    def test_mla(self, subject: Backend, oracle: Backend, feature: str, preset: str) -> None:
        """Multi-head latent attention (``LayerSpec.mla`` over a ``KVCacheLayout.mla`` cache,
        k alone, V its latent dims): output, log-sum-exp and the one latent cache match the
        reference on every batch kind. A backend that does not serve the case (``Feature.MLA``,
        ``Capabilities.mla_dims``, fp8) must refuse it before writing; it is then skipped."""
        for batch in self._batches(subject, feature, PRESETS[preset]):
            self._compare_with_lse(subject, oracle, batch)

    def _require_step(self, subject: Backend, batch: Batch) -> None:
        """Skip, with the backend's reasons, a step kind it does not declare (a tree mask,
        cross-attention), after checking that it is refused before anything is written."""
        # A paged step: ragged attention alone does not serve its cross-attention.
        uses = step_uses(batch.metadata)
        reasons = subject.unsupported_reasons(
            batch.layer, batch.cache.layout, self.device, uses=uses
        )
        refused(reasons, subject, batch, with_lse=False)

    def _compare_with_lse(self, subject: Backend, oracle: Backend, batch: Batch) -> None:
        """``_compare``; then, where the backend serves ``lse=`` for the batch's layer: the
        log-sum-exp matches the reference's, and asking for it leaves the output bit for bit."""
        out = self._compare(subject, oracle, batch)
        layer, layout = batch.layer, batch.cache.layout
        uses = step_uses(batch.metadata, lse=True)
        if subject.unsupported_reasons(layer, layout, self.device, uses=uses):
            return
        with_lse, lse, _ = batch.run_with_lse(subject)
        _, ref_lse, _ = self.reference_batch(batch).run_with_lse(oracle)
        assert torch.equal(with_lse, out), "asking for lse= changed the output"
        self._assert_lse(lse, ref_lse, layout)


def _cross_attention(seed: int) -> BatchSpec:
    """``BatchSpec.cross_attention``, checked to hold where cross-attention differs from a
    causal step (several queries over some keys) and a sequence without keys: there by
    construction of the preset, not by seed."""
    spec = BatchSpec.cross_attention(seed=seed)
    rows = list(zip(spec.query_lens, spec.seq_lens))
    assert any(q >= 2 and s >= 1 for q, s in rows), rows
    assert any(q >= 1 and s == 0 for q, s in rows), rows
    return spec


def _branches(meta: AttentionMetadata) -> bool:
    """Whether some draft token of ``meta``'s tree does not see every earlier new token of its
    sequence (the tree is not a plain causal chain, so ignoring it changes the output)."""
    mask = meta.tree_mask
    if mask is None or not meta.num_tokens:
        return False
    qsl = meta.query_start_loc_cpu.long()
    qlen = qsl[1:] - qsl[:-1]
    rows = mask[: meta.num_tokens].cpu()
    index = torch.arange(meta.num_tokens) - torch.repeat_interleave(qsl[:-1], qlen)
    cols = torch.arange(rows.shape[1])
    earlier = cols[None, :] < index[:, None]
    return bool((earlier & ~rows).any())
