"""The flashinfer backend through the conformance suite every backend runs (sm80+ GPU)."""

from __future__ import annotations

import pytest

from attnsdk.testing.conformance import BackendConformance

pytestmark = [pytest.mark.gpu, pytest.mark.flashinfer]


class TestFlashInferConformance(BackendConformance):
    backend = "flashinfer"
    device = "cuda"
