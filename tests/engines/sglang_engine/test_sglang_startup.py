"""The model is declared once: the drop-in prepares SGLang's real layers when SGLang builds it.

SGLang builds the attention backend after loading the model and allocating its KV pool
(``ModelRunner.init_attention_backends``). The drop-in's constructor then hands the attnsdk
backend every ``RadixAttention`` of ``model_runner.model`` (SGLang's own layer class, found by
its attributes) with the layout of its pool buffers (``Backend.prepare``): after start-up and
before any step, ``backend.prepared`` lists every distinct layer shape; the steps then add
nothing; a model the backend cannot serve is refused at start-up, every reason naming its
layers; an MLA model declares its absorbed layer over the latent pool and not its expanded
prefill layer (no cache).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from real_sglang import (
    DROPIN,
    HKV,
    HQ,
    D,
    Engine,
    EngineRunner,
    Pools,
    create_backend,
    make_layers,
)
from sglang.srt.layers.radix_attention import RadixAttention
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from test_sglang_mla import RANK, ROPE, MLAEngine

from attnsdk import Feature, KVCacheLayout, LayerSpec, UnsupportedConfigError
from attnsdk import create_backend as create_attnsdk_backend
from attnsdk.adapters.sglang import SGLangAttentionBackend
from attnsdk.backends.reference import ReferenceBackend


class NoSoftcap(ReferenceBackend):
    """The reference backend without ``Feature.SOFTCAP``."""

    capabilities = dataclasses.replace(
        ReferenceBackend.capabilities,
        features=ReferenceBackend.capabilities.features - {Feature.SOFTCAP},
    )


def declared(dropin, layers) -> list[tuple[LayerSpec, KVCacheLayout]]:
    """What the drop-in must have prepared for ``layers``: each distinct spec, with the layout
    of its pool buffers."""
    pool = dropin.token_to_kv_pool
    out = {}
    for layer in layers:
        spec = dropin.adapter.layer_spec(layer, attention_chunk_size=dropin.attention_chunk_size)
        k, v = pool.get_kv_buffer(layer.layer_id)
        out.setdefault(spec, dropin.adapter.kv_cache(k, v, dtype=dropin.model_runner.dtype).layout)
    return list(out.items())


@pytest.mark.parametrize("chunk", [None, 16], ids=["dense", "llama4-chunked"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_every_layer_shape_is_prepared_at_start_up(page_size: int, chunk: int | None) -> None:
    e = Engine(page_size, torch.float32, chunk=chunk)
    backend = create_attnsdk_backend("reference")
    e.dropin = SGLangAttentionBackend(e.dropin.model_runner, backend)
    want = declared(e.dropin, e.layers)
    assert len(want) == 4  # GQA, sliding window, softcap, encoder-only: all distinct
    assert backend.prepared == want
    if chunk is not None:
        assert {spec.attention_chunk_size for spec, _ in want} == {None, chunk}
    # Steps through SGLang's RadixAttention run on what start-up prepared: nothing is added.
    reqs = [e.table.admit() for _ in range(2)]
    items = list(zip(reqs, [9, 20]))
    e.run(e.table.batch(ForwardMode.EXTEND, items))
    for req, n in items:
        req.length = n
    e.run(e.table.batch(ForwardMode.DECODE, [(r, 1) for r in reqs]))
    assert backend.prepared == want


def test_through_sglangs_registry_the_shared_backend_holds_the_models_shapes() -> None:
    """The registered factory (``backend="reference"``) declares into the shared backend."""
    e = Engine(16, torch.bfloat16)
    assert set(declared(e.dropin, e.layers)) <= set(e.dropin.backend.prepared)


def test_a_model_the_backend_cannot_serve_is_refused_at_start_up_naming_its_layers() -> None:
    pools = Pools(16, torch.float32, layers=5)
    capped = [  # layers 2 and 4 cap their logits the same way, layer 3 another way
        RadixAttention(HQ, D, 1.0, HKV, layer_id=i, logit_cap=cap)
        for i, cap in ((3, 5.0), (4, 2.0))
    ]
    layers = [*make_layers()[:3], *capped]
    backend = NoSoftcap()
    with pytest.raises(UnsupportedConfigError) as info:
        SGLangAttentionBackend(EngineRunner(pools, layers=layers), backend)
    fields = [r.field for r in info.value.reasons]
    assert fields == ["layers[2], layers[4].softcap", "layers[3].softcap"]
    assert str(info.value).startswith(
        "SGLangAttentionBackend: the reference backend cannot serve this model:"
    )
    assert backend.prepared == []  # all or nothing
    # Through SGLang's registry (the factory's "reference" backend serves softcap) it starts.
    assert isinstance(
        create_backend(EngineRunner(pools, layers=layers), DROPIN), SGLangAttentionBackend
    )


def test_an_mla_model_declares_its_absorbed_layer_only() -> None:
    e = MLAEngine(16, torch.bfloat16)
    backend = create_attnsdk_backend("reference")
    dropin = SGLangAttentionBackend(e.runner, backend)
    ((spec, layout),) = backend.prepared
    assert spec.mla
    assert layout.mla
    assert (spec.head_dim, spec.v_dim, layout.page_size) == (RANK + ROPE, RANK, 16)
    assert dropin.kv_lora_rank == RANK


def test_a_runner_without_model_layers_is_checked_from_its_config() -> None:
    """SGLang's attention kit builds its runner with an empty model: nothing is declared, the
    config's shape is checked, and each layer is prepared at its first forward."""
    runner = EngineRunner(Pools(16, torch.float32), layers=[])
    backend = create_attnsdk_backend("reference")
    SGLangAttentionBackend(runner, backend)
    assert backend.prepared == []
