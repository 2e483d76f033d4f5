"""Per-model backend choice: ``create_backend(..., layers=, layout=)`` and the ``routed`` backend."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import pytest
import torch

import attnsdk as A
from attnsdk.backends.reference import ReferenceBackend
from attnsdk.selection.routed import RoutedBackend, RoutedOptions, RoutedPlan, step_kind
from attnsdk.testing import BatchSpec, assert_close_to_reference, make_batch

if TYPE_CHECKING:
    from collections.abc import Iterator

LAYOUT = A.KVCacheLayout(num_kv_heads=2, head_dim=16, page_size=4, dtype=torch.float32)
PLAIN = A.LayerSpec(num_heads=4, num_kv_heads=2, head_dim=16)
SOFTCAP = A.LayerSpec(num_heads=4, num_kv_heads=2, head_dim=16, softcap=20.0)


def counting(
    name: str, *, softcap: bool = True, lse: bool = True, without: tuple[A.Feature, ...] = ()
) -> type[ReferenceBackend]:
    """The reference maths under another name, counting forwards, optionally without softcap,
    without the log-sum-exp, or without other ``features``."""
    features = set(A.Feature) - (set() if softcap else {A.Feature.SOFTCAP}) - set(without)
    features -= set() if lse else {A.Feature.LSE}

    class Counting(ReferenceBackend):
        capabilities = A.Capabilities(
            devices=frozenset({"cpu"}),
            dtypes=frozenset({torch.float32}),
            kv_dtypes=frozenset(),
            max_head_dim=256,
            orders=frozenset(A.KVOrder),
            features=frozenset(features),
        )
        forwards: ClassVar[list[str]] = []

        def attend(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            Counting.forwards.append(name)
            return super().attend(*args, **kwargs)

    Counting.name = name
    return Counting


@pytest.fixture
def fast_no_softcap() -> Iterator[type[ReferenceBackend]]:
    """A high-priority backend without softcap, as fa3 is on a build without it."""
    cls = counting("nocap", softcap=False)
    handle = A.register_backend("nocap", cls, priority=1000)
    yield cls
    handle.remove()


# --- per-model auto ------------------------------------------------------------------------------


def test_auto_without_the_model_takes_the_highest_priority(fast_no_softcap: type) -> None:
    assert A.create_backend("auto", device="cpu").name == "nocap"


def test_auto_with_the_model_skips_a_backend_missing_a_layer_feature(
    fast_no_softcap: type,
) -> None:
    backend = A.create_backend("auto", device="cpu", layers=[PLAIN, SOFTCAP, PLAIN], layout=LAYOUT)
    assert backend.name != "nocap"
    assert backend.unsupported_reasons(SOFTCAP, LAYOUT, "cpu") == []
    # ... and it comes back prepared for the model.
    assert isinstance(backend, A.BackendBase)
    assert backend.prepared == [(PLAIN, LAYOUT), (SOFTCAP, LAYOUT)]


def test_an_explicit_backend_that_cannot_serve_a_layer_names_it(fast_no_softcap: type) -> None:
    with pytest.raises(A.UnsupportedConfigError, match="cannot serve this model") as info:
        A.create_backend("nocap", device="cpu", layers=[PLAIN, SOFTCAP], layout=LAYOUT)
    assert [r.field for r in info.value.reasons] == ["layers[1].softcap"]


def test_auto_with_no_backend_for_the_model_lists_every_backend_reason(
    fast_no_softcap: type,
) -> None:
    config = A.AttentionConfig(backend="auto", candidates=["nocap"])
    with pytest.raises(A.UnsupportedConfigError, match="no attention backend can serve") as info:
        A.create_backend(config, device="cpu", layers=[SOFTCAP], layout=LAYOUT)
    assert [r.field for r in info.value.reasons] == ["nocap.layers[0].softcap"]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"layers": [PLAIN]}, "layout"),
        ({"layout": LAYOUT}, "layers"),
        ({"layers": [PLAIN, "x"], "layout": LAYOUT}, r"layers\[1\]"),
        ({"layers": [PLAIN], "layout": "NHD"}, "layout"),
    ],
)
def test_the_model_arguments_are_checked(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(A.InvalidInputError, match=field):
        A.create_backend("reference", **kwargs)  # type: ignore[arg-type]


# --- routed --------------------------------------------------------------------------------------


@pytest.fixture
def three() -> Iterator[dict[str, type[ReferenceBackend]]]:
    classes = {n: counting(n) for n in ("dec", "pre", "mix")}
    handles = [A.register_backend(n, c) for n, c in classes.items()]
    for c in classes.values():
        c.forwards.clear()
    yield classes
    for h in handles:
        h.remove()


def routed_over_three() -> RoutedBackend:
    config = A.AttentionConfig(backend="routed", decode="dec", prefill="pre", mixed="mix")
    backend = A.create_backend(config, device="cpu")
    assert isinstance(backend, RoutedBackend)
    return backend


@pytest.mark.parametrize(
    ("query_lens", "seq_lens", "kind"),
    [
        ((1, 1, 1), (9, 1, 4), "decode"),
        ((1, 0, 1), (9, 3, 4), "decode"),
        ((5, 3), (5, 3), "prefill"),
        ((5, 0), (5, 0), "prefill"),
        ((5, 1), (5, 8), "mixed"),
        ((3, 3), (10, 3), "mixed"),
    ],
)
def test_each_step_runs_on_its_kind_s_backend(
    three: dict[str, type[ReferenceBackend]],
    query_lens: tuple[int, ...],
    seq_lens: tuple[int, ...],
    kind: str,
) -> None:
    backend = routed_over_three()
    batch = make_batch(BatchSpec(query_lens, seq_lens), PLAIN, LAYOUT, seed=sum(seq_lens))
    assert step_kind(batch.metadata) == kind
    out, cache = batch.run(backend)
    expected, expected_cache = batch.run(ReferenceBackend())
    assert_close_to_reference(out, expected, atol=1e-6, rtol=1e-6)
    assert torch.equal(cache.k, expected_cache.k)
    owner = {"decode": "dec", "prefill": "pre", "mixed": "mix"}[kind]
    forwards = [n for c in three.values() for n in c.forwards]
    assert forwards == [owner]


def test_routes_skip_candidates_that_cannot_serve_the_model(
    three: dict[str, type[ReferenceBackend]], fast_no_softcap: type
) -> None:
    config = A.AttentionConfig(
        backend="routed", decode=["nocap", "dec"], prefill="pre", mixed=["nocap", "mix"]
    )
    backend = A.create_backend(config, device="cpu")
    assert isinstance(backend, RoutedBackend)
    assert backend.routes == {"decode": "nocap", "prefill": "pre", "mixed": "nocap"}
    backend.prepare([PLAIN, SOFTCAP], LAYOUT, "cpu")
    assert backend.routes == {"decode": "dec", "prefill": "pre", "mixed": "mix"}
    why = backend.explain()
    assert why["decode"]["backend"] == "dec"
    assert why["decode"]["passed_over"] == {
        "nocap": ["configuration: softcap is not supported by this backend"]
    }


def test_a_route_no_candidate_can_serve_raises_every_reason(fast_no_softcap: type) -> None:
    config = A.AttentionConfig(backend="routed", decode="nocap", prefill="reference")
    backend = A.create_backend(config, device="cpu")
    with pytest.raises(A.UnsupportedConfigError, match="no backend for every step kind") as info:
        backend.prepare([SOFTCAP], LAYOUT, "cpu")
    assert [r.field for r in info.value.reasons] == ["decode.nocap.softcap"]


def test_routed_is_never_picked_by_auto_but_listed_by_name() -> None:
    assert "routed" in A.backend_names()
    assert "routed" not in A.explain("auto", device="cpu")
    assert A.explain("routed", PLAIN, LAYOUT, device="cpu") == {"routed": []}


def test_routes_name_known_backends_only() -> None:
    with pytest.raises(ValueError, match="nosuch"):
        RoutedOptions(decode="nosuch")
    with pytest.raises(A.AttnSDKError, match="decode"):
        A.AttentionConfig(backend="routed", decode=["reference", "nosuch"])
    with pytest.raises(ValueError, match="real backends"):
        RoutedOptions(mixed=["auto"])


def test_forward_needs_a_routed_plan() -> None:
    backend = A.create_backend(
        A.AttentionConfig(backend="routed", decode="reference", prefill="reference"), device="cpu"
    )
    batch = make_batch(BatchSpec((1,), (3,)), PLAIN, LAYOUT, seed=0)
    inner = ReferenceBackend().plan(batch.metadata)
    with pytest.raises(A.InvalidInputError, match="RoutedPlan"):
        backend.forward(batch.q, batch.k, batch.v, batch.fresh_cache(), inner, PLAIN)
    plan = backend.plan(batch.metadata)
    assert isinstance(plan, RoutedPlan)
    assert plan.kind == "decode"


def test_debug_mode_s_sync_check_reaches_every_route() -> None:
    checked: list[str] = []

    class Checked(ReferenceBackend):
        def sync_check(self, device: torch.device) -> None:
            checked.append(self.name)

    handles = []
    for name in ("dec", "pre"):
        cls = type(f"Checked_{name}", (Checked,), {"name": name})
        handles.append(A.register_backend(name, cls))
    try:
        backend = A.create_backend(
            A.AttentionConfig(backend="routed", decode="dec", prefill="pre", mixed="pre"),
            device="cpu",
        )
        assert isinstance(backend, RoutedBackend)
        backend.sync_check(torch.device("cpu"))
    finally:
        for h in handles:
            h.remove()
    assert sorted(checked) == ["dec", "pre"]


def test_a_layer_one_route_cannot_serve_is_refused_at_the_first_step(
    three: dict[str, type[ReferenceBackend]], fast_no_softcap: type
) -> None:
    config = A.AttentionConfig(backend="routed", decode="dec", prefill="nocap", mixed="mix")
    backend = A.create_backend(config, device="cpu")
    assert [r.field for r in backend.unsupported_reasons(SOFTCAP, LAYOUT, "cpu")] == [
        "prefill.softcap"
    ]
    batch = make_batch(BatchSpec((1, 1), (5, 9)), SOFTCAP, LAYOUT, seed=4)  # a decode step
    before = batch.cache.k.clone()
    plan = backend.plan(batch.metadata)
    with pytest.raises(A.UnsupportedConfigError, match="every route"):
        backend.forward(batch.q, batch.k, batch.v, batch.cache, plan, SOFTCAP)
    assert torch.equal(batch.cache.k, before)


def test_lse_goes_to_the_step_s_backend(three: dict[str, type[ReferenceBackend]]) -> None:
    backend = routed_over_three()
    assert A.Feature.LSE in backend.capabilities.features
    for query_lens, seq_lens in (((1, 1), (5, 9)), ((4, 3), (4, 3))):
        batch = make_batch(BatchSpec(query_lens, seq_lens), PLAIN, LAYOUT, seed=5)
        out, lse, _ = batch.run_with_lse(backend)
        expected_out, expected_lse, _ = batch.run_with_lse(ReferenceBackend())
        assert torch.equal(out, expected_out)
        assert torch.equal(lse, expected_lse)


def test_lse_one_route_cannot_return_is_refused_on_every_step() -> None:
    """The decode route could fill lse=, the prefill route could not: a decode step refuses it
    too (and writes nothing), so a model does not fail only at its first prefill."""
    handles = [
        A.register_backend("dec", counting("dec")),
        A.register_backend("nolse", counting("nolse", lse=False)),
    ]
    try:
        config = A.AttentionConfig(backend="routed", decode="dec", prefill="nolse", mixed="dec")
        backend = A.create_backend(config, device="cpu")
        assert isinstance(backend, RoutedBackend)
        assert A.Feature.LSE not in backend.capabilities.features
        batch = make_batch(BatchSpec((1, 1), (5, 9)), PLAIN, LAYOUT, seed=6)  # a decode step
        before = batch.cache.k.clone()
        with pytest.raises(A.UnsupportedConfigError, match="every route") as info:
            batch.run_with_lse(backend, batch.cache)
        assert [r.field for r in info.value.reasons] == ["prefill.lse"]
        assert torch.equal(batch.cache.k, before)
        out, _ = batch.run(backend)  # without lse= the step runs
        assert torch.isfinite(out).all()
    finally:
        for h in handles:
            h.remove()


@pytest.fixture
def no_trees_on_decode() -> Iterator[None]:
    """A decode backend without tree masks, cross-attention or ragged attention (as flashinfer
    is) and a full one for the other routes."""
    without = (A.Feature.TREE_MASK, A.Feature.CROSS_ATTENTION, A.Feature.RAGGED)
    handles = [
        A.register_backend("dec", counting("dec", without=without)),
        A.register_backend("mix", counting("mix")),
    ]
    yield
    for h in handles:
        h.remove()


def _routed(decode: str, prefill: str, mixed: str) -> RoutedBackend:
    config = A.AttentionConfig(backend="routed", decode=decode, prefill=prefill, mixed=mixed)
    backend = A.create_backend(config, device="cpu")
    assert isinstance(backend, RoutedBackend)
    return backend


def test_tree_and_cross_steps_are_mixed_steps_and_declared_by_that_route(
    no_trees_on_decode: None,
) -> None:
    """A tree step with one draft per sequence has decode lengths but is a mixed step: it runs
    on the mixed route, which serves trees, so the routed backend declares them and serves
    every tree step, whatever its lengths (and the same for cross-attention)."""
    backend = _routed("dec", "mix", "mix")
    assert {A.Feature.TREE_MASK, A.Feature.CROSS_ATTENTION} <= backend.capabilities.features
    mask = A.tree_mask_from_parents([[-1], [-1]])
    one_draft = A.AttentionMetadata.from_seqlens([1, 1], [9, 5], [[1, 2, 3], [4, 5, 0]], 4,
                                                 tree_mask=mask)  # fmt: skip
    assert step_kind(one_draft) == "mixed"
    plan = backend.plan(one_draft)
    assert isinstance(plan, RoutedPlan)
    assert plan.kind == "mixed"
    cross = A.AttentionMetadata.from_seqlens([1], [6], [[1, 2]], 4, cross_attention=True)
    assert step_kind(cross) == "mixed"
    features = backend.explain()["features"]
    assert features["tree_mask"] == features["cross_attention"] == "served"


def test_a_step_feature_the_mixed_route_lacks_is_refused_at_plan(no_trees_on_decode: None) -> None:
    """The mixed route without trees: not declared, every tree step refused at plan() with
    the route named, and explain() says why."""
    backend = _routed("mix", "mix", "dec")
    assert A.Feature.TREE_MASK not in backend.capabilities.features
    spec = BatchSpec.verify(batch_size=2, draft_tokens=3, seed=1)
    batch = make_batch(spec, PLAIN, LAYOUT, tree=True)
    with pytest.raises(A.UnsupportedConfigError, match="cannot serve this step") as info:
        backend.plan(batch.metadata)
    assert [r.field for r in info.value.reasons] == ["tree_mask"]
    assert "mixed route (dec) lacks it" in str(backend.explain()["features"]["tree_mask"])


def test_forward_ragged_runs_on_the_step_s_route_when_every_route_has_it(
    three: dict[str, type[ReferenceBackend]],
) -> None:
    backend = routed_over_three()
    assert A.Feature.RAGGED in backend.capabilities.features
    assert backend.unsupported_reasons(PLAIN, None, "cpu", uses=(A.Feature.RAGGED,)) == []
    torch.manual_seed(0)
    meta = A.AttentionMetadata.for_ragged([3, 2], [3, 2])
    q, k, v = torch.randn(5, 4, 16), torch.randn(5, 2, 16), torch.randn(5, 2, 16)
    reference = ReferenceBackend()
    want = reference.forward_ragged(q, k, v, reference.plan(meta), PLAIN)
    plan = backend.plan(meta)
    assert isinstance(plan, RoutedPlan)
    assert plan.kind == "prefill"
    torch.testing.assert_close(backend.forward_ragged(q, k, v, plan, PLAIN), want)


def test_forward_ragged_one_route_lacks_is_refused_typed(no_trees_on_decode: None) -> None:
    backend = _routed("dec", "mix", "mix")
    assert A.Feature.RAGGED not in backend.capabilities.features
    assert [
        r.field for r in backend.unsupported_reasons(PLAIN, None, "cpu", uses=(A.Feature.RAGGED,))
    ] == ["decode.ragged"]
    meta = A.AttentionMetadata.for_ragged([3], [3])
    q, k = torch.randn(3, 4, 16), torch.randn(3, 2, 16)
    out = torch.full((3, 4, 16), 7.0)
    with pytest.raises(A.UnsupportedConfigError, match="forward_ragged on every route") as info:
        backend.forward_ragged(q, k, k, backend.plan(meta), PLAIN, out=out)
    assert [r.field for r in info.value.reasons] == ["decode.ragged"]
    assert bool((out == 7).all())
    assert "decode route (dec) lacks it" in str(backend.explain()["features"]["ragged"])
