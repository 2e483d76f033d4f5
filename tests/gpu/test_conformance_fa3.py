"""The fa3 backend through the conformance suite every backend runs (H200 / sm90 only)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import pytest
import torch

from attnsdk.testing.conformance import BackendConformance

if TYPE_CHECKING:
    from attnsdk import KVCacheLayout
    from attnsdk.testing import Batch

pytestmark = [pytest.mark.gpu, pytest.mark.sm90, pytest.mark.fa3]

FP8 = torch.float8_e4m3fn


class TestFA3Conformance(BackendConformance):
    backend = "fa3"
    device = "cuda"

    def reference_batch(self, batch: Batch) -> Batch:
        """What FA3 documents it computes with: q cast to fp8 (clamped) when the KV cache is
        fp8, and sinks read as bf16."""
        q = batch.q
        if batch.cache.layout.is_quantized:
            fp8_max = torch.finfo(FP8).max
            q = q.clamp(-fp8_max, fp8_max).to(FP8).to(q.dtype)
        sinks = None if batch.sinks is None else batch.sinks.to(torch.bfloat16).float()
        return dataclasses.replace(batch, q=q, sinks=sinks)

    def tolerance(self, layout: KVCacheLayout) -> tuple[float, float]:
        # FA3 also rounds the probabilities to fp8 before P·V: twice the fp8-KV tolerance.
        return (0.12, 0.12) if layout.is_quantized else super().tolerance(layout)
