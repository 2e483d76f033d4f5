"""``flashinfer``: FlashInfer paged attention (``backend``) over CSR pages (``csr``)."""

from attnsdk.backends.flashinfer.backend import INSTALL_COMMAND, FlashInferBackend
from attnsdk.backends.flashinfer.csr import PagedCSR, build_csr, gather_indices
from attnsdk.backends.flashinfer.options import FlashInferOptions
from attnsdk.backends.flashinfer.plan import FlashInferPlan

__all__ = [
    "INSTALL_COMMAND",
    "FlashInferBackend",
    "FlashInferOptions",
    "FlashInferPlan",
    "PagedCSR",
    "build_csr",
    "gather_indices",
]
