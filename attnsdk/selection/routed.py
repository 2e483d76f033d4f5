"""``routed``: each kind of step on the backend that is fastest for it.

No one kernel wins everywhere. On an H200 (docs/benchmarks.md, bs 64 x 4k, Llama-3-8B
attention) FlashInfer's tensor-core decode reads the cache at 98.3 % of the copy ceiling and
FA3 at 93.0 %, while FA3's causal prefill is the fastest prefill measured. ``routed`` holds one
backend per step kind and sends each step to its own:

- ``decode``: every sequence has at most one new token;
- ``prefill``: every sequence is new (no cached context);
- ``mixed``: anything else (extend, chunked prefill, speculative verify, decode + prefill).

Each route is a list of candidates; the first that can run here and serves every layer the
model declares (``prepare``) is taken, so a model with softcap on an FA3 build without it goes
to the next candidate rather than failing. ``explain()`` and ``routes`` say which one each
kind got and why the ones before it were passed over. The backends share the cache: all of them
read and write the same paged K/V, so steps of different kinds interleave freely.

CUDA graphs: captured steps run on the ``decode`` route's backend (engines capture decode and
uniform verify batches); its ``graph_support`` is the routed backend's.

One rule for the features a step or a call asks for: ``capabilities`` declares a feature
exactly when every step that can ask for it lands on a backend that serves it, and a step or
call without it is refused (typed, before anything is written), never served on one route and
refused on another.

- A step with a ``tree_mask`` (speculative verify) or ``cross_attention`` is a ``mixed`` step
  whatever its lengths: ``TREE_MASK`` and ``CROSS_ATTENTION`` are the mixed route's.
- ``lse=`` and ``forward_ragged`` may come with a step of any kind: ``LSE`` and ``RAGGED`` are
  declared only when every route serves them. ``forward_ragged`` runs on the step's route
  (a ragged prefill on the prefill route).

``explain()`` lists each of these features with the route that serves it or why not.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from pydantic import BaseModel, ConfigDict, field_validator

from attnsdk.contract.capabilities import (
    Capabilities,
    Feature,
    Request,
    missing_features,
    step_uses,
)
from attnsdk.contract.errors import InvalidInputError, Reason, ReasonKind, UnsupportedConfigError
from attnsdk.contract.kv import KVCache, KVCacheLayout
from attnsdk.contract.layer import LayerSpec
from attnsdk.contract.metadata import check_metadata
from attnsdk.contract.plan import Plan
from attnsdk.selection.wrapper import BackendWrapper, ForwardCall, RaggedCall

if TYPE_CHECKING:
    from collections.abc import Iterable

    from attnsdk.contract.backend import Backend
    from attnsdk.contract.metadata import AttentionMetadata
    from attnsdk.contract.plan import GraphBuffers

__all__ = ["KINDS", "STEP_FEATURES", "RoutedBackend", "RoutedOptions", "RoutedPlan", "step_kind"]

KINDS = ("decode", "prefill", "mixed")
"""Step kinds, in the order ``routes`` lists them."""


class RoutedOptions(BaseModel):
    """Candidates per step kind, tried in order (a name or a list of names)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    decode: tuple[str, ...] = ("flashinfer", "fa3", "reference", "flex")
    """FlashInfer's tensor-core decode is the fastest decode measured on an H200."""
    prefill: tuple[str, ...] = ("fa3", "flashinfer", "reference", "flex")
    """FA3's causal prefill is the fastest prefill measured on an H200."""
    mixed: tuple[str, ...] = ("fa3", "flashinfer", "reference", "flex")
    """FA3 serves any mix in one varlen launch."""

    @field_validator("decode", "prefill", "mixed", mode="before")
    @classmethod
    def _one_or_many(cls, value: Any) -> Any:
        return (value,) if isinstance(value, str) else value

    @field_validator("decode", "prefill", "mixed")
    @classmethod
    def _known(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        from attnsdk.selection.registry import canonical_name

        if not value:
            raise ValueError("needs at least one backend name")
        names = tuple(canonical_name(n) for n in value)
        if "routed" in names or "auto" in names:
            raise ValueError("a route names real backends, not 'auto' or 'routed'")
        return names


@dataclass(frozen=True, slots=True)
class RoutedPlan(Plan):
    """The plan of the backend this step's kind is routed to."""

    kind: str = "mixed"
    backend: Backend | None = None
    inner: Plan | None = None


STEP_FEATURES = {
    Feature.TREE_MASK: ("mixed",),
    Feature.CROSS_ATTENTION: ("mixed",),
    Feature.LSE: KINDS,
    Feature.RAGGED: KINDS,
}
"""The features a step or call asks for, and the routes such a step can land on."""


def step_kind(meta: AttentionMetadata) -> str:
    """ "decode", "prefill" or "mixed", from the host twins (no device sync). A tree verify or
    cross-attention step is "mixed" whatever its lengths (module docstring)."""
    if meta.tree_mask is not None or meta.cross_attention:
        return "mixed"
    if meta.max_query_len <= 1:
        return "decode"
    qsl = meta.query_start_loc_cpu
    if torch.equal(qsl[1:] - qsl[:-1], meta.seq_lens_cpu):
        return "prefill"
    return "mixed"


class RoutedBackend(BackendWrapper):
    """One backend per step kind; see the module docstring."""

    name = "routed"
    priority: ClassVar[int] = 0
    """Unused: ``auto`` never picks a composite; it is asked for by name."""
    Options: ClassVar[type[BaseModel]] = RoutedOptions
    capabilities: Capabilities
    """The decode route's capabilities (graph support included), with the step features
    ``STEP_FEATURES`` allows."""

    def __init__(self, options: RoutedOptions | None = None) -> None:
        if options is not None and not isinstance(options, RoutedOptions):
            raise InvalidInputError("options", "None or a RoutedOptions", type(options).__name__)
        self.options = options or RoutedOptions()
        self._backends: dict[str, Backend] = {}
        self._passed_over: dict[str, dict[str, list[Reason]]] = {k: {} for k in KINDS}
        self.routes: dict[str, str] = {}
        """Step kind -> the backend name it runs on."""
        self._served: set[tuple[LayerSpec, KVCacheLayout, bool]] = set()
        """(layer, layout, lse asked) that every route serves, checked at their first forward."""
        self._choose(layers=(), layout=None, device=None)

    # -- class side (the registry asks before creating one) -------------------------------

    @classmethod
    def environment_reasons(cls, device: torch.device | str | None = None) -> list[Reason]:
        """Every route needs one candidate that can run here."""
        dev = None if device is None else torch.device(device)
        return [r for r in cls.refusals(Request(device=dev)) if r.kind is ReasonKind.ENVIRONMENT]

    @classmethod
    def refusals(cls, request: Request) -> list[Reason]:
        """Empty when every route has a candidate serving the request; else, per route with
        none, every candidate's reasons (field ``<kind>.<backend>.<field>``)."""
        routes = request.options if isinstance(request.options, RoutedOptions) else RoutedOptions()
        layers = [request.layer] if request.layer is not None else []
        found = _route_reasons(routes, layers, request.layout, request.device, request.uses)
        return found[1]

    # -- the BackendWrapper's view ----------------------------------------------------------

    def members(self) -> list[Backend]:
        return list({id(b): b for b in self._backends.values()}.values())

    def inner_for(self, plan: Plan) -> tuple[Backend, Plan]:
        if not isinstance(plan, RoutedPlan) or plan.backend is None or plan.inner is None:
            found = type(plan).__name__
            raise InvalidInputError("plan", "a RoutedPlan from this backend's plan()", found)
        return plan.backend, plan.inner

    def graph_backend(self) -> Backend:
        return self._backends["decode"]

    def unsupported_reasons(
        self,
        layer: LayerSpec | None = None,
        layout: KVCacheLayout | None = None,
        device: torch.device | str | None = None,
        *,
        uses: Iterable[Feature] = (),
        dtype: torch.dtype | None = None,
    ) -> list[Reason]:
        """What the backends the routes hold now cannot serve (field ``<kind>.<field>``): a
        step runs on its kind's backend, whatever other candidates could do, and each step
        feature is asked of the routes it can land on (``STEP_FEATURES``). ``prepare`` with
        the model re-routes to candidates that serve every layer."""
        asked = frozenset(uses)
        found: set[Reason] = set()
        for kind in KINDS:
            mine = _kind_uses(kind, asked)
            reasons = self._backends[kind].unsupported_reasons(
                layer, layout, device, uses=mine, dtype=dtype
            )
            found.update(Reason(r.kind, f"{kind}.{r.field}", r.message) for r in reasons)
        return sorted(found)

    # -- once per model -------------------------------------------------------------------

    def prepare(
        self,
        layers: Iterable[LayerSpec],
        layout: KVCacheLayout,
        device: torch.device | str | None = None,
    ) -> None:
        """Route each kind to its first candidate serving every layer, then prepare it."""
        listed = list(layers)
        self._choose(listed, layout, device)
        super().prepare(listed, layout, device)

    def explain(self) -> dict[str, dict[str, object]]:
        """Per step kind: the backend it runs on and why each earlier candidate was passed
        over; under ``"features"``, per step feature (``STEP_FEATURES``): served, or the routes
        whose backend lacks it."""
        report: dict[str, dict[str, object]] = {
            kind: {
                "backend": self.routes[kind],
                "passed_over": {
                    n: [str(r) for r in rs] for n, rs in self._passed_over[kind].items()
                },
            }
            for kind in KINDS
        }
        report["features"] = {
            feature.value: (
                "served"
                if not lacking
                else "refused: "
                + ", ".join(f"{k} route ({self.routes[k]})" for k in lacking)
                + " lacks it"
            )
            for feature, lacking in self._lacking().items()
        }
        return report

    def _lacking(self) -> dict[Feature, list[str]]:
        """Per step feature: the routes a step asking for it can land on whose backend lacks it."""
        return {
            feature: [k for k in kinds if feature not in self._backends[k].capabilities.features]
            for feature, kinds in STEP_FEATURES.items()
        }

    # -- per step and per layer -------------------------------------------------------------

    def plan(self, meta: AttentionMetadata) -> RoutedPlan:
        check_metadata(meta)
        reasons = missing_features(self.capabilities, step_uses(meta))
        if reasons:
            raise UnsupportedConfigError("the routed backend cannot serve this step:", reasons)
        kind = step_kind(meta)
        backend = self._backends[kind]
        return RoutedPlan(meta, kind=kind, backend=backend, inner=backend.plan(meta))

    def before_forward(self, call: ForwardCall) -> None:
        """Every route must serve the layer (and ``lse=``, when asked), not only this step's:
        a model whose prefill route cannot serve it fails at its first step, not at its first
        prefill."""
        layer, cache = call.layer, call.cache
        if not (isinstance(layer, LayerSpec) and isinstance(cache, KVCache)):
            return  # the route's own checks name it
        key = (layer, cache.layout, call.lse is not None)
        if key in self._served:
            return
        uses = (Feature.LSE,) if call.lse is not None else ()
        reasons = self.unsupported_reasons(layer, cache.layout, cache.device, uses=uses)
        if reasons:
            raise UnsupportedConfigError(
                "the routed backend cannot run this layer on every route:", reasons
            )
        self._served.add(key)

    def before_ragged(self, call: RaggedCall) -> None:
        """A ragged call runs on the step's route; refused, typed, when some route's backend
        has no ragged attention (module docstring)."""
        lacking = self._lacking()[Feature.RAGGED]
        if lacking:
            raise UnsupportedConfigError(
                "the routed backend cannot run forward_ragged on every route:",
                [_lacks(kind, self.routes[kind], "ragged") for kind in lacking],
            )

    # -- CUDA graphs: the decode route's backend ------------------------------------------

    def plan_for_capture(
        self,
        state: GraphBuffers,
        batch_size: int,
        num_tokens: int,
        *,
        max_query_len: int | None = None,
    ) -> Plan:
        backend = self.graph_backend()
        inner = backend.plan_for_capture(state, batch_size, num_tokens, max_query_len=max_query_len)
        return RoutedPlan(inner.metadata, inner.graph, kind="decode", backend=backend, inner=inner)

    # -- choosing ---------------------------------------------------------------------------

    def _choose(
        self,
        layers: list[LayerSpec] | tuple[()],
        layout: KVCacheLayout | None,
        device: torch.device | str | None,
    ) -> None:
        chosen, reasons, passed = _route_reasons(self.options, list(layers), layout, device)
        if reasons:
            raise UnsupportedConfigError(
                "the routed backend has no backend for every step kind:", reasons
            )
        from attnsdk.selection.create import create_backend

        by_name = {b.name: b for b in self.members()}
        for kind in KINDS:
            name = chosen[kind]
            if name not in by_name:
                by_name[name] = create_backend(name, device=device)
            self._backends[kind] = by_name[name]
        self.routes = dict(chosen)
        self._passed_over = passed
        self._served = set()
        # Graphs run on the decode route: its capabilities (graph support too) are ours, but a
        # step feature only where every route such a step can land on serves it.
        caps = self._backends["decode"].capabilities
        lacking = {f for f, routes in self._lacking().items() if routes}
        served = {f for f in STEP_FEATURES if f not in lacking}
        features = caps.features - set(STEP_FEATURES) | served
        self.capabilities = dataclasses.replace(caps, features=frozenset(features))


def _kind_uses(kind: str, uses: frozenset[Feature]) -> frozenset[Feature]:
    """The step features in ``uses`` that a step of ``kind`` can carry (``STEP_FEATURES``)."""
    return frozenset(f for f in uses if kind in STEP_FEATURES.get(f, KINDS))


def _lacks(kind: str, backend: str, feature: str) -> Reason:
    return Reason(
        ReasonKind.CONFIGURATION,
        f"{kind}.{feature}",
        f"is not supported by the {kind} route's backend ({backend})",
    )


def _route_reasons(
    options: RoutedOptions,
    layers: list[LayerSpec],
    layout: KVCacheLayout | None,
    device: torch.device | str | None,
    uses: frozenset[Feature] = frozenset(),
) -> tuple[dict[str, str], list[Reason], dict[str, dict[str, list[Reason]]]]:
    """Per kind: the first candidate that serves every layer (and the step features in
    ``uses`` that kind's steps carry), the reasons of kinds with none, and the reasons each
    earlier candidate was passed over."""
    from attnsdk.selection.create import explain
    from attnsdk.selection.registry import backend_names

    known = set(backend_names())
    chosen: dict[str, str] = {}
    failed: list[Reason] = []
    passed: dict[str, dict[str, list[Reason]]] = {}
    cache: dict[tuple[str, frozenset[Feature]], list[Reason]] = {}
    for kind in KINDS:
        passed[kind] = {}
        mine = _kind_uses(kind, uses)
        for name in getattr(options, kind):
            if (name, mine) not in cache:
                found: set[Reason] = set()
                if name not in known:  # a default candidate this installation lacks
                    found.add(Reason(ReasonKind.ENVIRONMENT, "backend", "is not registered"))
                asks: list[LayerSpec | None] = list(layers) or [None]
                for layer in asks if not found else []:
                    found.update(explain(name, layer, layout, device, uses=mine)[name])
                cache[(name, mine)] = sorted(found)
            if not cache[(name, mine)]:
                chosen[kind] = name
                break
            passed[kind][name] = cache[(name, mine)]
        else:
            failed += [
                Reason(r.kind, f"{kind}.{name}.{r.field}", r.message)
                for name, rs in passed[kind].items()
                for r in rs
            ]
    return chosen, sorted(failed), passed
