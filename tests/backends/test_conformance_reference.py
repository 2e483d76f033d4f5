"""The reference backend through the conformance suite every backend runs, on the CPU."""

from __future__ import annotations

from attnsdk.testing.conformance import BackendConformance


class TestReferenceConformance(BackendConformance):
    backend = "reference"
    device = "cpu"
