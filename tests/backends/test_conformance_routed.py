"""The routed backend through the conformance suite on the CPU: decode and mixed steps on the
reference, prefill steps on flex, over one shared cache."""

from __future__ import annotations

from attnsdk import AttentionConfig
from attnsdk.testing.conformance import BackendConformance


class TestRoutedConformance(BackendConformance):
    backend = AttentionConfig(
        backend="routed", decode="reference", prefill="flex", mixed="reference"
    )
    device = "cpu"
