"""``BackendConformance``: the one test suite every attnsdk backend runs (needs pytest).

A backend's test module subclasses it and names the backend and the device; pytest collects
the subclass (its name starts with ``Test``), never this base::

    from attnsdk.testing.conformance import BackendConformance

    class TestMineConformance(BackendConformance):
        backend = "mine"          # a registered name or an AttentionConfig
        device = "cuda"

Every case compares the backend with the ``reference`` backend (fp32 accumulation) run on a copy
of the same cache: the output within the dtype's tolerance (``attnsdk.testing.tolerance``) and
the whole cache after the step (bit-exact; fp8 slots the step writes within one fp8 step). A
case the backend declares it cannot serve (``unsupported_reasons``) must be refused with
``UnsupportedConfigError``, writing nothing, and is then skipped with those reasons: the
backend's own declarations are the only way to skip a case.

The matrix is a covering design, not a product: every batch preset on the plain layer, every
feature on a mixed batch, every storage order and page size on a mixed batch, each dtype with a
few features; then ``prepare`` / ``warmup``, bad metadata, ``out=``, ``k = v = None``, rows past
``num_tokens`` and CUDA-graph replay against eager execution (with and without ``lse=``).
No case relies on its seed to tell a rule apart: batches of a window or chunked layer also
hold ``edge_rows`` (where the boundaries fall), tree batches two sibling drafts, ragged steps
several queries over more keys and over fewer, and a scale other than the default has a case.

The log-sum-exp (``lse=``, docs/kv_layout.md): on every preset and feature it matches the
reference's and leaves the output bit for bit as without it; and attention split into a
non-causal pass over a prefix of each sequence's pages and a causal pass over the rest, merged
by ``attnsdk.merge_states``, equals one pass (the cascade / shared-prefix use). A backend whose
``lse_reasons`` refuses a case must raise ``UnsupportedConfigError`` and write nothing; the case
is then skipped with those reasons.

Class attributes a subclass may set: ``dtypes`` (default: fp16, bf16 and fp32; those the backend
does not declare are checked to be refused), ``page_sizes`` (of the layout cases), ``page_size``
(of the others), ``seeds`` (random batches per case), ``atol`` / ``rtol`` (override the
dtype-derived tolerance), and the hooks ``tolerance``, ``lse_tolerance`` and
``reference_batch`` for precision choices a backend documents (fa3 multiplies fp8 KV with q
cast to fp8).

``run_conformance(backend)`` runs the same cases without a pytest session and returns each
one's outcome (``CaseResult``): for a backend built inside a test, such as the deliberately
broken ones of tests/backends/test_conformance_mutants.py, which the suite must reject.
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import pytest
import torch

from attnsdk.backends.base import BackendBase, lse_reasons_of
from attnsdk.backends.graphs import GraphRunner
from attnsdk.backends.reference import ReferenceBackend
from attnsdk.contract.backend import Backend
from attnsdk.contract.capabilities import (
    GraphSupport,
    lse_capability_reasons,
    paged_cross_reasons,
    step_capability_reasons,
)
from attnsdk.contract.errors import InvalidMetadataError, Reason, UnsupportedConfigError
from attnsdk.contract.kv import COMPUTE_DTYPES, KVCacheLayout
from attnsdk.contract.layer import LayerSpec
from attnsdk.contract.metadata import AttentionMetadata
from attnsdk.kernels.merge import merge_states
from attnsdk.selection.create import create_backend, explain
from attnsdk.testing._batch import Batch, make_batch
from attnsdk.testing._conformance_cases import (
    _CHUNKED,
    _CROSS_FEATURES,
    _DTYPE_FEATURES,
    _LSE_FEATURES,
    _LSE_TOLERANCE,
    _MLA_FEATURES,
    _MLA_PRESETS,
    _ORDERS,
    _PAGE_ORDERS,
    _RAGGED_FEATURES,
    _RAGGED_PREFIX_FEATURES,
    _SPLIT_FEATURES,
    _TREE_FEATURES,
    _TREE_PRESETS,
    CHUNK_PRESETS,
    FEATURES,
    PACKED,
    PRESETS,
    FeatureCase,
    _assert_same_cache,
    _base,
    _branches,
    _chunk_edges_64,
    _copy,
    _dtype_id,
    _layers_for,
    _mixed,
    _name,
    _packed,
    _rows,
    _with_siblings,
    edge_rows,
    ragged_step,
)
from attnsdk.testing._spec import BatchSpec
from attnsdk.testing._tolerance import assert_close_to_reference, tolerance

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    from attnsdk.selection.config import AttentionConfig

__all__ = [
    "CHUNK_PRESETS",
    "FEATURES",
    "PRESETS",
    "BackendConformance",
    "CaseResult",
    "FeatureCase",
    "run_conformance",
]


class BackendConformance:
    """Base class of a backend's conformance tests; see the module docstring."""

    backend: ClassVar[str | AttentionConfig]
    """The backend under test: a registered name or an ``AttentionConfig``."""
    device: ClassVar[str] = "cpu"
    dtypes: ClassVar[tuple[torch.dtype, ...] | None] = None
    """Compute dtypes of the dtype cases; None: fp16, bf16 and fp32."""
    page_sizes: ClassVar[tuple[int, ...]] = (1, 16, 64)
    page_size: ClassVar[int] = 16
    seeds: ClassVar[int] = 3
    atol: ClassVar[float | None] = None
    rtol: ClassVar[float | None] = None
    serves_basic_case: ClassVar[bool] = True
    """False only for a backend that cannot serve a GQA layer on an NHD cache at ``page_size``
    (otherwise a backend refusing everything would pass by skipping)."""

    # -- hooks --------------------------------------------------------------------------------

    def tolerance(self, layout: KVCacheLayout) -> tuple[float, float]:
        """(atol, rtol) of the output comparison; default from the dtypes, then ``atol``/``rtol``."""
        atol, rtol = tolerance(layout.dtype, layout.storage_dtype)
        return (
            atol if self.atol is None else self.atol,
            rtol if self.rtol is None else self.rtol,
        )

    def lse_tolerance(self, layout: KVCacheLayout) -> tuple[float, float]:
        """(atol, rtol) of the log-sum-exp comparison: ``_LSE_TOLERANCE``, or the output's
        tolerance with fp8 KV (a backend may round q differently around the fp8 scales)."""
        if layout.is_quantized:
            return self.tolerance(layout)
        return _LSE_TOLERANCE

    def reference_batch(self, batch: Batch) -> Batch:
        """The batch the reference runs: override to model rounding the backend documents."""
        return batch

    # -- parametrisation and fixtures ---------------------------------------------------------

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        """Parametrise ``dtype`` and ``page_size`` from the subclass's attributes."""
        if "dtype" in metafunc.fixturenames:
            dtypes = self.dtypes or tuple(sorted(COMPUTE_DTYPES, key=str))
            metafunc.parametrize("dtype", dtypes, ids=[_dtype_id(d) for d in dtypes])
        if "page_size" in metafunc.fixturenames:
            metafunc.parametrize(
                "page_size", self.page_sizes, ids=[f"p{p}" for p in self.page_sizes]
            )

    @pytest.fixture(scope="class")
    @classmethod
    def subject(cls) -> Backend:
        """The backend under test; skips the class, with the reasons, where it cannot run."""
        config = cls.backend
        dev = torch.device(cls.device)
        if dev.type == "cuda" and not torch.cuda.is_available():
            pytest.skip(f"{cls.__name__} needs a CUDA device ({cls.device}); none is visible")
        env = [r for reasons in explain(config, device=dev).values() for r in reasons]
        if env:
            pytest.skip(f"{_name(config)} cannot run on {dev}: " + "; ".join(map(str, env)))
        return create_backend(config, device=dev)

    @pytest.fixture(scope="class")
    @classmethod
    def oracle(cls) -> Backend:
        """The reference backend: every output and cache is compared with it."""
        return ReferenceBackend()

    # -- the matrix ---------------------------------------------------------------------------

    @pytest.mark.parametrize("preset", sorted(PRESETS))
    def test_preset(self, subject: Backend, oracle: Backend, preset: str) -> None:
        """Every batch shape an engine produces, on the plain (MHA) layer."""
        self._check(
            subject, oracle, "mha", self._dtype(subject), "NHD", self.page_size, PRESETS[preset]
        )

    @pytest.mark.parametrize("feature", sorted(set(FEATURES) - set(_MLA_FEATURES)))
    def test_feature(self, subject: Backend, oracle: Backend, feature: str) -> None:
        """Every feature of DESIGN §2 on mixed batches."""
        self._check(subject, oracle, feature, self._dtype(subject), "NHD", self.page_size, _mixed)

    @pytest.mark.parametrize("order", _ORDERS)
    def test_layout(self, subject: Backend, oracle: Backend, order: str, page_size: int) -> None:
        """Storage orders (NHD, HND, packed K‖V) and page sizes on mixed batches."""
        self._check(subject, oracle, "gqa", self._dtype(subject), order, page_size, _mixed)

    @pytest.mark.parametrize("preset", sorted(CHUNK_PRESETS))
    @pytest.mark.parametrize("feature", _CHUNKED)
    def test_chunked(self, subject: Backend, oracle: Backend, feature: str, preset: str) -> None:
        """Chunked local attention where chunks matter: rows on chunk edges (decode on a
        chunk's first and last position, extends across and from a boundary, a prefill over
        several chunks), decode and verify rows anywhere, graph padding."""
        spec = CHUNK_PRESETS[preset]
        self._check(subject, oracle, feature, self._dtype(subject), "NHD", self.page_size, spec)

    @pytest.mark.parametrize("order", _ORDERS)
    def test_chunked_layout(
        self, subject: Backend, oracle: Backend, order: str, page_size: int
    ) -> None:
        """Chunks of 64 over each storage order and page size."""
        dtype = self._dtype(subject)
        self._check(subject, oracle, "chunked-64", dtype, order, page_size, _chunk_edges_64)

    @pytest.mark.parametrize("feature", _DTYPE_FEATURES)
    def test_dtype(
        self, subject: Backend, oracle: Backend, feature: str, dtype: torch.dtype
    ) -> None:
        """Each compute dtype with a few features; undeclared dtypes must be refused."""
        self._check(subject, oracle, feature, dtype, "NHD", self.page_size, _mixed)

    # -- the lifecycle and the edges of forward -----------------------------------------------

    def test_prepare_and_warmup(self, subject: Backend, oracle: Backend) -> None:
        """``prepare`` every servable feature layer, ``warmup``, then a step still matches."""
        base = _base(subject)
        dtype = self._dtype(subject)
        layout = self._layout(FEATURES["gqa"], dtype, "NHD", self.page_size)
        layers = [
            lay
            for lay in _layers_for(layout)
            if not subject.unsupported_reasons(lay, layout, self.device)
        ]
        if not layers:
            pytest.skip(f"{subject.name} serves none of the feature layers on {layout}")
        base.prepare(layers, layout, self.device)
        assert set(base.prepared) >= {(lay, layout) for lay in layers}
        base.warmup(self.device)
        for layer in layers:
            batch = self._batch(layer, layout, _mixed(3), seed=3)
            self._compare(subject, oracle, batch)

    def test_prepare_names_the_unservable_layer(self, subject: Backend) -> None:
        """``prepare`` refuses a model with every reason, each naming ``layers[i]``."""
        base = _base(subject)
        layout = self._layout(FEATURES["gqa"], self._dtype(subject), "NHD", self.page_size)
        good = LayerSpec(**FEATURES["gqa"].layer)
        bad = next(
            (
                lay
                for lay in _layers_for(layout)
                if subject.unsupported_reasons(lay, layout, self.device)
            ),
            # Every feature served: a layer whose KV heads are not the cache's.
            LayerSpec(num_heads=8, num_kv_heads=4, head_dim=layout.head_dim),
        )
        before = base.prepared
        with pytest.raises(UnsupportedConfigError, match=r"layers\[1\]") as info:
            base.prepare([good, bad], layout, self.device)
        fields = [r.field for r in info.value.reasons]
        assert fields, "UnsupportedConfigError without reasons"
        assert all(f.startswith("layers[1].") for f in fields), fields
        assert base.prepared == before, "a refused model left layers prepared"

    def test_serves_the_basic_case(self, subject: Backend) -> None:
        """A backend that refused everything would pass every other case by skipping: it must
        serve at least a GQA layer on an NHD cache of ``page_size`` in its first dtype
        (set ``serves_basic_case = False`` for a backend that truly cannot)."""
        if not self.serves_basic_case:
            pytest.skip("the backend declares it does not serve the basic case")
        layout = self._layout(FEATURES["gqa"], self._dtype(subject), "NHD", self.page_size)
        layer = LayerSpec(**FEATURES["gqa"].layer)
        assert subject.unsupported_reasons(layer, layout, self.device) == []

    def test_plan_rejects_bad_metadata(self, subject: Backend) -> None:
        """A row with more query tokens than keys is refused by ``plan``, naming the field."""
        qsl = torch.tensor([0, 2, 5], dtype=torch.int32)
        seq = torch.tensor([4, 2], dtype=torch.int32)  # row 1: 3 new tokens but 2 keys
        meta = AttentionMetadata.from_tensors(
            query_start_loc=qsl.to(self.device),
            seq_lens=seq.to(self.device),
            page_table=torch.tensor([[1], [2]], dtype=torch.int32, device=self.device),
            slot_mapping=torch.full((5,), -1, dtype=torch.int64, device=self.device),
            query_start_loc_cpu=qsl,
            seq_lens_cpu=seq,
            page_size=self.page_size,
        )
        with pytest.raises(InvalidMetadataError, match=r"seq_lens\[1\]"):
            subject.plan(meta)

    @pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided"])
    def test_out_is_honoured(self, subject: Backend, oracle: Backend, strided: bool) -> None:
        """``out=`` (also a column view of a wider buffer) receives the result."""
        layer, layout = self._case("gqa", self._dtype(subject), "NHD", self.page_size)
        batch = self._batch(layer, layout, _mixed(1), seed=1)
        self._require(subject, batch)
        t, hq, dv = batch.q.shape[0], layer.num_heads, layer.v_dim
        wide = torch.full(
            (t, hq, dv + (8 if strided else 0)),
            float("nan"),
            dtype=batch.q.dtype,
            device=self.device,
        )
        out = wide[..., :dv]
        cache = batch.fresh_cache()
        plan = subject.plan(batch.metadata)
        result = subject.forward(batch.q, batch.k, batch.v, cache, plan, layer, out=out)
        ref, ref_cache = self.reference_batch(batch).run(oracle)
        n = batch.metadata.num_tokens
        self._assert_output(out[:n], ref, layout)
        _assert_same_cache(cache, ref_cache, batch.metadata, exact=True)
        assert torch.equal(result[:n], out[:n]), (
            "forward returned other values than it wrote to out"
        )
        if strided:
            assert bool(wide[..., dv:].isnan().all()), "forward wrote past the columns of out"

    @pytest.mark.parametrize("feature", ["gqa", "fp8-e4m3-per-head"])
    def test_kv_already_written(self, subject: Backend, oracle: Backend, feature: str) -> None:
        """``k = v = None``: the caller wrote the new K/V; forward only attends, writes nothing."""
        layer, layout = self._case(feature, self._dtype(subject), "NHD", self.page_size)
        batch = self._batch(
            layer, layout, _mixed(2), seed=2, per_head=FEATURES[feature].per_head_scales
        )
        self._require(subject, batch)
        ref, written = self.reference_batch(batch).run(oracle)
        cache = _copy(written)
        scales = {"k_scale": batch.k_scale, "v_scale": batch.v_scale}
        out = subject.forward(
            batch.q, None, None, cache, subject.plan(batch.metadata), layer, **scales
        )
        self._assert_output(out[: batch.metadata.num_tokens], ref, layout)
        _assert_same_cache(cache, written, batch.metadata, exact=True)

    @pytest.mark.parametrize("kind", ["q-rows", "graph-metadata"])
    def test_rows_past_num_tokens(self, subject: Backend, oracle: Backend, kind: str) -> None:
        """Extra NaN rows of q / k / v (an engine's padded graph buffers), or metadata whose
        ``num_tokens`` covers them with slot -1, leave real rows and the cache as they are."""
        layer, layout = self._case("gqa", self._dtype(subject), "NHD", self.page_size)
        batch = self._batch(layer, layout, _mixed(4), seed=4)
        self._require(subject, batch)
        extra, n = 5, batch.metadata.num_tokens

        def pad(x: torch.Tensor) -> torch.Tensor:
            return torch.cat([x, torch.full_like(x[:extra], float("nan"))])

        meta = batch.metadata
        if kind == "graph-metadata":
            unused = torch.full((extra,), -1, dtype=torch.int64, device=self.device)
            meta = dataclasses.replace(
                meta, num_tokens=n + extra, slot_mapping=torch.cat([meta.slot_mapping, unused])
            )
        v = None if batch.v is None else pad(batch.v)
        padded = dataclasses.replace(batch, metadata=meta, q=pad(batch.q), k=pad(batch.k), v=v)
        out, cache = padded.run(subject)
        ref, ref_cache = self.reference_batch(batch).run(oracle)
        self._assert_output(out[:n], ref, layout)
        _assert_same_cache(cache, ref_cache, batch.metadata, exact=not layout.is_quantized)

    # -- tree verify --------------------------------------------------------------------------

    @pytest.mark.parametrize("preset", _TREE_PRESETS)
    @pytest.mark.parametrize("feature", _TREE_FEATURES)
    def test_tree_verify(
        self, subject: Backend, oracle: Backend, feature: str, preset: str
    ) -> None:
        """Speculative-tree verify (``AttentionMetadata.tree_mask``, random draft trees):
        output, log-sum-exp and cache match the reference, and the tree moves the output away
        from a causal chain's (a backend that ignores the mask fails). A backend without
        ``Feature.TREE_MASK`` must refuse the step before writing; the case is then skipped."""
        f = FEATURES[feature]
        layer, layout = self._case(feature, self._dtype(subject), "NHD", self.page_size)
        for seed in range(self.seeds):
            spec = PRESETS[preset](seed)
            batch = self._batch(layer, layout, spec, seed, per_head=f.per_head_scales, tree=True)
            self._require(subject, batch)
            self._require_step(subject, batch)
            out = self._compare(subject, oracle, batch)
            self._check_lse_of(subject, oracle, batch, out)
            # Every tree preset has a sequence of several draft tokens, and _batch makes two of
            # them siblings; ignoring the mask must then fail the comparison above by a margin:
            # the causal chain's output is off by twice the tolerance somewhere.
            assert _branches(batch.metadata), "the tree is a causal chain: it proves nothing"
            chain = dataclasses.replace(batch.metadata, tree_mask=None)
            ref, _ = self.reference_batch(batch).run(oracle)
            causal, _ = self.reference_batch(dataclasses.replace(batch, metadata=chain)).run(oracle)
            atol, rtol = self.tolerance(layout)
            gap = (causal.float() - ref.float()).abs() - 2 * (atol + rtol * ref.float().abs())
            assert float(gap.max()) > 0, "a causal chain is within twice the tolerance"

    # -- cross-attention ----------------------------------------------------------------------

    @pytest.mark.parametrize("feature", _CROSS_FEATURES)
    def test_cross_attention(self, subject: Backend, oracle: Backend, feature: str) -> None:
        """Cross-attention (``AttentionMetadata.cross_attention``): decoder rows over an
        encoder's keys, with more queries than keys and an empty encoder among them: output and
        log-sum-exp match the reference and the cache is untouched. A backend without
        ``Feature.CROSS_ATTENTION`` must refuse the step before writing; it is then skipped."""
        f = FEATURES[feature]
        layer, layout = self._case(feature, self._dtype(subject), "NHD", self.page_size)
        for seed in range(self.seeds):
            spec = BatchSpec.cross_attention(seed=seed)
            rows = list(zip(spec.query_lens, spec.seq_lens))
            # Where cross-attention differs from a causal step (several queries over some keys)
            # and the sequence without keys: there by construction of the preset, not by seed.
            assert any(q >= 2 and s >= 1 for q, s in rows), rows
            assert any(q >= 1 and s == 0 for q, s in rows), rows
            batch = self._batch(layer, layout, spec, seed, per_head=f.per_head_scales)
            self._require(subject, batch)
            self._require_step(subject, batch)
            out = self._compare(subject, oracle, batch)
            self._check_lse_of(subject, oracle, batch, out)

    # -- MLA ----------------------------------------------------------------------------------

    @pytest.mark.parametrize("preset", _MLA_PRESETS)
    @pytest.mark.parametrize("feature", _MLA_FEATURES)
    def test_mla(self, subject: Backend, oracle: Backend, feature: str, preset: str) -> None:
        """Multi-head latent attention (``LayerSpec.mla`` over a ``KVCacheLayout.mla`` cache,
        k alone, V its latent dims): output, log-sum-exp and the one latent cache match the
        reference on every batch kind. A backend that does not serve the case (``Feature.MLA``,
        ``Capabilities.mla_dims``, fp8) must refuse it before writing; it is then skipped."""
        layer, layout = self._case(feature, self._dtype(subject), "NHD", self.page_size)
        for seed in range(self.seeds):
            batch = self._batch(layer, layout, PRESETS[preset](seed), seed)
            self._require(subject, batch)
            out = self._compare(subject, oracle, batch)
            self._check_lse_of(subject, oracle, batch, out)

    # -- ragged ------------------------------------------------------------------------------

    @pytest.mark.parametrize(
        ("feature", "kind"),
        [(f, k) for f in _RAGGED_FEATURES for k in ("prefill", "extend")]
        + [(f, "prefix") for f in _RAGGED_PREFIX_FEATURES],
        ids=[f"{f}-{k}" for f in _RAGGED_FEATURES for k in ("prefill", "extend")]
        + [f"{f}-prefix" for f in _RAGGED_PREFIX_FEATURES],
    )
    def test_ragged(self, subject: Backend, oracle: Backend, feature: str, kind: str) -> None:
        """``forward_ragged`` (K/V in the call, no cache: MLA's expanded prefill and its prefix
        chunks): output and log-sum-exp match the reference; ``out=`` receives the result, and
        asking for the lse leaves the output bit for bit. Each step holds, besides its random
        sequences, those on which the layer's rules differ (``ragged_step``): several queries
        over more keys and over fewer, none (a prefix chunk); the edges of a window or of
        chunks. A backend that does not serve it must raise
        ``UnsupportedConfigError``; the case is then skipped with its reasons."""
        layer, dtype = LayerSpec(**FEATURES[feature].layer), self._dtype(subject)
        dev = torch.device(self.device)
        ask = getattr(subject, "ragged_reasons", None)
        if ask is None:
            pytest.skip(f"{type(subject).__name__} has no forward_ragged (it is no BackendBase)")
        reasons = list(ask(layer, dev))
        if reasons:
            step = ragged_step(layer, kind, 0, dtype, dev)
            with pytest.raises(UnsupportedConfigError):  # refused before the plan is read
                subject.forward_ragged(  # type: ignore[attr-defined]
                    step.q, step.k, step.v, oracle.plan(step.metadata), layer, sinks=step.sinks
                )
            pytest.skip("declared unsupported: " + "; ".join(map(str, reasons)))
        with_lse = not lse_capability_reasons(subject.capabilities)
        atol, rtol = tolerance(dtype)
        for seed in range(self.seeds):
            step = ragged_step(layer, kind, seed, dtype, dev)
            args = (step.q, step.k, step.v)
            plan, ref_plan = subject.plan(step.metadata), oracle.plan(step.metadata)
            out = subject.forward_ragged(*args, plan, layer, sinks=step.sinks)  # type: ignore[attr-defined]
            lse = torch.full((step.metadata.num_tokens, layer.num_heads), float("nan"), device=dev)
            ref_lse = torch.empty_like(lse)
            ref = oracle.forward_ragged(*args, ref_plan, layer, sinks=step.sinks, lse=ref_lse)  # type: ignore[attr-defined]
            assert_close_to_reference(out, ref, atol=atol, rtol=rtol)
            given = torch.full_like(out, float("nan"))
            asked = {"lse": lse} if with_lse else {}
            again = subject.forward_ragged(*args, plan, layer, sinks=step.sinks, out=given, **asked)  # type: ignore[attr-defined]
            assert torch.equal(given, out), "out= did not receive the output (or lse= changed it)"
            assert torch.equal(again, out), "forward_ragged returned other values than out="
            if with_lse:
                empty = torch.isneginf(ref_lse)
                assert torch.equal(torch.isneginf(lse), empty), "-inf where the oracle's is"
                assert_close_to_reference(
                    lse[~empty], ref_lse[~empty], atol=_LSE_TOLERANCE[0], rtol=_LSE_TOLERANCE[1]
                )

    # -- the log-sum-exp ----------------------------------------------------------------------

    @pytest.mark.parametrize(
        ("feature", "preset"),
        [("mha", p) for p in sorted(PRESETS)] + [(f, "mixed") for f in _LSE_FEATURES],
        ids=[f"mha-{p}" for p in sorted(PRESETS)] + list(_LSE_FEATURES),
    )
    def test_lse(self, subject: Backend, oracle: Backend, feature: str, preset: str) -> None:
        """``lse=`` matches the reference's log-sum-exp; the output is bit for bit the one
        without it; refusals (``lse_reasons``) write nothing."""
        f = FEATURES[feature]
        spec = PRESETS.get(preset, _mixed)
        layer, layout = self._case(feature, self._dtype(subject), "NHD", self.page_size)
        for seed in range(self.seeds):
            batch = self._batch(layer, layout, spec(seed), seed, per_head=f.per_head_scales)
            self._require(subject, batch)
            self._require_lse(subject, batch)
            out, lse, cache = batch.run_with_lse(subject)
            plain, _ = batch.run(subject)
            ref_out, ref_lse, ref_cache = self.reference_batch(batch).run_with_lse(oracle)
            self._assert_output(out, ref_out, layout)
            assert torch.equal(out, plain), "asking for lse= changed the output"
            self._assert_lse(lse, ref_lse, layout)
            _assert_same_cache(cache, ref_cache, batch.metadata, exact=not layout.is_quantized)
            if layer.has_sinks and batch.metadata.num_tokens:
                plain_layer = dataclasses.replace(layer, has_sinks=False)
                no_sink = dataclasses.replace(batch, layer=plain_layer, sinks=None)
                _, without, _ = self.reference_batch(no_sink).run_with_lse(oracle)
                gap = float((ref_lse - without).abs().max())
                assert gap > 10 * self.lse_tolerance(layout)[0], f"sinks moved lse by {gap:.3g}"

    @pytest.mark.parametrize("kind", ["decode", "extend"])
    @pytest.mark.parametrize("feature", _SPLIT_FEATURES)
    def test_lse_split_and_merge_equals_one_pass(
        self, subject: Backend, feature: str, kind: str
    ) -> None:
        """Cascade attention: a non-causal pass over the first pages of each sequence and a
        causal pass over the rest (the sinks in that one only), merged with
        ``attnsdk.merge_states``, equal one pass over all keys, output and lse."""
        layer, layout = self._case(feature, self._dtype(subject), "NHD", self.page_size)
        prefix_layer = dataclasses.replace(layer, causal=False, has_sinks=False)
        dev = torch.device(self.device)
        reasons = [
            *subject.unsupported_reasons(layer, layout, dev),
            *subject.unsupported_reasons(prefix_layer, layout, dev),
            *lse_reasons_of(subject, layer, layout, dev),
            *lse_reasons_of(subject, prefix_layer, layout, dev),
        ]
        if reasons:
            pytest.skip("declared unsupported: " + "; ".join(map(str, sorted(set(reasons)))))
        p = layout.page_size
        r = random.Random(f"{feature}-{kind}")
        n = [1 if kind == "decode" else r.randint(1, 7) for _ in range(5)]
        prefix_pages = [max(r.randint(1, 3), -(-q // p)) for q in n]  # prefix_len >= query_len
        suffix = [q + r.randint(0, 2 * p) for q in n]  # the new tokens sit in the suffix
        seq = [m * p + s for m, s in zip(prefix_pages, suffix)]
        batch = self._batch(layer, layout, BatchSpec(tuple(n), tuple(seq)), seed=len(feature))
        cache = batch.fresh_cache()
        sinks = {"sinks": batch.sinks} if layer.has_sinks else {}

        def attend(
            lens: list[int], table: torch.Tensor, spec: LayerSpec, *, write: bool, **kw: Any
        ) -> tuple[torch.Tensor, torch.Tensor]:
            meta = AttentionMetadata.from_seqlens(n, lens, table, p, device=dev)
            lse = torch.full((batch.q.shape[0], spec.num_heads), float("nan"), device=dev)
            k, v = (batch.k, batch.v) if write else (None, None)
            out = subject.forward(batch.q, k, v, cache, subject.plan(meta), spec, lse=lse, **kw)
            return out, lse

        table = batch.metadata.page_table.cpu()
        full, full_lse = attend(seq, table, layer, write=True, **sinks)
        # The parts read the cache the full pass wrote: each its own page table and lengths.
        prefix_table = _rows(table, [(0, m) for m in prefix_pages])
        suffix_table = _rows(table, [(m, m + -(-s // p)) for m, s in zip(prefix_pages, suffix)])
        prefix_lens = [m * p for m in prefix_pages]
        out_a, lse_a = attend(prefix_lens, prefix_table, prefix_layer, write=False)
        out_b, lse_b = attend(suffix, suffix_table, layer, write=False, **sinks)
        out, lse = merge_states(out_a, lse_a, out_b, lse_b)
        self._assert_output(out, full, layout)
        self._assert_lse(lse, full_lse, layout)

    # -- CUDA graphs ----------------------------------------------------------------------------

    @pytest.mark.parametrize("with_lse", [False, True], ids=["out", "out+lse"])
    @pytest.mark.parametrize("feature", ["gqa", "chunked", "mla", "mla-small", "mla-fp8"])
    @pytest.mark.parametrize("tokens_per_seq", [1, 3])
    def test_graph_replay_equals_eager(
        self, subject: Backend, tokens_per_seq: int, feature: str, with_lse: bool
    ) -> None:
        """CUDA-graph capture (``GraphRunner`` over graph_state / plan_for_capture /
        plan_for_replay) then replay of smaller batches equals eager execution (also the
        ``lse=`` a captured step writes into a static buffer), on a fresh backend prepared for
        the one layer. A capture of several tokens per sequence may refuse a chunked layer
        (virtual-batch backends serve chunks in decode graphs only), with reasons naming
        ``attention_chunk_size``; it is then skipped with them."""
        if torch.device(self.device).type != "cuda":
            pytest.skip(f"CUDA graphs need a CUDA device; this class runs on {self.device}")
        level = subject.capabilities.graph_support
        needed = GraphSupport.DECODE_ONLY if tokens_per_seq == 1 else GraphSupport.UNIFORM_BATCH
        if level < needed:
            pytest.skip(
                f"{subject.name} declares graph_support={level.name}, this needs {needed.name}"
            )
        layer, layout = self._case(feature, self._dtype(subject), "NHD", self.page_size)
        reasons = subject.unsupported_reasons(layer, layout, self.device)
        if with_lse:
            reasons += lse_reasons_of(subject, layer, layout, torch.device(self.device))
        if reasons:
            pytest.skip("; ".join(map(str, reasons)))
        # Layers other tests prepared (chunked ones among them) must not decide this capture.
        fresh = self._fresh(subject)
        if isinstance(fresh, BackendBase):
            fresh.prepare([layer], layout, self.device)
        try:
            self._graph_vs_eager(fresh, layer, layout, tokens_per_seq, level, with_lse)
        except UnsupportedConfigError as exc:
            chunked = {r.field for r in exc.reasons} == {"attention_chunk_size"}
            if tokens_per_seq == 1 or layer.attention_chunk_size is None or not chunked:
                raise
            pytest.skip("refused: " + "; ".join(map(str, exc.reasons)))

    # -- helpers ------------------------------------------------------------------------------

    def _fresh(self, subject: Backend) -> Backend:
        """A new backend like ``subject``, which no other case has prepared layers on."""
        return create_backend(self.backend, device=torch.device(self.device))

    def _graph_vs_eager(
        self,
        subject: Backend,
        layer: LayerSpec,
        layout: KVCacheLayout,
        tokens_per_seq: int,
        level: GraphSupport,
        with_lse: bool,
    ) -> None:
        dev, p, max_pages, num_pages = torch.device(self.device), layout.page_size, 8, 200
        gen = torch.Generator().manual_seed(tokens_per_seq)
        graph_cache = layout.allocate(num_pages, dev)
        for x in (graph_cache.k,) if layout.mla else (graph_cache.k, graph_cache.v):
            x.copy_(torch.randn(x.shape, generator=gen).to(x.dtype))
        eager_cache = _copy(graph_cache)

        sizes = [1, 3, 8]
        # The captured steps write each row's lse into one static buffer (a prefix per size).
        static_lse = torch.full(
            (sizes[-1] * tokens_per_seq, layer.num_heads), float("nan"), device=dev
        )

        def step(plan: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            lse = {"lse": static_lse[: q.shape[0]]} if with_lse else {}
            values = None if layout.mla else v  # an MLA layer's V is the latent part of k
            return subject.forward(q, k, values, graph_cache, plan, layer, **lse)

        runner = GraphRunner(
            subject, step, batch_sizes=sizes, max_pages=max_pages, page_size=p,
            tokens_per_seq=tokens_per_seq, device=dev,
        )  # fmt: skip

        def rand(t: int, h: int, d: int) -> torch.Tensor:
            return torch.randn(t, h, d, generator=gen).to(dev, layout.dtype)

        rows = sizes[-1] * tokens_per_seq
        hq, hkv, d, dv = layer.num_heads, layer.num_kv_heads, layer.head_dim, layer.v_dim
        runner.capture(rand(rows, hq, d), rand(rows, hkv, d), rand(rows, hkv, dv))
        # An eager step larger than every capture, on a cache of its own, before the replays:
        # what a backend allocates for it must not move what the captured steps write into.
        big = 5 * rows
        big_pages = -(-big // p)
        table = torch.arange(1, big_pages + 1, dtype=torch.int32)[None, :]
        meta = AttentionMetadata.from_seqlens([big], [big], table, p, device=dev)
        values = None if layout.mla else rand(big, hkv, dv)
        subject.forward(rand(big, hq, d), rand(big, hkv, d), values,
                        layout.allocate(big_pages + 1, dev), subject.plan(meta), layer)  # fmt: skip
        r = random.Random(tokens_per_seq)
        for b in (1, 2, 3, 5, 8):
            if level >= GraphSupport.ANY_BATCH:
                q_lens = [r.randint(0, tokens_per_seq) for _ in range(b)]
                q_lens[0] = max(q_lens[0], 1)
            else:
                q_lens = [tokens_per_seq] * b
            seq = [q + r.randint(0, max_pages * p - q) for q in q_lens]
            pages = r.sample(range(1, num_pages), b * max_pages)
            table = torch.tensor(pages, dtype=torch.int32).view(b, max_pages)
            meta = AttentionMetadata.from_seqlens(q_lens, seq, table, p, device=dev)
            t = meta.num_tokens
            q, k, v = rand(t, hq, d), rand(t, hkv, d), rand(t, hkv, dv)
            got = runner(meta, q, k, v).clone()
            eager_lse = torch.full((t, layer.num_heads), float("nan"), device=dev)
            lse = {"lse": eager_lse} if with_lse else {}
            values = None if layout.mla else v
            plan = subject.plan(meta)
            want = subject.forward(q, k, values, eager_cache, plan, layer, **lse)[:t]
            self._assert_output(got, want, layout)
            if with_lse:
                self._assert_lse(static_lse[:t], eager_lse, layout)
            _assert_same_cache(graph_cache, eager_cache, meta, exact=True)

    def _dtype(self, subject: Backend) -> torch.dtype:
        """The compute dtype of the non-dtype cases: bf16 if served, else the first served."""
        allowed = self.dtypes or tuple(COMPUTE_DTYPES)
        for d in (torch.bfloat16, torch.float16, torch.float32):
            if d in allowed and d in subject.capabilities.dtypes:
                return d
        return allowed[0]

    def _layout(
        self, f: FeatureCase, dtype: torch.dtype, order: str, page_size: int
    ) -> KVCacheLayout:
        return KVCacheLayout(
            f.layer["num_kv_heads"],
            f.layer["head_dim"],
            page_size,
            dtype=dtype,
            v_head_dim=f.layer.get("v_head_dim"),
            order="HND" if order == PACKED else order,
            kv_dtype=f.kv_dtype,
            mla=f.layer.get("mla", False),
        )

    def _case(
        self, feature: str, dtype: torch.dtype, order: str, page_size: int
    ) -> tuple[LayerSpec, KVCacheLayout]:
        f = FEATURES[feature]
        return LayerSpec(**f.layer), self._layout(f, dtype, order, page_size)

    def _batch(
        self,
        layer: LayerSpec,
        layout: KVCacheLayout,
        spec: BatchSpec,
        seed: int,
        *,
        per_head: bool = False,
        packed: bool = False,
        tree: bool = False,
    ) -> Batch:
        pages = _PAGE_ORDERS[seed % len(_PAGE_ORDERS)]
        edges = edge_rows(layer)
        if edges:
            # The rows where a window's or chunks' boundaries bite, whatever the seed drew;
            # first, so that graph padding rows stay last.
            spec = BatchSpec(
                tuple(q for q, _ in edges) + spec.query_lens,
                tuple(s for _, s in edges) + spec.seq_lens,
                spec.name,
                (False,) * len(edges) + spec.padded,
                spec.cross,
            )
        batch = make_batch(
            spec,
            layer,
            layout,
            pages=pages,
            seed=seed,
            device=self.device,
            per_head_scales=per_head,
            tree=tree,
        )
        if packed:
            batch = dataclasses.replace(batch, cache=_packed(batch.cache))
        if tree:
            batch = dataclasses.replace(batch, metadata=_with_siblings(batch.metadata))
        if batch.sinks is not None:
            # make_batch's unit-normal sinks barely move the output; these move it well past
            # the tolerance, so a backend that ignores them fails.
            gen = torch.Generator().manual_seed(seed)
            sinks = 1.0 + 2.0 * torch.randn(layer.num_heads, generator=gen)
            batch = dataclasses.replace(batch, sinks=sinks.to(self.device))
        return batch

    def _assert_output(self, out: torch.Tensor, ref: torch.Tensor, layout: KVCacheLayout) -> None:
        atol, rtol = self.tolerance(layout)
        assert_close_to_reference(out, ref, atol=atol, rtol=rtol)

    def _require(self, subject: Backend, batch: Batch) -> None:
        """Skip, with the backend's reasons, what it declares it cannot serve, after checking
        that forward refuses it and writes nothing."""
        reasons = subject.unsupported_reasons(batch.layer, batch.cache.layout, self.device)
        _refused(reasons, subject, batch, with_lse=False)

    def _require_lse(self, subject: Backend, batch: Batch) -> None:
        """Skip, with its reasons, a case whose ``lse=`` the backend declares it cannot fill,
        after checking that forward refuses it and writes nothing."""
        dev = torch.device(self.device)
        reasons = lse_reasons_of(subject, batch.layer, batch.cache.layout, dev)
        _refused(reasons, subject, batch, with_lse=True)

    def _require_step(self, subject: Backend, batch: Batch) -> None:
        """Skip, with the backend's reasons, a step kind it does not declare (a tree mask,
        cross-attention), after checking that it is refused before anything is written."""
        reasons = step_capability_reasons(subject.capabilities, batch.metadata)
        if batch.metadata.cross_attention:  # a paged step: RAGGED alone does not serve it
            reasons += paged_cross_reasons(subject.capabilities)
        _refused(reasons, subject, batch, with_lse=False)

    def _check_lse_of(
        self, subject: Backend, oracle: Backend, batch: Batch, out: torch.Tensor
    ) -> None:
        """Where the backend serves ``lse=`` for the batch's layer: the log-sum-exp matches the
        reference's, and asking for it leaves ``out`` (the run without it) bit for bit."""
        layer, layout = batch.layer, batch.cache.layout
        if lse_reasons_of(subject, layer, layout, torch.device(self.device)):
            return
        with_lse, lse, _ = batch.run_with_lse(subject)
        _, ref_lse, _ = self.reference_batch(batch).run_with_lse(oracle)
        assert torch.equal(with_lse, out), "asking for lse= changed the output"
        self._assert_lse(lse, ref_lse, layout)

    def _assert_lse(self, lse: torch.Tensor, ref: torch.Tensor, layout: KVCacheLayout) -> None:
        """Within ``lse_tolerance``; rows that see no key and no sink are -inf on both sides."""
        assert lse.dtype == torch.float32, f"lse dtype {lse.dtype}"
        empty = torch.isneginf(ref)
        assert torch.equal(torch.isneginf(lse), empty), "-inf (no key seen) where the oracle's is"
        atol, rtol = self.lse_tolerance(layout)
        assert_close_to_reference(lse[~empty], ref[~empty], atol=atol, rtol=rtol)

    def _check(
        self,
        subject: Backend,
        oracle: Backend,
        feature: str,
        dtype: torch.dtype,
        order: str,
        page_size: int,
        spec: Callable[[int], BatchSpec],
    ) -> None:
        f = FEATURES[feature]
        layer, layout = self._case(feature, dtype, order, page_size)
        for seed in range(self.seeds):
            packed = order == PACKED
            batch = self._batch(
                layer, layout, spec(seed), seed, per_head=f.per_head_scales, packed=packed
            )
            self._require(subject, batch)
            out = self._compare(subject, oracle, batch)
            if layer.has_sinks and batch.metadata.num_tokens:
                # A backend that ignores sinks must fail: they move the output well past the
                # tolerance (checked here, so the case cannot pass vacuously).
                plain = dataclasses.replace(
                    batch, layer=dataclasses.replace(layer, has_sinks=False), sinks=None
                )
                without, _ = self.reference_batch(plain).run(oracle)
                gap = float((out.float() - without.float()).abs().max())
                atol, _ = self.tolerance(layout)
                assert gap > 10 * atol, f"sinks moved the output by only {gap:.3g}"

    def _compare(self, subject: Backend, oracle: Backend, batch: Batch) -> torch.Tensor:
        """Run both on copies of the same cache; compare the output and the whole cache."""
        layout = batch.cache.layout
        out, cache = batch.run(subject, _copy(batch.cache))
        ref, ref_cache = self.reference_batch(batch).run(oracle)
        self._assert_output(out, ref, layout)
        _assert_same_cache(cache, ref_cache, batch.metadata, exact=not layout.is_quantized)
        return out


def _refused(reasons: list[Reason], subject: Backend, batch: Batch, *, with_lse: bool) -> None:
    """With ``reasons``: check that running ``batch`` raises ``UnsupportedConfigError`` and
    writes nothing, then skip the case naming them. Without: return."""
    if not reasons:
        return
    cache = _copy(batch.cache)
    run = batch.run_with_lse if with_lse else batch.run
    with pytest.raises(UnsupportedConfigError):
        run(subject, cache)
    _assert_same_cache(cache, batch.cache, batch.metadata, exact=True, what="refused step")
    pytest.skip("declared unsupported: " + "; ".join(map(str, reasons)))


# -- running the suite without pytest ----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CaseResult:
    """The outcome of one conformance case, as ``run_conformance`` returns it."""

    case: str
    """The case's pytest id without the class, e.g. ``test_feature[window]``."""
    outcome: Literal["passed", "failed", "skipped"]
    message: str = ""
    """Why it failed (the exception's type and text) or was skipped; empty when it passed."""


def run_conformance(
    backend: Backend | str | AttentionConfig,
    *,
    device: str = "cpu",
    suite: type[BackendConformance] = BackendConformance,
    stop_at_first_failure: bool = False,
) -> list[CaseResult]:
    """Run every case of ``suite`` on ``backend`` without a pytest session, in pytest's order.

    For a backend a pytest class cannot name: one built inside a test (the deliberately broken
    backends of tests/backends/test_conformance_mutants.py, which the suite must reject) or in
    a script. ``backend`` is a backend instance, a registered name or an ``AttentionConfig``;
    ``suite`` is ``BackendConformance`` or a subclass whose attributes and hooks (``seeds``,
    ``dtypes``, ``tolerance``, ...) apply; its ``backend`` and ``device`` are replaced. The
    cases get the same arguments as under pytest (``subject``, ``oracle``, the parametrised
    values, ``dtype`` and ``page_size`` from the class attributes). A case is skipped when it
    calls ``pytest.skip`` (a refusal the backend declares, a CUDA-only case on a CPU) and
    fails on any exception, ``pytest.fail`` and ``pytest.raises``' included.
    ``stop_at_first_failure``: return as soon as one case fails.
    """
    dev = torch.device(device)
    subject = backend if isinstance(backend, Backend) else create_backend(backend, device=dev)
    attrs: dict[str, Any] = {"device": device}
    if isinstance(backend, Backend):
        attrs["backend"] = subject.name
        attrs["_fresh"] = lambda self, s: type(s)(s.options) if isinstance(s, BackendBase) else s
    else:
        attrs["backend"] = backend
    cls = type(f"Run{suite.__name__}", (suite,), attrs)
    oracle = ReferenceBackend()
    results = []
    fixtures = {"subject": subject, "oracle": oracle}
    for name, args, case, params in _cases(cls):
        try:
            kwargs = {a: params[a] if a in params else fixtures[a] for a in args}
        except KeyError as exc:
            raise TypeError(
                f"{case} takes the fixture {exc}, which run_conformance does not provide"
            ) from None
        try:
            getattr(cls(), name)(**kwargs)
        except pytest.skip.Exception as exc:
            results.append(CaseResult(case, "skipped", str(exc)))
        except (Exception, pytest.fail.Exception) as exc:
            results.append(CaseResult(case, "failed", f"{type(exc).__name__}: {exc}"))
            if stop_at_first_failure:
                break
        else:
            results.append(CaseResult(case, "passed"))
    return results


def _cases(
    cls: type[BackendConformance],
) -> Iterator[tuple[str, list[str], str, dict[str, Any]]]:
    """(method, argument names, pytest id, parametrised values) of every case of ``cls``, in
    the order and with the ids pytest gives them: ``pytest_generate_tests``' axes first, then
    each ``parametrize`` mark from the one nearest the function outwards, the first outermost
    (tests/backends/test_conformance_mutants.py compares them with pytest's collection)."""
    methods: dict[str, Any] = {}
    for klass in reversed(cls.__mro__):
        methods.update((n, f) for n, f in vars(klass).items() if n.startswith("test_"))
    dtypes = cls.dtypes or tuple(sorted(COMPUTE_DTYPES, key=str))
    for name, fn in methods.items():
        args = [a for a in inspect.signature(fn).parameters if a != "self"]
        axes: list[list[tuple[str, dict[str, Any]]]] = []
        if "dtype" in args:
            axes.append([(_dtype_id(d), {"dtype": d}) for d in dtypes])
        if "page_size" in args:
            axes.append([(f"p{p}", {"page_size": p}) for p in cls.page_sizes])
        for mark in getattr(fn, "pytestmark", []):
            if mark.name != "parametrize":
                continue
            names, values = mark.args[0], list(mark.args[1])
            names = [n.strip() for n in names.split(",")] if isinstance(names, str) else names
            rows = [row if len(names) > 1 else (row,) for row in values]
            ids = mark.kwargs.get("ids") or [
                "-".join(_param_id(x, n, i) for x, n in zip(row, names))
                for i, row in enumerate(rows)
            ]
            axes.append([(i, dict(zip(names, row))) for i, row in zip(ids, rows)])
        for combo in itertools.product(*axes):
            case = name + ("[" + "-".join(i for i, _ in combo) + "]" if combo else "")
            yield name, args, case, {k: v for _, kw in combo for k, v in kw.items()}


def _param_id(value: Any, name: str, index: int) -> str:
    """pytest's id of one parametrised value."""
    if value is None or isinstance(value, (str, int, float, bool)):
        return str(value)
    return f"{name}{index}"
