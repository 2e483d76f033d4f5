"""``fa3``: FlashAttention-3 on Hopper (``backend``), its options (``options``), what a step
works out once for all layers (``planner``), its kernel providers (``kernels``) and what it
refuses beyond its capabilities (``refusals``)."""

from attnsdk.backends.fa3.backend import FA3Backend
from attnsdk.backends.fa3.options import FA3Options
from attnsdk.backends.fa3.planner import FA3Plan

__all__ = ["FA3Backend", "FA3Options", "FA3Plan"]
