"""The matrix: every batch preset on the plain layer, every feature on a mixed batch, every
storage order and page size, chunks where they matter, each dtype with a few features."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from attnsdk.testing.conformance._cases import (
    CHUNK_PRESETS,
    CHUNKED,
    DTYPE_FEATURES,
    FEATURES,
    MLA_FEATURES,
    ORDERS,
    PRESETS,
    chunk_edges_64,
    mixed,
)
from attnsdk.testing.conformance._harness import Harness, without_sinks

if TYPE_CHECKING:
    from collections.abc import Iterable

    import torch

    from attnsdk.contract.backend import Backend
    from attnsdk.testing._batch import Batch


class MatrixCases(Harness):
    """Output and cache against the reference over the covering design of batches, features,
    storage orders, page sizes and dtypes."""

    @pytest.mark.parametrize("preset", sorted(PRESETS))
    def test_preset(self, subject: Backend, oracle: Backend, preset: str) -> None:
        """Every batch shape an engine produces, on the plain (MHA) layer."""
        self._check(subject, oracle, self._batches(subject, "mha", PRESETS[preset]))

    @pytest.mark.parametrize("feature", sorted(set(FEATURES) - set(MLA_FEATURES)))
    def test_feature(self, subject: Backend, oracle: Backend, feature: str) -> None:
        """Every feature of DESIGN §2 on mixed batches."""
        self._check(subject, oracle, self._batches(subject, feature, mixed))

    @pytest.mark.parametrize("order", ORDERS)
    def test_layout(self, subject: Backend, oracle: Backend, order: str, page_size: int) -> None:
        """Storage orders (NHD, HND, packed K‖V) and page sizes on mixed batches."""
        batches = self._batches(subject, "gqa", mixed, order=order, page_size=page_size)
        self._check(subject, oracle, batches)

    @pytest.mark.parametrize("preset", sorted(CHUNK_PRESETS))
    @pytest.mark.parametrize("feature", CHUNKED)
    def test_chunked(self, subject: Backend, oracle: Backend, feature: str, preset: str) -> None:
        """Chunked local attention where chunks matter: rows on chunk edges (decode on a
        chunk's first and last position, extends across and from a boundary, a prefill over
        several chunks), decode and verify rows anywhere, graph padding."""
        self._check(subject, oracle, self._batches(subject, feature, CHUNK_PRESETS[preset]))

    @pytest.mark.parametrize("order", ORDERS)
    def test_chunked_layout(
        self, subject: Backend, oracle: Backend, order: str, page_size: int
    ) -> None:
        """Chunks of 64 over each storage order and page size."""
        batches = self._batches(
            subject, "chunked-64", chunk_edges_64, order=order, page_size=page_size
        )
        self._check(subject, oracle, batches)

    @pytest.mark.parametrize("feature", DTYPE_FEATURES)
    def test_dtype(
        self, subject: Backend, oracle: Backend, feature: str, dtype: torch.dtype
    ) -> None:
        """Each compute dtype with a few features; undeclared dtypes must be refused."""
        self._check(subject, oracle, self._batches(subject, feature, mixed, dtype=dtype))

    def _check(self, subject: Backend, oracle: Backend, batches: Iterable[Batch]) -> None:
        """Each batch: output and cache as the reference's (``_compare``), and sinks, where
        the layer has them, move the output."""
        for batch in batches:
            out = self._compare(subject, oracle, batch)
            if batch.layer.has_sinks and batch.metadata.num_tokens:
                # A backend that ignores sinks must fail: they move the output well past the
                # tolerance (checked here, so the case cannot pass vacuously).
                without, _ = self.reference_batch(without_sinks(batch)).run(oracle)
                gap = float((out.float() - without.float()).abs().max())
                atol, _ = self.tolerance(batch.cache.layout)
                assert gap > 10 * atol, f"sinks moved the output by only {gap:.3g}"
