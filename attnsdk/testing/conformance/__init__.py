"""The conformance suite every attnsdk backend runs (needs pytest): ``BackendConformance``, the
pytest class a backend's tests subclass, and ``run_conformance``, its cases without a pytest
session.

One module per subject: ``_cases`` (feature layers and batch presets), ``_cache`` (copying and
comparing KV caches), ``_harness`` (the attributes, hooks, fixtures and helpers every case
shares), the cases in ``_matrix``, ``_lifecycle``, ``_steps`` (tree, cross-attention, MLA),
``_ragged``, ``_lse`` and ``_graphs``, combined in ``_suite``; ``_runner`` runs them.
"""

from attnsdk.testing.conformance._cases import CHUNK_PRESETS, FEATURES, PRESETS, FeatureCase
from attnsdk.testing.conformance._runner import CaseResult, run_conformance
from attnsdk.testing.conformance._suite import BackendConformance

__all__ = [
    "CHUNK_PRESETS",
    "FEATURES",
    "PRESETS",
    "BackendConformance",
    "CaseResult",
    "FeatureCase",
    "run_conformance",
]
