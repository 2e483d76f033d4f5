"""The fa3 backend through the conformance suite every backend runs (H200 / sm90 only)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest
from fake_fa3 import fa3_rounding

from attnsdk.testing.conformance import BackendConformance

if TYPE_CHECKING:
    from attnsdk import KVCacheLayout
    from attnsdk.testing import Batch

pytestmark = [pytest.mark.gpu, pytest.mark.sm90, pytest.mark.fa3]


class TestFA3Conformance(BackendConformance):
    backend = "fa3"
    device = "cuda"

    def reference_batch(self, batch: Batch) -> Batch:
        return fa3_rounding(batch)  # q cast to fp8 with an fp8 cache, sinks read as bf16

    def tolerance(self, layout: KVCacheLayout) -> tuple[float, float]:
        # FA3 also rounds the probabilities to fp8 before P·V: twice the fp8-KV tolerance.
        return (0.12, 0.12) if layout.is_quantized else super().tolerance(layout)
