"""``BackendBase``: what a backend author gets for free, and what the registry reads from it."""

from __future__ import annotations

import pytest
import torch

import attnsdk as A
from attnsdk.backends.reference import ReferenceBackend
from attnsdk.testing import BatchSpec, assert_close_to_reference, make_batch

GQA = A.LayerSpec(num_heads=4, num_kv_heads=2, head_dim=16)
LAYOUT = A.KVCacheLayout(num_kv_heads=2, head_dim=16, page_size=4, dtype=torch.float32)


class Dense(A.BackendBase):
    """A whole backend: gather each sequence's keys from its pages, then plain softmax attention.
    Causal only, no GQA extras beyond repeat_interleave: enough to exercise the base class."""

    name = "dense"
    capabilities = A.Capabilities(
        devices=frozenset({"cpu"}),
        dtypes=frozenset({torch.float32}),
        kv_dtypes=frozenset(),
        max_head_dim=64,
        features=frozenset({A.Feature.GQA}),
    )

    def __init__(self, options: A.NoOptions | None = None) -> None:
        super().__init__(options)
        self.calls: list[str] = []

    @classmethod
    def refusals(cls, request: A.Request) -> list[A.Reason]:
        reasons = super().refusals(request)
        if request.layer is not None and request.layer.head_dim == 48:
            reasons.append(A.Reason(A.ReasonKind.CONFIGURATION, "head_dim", "48 is unlucky"))
        return sorted(reasons)

    def layer_state(self, layer: A.LayerSpec, layout: A.KVCacheLayout) -> float:
        self.calls.append("layer_state")
        return layer.softmax_scale

    def make_plan(self, meta: A.AttentionMetadata) -> A.Plan:
        self.calls.append("make_plan")
        return super().make_plan(meta)

    def attend(self, call):  # type: ignore[no-untyped-def]
        q, cache, plan, layer, state = call.q, call.cache, call.plan, call.layer, call.state
        meta, p, out = plan.metadata, cache.layout.page_size, call.out
        qsl, lens = meta.query_start_loc_cpu.tolist(), meta.seq_lens_cpu.tolist()
        for b, length in enumerate(lens):
            q0, q1 = qsl[b], qsl[b + 1]
            pages = meta.page_table[b, : -(-length // p)].long()
            k = cache.k_nhd[pages].flatten(0, 1)[:length].repeat_interleave(layer.group_size, 1)
            v = cache.v_nhd[pages].flatten(0, 1)[:length].repeat_interleave(layer.group_size, 1)
            s = torch.einsum("qhd,khd->hqk", q[q0:q1], k) * state
            pos = torch.arange(length - (q1 - q0), length)[:, None]
            s = s.masked_fill(torch.arange(length)[None, :] > pos, float("-inf"))
            out[q0:q1] = torch.einsum("hqk,khd->qhd", s.softmax(-1), v)
        return out


def test_a_small_subclass_is_a_whole_backend() -> None:
    batch = make_batch(BatchSpec(query_lens=(1, 5, 3), seq_lens=(8, 5, 7)), GQA, LAYOUT, seed=1)
    dense = Dense()
    assert isinstance(dense, A.Backend)
    out, cache = batch.run(dense)
    expected, expected_cache = batch.run(ReferenceBackend())
    assert_close_to_reference(out, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(cache.k, expected_cache.k)
    assert torch.equal(cache.v, expected_cache.v)
    assert dense.calls == ["make_plan", "layer_state"]  # the layer is prepared at its first forward


def test_reasons_join_capabilities_environment_and_the_hook() -> None:
    layer = A.LayerSpec(num_heads=4, num_kv_heads=4, head_dim=48, softcap=5.0)
    fields = [r.field for r in Dense.refusals(A.Request(layer, device=torch.device("cuda")))]
    assert fields == ["device", "head_dim", "softcap"]
    assert Dense().unsupported_reasons(GQA, LAYOUT, "cpu") == []
    # The registry asks the class, without creating it.
    assert isinstance(Dense, A.BackendClass)
    registration = A.register_backend("dense-test", Dense)
    try:
        explained = A.explain("dense-test", layer, device="cpu")["dense-test"]
    finally:
        registration.remove()
    assert [r.field for r in explained] == ["head_dim", "softcap"]


def test_forward_refuses_a_layer_it_cannot_serve_before_writing() -> None:
    batch = make_batch(BatchSpec(query_lens=(2,), seq_lens=(5,)), GQA, LAYOUT, seed=2)
    layer = A.LayerSpec(num_heads=4, num_kv_heads=2, head_dim=16, sliding_window=4)
    before = batch.cache.k.clone()
    plan = Dense().plan(batch.metadata)
    with pytest.raises(A.UnsupportedConfigError, match="sliding_window"):
        Dense().forward(batch.q, batch.k, batch.v, batch.cache, plan, layer)
    assert torch.equal(batch.cache.k, before)


def test_forward_refuses_lse_without_the_feature_before_writing() -> None:
    """Dense does not declare Feature.LSE: lse= is refused, naming it, and nothing is written."""
    batch = make_batch(BatchSpec(query_lens=(2, 1), seq_lens=(5, 3)), GQA, LAYOUT, seed=2)
    dense = Dense()
    reasons = dense.unsupported_reasons(GQA, LAYOUT, "cpu", uses=(A.Feature.LSE,))
    assert [r.field for r in reasons] == ["lse"]
    k, v = batch.cache.k.clone(), batch.cache.v.clone()
    with pytest.raises(A.UnsupportedConfigError, match=r"log-sum-exp \(lse=\)") as info:
        batch.run_with_lse(dense, batch.cache)
    assert [r.field for r in info.value.reasons] == ["lse"]
    assert torch.equal(batch.cache.k, k)
    assert torch.equal(batch.cache.v, v)
    assert dense.prepared == [], "the refused call prepared the layer"
    out, _ = batch.run(dense)  # without lse= it serves the layer
    assert torch.isfinite(out).all()


def test_a_chunked_layer_is_refused_by_its_field_before_writing() -> None:
    """A backend without ``Feature.CHUNKED_LOCAL`` refuses a chunked layer, naming the
    ``LayerSpec`` field an integrator sets (not the feature's value)."""
    batch = make_batch(BatchSpec(query_lens=(6,), seq_lens=(9,)), GQA, LAYOUT, seed=3)
    layer = A.LayerSpec(num_heads=4, num_kv_heads=2, head_dim=16, attention_chunk_size=4)
    reasons = Dense.refusals(A.Request(layer, LAYOUT, torch.device("cpu")))
    assert [str(r) for r in reasons] == [
        "configuration: attention_chunk_size is not supported by this backend"
    ]
    before = batch.cache.k.clone()
    plan = Dense().plan(batch.metadata)
    with pytest.raises(A.UnsupportedConfigError, match="attention_chunk_size"):
        Dense().forward(batch.q, batch.k, batch.v, batch.cache, plan, layer)
    assert torch.equal(batch.cache.k, before)


def test_prepare_names_every_layer_it_cannot_serve() -> None:
    bad = A.LayerSpec(num_heads=4, num_kv_heads=2, head_dim=16, softcap=30.0)
    worse = A.LayerSpec(num_heads=4, num_kv_heads=2, head_dim=16, sliding_window=8)
    dense = Dense()
    with pytest.raises(A.UnsupportedConfigError) as info:
        dense.prepare([GQA, bad, GQA, worse], LAYOUT)
    assert [r.field for r in info.value.reasons] == [
        "layers[1].softcap",
        "layers[3].sliding_window",
    ]
    assert "layers[1].softcap" in str(info.value)
    # All or nothing: the servable layers of a refused model are not prepared either.
    assert dense.prepared == []


def test_prepare_computes_each_shape_once_and_warmup_runs_them() -> None:
    dense = Dense()
    window = A.LayerSpec(num_heads=4, num_kv_heads=2, head_dim=16, scale=0.5)
    dense.prepare([GQA, GQA, window, GQA], LAYOUT, "cpu")
    assert dense.prepared == [(GQA, LAYOUT), (window, LAYOUT)]
    assert dense.calls == ["layer_state", "layer_state"]
    dense.warmup("cpu")
    # Two steps per shape (prefills, then a mixed step); no shape is prepared again.
    assert dense.calls.count("make_plan") == 4
    assert dense.calls.count("layer_state") == 2


def test_warmup_before_prepare_does_nothing() -> None:
    dense = Dense()
    dense.warmup("cpu")
    assert dense.calls == []


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"layers": [GQA], "layout": "NHD"}, "layout"),
        ({"layers": [GQA, "layer"], "layout": LAYOUT}, r"layers\[1\]"),
    ],
)
def test_prepare_rejects_wrong_types(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(A.InvalidInputError, match=match):
        Dense().prepare(**kwargs)  # type: ignore[arg-type]


def test_options_of_another_backend_are_refused() -> None:
    from attnsdk.backends.reference import ReferenceOptions

    with pytest.raises(A.InvalidInputError, match="NoOptions"):
        Dense(ReferenceOptions())  # type: ignore[arg-type]


def test_a_subclass_must_name_itself_and_declare_capabilities() -> None:
    with pytest.raises(TypeError, match="name, capabilities"):

        class Nameless(A.BackendBase):
            pass


def test_a_backend_without_attend_says_so() -> None:
    class Lazy(Dense):
        attend = A.BackendBase.attend

    batch = make_batch(BatchSpec(query_lens=(1,), seq_lens=(3,)), GQA, LAYOUT, seed=3)
    with pytest.raises(NotImplementedError, match="Lazy must implement attend"):
        batch.run(Lazy())


class StrictOptions(A.NoOptions):
    no_gqa: bool = True
    """Refuse grouped-query layers (a kernel variant this option would select)."""


class Strict(Dense):
    name = "strict"
    Options = StrictOptions

    def __init__(self, options: StrictOptions | None = None) -> None:
        A.BackendBase.__init__(self, options)
        self.calls = []

    @classmethod
    def refusals(cls, request: A.Request) -> list[A.Reason]:
        reasons = super().refusals(request)
        layer = request.layer
        if cls.options_of(request).no_gqa and layer is not None and layer.group_size > 1:
            reasons.append(A.Reason(A.ReasonKind.CONFIGURATION, "num_heads", "no GQA with no_gqa"))
        return sorted(reasons)


def test_refusals_follow_the_options_everywhere() -> None:
    lenient = StrictOptions(no_gqa=False)
    cpu = torch.device("cpu")
    assert [r.field for r in Strict.refusals(A.Request(GQA, LAYOUT, cpu))] == ["num_heads"]
    assert Strict.refusals(A.Request(GQA, LAYOUT, cpu, lenient)) == []
    assert [r.field for r in Strict().unsupported_reasons(GQA, LAYOUT, "cpu")] == ["num_heads"]
    assert Strict(lenient).unsupported_reasons(GQA, LAYOUT, "cpu") == []
    registration = A.register_backend("strict-test", Strict, priority=1000)
    try:
        configured = A.AttentionConfig(backend="strict-test", no_gqa=False)
        assert A.explain(configured, GQA, LAYOUT, "cpu") == {"strict-test": []}
        assert [r.field for r in A.explain("strict-test", GQA, LAYOUT, "cpu")["strict-test"]] == [
            "num_heads"
        ]
        # "auto" creates defaults, so it passes over a backend its default options refuse.
        chosen = A.create_backend("auto", device="cpu", layers=[GQA], layout=LAYOUT)
        assert chosen.name != "strict"
        plain = A.LayerSpec(num_heads=2, num_kv_heads=2, head_dim=16)
        chosen = A.create_backend("auto", device="cpu", layers=[plain], layout=LAYOUT)
        assert chosen.name == "strict"
    finally:
        registration.remove()


@pytest.mark.parametrize("needs", ["q", "k", "v", "sinks"])
def test_a_call_that_would_need_gradients_is_refused_before_writing(needs: str) -> None:
    """No backend computes a backward: an input that requires grad under grad mode is refused,
    named, before the cache, ``out`` or ``lse`` change; the same call under ``no_grad`` runs."""
    layer = A.LayerSpec(num_heads=4, num_kv_heads=2, head_dim=16, has_sinks=True)
    batch = make_batch(BatchSpec.mixed(seed=2), layer, LAYOUT, seed=2)
    backend = ReferenceBackend()
    args = {"q": batch.q, "k": batch.k, "v": batch.v, "sinks": batch.sinks}
    args[needs] = args[needs].clone().requires_grad_(True)
    cache = batch.fresh_cache()
    out = torch.full((batch.q.shape[0], 4, 16), 7.0)
    lse = torch.full((batch.q.shape[0], 4), 7.0)
    plan = backend.plan(batch.metadata)
    with pytest.raises(A.UnsupportedConfigError, match="inference only") as err:
        backend.forward(args["q"], args["k"], args["v"], cache, plan, layer,
                        sinks=args["sinks"], out=out, lse=lse)  # fmt: skip
    assert [r.field for r in err.value.reasons] == [f"{needs}.requires_grad"]
    assert torch.equal(cache.k, batch.cache.k)
    assert torch.equal(cache.v, batch.cache.v)
    assert bool((out == 7).all())
    assert bool((lse == 7).all())
    ragged = backend.plan(A.AttentionMetadata.for_ragged([2, 3], [2, 3]))
    with pytest.raises(A.UnsupportedConfigError, match="inference only"):
        backend.forward_ragged(args["q"][:5], args["k"][:5], args["v"][:5], ragged, layer,
                               sinks=args["sinks"])  # fmt: skip
    with torch.no_grad():
        got = backend.forward(args["q"], args["k"], args["v"], cache, plan, layer,
                              sinks=args["sinks"])  # fmt: skip
    want, _ = batch.run(backend)
    assert_close_to_reference(got, want)
