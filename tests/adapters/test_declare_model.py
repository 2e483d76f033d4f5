"""``declare_model``: how both drop-ins declare a model to a backend at start-up."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from attnsdk import (
    Feature,
    KVCacheLayout,
    LayerSpec,
    Reason,
    ReasonKind,
    UnsupportedConfigError,
    create_backend,
)
from attnsdk.adapters._common import ModelLayer, declare_model
from attnsdk.backends.reference import ReferenceBackend

LAYOUT = KVCacheLayout(num_kv_heads=2, head_dim=16, page_size=16, dtype=torch.float32)
PLAIN = LayerSpec(num_heads=4, num_kv_heads=2, head_dim=16)
CAPPED = LayerSpec(num_heads=4, num_kv_heads=2, head_dim=16, softcap=5.0)


class NoSoftcap(ReferenceBackend):
    capabilities = dataclasses.replace(
        ReferenceBackend.capabilities,
        features=ReferenceBackend.capabilities.features - {Feature.SOFTCAP, Feature.RAGGED},
    )


class Unplugged(NoSoftcap):
    """Refuses every layer for a reason about no layer (an environment reason)."""

    @classmethod
    def environment_reasons(cls, device=None):  # type: ignore[no-untyped-def]
        return [Reason(ReasonKind.ENVIRONMENT, "install", "needs a kernel package")]


def layers(specs: list[LayerSpec], layout: KVCacheLayout | None = LAYOUT) -> list[ModelLayer]:
    return [ModelLayer(f"layers[{i}]", spec, layout, torch.float32) for i, spec in enumerate(specs)]


def test_each_distinct_shape_is_prepared_once_per_layout() -> None:
    backend = create_backend("reference")
    other = dataclasses.replace(LAYOUT, page_size=32)
    declare_model(backend, [*layers([PLAIN, CAPPED, PLAIN]), *layers([PLAIN], other)], "cpu", "X")
    assert backend.prepared == [(PLAIN, LAYOUT), (CAPPED, LAYOUT), (PLAIN, other)]


def test_refusals_name_every_layer_of_the_shape() -> None:
    specs = [CAPPED if i % 2 else PLAIN for i in range(12)]
    with pytest.raises(UnsupportedConfigError) as info:
        declare_model(NoSoftcap(), layers(specs), "cpu", "MyDropIn")
    (reason,) = info.value.reasons
    assert reason.field == "layers[1], layers[3], ..., layers[11] (6 layers).softcap"
    assert str(info.value).startswith("MyDropIn: the reference backend cannot serve this model:")


def test_a_reason_about_no_layer_comes_once() -> None:
    with pytest.raises(UnsupportedConfigError) as info:
        declare_model(Unplugged(), layers([PLAIN, CAPPED]), "cpu", "X")
    fields = [r.field for r in info.value.reasons]
    assert fields.count("install") == 1
    assert fields[0] == "install"  # environment first
    assert "layers[1].softcap" in fields


def test_layers_without_a_cache_are_checked_for_ragged_attention() -> None:
    encoder = dataclasses.replace(PLAIN, causal=False)
    backend = NoSoftcap()
    with pytest.raises(UnsupportedConfigError) as info:
        declare_model(
            backend,
            layers([encoder, encoder], None),
            "cpu",
            "X",
            refused=[Reason(ReasonKind.CONFIGURATION, "layers[7].attn_type", "not mapped")],
        )
    assert [r.field for r in info.value.reasons] == [
        "layers[0], layers[1].ragged",
        "layers[7].attn_type",
    ]
    assert backend.prepared == []
