"""``BackendBase``: the one class a backend author subclasses.

A backend declares what it can do as data (``capabilities``) and writes two things: how to
attend (``attend``) and, when it has any, what it works out once per layer shape
(``layer_state``) or once per step (``make_plan``). The base class owns everything every
backend must do the same way: the reasons it cannot serve a request, the host checks of every
plan and forward, the order check → store → attend, per-model preparation and warm-up, and the
CUDA-graph hooks (``GraphHooks``).

    class MyBackend(BackendBase):
        name = "mine"
        capabilities = Capabilities(devices=frozenset({"cuda"}), ...)

        def attend(self, call):
            ...  # new K/V are already in ``call.cache``; write (T, Hq, Dv) into ``call.out``
                 # and, when ``call.lse`` is a tensor, each row's log-sum-exp (T, Hq) into it

docs/adding_a_backend.md walks through one; ``attnsdk.testing.conformance`` is the test suite
every backend runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from attnsdk.backends.warmup import check_warmup_args, warm_up
from attnsdk.contract.backend import NoOptions, check_forward_args, check_plan
from attnsdk.contract.capabilities import (
    Capabilities,
    Feature,
    Request,
    capability_reasons,
    device_reasons,
    missing_features,
    step_uses,
)
from attnsdk.contract.checks import check_device
from attnsdk.contract.errors import InvalidInputError, Reason, ReasonKind, UnsupportedConfigError
from attnsdk.contract.kv import KVCacheLayout, mla_value
from attnsdk.contract.layer import LayerSpec
from attnsdk.contract.metadata import check_is_metadata, check_metadata
from attnsdk.contract.plan import GraphBuffers, Plan
from attnsdk.features import cross as features_cross
from attnsdk.features import ragged as features_ragged
from attnsdk.features import tree as features_tree
from attnsdk.features.ragged import RaggedStep, check_ragged_args, clear_keyless_rows, ragged_step

if TYPE_CHECKING:
    from collections.abc import Iterable

    from pydantic import BaseModel

    from attnsdk.contract.kv import KVCache
    from attnsdk.contract.metadata import AttentionMetadata

__all__ = ["AttendArgs", "BackendBase", "GraphHooks", "RaggedArgs"]

_UNSET: Any = object()
_ASKED = {
    Feature.LSE: " with the log-sum-exp (lse=)",
    Feature.RAGGED: " ragged (forward_ragged)",
    Feature.TREE_MASK: " in a tree verify step (a step with a tree_mask)",
    Feature.CROSS_ATTENTION: " in a cross-attention step",
}
"""How a refusal's message says what the call asked for."""

_RAGGED_STEPS = 8
"""Ragged plans whose ``RaggedStep`` a backend keeps: SGLang's chunked prefix uses one per
prefix chunk in turn, every layer."""


@dataclass(frozen=True, slots=True)
class AttendArgs:
    """One layer's ``attend`` call, every argument checked by ``forward`` (shapes: the Shape
    legend of ``Backend.forward``): the new K/V are already in ``cache``."""

    q: torch.Tensor
    """(T, Hq, D)."""
    cache: KVCache
    plan: Plan
    layer: LayerSpec
    state: Any
    """``layer_state(layer, cache.layout)``."""
    out: torch.Tensor
    """(T, Hq, Dv): the hook writes the output here and returns it."""
    sinks: torch.Tensor | None = None
    """(Hq,) fp32 when ``layer.has_sinks``."""
    k_scale: torch.Tensor | None = None
    """fp8 caches: () / (1,) / (Hkv,) fp32; for an MLA layer it scales the latent (V) too."""
    v_scale: torch.Tensor | None = None
    lse: torch.Tensor | None = None
    """(T, Hq) fp32 contiguous, for each row's natural-log log-sum-exp; only when
    ``refusals`` allowed ``Feature.LSE``."""

    def unpacked(
        self,
    ) -> tuple[
        torch.Tensor | None,
        torch.Tensor | None,
        torch.Tensor | None,
        torch.Tensor,
        torch.Tensor | None,
    ]:
        """``(sinks, k_scale, v_scale, out, lse)``, for a hook that names them locally."""
        return self.sinks, self.k_scale, self.v_scale, self.out, self.lse


@dataclass(frozen=True, slots=True)
class RaggedArgs:
    """One layer's ``attend_ragged`` call, every argument checked by ``forward_ragged``."""

    q: torch.Tensor
    """(T, Hq, D)."""
    k: torch.Tensor
    """(Tk, Hkv, D): sequence b's keys at rows ``key_start_loc[b]:key_start_loc[b+1]``."""
    v: torch.Tensor
    """(Tk, Hkv, Dv)."""
    plan: Plan
    layer: LayerSpec
    key_start_loc: torch.Tensor
    """(B + 1,) int32, on the device."""
    out: torch.Tensor
    """(T, Hq, Dv): the hook writes the output here and returns it."""
    sinks: torch.Tensor | None = None
    lse: torch.Tensor | None = None


class GraphHooks:
    """The ``Backend`` CUDA-graph hooks over ``GraphBuffers``; backends mix it in.

    A backend whose plans carry more than the metadata sets ``plan_type`` to its ``Plan``
    subclass (constructible as ``plan_type(metadata, graph=state)``).
    """

    plan_type: ClassVar[type[Plan]] = Plan
    buffers_type: ClassVar[type[GraphBuffers]] = GraphBuffers
    """The static buffers ``graph_state`` allocates (a subclass for backends with more)."""

    def graph_state(
        self,
        max_batch: int,
        max_tokens: int,
        max_pages: int,
        *,
        page_size: int,
        device: torch.device | str,
    ) -> GraphBuffers:
        return self.buffers_type(
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
        meta = state.capture_metadata(batch_size, num_tokens, max_query_len=max_query_len)
        return self.capture_plan(meta, state)

    def capture_plan(self, meta: AttentionMetadata, state: GraphBuffers) -> Plan:
        """Hook: the plan a capture of ``meta`` (basic-slice views of ``state``, upper-bound
        host maxima) runs with; the backend's checks of such a capture go here too. Default:
        ``plan_type(meta, graph=state)``."""
        return self.plan_type(meta, graph=state)

    def plan_for_replay(self, plan: Plan, meta: AttentionMetadata) -> None:
        if not isinstance(plan, Plan) or plan.graph is None or not isinstance(plan, self.plan_type):
            raise InvalidInputError(
                "plan",
                f"a {self.plan_type.__name__} made by plan_for_capture",
                f"a {type(plan).__name__} without graph buffers"
                if isinstance(plan, Plan) and plan.graph is None
                else type(plan).__name__,
            )
        check_is_metadata("meta", meta)
        if meta.tree_mask is not None or meta.cross_attention:
            field = "tree_mask" if meta.tree_mask is not None else "cross_attention"
            raise UnsupportedConfigError(
                "this step cannot be replayed from a CUDA graph:",
                [Reason(ReasonKind.BATCH, field, "the graph buffers do not carry it")],
            )
        # replay_update runs plan's host checks at the graph's page size: a page table too
        # narrow for it is refused rather than padded with the reserved page.
        plan.graph.replay_update(plan.metadata, meta)


class BackendBase(GraphHooks):
    """Base class of attnsdk backends; see the module docstring.

    Class attributes a subclass sets: ``name``, ``capabilities``, and optionally ``priority``
    (``"auto"`` tries higher first), ``Options`` (a frozen pydantic model) and ``plan_type``
    (a ``Plan`` subclass when plans carry more than the metadata).
    """

    name: ClassVar[str]
    capabilities: ClassVar[Capabilities]
    priority: ClassVar[int] = 0
    Options: ClassVar[type[BaseModel]] = NoOptions

    def __init__(self, options: BaseModel | None = None) -> None:
        if options is not None and not isinstance(options, self.Options):
            raise InvalidInputError(
                "options", f"None or a {self.Options.__name__}", type(options).__name__
            )
        self.options = options if options is not None else self.Options()
        self._layer_states: dict[tuple[LayerSpec, KVCacheLayout], Any] = {}
        self._served: set[tuple[object, ...]] = set()
        """Kinds of call (layer, layout or None, device, lse asked, tree or dtype, cross) whose
        refusals came back empty: asked once, not per call (FlashInfer's check looks up its
        package, ~tens of µs)."""
        self._ragged_steps: dict[int, tuple[AttentionMetadata, RaggedStep]] = {}
        """id(metadata) -> (metadata, its RaggedStep), the last ``_RAGGED_STEPS`` plans'."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.__dict__.get("__abstract__"):
            return
        missing = [a for a in ("name", "capabilities") if not hasattr(cls, a)]
        if missing:
            raise TypeError(f"{cls.__name__} (a BackendBase) must set {', '.join(missing)}")

    # -- what it can serve (class side: the registry asks before creating one) -------------

    @classmethod
    def environment_reasons(cls, device: torch.device | str | None = None) -> list[Reason]:
        """Hook: why it cannot run on ``device`` at all: the device type and compute capability
        from ``capabilities``; a backend that needs a kernel package adds an ``install`` reason.
        Imports nothing: the registry asks every backend before creating any."""
        return device_reasons(cls.capabilities, device)

    @classmethod
    def refusals(cls, request: Request) -> list[Reason]:
        """Hook: every reason this backend cannot serve ``request``, sorted, environment first:
        ``environment_reasons``, ``capability_reasons`` and the step features' rules
        (``attnsdk.features``). A backend adds what its kernels refuse beyond what
        ``capabilities`` can say (a build's switches, a kernel variant an option selects),
        extending ``super().refusals(request)``; ``request.options`` is an ``Options`` instance
        or None (the defaults: ``options_of``)."""
        reasons = set(cls.environment_reasons(request.device))
        reasons.update(capability_reasons(cls.capabilities, request))
        for rules in (features_tree.refusals, features_cross.refusals, features_ragged.refusals):
            reasons.update(rules(request))
        return sorted(reasons)

    @classmethod
    def options_of(cls, request: Request) -> Any:
        """``request.options``, or this backend's default options."""
        return request.options if request.options is not None else cls.Options()

    def unsupported_reasons(
        self,
        layer: LayerSpec | None = None,
        layout: KVCacheLayout | None = None,
        device: torch.device | str | None = None,
        *,
        uses: Iterable[Feature] = (),
        dtype: torch.dtype | None = None,
    ) -> list[Reason]:
        """Every reason this backend, with its options, cannot serve ``layer`` over ``layout``
        on ``device`` with the step features ``uses`` (``refusals`` of that ``Request``)."""
        dev = check_device("device", device) if device is not None else None
        request = Request(layer, layout, dev, self.options, frozenset(uses), dtype)
        return self.refusals(request)

    # -- once per model ---------------------------------------------------------------------

    def prepare(
        self,
        layers: Iterable[LayerSpec],
        layout: KVCacheLayout,
        device: torch.device | str | None = None,
    ) -> None:
        """Check and precompute every layer of a model before serving it.

        Raises ``UnsupportedConfigError`` with every reason of every layer it cannot serve
        (each reason's field names the layer index). Optional: ``forward`` prepares a layer it
        has not seen, but then the first step pays for it, and backends that plan per layer
        shape (one kernel variant per shape) can only plan the shapes they know.
        """
        if not isinstance(layout, KVCacheLayout):
            raise InvalidInputError("layout", "a KVCacheLayout", type(layout).__name__)
        dev = check_device("device", device) if device is not None else None
        try:
            if isinstance(layers, (str, bytes, LayerSpec)):
                raise TypeError  # one layer, or characters: not a model's layers
            items = iter(layers)
        except TypeError:
            raise InvalidInputError(
                "layers", "an iterable of LayerSpec, one per attention layer", repr(layers)
            ) from None
        failed: list[Reason] = []
        new: dict[tuple[LayerSpec, KVCacheLayout], Any] = {}
        for i, layer in enumerate(items):
            if not isinstance(layer, LayerSpec):
                raise InvalidInputError(f"layers[{i}]", "a LayerSpec", type(layer).__name__)
            key = (layer, layout)
            if key in self._layer_states or key in new:
                continue
            reasons = self.unsupported_reasons(layer, layout, dev)
            if reasons:
                failed += [Reason(r.kind, f"layers[{i}].{r.field}", r.message) for r in reasons]
            elif not failed:
                new[key] = self.layer_state(layer, layout)
        if failed:
            # All or nothing: a model that cannot be served leaves no layer prepared.
            raise UnsupportedConfigError(
                f"the {self.name} backend cannot serve this model:", sorted(set(failed))
            )
        self._layer_states.update(new)

    @property
    def prepared(self) -> list[tuple[LayerSpec, KVCacheLayout]]:
        """The (layer, layout) pairs seen so far by ``prepare`` or ``forward``, in that order."""
        return list(self._layer_states)

    def warmup(self, device: torch.device | str | None = None, num_pages: int = 8) -> None:
        """Compile or load the kernel variants the prepared layers need, before serving.

        Runs two small eager steps per prepared layer shape (two prefills, then a decode row
        beside an extend row) on a scratch cache of ``num_pages`` pages. Backends whose kernels
        compile per layer shape (Triton, JIT libraries) then serve the first real step without
        compiling; one that also specialises on the pool size (compiled flex) compiles again
        for the real cache unless ``num_pages`` matches it. The two steps need at least
        1 + 2 * ceil(2 / page_size) pages (3 from page size 2 on, 5 at page size 1): a smaller
        ``num_pages`` gets that many. A no-op before ``prepare``, but its arguments are checked
        first: ``device`` one this machine has (None: the backend's default), ``num_pages`` an
        int >= 1.
        """
        dev, pages = check_warmup_args(self.capabilities, device, num_pages)
        for layer, layout in self.prepared:
            warm_up(self, layer, layout, dev, pages)

    def layer_state(self, layer: LayerSpec, layout: KVCacheLayout) -> Any:
        """Hook: what ``attend`` needs per (layer, layout), worked out once (kernel arguments,
        a compiled function). Called only for pairs this backend can serve. Default: None."""
        return None

    # -- once per step ----------------------------------------------------------------------

    def plan(self, meta: AttentionMetadata) -> Plan:
        """Check ``meta`` on the host (no device sync), then ``make_plan``. A step with a
        ``tree_mask`` or ``cross_attention`` is refused unless the backend declares the feature
        (a cross-attention step also plans on a backend with ragged attention alone: its
        ``forward_ragged`` serves it, its ``forward`` refuses it)."""
        check_metadata(meta)
        uses = step_uses(meta)
        if uses:
            if Feature.RAGGED in self.capabilities.features:
                uses |= {Feature.RAGGED}
            reasons = missing_features(self.capabilities, uses)
            if reasons:
                raise UnsupportedConfigError(
                    f"the {self.name} backend cannot serve this step:", reasons
                )
        return self.make_plan(meta)

    def make_plan(self, meta: AttentionMetadata) -> Plan:
        """Hook: per-step precomputation shared by all layers; ``meta`` is already checked.
        ``self.prepared`` lists the layer shapes to plan for. Default: ``plan_type(meta)``."""
        return self.plan_type(meta)

    # -- once per layer ---------------------------------------------------------------------

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
        """Check the arguments, write new K/V (``store``), then ``attend``. See ``Backend``."""
        check_forward_args(
            q, k, v, cache, plan, layer,
            sinks=sinks, k_scale=k_scale, v_scale=v_scale, out=out, lse=lse,
        )  # fmt: skip
        meta = plan.metadata
        if meta.cross_attention and (k is not None or v is not None):
            raise InvalidInputError(
                "k/v",
                "None in a cross-attention step (write the encoder's K/V beforehand, e.g. "
                "with KVCache.store)",
                "tensors",
            )
        layout = cache.layout
        served = (layer, layout, cache.device, lse is not None, meta.tree_mask is not None,
                  meta.cross_attention)  # fmt: skip
        if served not in self._served:
            self._check_serves(layer, layout, cache.device, step_uses(meta, lse=lse is not None))
            self._served.add(served)
        state = self._layer_states.get((layer, layout), _UNSET)
        if state is _UNSET:
            state = self._layer_states[(layer, layout)] = self.layer_state(layer, layout)
        self.check_step(plan, cache)
        if cache.layout.mla:
            # V is a view of K's latent dims: every store and attend serves MLA as they are
            # (the latent is written twice, the same bytes; read back with K's scale).
            v_scale = k_scale
            if k is not None:
                v = mla_value(k, None, cache.layout)
        if k is not None and v is not None:
            self.store(k, v, cache, plan, state, k_scale=k_scale, v_scale=v_scale)
        if out is None:
            out = torch.empty(
                q.shape[0], layer.num_heads, layer.v_dim, dtype=q.dtype, device=q.device
            )
        return self.attend(
            AttendArgs(q, cache, plan, layer, state, out, sinks, k_scale, v_scale, lse)
        )

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
        """Attention over K/V given in the call; no cache is read or written (``attnsdk.features.ragged``).

        q: (T, Hq, D); k: (Tk, Hkv, D) and v: (Tk, Hkv, Dv), sequence b's keys at rows
        ``key_start_loc[b]:key_start_loc[b+1]`` (Tk >= sum(seq_lens)), all in q's dtype.
        ``plan`` comes from ``plan(meta)``, typically of ``AttentionMetadata.for_ragged``;
        sinks, out and lse as in ``forward``. Returns (T, Hq, Dv) in q's dtype.
        """
        check_plan(plan)
        step = self._ragged_step(plan)
        check_ragged_args(q, k, v, plan, layer, sinks=sinks, out=out, lse=lse, keys=step.keys)
        cross = plan.metadata.cross_attention
        served = (layer, None, q.device, lse is not None, q.dtype, cross)
        if served not in self._served:
            uses = step_uses(plan.metadata, lse=lse is not None, ragged=True)
            self._check_serves(layer, None, q.device, uses, q.dtype)
            self._served.add(served)
        if out is None:
            out = torch.empty(
                q.shape[0], layer.num_heads, layer.v_dim, dtype=q.dtype, device=q.device
            )
        call = RaggedArgs(q, k, v, plan, layer, step.key_start_loc, out, sinks, lse)
        result = self.attend_ragged(call)
        clear_keyless_rows(step.keyless, sinks, result, lse)
        return result

    def _ragged_step(self, plan: Plan) -> RaggedStep:
        """``plan``'s ``RaggedStep``, read from its metadata's host twins on the first ragged
        call only (every layer of a step shares it; SGLang's chunked prefix uses several plans
        in turn, so a few are kept). Keyed by the metadata, which is all it depends on: the
        plans themselves are not kept alive (flashinfer frees a dropped plan's wrappers)."""
        meta = plan.metadata
        hit = self._ragged_steps.get(id(meta))
        if hit is not None and hit[0] is meta:
            return hit[1]
        step = ragged_step(meta)
        if len(self._ragged_steps) >= _RAGGED_STEPS:
            del self._ragged_steps[next(iter(self._ragged_steps))]
        self._ragged_steps[id(meta)] = (meta, step)
        return step

    def attend_ragged(self, call: RaggedArgs) -> torch.Tensor:
        """Hook of a backend declaring ``Feature.RAGGED``: the attention of ``forward_ragged``
        into ``out`` (and ``lse``), every argument checked; ``key_start_loc`` (B + 1,) int32
        on the device says where each sequence's keys start in k / v. Rows of sequences with
        queries and no keys may hold anything: ``forward_ragged`` sets them afterwards."""
        raise NotImplementedError(f"{type(self).__name__} declares no ragged attention")

    def _check_serves(
        self,
        layer: LayerSpec,
        layout: KVCacheLayout | None,
        device: torch.device,
        uses: frozenset[Feature],
        dtype: torch.dtype | None = None,
    ) -> None:
        """Refuse, before anything is written, a call this backend cannot serve (asked once per
        kind of call: the served keys remember the answer)."""
        reasons = self.unsupported_reasons(layer, layout, device, uses=uses, dtype=dtype)
        if reasons:
            asked = "".join(_ASKED[f] for f in sorted(uses, key=lambda f: f.value))
            raise UnsupportedConfigError(
                f"the {self.name} backend cannot run this layer{asked}:", reasons
            )

    def sync_check(self, device: torch.device) -> None:
        """Raise now, with a device sync, what device code recorded (debug mode calls it).
        Default: nothing to check (``DeviceStoreBackend`` checks its KV store's flag)."""

    def check_step(self, plan: Plan, cache: KVCache) -> None:
        """Hook: checks before anything is written, beyond the host checks every forward runs
        (the reference backend checks every page it will read, with a sync). Default: none."""

    def store(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: KVCache,
        plan: Plan,
        state: Any,
        *,
        k_scale: torch.Tensor | None,
        v_scale: torch.Tensor | None,
    ) -> None:
        """Write rows ``0..num_tokens-1`` of k / v at the plan's slots (negative: skip).

        Default: ``KVCache.store`` (portable, checks every slot, syncs). GPU backends use the
        sync-free Triton store (``attnsdk.backends.gpu.DeviceStoreBackend``).
        """
        meta = plan.metadata
        t = meta.num_tokens
        if cache.layout.mla:  # k alone: KVCache.store writes the latent view from it
            cache.store(k[:t], None, meta.slot_mapping[:t], k_scale=k_scale)
            return
        cache.store(k[:t], v[:t], meta.slot_mapping[:t], k_scale=k_scale, v_scale=v_scale)

    def attend(self, call: AttendArgs) -> torch.Tensor:
        """Attention of q (T, Hq, D) over the cache (new K/V already stored), into ``out``
        (T, Hq, Dv), which it returns; when ``lse`` is a tensor, also each row's natural-log
        log-sum-exp into it ((T, Hq) fp32, contiguous; only when ``refusals`` allowed it).
        Every argument has passed the host checks; ``state`` is
        ``layer_state(layer, cache.layout)``."""
        raise NotImplementedError(f"{type(self).__name__} must implement attend()")
