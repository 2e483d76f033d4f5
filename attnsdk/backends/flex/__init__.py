"""``flex``: torch FlexAttention over the paged cache (``backend``)."""

from attnsdk.backends.flex.backend import FlexBackend, FlexOptions, FlexPlan

__all__ = ["FlexBackend", "FlexOptions", "FlexPlan"]
