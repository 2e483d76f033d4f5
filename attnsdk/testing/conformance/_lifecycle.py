"""The lifecycle and the edges of ``forward``: ``prepare`` and ``warmup``, bad metadata,
``out=``, ``k = v = None`` and rows past ``num_tokens``."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import pytest
import torch

from attnsdk.backends.base import BackendBase
from attnsdk.contract.errors import InvalidMetadataError, UnsupportedConfigError
from attnsdk.contract.layer import LayerSpec
from attnsdk.contract.metadata import AttentionMetadata
from attnsdk.testing.conformance._cache import assert_same_cache, copy_cache
from attnsdk.testing.conformance._cases import FEATURES, mixed
from attnsdk.testing.conformance._harness import Harness

if TYPE_CHECKING:
    from attnsdk.contract.backend import Backend
    from attnsdk.contract.kv import KVCacheLayout


class LifecycleCases(Harness):
    """A model's layers prepared at once, and the arguments of ``plan`` and ``forward`` that
    engines use besides a plain step."""

    def test_prepare_and_warmup(self, subject: Backend, oracle: Backend) -> None:
        """``prepare`` every servable feature layer, ``warmup``, then a step still matches."""
        base = _base(subject)
        _, layout = self._case(subject, "gqa")
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
            batch = self._batch(layer, layout, mixed(3), seed=3)
            self._compare(subject, oracle, batch)

    def test_prepare_names_the_unservable_layer(self, subject: Backend) -> None:
        """``prepare`` refuses a model with every reason, each naming ``layers[i]``."""
        base = _base(subject)
        good, layout = self._case(subject, "gqa")
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
        layer, layout = self._case(subject, "gqa")
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
        layer, layout = self._case(subject, "gqa")
        batch = self._batch(layer, layout, mixed(1), seed=1)
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
        assert_same_cache(cache, ref_cache, batch.metadata, exact=True)
        assert torch.equal(result[:n], out[:n]), (
            "forward returned other values than it wrote to out"
        )
        if strided:
            assert bool(wide[..., dv:].isnan().all()), "forward wrote past the columns of out"

    @pytest.mark.parametrize("feature", ["gqa", "fp8-e4m3-per-head"])
    def test_kv_already_written(self, subject: Backend, oracle: Backend, feature: str) -> None:
        """``k = v = None``: the caller wrote the new K/V; forward only attends, writes nothing."""
        layer, layout = self._case(subject, feature)
        batch = self._batch(
            layer, layout, mixed(2), seed=2, per_head=FEATURES[feature].per_head_scales
        )
        self._require(subject, batch)
        ref, written = self.reference_batch(batch).run(oracle)
        cache = copy_cache(written)
        scales = {"k_scale": batch.k_scale, "v_scale": batch.v_scale}
        out = subject.forward(
            batch.q, None, None, cache, subject.plan(batch.metadata), layer, **scales
        )
        self._assert_output(out[: batch.metadata.num_tokens], ref, layout)
        assert_same_cache(cache, written, batch.metadata, exact=True)

    @pytest.mark.parametrize("kind", ["q-rows", "graph-metadata"])
    def test_rows_past_num_tokens(self, subject: Backend, oracle: Backend, kind: str) -> None:
        """Extra NaN rows of q / k / v (an engine's padded graph buffers), or metadata whose
        ``num_tokens`` covers them with slot -1, leave real rows and the cache as they are."""
        layer, layout = self._case(subject, "gqa")
        batch = self._batch(layer, layout, mixed(4), seed=4)
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
        assert_same_cache(cache, ref_cache, batch.metadata, exact=not layout.is_quantized)


def _base(subject: Backend) -> BackendBase:
    if not isinstance(subject, BackendBase):
        pytest.skip(f"{type(subject).__name__} is no BackendBase: it has no prepare / warmup")
    return subject


def _layers_for(layout: KVCacheLayout) -> list[LayerSpec]:
    """The feature layers that fit ``layout``'s KV heads and head dims."""
    dims = (layout.num_kv_heads, layout.head_dim, layout.v_dim)
    layers = [LayerSpec(**f.layer) for f in FEATURES.values() if f.kv_dtype is None]
    return [lay for lay in layers if (lay.num_kv_heads, lay.head_dim, lay.v_dim) == dims]
