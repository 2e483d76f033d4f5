"""The drop-in vLLM backend on attnsdk's ``reference`` backend, registrable by class path.

vLLM registers and resolves attention backends by dotted class path
(``register_backend(AttentionBackendEnum.CUSTOM, "module.Class")``). tests/engines is on
PYTHONPATH, so this module is ``vllm_engine.attnsdk_ref`` both to the tests and to vLLM's
resolver, which therefore hand out the same class objects.
"""

from __future__ import annotations

import functools
from typing import Any

from attnsdk import AttentionConfig
from attnsdk.adapters.vllm import (
    AttnSDKAttentionBackend,
    AttnSDKMLABackend,
    AttnSDKMLAPrefillBackend,
)

REF = "vllm_engine.attnsdk_ref.Ref"
REF_DEBUG = "vllm_engine.attnsdk_ref.RefDebug"
MISSCALED = "vllm_engine.attnsdk_ref.Misscaled"


class Ref(AttnSDKAttentionBackend):  # type: ignore[misc,valid-type]
    """attnsdk's reference backend behind vLLM's ``AttentionBackend`` API."""

    attnsdk_backend = "reference"


class RefDebug(AttnSDKAttentionBackend):  # type: ignore[misc,valid-type]
    """The same in attnsdk's debug mode: every plan and forward validated against the cache."""

    attnsdk_backend = AttentionConfig(backend="reference", debug=True)


class Misscaled(Ref):
    """A deliberately broken backend (softmax scale doubled): vLLM's harness must reject it."""

    @classmethod
    def get_impl_cls(cls) -> type:
        return _misscaled(super().get_impl_cls())


@functools.cache
def _misscaled(base: type) -> type:
    def __init__(self: Any, num_heads: int, head_size: int, scale: float, *a: Any, **k: Any):
        base.__init__(self, num_heads, head_size, 2 * scale, *a, **k)

    return type("MisscaledImpl", (base,), {"__init__": __init__})


REF_MLA = "vllm_engine.attnsdk_ref.RefMLA"


class RefMLA(AttnSDKMLABackend):  # type: ignore[misc,valid-type]
    """attnsdk's reference backend serving vLLM's MLA layers' decode rows."""

    attnsdk_backend = "reference"


class FlexMLA(AttnSDKMLABackend):  # type: ignore[misc,valid-type]
    """attnsdk's flex backend for MLA decode: dims within 256, no fp8 (vLLM's check refuses)."""

    attnsdk_backend = "flex"


REF_MLA_PREFILL = "vllm_engine.attnsdk_ref.RefMLAPrefill"


class RefMLAPrefill(AttnSDKMLAPrefillBackend):  # type: ignore[misc,valid-type]
    """attnsdk's reference backend serving vLLM's MLA prefill (new tokens, context chunks)."""

    attnsdk_backend = "reference"


FLEX_MLA_PREFILL = "vllm_engine.attnsdk_ref.FlexMLAPrefill"


class FlexMLAPrefill(AttnSDKMLAPrefillBackend):  # type: ignore[misc,valid-type]
    """attnsdk's flex backend, which has no ragged attention: vLLM's selection refuses it."""

    attnsdk_backend = "flex"


REF_FRESH = "vllm_engine.attnsdk_ref.RefFresh"


class RefFresh(AttnSDKAttentionBackend):  # type: ignore[misc,valid-type]
    """The drop-in over a reference backend instance a test sets (``fresh()``), so what the
    model's start-up prepared (``Backend.prepared``) is that test's alone."""

    attnsdk_backend = None


def fresh() -> Any:
    """A new reference backend behind ``RefFresh``; returns it."""
    from attnsdk import create_backend

    RefFresh.attnsdk_backend = create_backend("reference")
    return RefFresh.attnsdk_backend


NO_SOFTCAP = "vllm_engine.attnsdk_ref.NoSoftcapRef"


class NoSoftcapRef(AttnSDKAttentionBackend):  # type: ignore[misc,valid-type]
    """The reference backend without ``Feature.SOFTCAP``: vLLM's selection does not ask about
    soft caps, so a capped model reaches start-up, where the builders refuse it."""

    attnsdk_backend = None


def no_softcap() -> Any:
    """A new reference backend without soft caps behind ``NoSoftcapRef``; returns it."""
    import dataclasses

    from attnsdk import Feature
    from attnsdk.backends.reference import ReferenceBackend

    class NoSoftcap(ReferenceBackend):
        capabilities = dataclasses.replace(
            ReferenceBackend.capabilities,
            features=ReferenceBackend.capabilities.features - {Feature.SOFTCAP},
        )

    NoSoftcapRef.attnsdk_backend = NoSoftcap()
    return NoSoftcapRef.attnsdk_backend


FLEX = "vllm_engine.attnsdk_ref.FlexRef"


class FlexRef(AttnSDKAttentionBackend):  # type: ignore[misc,valid-type]
    """attnsdk's flex backend (no ragged attention) behind vLLM's ``AttentionBackend`` API."""

    attnsdk_backend = "flex"
