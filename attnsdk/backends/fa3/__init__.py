"""``fa3``: FlashAttention-3 on Hopper (``backend``), its kernel providers (``kernels``)."""

from attnsdk.backends.fa3.backend import FA3Backend, FA3Options, FA3Plan

__all__ = ["FA3Backend", "FA3Options", "FA3Plan"]
