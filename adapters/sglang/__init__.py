"""SGLang adapter: ``ForwardBatch`` → ``AttentionMetadata`` and a drop-in attention backend.

No sglang import at run time: batch objects are read by SGLang's attribute names. Mock batch
objects for tests live in ``attnsdk.adapters.sglang.testing``. Guide: docs/adapters/sglang.md.
"""

from attnsdk.adapters.sglang._adapter import Lengths, SGLangAdapter, StepKind, step_kind
from attnsdk.adapters.sglang._backend import SGLangAttentionBackend

__all__ = [
    "Lengths",
    "SGLangAdapter",
    "SGLangAttentionBackend",
    "StepKind",
    "step_kind",
]
