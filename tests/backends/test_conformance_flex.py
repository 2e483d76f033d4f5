"""The flex backend runs the conformance suite on the CPU (eager flex: compile=False)."""

from __future__ import annotations

from attnsdk import AttentionConfig
from attnsdk.testing.conformance import BackendConformance


class TestFlexConformance(BackendConformance):
    backend = AttentionConfig(backend="flex", compile=False)
    device = "cpu"
    page_size = 16
    page_sizes = (16, 32, 64)
