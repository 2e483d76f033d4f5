"""Backends that differ from the reference in what they declare, for refusal tests."""

from __future__ import annotations

import dataclasses

from attnsdk import Feature
from attnsdk.backends.reference import ReferenceBackend


class NoTreesBackend(ReferenceBackend):
    """The reference without ``Feature.TREE_MASK`` (like flashinfer): tree steps are refused."""

    name = "no-trees"
    capabilities = dataclasses.replace(
        ReferenceBackend.capabilities,
        features=ReferenceBackend.capabilities.features - {Feature.TREE_MASK},
    )


class NoCrossBackend(ReferenceBackend):
    """The reference without ``Feature.CROSS_ATTENTION`` or ``Feature.RAGGED``."""

    name = "no-cross"
    capabilities = dataclasses.replace(
        ReferenceBackend.capabilities,
        features=ReferenceBackend.capabilities.features - {Feature.CROSS_ATTENTION, Feature.RAGGED},
    )


class RaggedCrossOnlyBackend(ReferenceBackend):
    """The reference without paged ``Feature.CROSS_ATTENTION`` but with ``Feature.RAGGED``
    (like flashinfer): cross-attention chunks only through ``forward_ragged``."""

    name = "ragged-cross-only"
    capabilities = dataclasses.replace(
        ReferenceBackend.capabilities,
        features=ReferenceBackend.capabilities.features - {Feature.CROSS_ATTENTION},
    )
