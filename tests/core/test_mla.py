"""MLA (``LayerSpec.mla`` over a ``KVCacheLayout.mla`` latent cache): the records, the cache,
the checks, DeepSeek's own math, and the backends that serve it against the float64 oracle."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from oracle import run_oracle

import attnsdk as A
from attnsdk import Feature, InvalidInputError, UnsupportedConfigError
from attnsdk.backends.fa3 import FA3Backend
from attnsdk.backends.flashinfer import FlashInferBackend
from attnsdk.contract.capabilities import capability_reasons
from attnsdk.testing import BatchSpec, make_batch

RANK, ROPE = 32, 16


def small() -> tuple[A.LayerSpec, A.KVCacheLayout]:
    return (
        A.LayerSpec.for_mla(4, kv_lora_rank=RANK, rope_dim=ROPE, scale=0.2),
        A.KVCacheLayout.for_mla(16, kv_lora_rank=RANK, rope_dim=ROPE, dtype=torch.float32),
    )


# -- the records ----------------------------------------------------------------------------


def test_for_mla_builds_deepseeks_shape() -> None:
    layer = A.LayerSpec.for_mla(128, scale=0.1)
    layout = A.KVCacheLayout.for_mla(page_size=64)
    assert (layer.num_kv_heads, layer.head_dim, layer.v_dim, layer.mla) == (1, 576, 512, True)
    assert (layer.kv_lora_rank, layer.rope_dim) == (512, 64)
    assert (layout.num_kv_heads, layout.head_dim, layout.v_dim, layout.mla) == (1, 576, 512, True)
    plain = A.LayerSpec(8, 8, 64)
    assert (plain.kv_lora_rank, plain.rope_dim) == (None, None)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"num_heads": 8, "num_kv_heads": 2, "head_dim": 96, "v_head_dim": 64}, "num_kv_heads"),
        ({"num_heads": 8, "num_kv_heads": 1, "head_dim": 96}, "v_head_dim"),
        ({"num_heads": 8, "num_kv_heads": 1, "head_dim": 64, "v_head_dim": 80}, "v_head_dim"),
    ],
)
def test_an_mla_layer_needs_one_head_and_a_shorter_latent(
    kwargs: dict[str, int], field: str
) -> None:
    with pytest.raises(InvalidInputError, match=rf"LayerSpec\.{field}.*for_mla"):
        A.LayerSpec(**kwargs, mla=True)
    layout_kwargs = {k: v for k, v in kwargs.items() if k != "num_heads"}
    with pytest.raises(InvalidInputError, match=rf"KVCacheLayout\.{field}"):
        A.KVCacheLayout(**layout_kwargs, page_size=16, mla=True)


def test_an_mla_layout_is_nhd_and_mla_is_a_bool() -> None:
    with pytest.raises(InvalidInputError, match=r"KVCacheLayout\.order.*'NHD' for MLA"):
        A.KVCacheLayout(1, 96, 16, v_head_dim=64, order="HND", mla=True)
    with pytest.raises(InvalidInputError, match=r"LayerSpec\.mla"):
        A.LayerSpec(4, 1, 96, v_head_dim=64, mla=1)  # type: ignore[arg-type]


# -- the cache ------------------------------------------------------------------------------


def test_allocate_and_wrap_give_v_as_the_latent_view() -> None:
    _, layout = small()
    cache = layout.allocate(3)
    assert cache.v.data_ptr() == cache.k.data_ptr()
    assert tuple(cache.v.shape) == (3, 16, 1, RANK)
    k = torch.randn(3, 16, 1, RANK + ROPE)
    assert torch.equal(layout.wrap(k).v, k[..., :RANK])
    assert layout.wrap(k, k[..., :RANK]).v.data_ptr() == k.data_ptr()
    with pytest.raises(InvalidInputError, match=r"v: expected None or k\[..., :32\]"):
        layout.wrap(k, k[..., :RANK].clone())
    with pytest.raises(InvalidInputError, match="only an MLA layout has no V"):
        A.KVCacheLayout(1, 48, 16).wrap(torch.zeros(3, 16, 1, 48))


def test_store_writes_k_alone_and_refuses_a_separate_v() -> None:
    _, layout = small()
    cache = layout.allocate(3)
    k = torch.randn(2, 1, RANK + ROPE)
    cache.store(k, None, torch.tensor([17, 40]))
    assert torch.equal(cache.k[1, 1], k[0])
    assert torch.equal(cache.v[2, 8, 0], k[1, 0, :RANK])
    with pytest.raises(InvalidInputError, match="v: expected None for an MLA cache"):
        cache.store(k, torch.randn(2, 1, RANK), torch.tensor([1, 2]))
    fp8 = A.KVCacheLayout.for_mla(
        16, kv_lora_rank=RANK, rope_dim=ROPE, kv_dtype=torch.float8_e4m3fn
    )
    with pytest.raises(InvalidInputError, match="v_scale"):
        fp8.allocate(3).store(
            k.bfloat16(), None, torch.tensor([1, 2]), v_scale=torch.ones(()), k_scale=None
        )


# -- forward's checks ---------------------------------------------------------------------------


def test_forward_refuses_v_v_scale_and_a_layer_layout_mismatch() -> None:
    layer, layout = small()
    batch = make_batch(BatchSpec.decode(batch_size=2), layer, layout)
    backend = A.create_backend("reference")
    plan = backend.plan(batch.metadata)
    cache = batch.fresh_cache()
    with pytest.raises(InvalidInputError, match="v: expected None for an MLA layer"):
        backend.forward(batch.q, batch.k, batch.k[..., :RANK], cache, plan, layer)
    plain = A.LayerSpec(4, 1, RANK + ROPE, v_head_dim=RANK, scale=0.2)
    with pytest.raises(InvalidInputError, match=r"layer\.mla: expected True like the cache layout"):
        backend.forward(batch.q, batch.k, None, cache, plan, plain)
    assert torch.equal(cache.k, batch.cache.k), "a refused forward wrote"


def test_capabilities_name_the_feature_the_pair_and_the_mismatch() -> None:
    layer, layout = small()
    caps = A.create_backend("reference").capabilities
    no_mla = A.Capabilities(**{**_fields(caps), "features": caps.features - {Feature.MLA}})
    reasons = capability_reasons(no_mla, A.Request(layer, layout))
    assert [(r.field, r.message) for r in reasons] == [("mla", "is not supported by this backend")]
    only_deepseek = A.Capabilities(**{**_fields(caps), "mla_dims": frozenset({(512, 64)})})
    (reason,) = capability_reasons(only_deepseek, A.Request(layer, layout))
    assert "must be one of [(512, 64)], found (32, 16)" in reason.message
    plain_layout = A.KVCacheLayout(1, RANK + ROPE, 16, v_head_dim=RANK, dtype=torch.float32)
    (reason,) = capability_reasons(caps, A.Request(layer, plain_layout))
    assert reason.message == "layer has True but the KV layout has False"


def _fields(caps: A.Capabilities) -> dict[str, object]:
    return {name: getattr(caps, name) for name in caps.__slots__}  # type: ignore[attr-defined]


# -- the math -------------------------------------------------------------------------------


def test_absorbed_attention_equals_deepseeks_expanded_attention() -> None:
    """DeepSeek's MLA, two ways: expanded (per-head keys ``[c W_UK^T, k_rope]`` and values
    ``c W_UV``, plain causal MHA) and absorbed (q_nope W_UK against the latent cache through
    the SDK, then W_UV). They are the same attention; the SDK's contract is the second."""
    gen = torch.Generator().manual_seed(0)
    heads, nope, v_dim, length, n = 4, 24, 20, 37, 5
    scale = (nope + ROPE) ** -0.5

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    c, k_rope = randn(length, RANK), randn(length, ROPE)
    w_uk, w_uv = randn(heads, nope, RANK) / 4, randn(heads, RANK, v_dim) / 4
    q_nope, q_rope = randn(n, heads, nope), randn(n, heads, ROPE)

    expanded = torch.empty(n, heads, v_dim, dtype=torch.float64)
    pos = length - n + torch.arange(n)[:, None]
    for h in range(heads):
        keys = torch.cat([c @ w_uk[h].T, k_rope], dim=1)
        scores = torch.cat([q_nope[:, h], q_rope[:, h]], dim=1) @ keys.T * scale
        scores = scores.masked_fill(torch.arange(length)[None, :] > pos, float("-inf"))
        expanded[:, h] = torch.softmax(scores, -1) @ (c @ w_uv[h])

    layer = A.LayerSpec.for_mla(heads, kv_lora_rank=RANK, rope_dim=ROPE, scale=scale)
    layout = A.KVCacheLayout.for_mla(8, kv_lora_rank=RANK, rope_dim=ROPE, dtype=torch.float32)
    cache = layout.allocate(-(-length // 8) + 1)
    table = torch.arange(1, cache.num_pages, dtype=torch.int32)[None, :]
    meta = A.AttentionMetadata.from_seqlens([n], [length], table, 8)
    latent = torch.cat([c, k_rope], dim=1).float()[:, None, :]
    cache.store(latent[: length - n], None, meta.slot_mapping.new_tensor(range(8, length - n + 8)))
    q = torch.cat([torch.einsum("thd,hdr->thr", q_nope, w_uk), q_rope], dim=2).float()
    backend = A.create_backend("reference")
    out = backend.forward(q, latent[length - n :], None, cache, backend.plan(meta), layer)
    absorbed = torch.einsum("thr,hrv->thv", out.double(), w_uv)
    torch.testing.assert_close(absorbed, expanded, atol=1e-5, rtol=1e-5)


# -- the backends that serve it, on random batches ----------------------------------------------


@pytest.mark.parametrize("backend_name", ["reference", "flex"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_random_mla_batches_match_the_oracle(backend_name: str, dtype: torch.dtype) -> None:
    layer, _ = small()
    layout = A.KVCacheLayout.for_mla(16, kv_lora_rank=RANK, rope_dim=ROPE, dtype=dtype)
    backend = A.create_backend(backend_name, device="cpu")
    stream = random.Random(f"mla-{backend_name}-{dtype}")
    atol = 2e-5 if dtype == torch.float32 else 2e-2
    for seed in range(25):
        batch = make_batch(BatchSpec.random(stream), layer, layout, seed=seed)
        out, cache = batch.run(backend)
        want = run_oracle(batch)
        torch.testing.assert_close(out.double(), want.out, atol=atol, rtol=atol)
        assert torch.equal(cache.k.view(torch.uint8), want.k.view(torch.uint8))
        assert cache.v.data_ptr() == cache.k.data_ptr()


def test_fp8_latent_is_read_with_k_scale() -> None:
    layer = A.LayerSpec.for_mla(4, kv_lora_rank=RANK, rope_dim=ROPE, scale=0.2)
    layout = A.KVCacheLayout.for_mla(
        16, kv_lora_rank=RANK, rope_dim=ROPE, kv_dtype=torch.float8_e4m3fn
    )
    backend = A.create_backend("reference")
    for seed in range(5):
        batch = make_batch(BatchSpec.mixed(seed=seed), layer, layout, seed=seed)
        assert batch.v is None
        assert batch.v_scale is None
        out, _ = batch.run(backend)
        torch.testing.assert_close(out.double(), run_oracle(batch).out, atol=3e-2, rtol=3e-2)
        doubled = batch.k_scale * 2  # the latent is dequantised with k_scale: the output moves
        moved, _ = dataclasses.replace(batch, k_scale=doubled).run(backend)
        assert float((moved.float() - out.float()).abs().max()) > 0.1


def test_flashinfer_and_fa3_take_deepseeks_dims_flex_small_ones() -> None:
    layer, layout = small()
    for cls in (FA3Backend, FlashInferBackend):
        reasons = cls.refusals(A.Request(layer, layout))
        assert any("must be one of [(512, 64)]" in r.message for r in reasons), reasons
    flex = A.create_backend("flex", device="cpu")
    with pytest.raises(UnsupportedConfigError, match="head_dim must be <= 256"):
        flex.prepare([A.LayerSpec.for_mla(16)], A.KVCacheLayout.for_mla(16))
