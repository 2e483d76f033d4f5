"""The flex backend through the conformance suite on CUDA (compiled, its default there)."""

from __future__ import annotations

import pytest

from attnsdk.testing.conformance import BackendConformance

pytestmark = pytest.mark.gpu


class TestFlexConformanceCUDA(BackendConformance):
    backend = "flex"
    device = "cuda"
    page_size = 16
    page_sizes = (16, 32, 64)
