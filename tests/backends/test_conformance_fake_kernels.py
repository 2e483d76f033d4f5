"""fa3 and flashinfer through the conformance suite on the CPU, over their fake kernels.

The fakes (tests/fake_fa3.py, tests/backends/test_flashinfer_cpu.py) compute what the
real kernels document, so everything the backends themselves do is checked here on every
push: the suite's chunked cases, above all, reach the virtual batch with every storage order,
page size and dtype. The real kernels run the same suite in tests/gpu.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import TYPE_CHECKING

import pytest
import torch
from fake_fa3 import CPUFA3, fake_fa3
from test_flashinfer_cpu import CPUFlashInfer, fake_flashinfer

from attnsdk.backends import flashinfer as fi_module
from attnsdk.testing.conformance import BackendConformance

if TYPE_CHECKING:
    from collections.abc import Iterator

    from attnsdk import Backend, KVCacheLayout
    from attnsdk.testing import Batch

FP8 = torch.float8_e4m3fn


class TestFakeFA3Conformance(BackendConformance):
    backend = "fa3"
    device = "cpu"

    @pytest.fixture(scope="class")
    @classmethod
    def subject(cls) -> Iterator[Backend]:
        with pytest.MonkeyPatch.context() as mp:
            fake_fa3(mp)
            yield CPUFA3()

    def reference_batch(self, batch: Batch) -> Batch:
        """As tests/gpu/test_conformance_fa3.py: q cast to fp8 for an fp8 cache, sinks bf16."""
        q = batch.q
        if batch.cache.layout.is_quantized:
            fp8_max = torch.finfo(FP8).max
            q = q.clamp(-fp8_max, fp8_max).to(FP8).to(q.dtype)
        sinks = None if batch.sinks is None else batch.sinks.to(torch.bfloat16).float()
        return dataclasses.replace(batch, q=q, sinks=sinks)

    def tolerance(self, layout: KVCacheLayout) -> tuple[float, float]:
        return (0.06, 0.06) if layout.is_quantized else super().tolerance(layout)


class TestFakeFlashInferConformance(BackendConformance):
    backend = "flashinfer"
    device = "cpu"

    @pytest.fixture(scope="class")
    @classmethod
    def subject(cls) -> Iterator[Backend]:
        with pytest.MonkeyPatch.context() as mp:
            mp.setitem(sys.modules, "flashinfer", fake_flashinfer())
            mp.setattr(fi_module, "module_present", lambda name: True)
            yield CPUFlashInfer()
