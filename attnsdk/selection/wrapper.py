"""``BackendWrapper``: a backend made of other backends, forwarding every protocol member.

Debug mode wraps one backend (``debug.DebugBackend``: checks around each call) and ``routed``
one per step kind (``routed.RoutedBackend``: each step on its kind's backend). Both are
``Backend``s in full because this base forwards each member of the protocol; a subclass says
which backends it holds (``members``), which one a plan's calls go to (``inner_for``) and which
one captures CUDA graphs (``graph_backend``), and adds checks around a layer's call through
``before_forward`` / ``after_forward`` (``before_ragged`` / ``after_ragged``), which see the
whole call as one record.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from attnsdk.contract.errors import Reason

if TYPE_CHECKING:
    from collections.abc import Iterable

    import torch

    from attnsdk.contract.backend import Backend
    from attnsdk.contract.capabilities import Capabilities, Feature
    from attnsdk.contract.kv import KVCache, KVCacheLayout
    from attnsdk.contract.layer import LayerSpec
    from attnsdk.contract.metadata import AttentionMetadata
    from attnsdk.contract.plan import GraphBuffers, Plan

__all__ = ["BackendWrapper", "ForwardCall", "RaggedCall"]


@dataclass(frozen=True, slots=True)
class ForwardCall:
    """One ``forward`` call as the wrapper received it (``Backend.forward`` documents each)."""

    q: torch.Tensor
    k: torch.Tensor | None
    v: torch.Tensor | None
    cache: KVCache
    plan: Plan
    layer: LayerSpec
    sinks: torch.Tensor | None
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None
    out: torch.Tensor | None
    lse: torch.Tensor | None


@dataclass(frozen=True, slots=True)
class RaggedCall:
    """One ``forward_ragged`` call as the wrapper received it."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    plan: Plan
    layer: LayerSpec
    sinks: torch.Tensor | None
    out: torch.Tensor | None
    lse: torch.Tensor | None


class BackendWrapper:
    """Forwards every member of ``Backend``; see the module docstring."""

    name: str
    capabilities: Capabilities

    def members(self) -> list[Backend]:
        """The distinct backends this one holds (each once)."""
        raise NotImplementedError

    def inner_for(self, plan: Plan) -> tuple[Backend, Plan]:
        """The backend that runs ``plan``'s calls, and its own plan. Default: the first member,
        with ``plan`` as it is."""
        return self.members()[0], plan

    def graph_backend(self) -> Backend:
        """The backend that captures and replays CUDA graphs. Default: the first member."""
        return self.members()[0]

    def captured(self, plan: Plan) -> Plan:
        """The plan ``plan_for_capture`` returns for the graph backend's ``plan`` (which
        ``inner_for`` must map back to it). Default: ``plan`` itself."""
        return plan

    def reason_sources(
        self, uses: frozenset[Feature]
    ) -> list[tuple[str, Backend, frozenset[Feature]]]:
        """(field prefix, backend, step features to ask it) for ``unsupported_reasons``.
        Default: every member, unprefixed, with every feature."""
        return [("", backend, uses) for backend in self.members()]

    # -- once per model ---------------------------------------------------------------------

    def unsupported_reasons(
        self,
        layer: LayerSpec | None = None,
        layout: KVCacheLayout | None = None,
        device: torch.device | str | None = None,
        *,
        uses: Iterable[Feature] = (),
        dtype: torch.dtype | None = None,
    ) -> list[Reason]:
        found: set[Reason] = set()
        for prefix, backend, mine in self.reason_sources(frozenset(uses)):
            for r in backend.unsupported_reasons(layer, layout, device, uses=mine, dtype=dtype):
                found.add(Reason(r.kind, f"{prefix}.{r.field}", r.message) if prefix else r)
        return sorted(found)

    def prepare(
        self,
        layers: Iterable[LayerSpec],
        layout: KVCacheLayout,
        device: torch.device | str | None = None,
    ) -> None:
        listed = list(layers)
        for backend in self.members():
            backend.prepare(listed, layout, device)

    def warmup(self, device: torch.device | str | None = None, num_pages: int = 8) -> None:
        for backend in self.members():
            backend.warmup(device, num_pages)

    def sync_check(self, device: torch.device) -> None:
        for backend in self.members():
            backend.sync_check(device)

    # -- per step and per layer -------------------------------------------------------------

    def plan(self, meta: AttentionMetadata) -> Plan:
        return self.members()[0].plan(meta)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        cache: KVCache,
        plan: Plan,
        layer: LayerSpec,
        *,
        sinks: torch.Tensor | None = None,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
        lse: torch.Tensor | None = None,
    ) -> torch.Tensor:
        call = ForwardCall(q, k, v, cache, plan, layer, sinks, k_scale, v_scale, out, lse)
        self.before_forward(call)
        backend, inner = self.inner_for(plan)
        result = backend.forward(
            q, k, v, cache, inner, layer,
            sinks=sinks, k_scale=k_scale, v_scale=v_scale, out=out, lse=lse,
        )  # fmt: skip
        return self.after_forward(call, result)

    def before_forward(self, call: ForwardCall) -> None:
        """Hook: checks before the inner ``forward`` runs (it must write nothing)."""

    def after_forward(self, call: ForwardCall, result: torch.Tensor) -> torch.Tensor:
        """Hook: checks of the inner ``forward``'s result, which it returns."""
        return result

    def forward_ragged(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        plan: Plan,
        layer: LayerSpec,
        *,
        sinks: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
        lse: torch.Tensor | None = None,
    ) -> torch.Tensor:
        call = RaggedCall(q, k, v, plan, layer, sinks, out, lse)
        self.before_ragged(call)
        backend, inner = self.inner_for(plan)
        result = backend.forward_ragged(q, k, v, inner, layer, sinks=sinks, out=out, lse=lse)
        return self.after_ragged(call, result)

    def before_ragged(self, call: RaggedCall) -> None:
        """Hook: checks before the inner ``forward_ragged`` runs."""

    def after_ragged(self, call: RaggedCall, result: torch.Tensor) -> torch.Tensor:
        """Hook: checks of the inner ``forward_ragged``'s result, which it returns."""
        return result

    # -- CUDA graphs ------------------------------------------------------------------------

    def graph_state(
        self,
        max_batch: int,
        max_tokens: int,
        max_pages: int,
        *,
        page_size: int,
        device: torch.device | str,
    ) -> GraphBuffers:
        return self.graph_backend().graph_state(
            max_batch, max_tokens, max_pages, page_size=page_size, device=device
        )

    def plan_for_capture(
        self,
        state: GraphBuffers,
        batch_size: int,
        num_tokens: int,
        *,
        max_query_len: int | None = None,
    ) -> Plan:
        inner = self.graph_backend().plan_for_capture(
            state, batch_size, num_tokens, max_query_len=max_query_len
        )
        return self.captured(inner)

    def plan_for_replay(self, plan: Plan, meta: AttentionMetadata) -> None:
        backend, inner = self.inner_for(plan)
        backend.plan_for_replay(inner, meta)
