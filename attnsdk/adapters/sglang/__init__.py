"""SGLang adapter: ``ForwardBatch`` → ``AttentionMetadata`` and a drop-in attention backend.

No sglang import until the drop-in class is first used: batch objects are read by SGLang's
attribute names, and ``SGLangAttentionBackend`` is built on first access, subclassing SGLang's
``AttentionBackend`` when SGLang is installed. Mock batch objects for tests live in
``attnsdk.adapters.sglang.testing``. Guide: docs/adapters/sglang.md.
"""

from typing import TYPE_CHECKING, Any

from attnsdk.adapters.sglang._adapter import Lengths, SGLangAdapter
from attnsdk.adapters.sglang._backend import SGLANG_VERSIONS
from attnsdk.adapters.sglang._modes import StepKind, step_kind

if TYPE_CHECKING:
    from attnsdk.adapters.sglang._backend import (
        SGLangAttentionBackendImpl as SGLangAttentionBackend,
    )

__all__ = [
    "SGLANG_VERSIONS",
    "Lengths",
    "SGLangAdapter",
    "SGLangAttentionBackend",
    "StepKind",
    "step_kind",
]


def __getattr__(name: str) -> Any:
    if name == "SGLangAttentionBackend":
        from attnsdk.adapters.sglang._backend import sglang_backend_class

        return sglang_backend_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
