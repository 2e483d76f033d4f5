"""vLLM's MLA prefill (the expanded path) on an attnsdk backend's ``forward_ragged``.

An MLA layer's prefill in vLLM does not read the latent cache in the kernel: ``MLACommonImpl``
up-projects the new tokens' latents into per-head K (``qk_nope + rope`` dims) and V
(``v_head_dim``), and asks its *MLA prefill backend* (``attention_config.mla_prefill_backend``)
for two things:

* ``run_prefill_new_tokens``: the new tokens causally over themselves (with the log-sum-exp
  when the requests have a cached context);
* ``run_prefill_context_chunk``: the queries over one workspace-sized chunk of that context,
  gathered from the cache and up-projected by vLLM, with no mask, plus the log-sum-exp.

vLLM merges the parts itself. Both calls are ``Backend.forward_ragged`` (docs/kv_layout.md,
"Ragged attention"): the step's plans are made once per step in ``prepare_metadata``, from the
host lengths vLLM's builder already has (no sync), and shared by every layer::

    class FlashInferMLAPrefill(AttnSDKMLAPrefillBackend):
        attnsdk_backend = "flashinfer"

    attnsdk.adapters.vllm.register_mla_prefill("mypkg.attn.FlashInferMLAPrefill")
    # then attention_config={"mla_prefill_backend": "CUSTOM"}

The class subclasses vLLM's ``MLAPrefillBackend``, so it exists only where vLLM is installed.
It serves any MLA decode backend (vLLM's own or ``AttnSDKMLABackend``): the cache is not read
here.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from attnsdk.adapters._common import drop_in_class, ragged_reasons, resolve_backend
from attnsdk.adapters.vllm._backend import VLLM_VERSIONS, serves_compute_capability
from attnsdk.contract.errors import (
    BackendUnavailableError,
    InvalidInputError,
    InvalidMetadataError,
    Reason,
    ReasonKind,
    UnsupportedConfigError,
)
from attnsdk.contract.layer import LayerSpec
from attnsdk.contract.metadata import AttentionMetadata

if TYPE_CHECKING:
    from attnsdk.adapters.vllm._resolve import BackendSpec
    from attnsdk.contract.plan import Plan

__all__ = ["AttnSDKMLAPrefillBackendBase", "vllm_mla_prefill_class"]

_PREFILL_MODULE = "vllm.v1.attention.backends.mla.prefill.base"


def expanded_layer(
    num_heads: int, qk_head_dim: int, v_head_dim: int, scale: float | None
) -> LayerSpec:
    """The expanded MLA layer a prefill attends with: one KV head per query head, K of
    ``qk_nope + rope`` dims, V of ``v_head_dim``, causal (a context chunk replaces that)."""
    return LayerSpec(
        num_heads=num_heads,
        num_kv_heads=num_heads,
        head_dim=qk_head_dim,
        v_head_dim=v_head_dim,
        scale=scale,
    )


@dataclasses.dataclass(frozen=True)
class _StepPlans:
    """The plans of one step's prefill: the new tokens, then one per context chunk (in
    ``chunked_context.chunks`` order), for the prefill metadata they were made from."""

    metadata: Any
    new_tokens: Plan
    chunks: tuple[Plan, ...]
    chunk_objects: tuple[Any, ...]
    """vLLM's ``ContextChunk`` objects the chunk plans describe (a call names one of them)."""


class AttnSDKMLAPrefillBackendBase:
    """vLLM's ``MLAPrefillBackend`` on ``forward_ragged``. Use it as
    ``attnsdk.adapters.vllm.AttnSDKMLAPrefillBackend``; set ``attnsdk_backend`` in a subclass."""

    attnsdk_backend: ClassVar[BackendSpec] = None

    @staticmethod
    def get_name() -> str:
        return "ATTNSDK"

    @classmethod
    def is_available(cls) -> bool:
        try:
            resolve_backend(cls.attnsdk_backend)
        except BackendUnavailableError:
            return False
        return True

    @classmethod
    def supports_compute_capability(cls, device_capability: Any) -> bool:
        if device_capability is None or not cls.is_available():
            return True  # a CPU backend; an unavailable one is refused by is_available
        return serves_compute_capability(resolve_backend(cls.attnsdk_backend), device_capability)

    @classmethod
    def validate_configuration(cls, device_capability: Any, selector_config: Any) -> list[str]:
        """vLLM's checks (device, dtype, availability) plus the attnsdk backend's ragged
        reasons for the model's expanded layer (a ragged-less backend is refused here, at
        selection, not in the first prefill)."""
        reasons: list[str] = super().validate_configuration(  # type: ignore[misc]
            device_capability, selector_config
        )
        dims = selector_config.mla_dimensions
        if reasons or not dims.v_head_dim:
            return reasons  # unavailable, or vLLM did not know the model's dims yet
        layer = expanded_layer(
            1, dims.qk_nope_head_dim + dims.qk_rope_head_dim, dims.v_head_dim, None
        )
        device = "cuda" if device_capability is not None else None
        backend = resolve_backend(cls.attnsdk_backend)
        return [str(r) for r in ragged_reasons(backend, layer, device)]

    def __init__(
        self,
        num_heads: int,
        scale: float,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        vllm_config: Any,
    ) -> None:
        super().__init__(  # type: ignore[call-arg]  # vLLM's MLAPrefillBackend
            num_heads=num_heads,
            scale=scale,
            kv_lora_rank=kv_lora_rank,
            qk_nope_head_dim=qk_nope_head_dim,
            qk_rope_head_dim=qk_rope_head_dim,
            v_head_dim=v_head_dim,
            vllm_config=vllm_config,
        )
        self.backend = resolve_backend(self.attnsdk_backend)
        self.layer = expanded_layer(
            num_heads, qk_nope_head_dim + qk_rope_head_dim, v_head_dim, scale
        )
        reasons = ragged_reasons(self.backend, self.layer, None)
        if reasons:
            raise UnsupportedConfigError(
                "AttnSDKMLAPrefillBackend cannot serve this model:", reasons
            )
        self.context_layer = dataclasses.replace(self.layer, causal=False)
        """A context chunk: every key is before the queries (``cross_attention`` plans)."""
        self._plans: _StepPlans | None = None

    def supports_out(self) -> bool:
        """True: both calls write into a caller's ``out`` (tokens, heads, v_head_dim)."""
        return True

    def prepare_metadata(self, prefill_metadata: Any) -> None:
        """Once per step (vLLM's builder): plan the new tokens and every context chunk from
        host lengths (``query_lens_cpu``, each chunk's host ``seq_lens``); ``for_ragged`` moves
        them in one pinned, non-blocking copy per plan, so nothing syncs."""
        super().prepare_metadata(prefill_metadata)  # type: ignore[misc]
        query_lens = prefill_metadata.query_lens_cpu
        if query_lens is None:
            raise InvalidMetadataError(
                "prefill_metadata.query_lens_cpu",
                "the prefills' host query lengths (vLLM's builder sets them)",
                None,
            )
        device = prefill_metadata.query_start_loc.device
        plan = self.backend.plan
        new_tokens = plan(AttentionMetadata.for_ragged(query_lens, query_lens, device=device))
        context = prefill_metadata.chunked_context
        objects = tuple(context.chunks) if context is not None else ()
        chunks = tuple(
            plan(
                AttentionMetadata.for_ragged(
                    query_lens[chunk.request_slice],
                    chunk.seq_lens,
                    device=device,
                    cross_attention=True,
                )
            )
            for chunk in objects
        )
        self._plans = _StepPlans(prefill_metadata, new_tokens, chunks, objects)

    def run_prefill_new_tokens(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        return_softmax_lse: bool,
        out: torch.Tensor | None = None,
        output_scale: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The prefills' new tokens, causal over themselves: (tokens, heads, v_head_dim), and
        the log-sum-exp (heads, tokens) when asked (vLLM merges it with the context's)."""
        if output_scale is not None:
            raise UnsupportedConfigError(
                "AttnSDKMLAPrefillBackend cannot serve this call:",
                [Reason(ReasonKind.CONFIGURATION, "output_scale",
                        "must be None: fused fp8 output is not offered (supports_quant_output)")],
            )  # fmt: skip
        return self._attend(q, k, v, self._step().new_tokens, self.layer, out, return_softmax_lse)

    def run_prefill_context_chunk(
        self,
        chunk: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The queries of ``chunk``'s requests over its context keys, no mask, and the
        log-sum-exp (heads, tokens). A request without keys in the chunk would get zeros and an
        lse of -inf (vLLM's chunk planner leaves such requests out)."""
        step = self._step()
        index = getattr(chunk, "index", None)
        if not isinstance(index, int) or not 0 <= index < len(step.chunks):
            raise InvalidMetadataError(
                "chunk.index", f"one of the {len(step.chunks)} planned context chunks", index
            )
        if step.chunk_objects[index] is not chunk:
            raise InvalidMetadataError(
                "chunk",
                "a context chunk of the prefill metadata prepare_metadata planned",
                f"another chunk {index}",
            )
        result = self._attend(q, k, v, step.chunks[index], self.context_layer, out, True)
        assert isinstance(result, tuple)
        return result

    def _step(self) -> _StepPlans:
        plans = self._plans
        if plans is None or plans.metadata is not getattr(self, "_prefill_metadata", None):
            raise InvalidMetadataError(
                "prepare_metadata",
                "called by vLLM's builder for this step before the prefill runs",
                "no plans for the current prefill metadata",
            )
        return plans

    def _attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        plan: Plan,
        layer: LayerSpec,
        out: torch.Tensor | None,
        want_lse: bool,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        rows = plan.metadata.num_tokens
        if q.shape[0] != rows:  # more rows would come back unwritten
            raise InvalidInputError("q.shape[0]", f"{rows} (the rows this part was planned for)",
                                    q.shape[0])  # fmt: skip
        lse = (
            torch.empty(q.shape[0], layer.num_heads, dtype=torch.float32, device=q.device)
            if want_lse
            else None
        )
        o = self.backend.forward_ragged(q, k, v, plan, layer, out=out, lse=lse)
        if lse is None:
            return o
        # attnsdk's lse is (tokens, heads); vLLM's merges read (heads, tokens), contiguous.
        return o, lse.t().contiguous()


@functools.cache
def vllm_mla_prefill_class() -> type:
    """The public ``AttnSDKMLAPrefillBackend``, subclassing vLLM's ``MLAPrefillBackend``.
    Raises ``BackendUnavailableError`` where vLLM (0.33 or later) is not installed."""
    VLLM_VERSIONS.check()
    try:
        importlib.import_module(_PREFILL_MODULE)
    except ImportError as err:
        raise BackendUnavailableError(
            f"AttnSDKMLAPrefillBackend subclasses vLLM's MLA prefill backend ({_PREFILL_MODULE}), "
            f"which is not importable here: {err}",
            "pip install 'vllm>=0.33'",
        ) from err
    return drop_in_class(
        AttnSDKMLAPrefillBackendBase,
        "AttnSDKMLAPrefillBackend",
        "attnsdk.adapters.vllm",
        (_PREFILL_MODULE, "MLAPrefillBackend"),
    )
