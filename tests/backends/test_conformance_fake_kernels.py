"""fa3 and flashinfer through the conformance suite on the CPU, over their fake kernels.

The fakes (tests/fake_fa3.py, tests/backends/test_flashinfer_cpu.py) compute what the
real kernels document, so everything the backends themselves do is checked here on every
push: the suite's chunked cases, above all, reach the virtual batch with every storage order,
page size and dtype. The real kernels run the same suite in tests/gpu.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import pytest
from fake_fa3 import CPUFA3, fa3_rounding, fake_fa3
from test_flashinfer_cpu import CPUFlashInfer, fake_flashinfer

from attnsdk.backends.flashinfer import backend as fi_module
from attnsdk.testing.conformance import BackendConformance

if TYPE_CHECKING:
    from collections.abc import Iterator

    from attnsdk import Backend, KVCacheLayout
    from attnsdk.testing import Batch


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
        return fa3_rounding(batch)

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
