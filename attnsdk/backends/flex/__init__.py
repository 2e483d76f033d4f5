"""``flex``: torch FlexAttention over the paged cache (``backend``), its options (``options``),
the per-step block mask (``mask``) and the flex call (``kernel``)."""

from attnsdk.backends.flex.backend import FlexBackend, FlexPlan
from attnsdk.backends.flex.options import FlexOptions

__all__ = ["FlexBackend", "FlexOptions", "FlexPlan"]
