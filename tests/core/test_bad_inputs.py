"""Malformed inputs: each raises a typed attnsdk error naming the field, and writes nothing.

The device axis (q on another device than the cache) needs a GPU; tests/gpu covers it. Here a
metadata on the ``meta`` device stands in for a device mismatch.
"""

from __future__ import annotations

import dataclasses
import re
from typing import TYPE_CHECKING, Any

import pytest
import torch

from attnsdk import (
    AttentionMetadata,
    AttnSDKError,
    InvalidInputError,
    InvalidMetadataError,
    KVCacheLayout,
    LayerSpec,
)
from attnsdk.backends.reference import ReferenceBackend
from attnsdk.testing import BatchSpec, make_batch

if TYPE_CHECKING:
    from collections.abc import Callable

    from attnsdk.testing import Batch

E4M3 = torch.float8_e4m3fn
HQ, HKV, D, DV, T = 4, 2, 16, 8, 9
reference = ReferenceBackend()


def raises_field(
    field: str, error: type[AttnSDKError] = InvalidInputError
) -> pytest.RaisesContext[AttnSDKError]:
    return pytest.raises(error, match=rf"^{re.escape(field)}: expected ")


def make(*, quantized: bool = False, has_sinks: bool = False) -> Batch:
    layer = LayerSpec(HQ, HKV, D, v_head_dim=DV, has_sinks=has_sinks)
    layout = KVCacheLayout(
        HKV, D, 4, dtype=torch.float32, v_head_dim=DV, kv_dtype=E4M3 if quantized else None
    )
    spec = BatchSpec((1, 5, 3), (7, 5, 10))
    return make_batch(spec, layer, layout, seed=1, per_head_scales=quantized)


def forward_kwargs(batch: Batch) -> dict[str, Any]:
    return {
        "q": batch.q,
        "k": batch.k,
        "v": batch.v,
        "cache": batch.fresh_cache(),
        "plan": reference.plan(batch.metadata),
        "layer": batch.layer,
        "sinks": batch.sinks,
        "k_scale": batch.k_scale,
        "v_scale": batch.v_scale,
        "out": None,
    }


Mutation = dict[str, Any]
f32 = torch.float32


def _randn(*shape: int, dtype: torch.dtype = f32) -> torch.Tensor:
    return torch.randn(*shape).to(dtype)


def _meta_on_meta_device(batch: Batch) -> Any:
    m = batch.metadata
    moved = dataclasses.replace(
        m,
        query_start_loc=m.query_start_loc.to("meta"),
        seq_lens=m.seq_lens.to("meta"),
        page_table=m.page_table.to("meta"),
        slot_mapping=m.slot_mapping.to("meta"),
    )
    return reference.plan(moved)


def _short_q_meta(batch: Batch) -> Any:
    return reference.plan(
        AttentionMetadata.from_seqlens(
            [1, 5, 3, 1], [7, 5, 10, 1], torch.zeros(4, 3, dtype=torch.int32), 4
        )
    )


# (id, variant of make(), changes to forward's arguments, field named in the error)
CASES: list[tuple[str, dict[str, bool], Callable[[Batch], Mutation], str]] = [
    ("q-heads", {}, lambda b: {"q": _randn(T, HQ + 1, D)}, "q.shape"),
    ("q-head-dim", {}, lambda b: {"q": _randn(T, HQ, D + 1)}, "q.shape"),
    ("q-2d", {}, lambda b: {"q": _randn(T, HQ * D)}, "q.shape"),
    ("q-dtype", {}, lambda b: {"q": b.q.half()}, "q.dtype"),
    ("q-not-tensor", {}, lambda b: {"q": b.q.tolist()}, "q"),
    ("q-fewer-rows", {}, lambda b: {"q": b.q[:-1], "k": b.k[:-1], "v": b.v[:-1]}, "q.shape[0]"),
    ("q-fewer-rows-no-kv", {}, lambda b: {"q": b.q[:-1], "k": None, "v": None}, "q.shape[0]"),
    ("q-more-rows-than-kv", {}, lambda b: {"q": torch.cat([b.q, b.q[:1]])}, "k.shape"),
    ("k-rows", {}, lambda b: {"k": b.k[:-1]}, "k.shape"),
    ("k-heads", {}, lambda b: {"k": _randn(T, HKV + 1, D)}, "k.shape"),
    ("k-head-dim", {}, lambda b: {"k": _randn(T, HKV, DV)}, "k.shape"),
    ("k-dtype", {}, lambda b: {"k": b.k.double()}, "k.dtype"),
    ("v-head-dim", {}, lambda b: {"v": _randn(T, HKV, D)}, "v.shape"),
    ("v-heads", {}, lambda b: {"v": _randn(T, HKV * 2, DV)}, "v.shape"),
    ("v-dtype", {}, lambda b: {"v": b.v.bfloat16()}, "v.dtype"),
    ("k-without-v", {}, lambda b: {"v": None}, "k/v"),
    ("v-without-k", {}, lambda b: {"k": None}, "k/v"),
    ("sinks-missing", {"has_sinks": True}, lambda b: {"sinks": None}, "sinks"),
    ("sinks-unexpected", {}, lambda b: {"sinks": torch.zeros(HQ)}, "sinks"),
    ("sinks-shape", {"has_sinks": True}, lambda b: {"sinks": torch.zeros(HKV)}, "sinks.shape"),
    ("sinks-2d", {"has_sinks": True}, lambda b: {"sinks": torch.zeros(1, HQ)}, "sinks.shape"),
    (
        "sinks-dtype",
        {"has_sinks": True},
        lambda b: {"sinks": torch.zeros(HQ).half()},
        "sinks.dtype",
    ),
    ("k-scale-on-bf16-cache", {}, lambda b: {"k_scale": torch.ones(())}, "k_scale"),
    ("v-scale-on-bf16-cache", {}, lambda b: {"v_scale": torch.ones(HKV)}, "v_scale"),
    ("k-scale-shape", {"quantized": True}, lambda b: {"k_scale": torch.ones(HKV + 1)}, "k_scale"),
    ("v-scale-2d", {"quantized": True}, lambda b: {"v_scale": torch.ones(1, HKV)}, "v_scale"),
    (
        "k-scale-dtype",
        {"quantized": True},
        lambda b: {"k_scale": torch.ones(HKV).half()},
        "k_scale.dtype",
    ),
    (
        "v-scale-dtype",
        {"quantized": True},
        lambda b: {"v_scale": torch.ones(()).double()},
        "v_scale.dtype",
    ),
    ("layer-kv-heads", {}, lambda b: {"layer": LayerSpec(HQ, HKV * 2, D, v_head_dim=DV)}, "layer"),
    ("layer-head-dim", {}, lambda b: {"layer": LayerSpec(HQ, HKV, D * 2, v_head_dim=DV)}, "layer"),
    ("layer-v-head-dim", {}, lambda b: {"layer": LayerSpec(HQ, HKV, D)}, "layer"),
    (
        "layer-num-heads",
        {},
        lambda b: {"layer": LayerSpec(HQ * 2, HKV, D, v_head_dim=DV)},
        "q.shape",
    ),
    ("out-shape", {}, lambda b: {"out": torch.empty(T, HQ, D)}, "out.shape"),
    ("out-rows", {}, lambda b: {"out": torch.empty(T - 1, HQ, DV)}, "out.shape"),
    ("out-dtype", {}, lambda b: {"out": torch.empty(T, HQ, DV, dtype=torch.float16)}, "out.dtype"),
    ("metadata-device", {}, lambda b: {"plan": _meta_on_meta_device(b)}, "plan.metadata.device"),
    ("metadata-more-tokens", {}, lambda b: {"plan": _short_q_meta(b)}, "q.shape[0]"),
]


@pytest.mark.parametrize(
    ("variant", "mutate", "field"), [pytest.param(v, m, f, id=i) for i, v, m, f in CASES]
)
def test_forward_rejects(
    variant: dict[str, bool], mutate: Callable[[Batch], Mutation], field: str
) -> None:
    batch = make(**variant)
    kwargs = forward_kwargs(batch)
    reference.forward(**kwargs)  # the unmodified call is valid
    kwargs = forward_kwargs(batch)
    cache = kwargs["cache"]
    kwargs.update(mutate(batch))
    if isinstance(kwargs["out"], torch.Tensor):
        kwargs["out"].fill_(7.0)
    out_before = None if kwargs["out"] is None else kwargs["out"].clone()
    with raises_field(field) as info:
        reference.forward(**kwargs)
    assert info.value.field == field  # type: ignore[attr-defined]
    # A rejected call writes nothing: not the cache, not the output buffer.
    assert torch.equal(cache.k.view(torch.uint8), batch.cache.k.view(torch.uint8))
    assert torch.equal(cache.v.view(torch.uint8), batch.cache.v.view(torch.uint8))
    if out_before is not None:
        assert torch.equal(kwargs["out"], out_before)


# --- LayerSpec ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"num_heads": 0}, "LayerSpec.num_heads"),
        ({"num_heads": -4}, "LayerSpec.num_heads"),
        ({"num_heads": 4.0}, "LayerSpec.num_heads"),
        ({"num_kv_heads": 0}, "LayerSpec.num_kv_heads"),
        ({"head_dim": 0}, "LayerSpec.head_dim"),
        ({"head_dim": "64"}, "LayerSpec.head_dim"),
        ({"v_head_dim": 0}, "LayerSpec.v_head_dim"),
        ({"v_head_dim": 8.5}, "LayerSpec.v_head_dim"),
        ({"num_heads": 6, "num_kv_heads": 4}, "LayerSpec.num_heads"),
        ({"sliding_window": 0}, "LayerSpec.sliding_window"),
        ({"sliding_window": -1}, "LayerSpec.sliding_window"),
        ({"sliding_window": 4.0}, "LayerSpec.sliding_window"),
        ({"attention_chunk_size": 0}, "LayerSpec.attention_chunk_size"),
        ({"attention_chunk_size": -8192}, "LayerSpec.attention_chunk_size"),
        ({"attention_chunk_size": 8192.0}, "LayerSpec.attention_chunk_size"),
        ({"softcap": -1.0}, "LayerSpec.softcap"),
        ({"scale": 0.0}, "LayerSpec.scale"),
        ({"scale": -0.1}, "LayerSpec.scale"),
        ({"scale": float("nan")}, "LayerSpec.scale"),
    ],
)
def test_layer_spec_rejects(kwargs: dict[str, Any], field: str) -> None:
    args: dict[str, Any] = {"num_heads": 4, "num_kv_heads": 2, "head_dim": 16, **kwargs}
    with raises_field(field):
        LayerSpec(**args)


def test_sliding_window_hint_mentions_sglang() -> None:
    with pytest.raises(InvalidInputError, match="SGLang"):
        LayerSpec(4, 2, 16, sliding_window=0)


# --- KVCacheLayout and allocate ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"num_kv_heads": 0}, "KVCacheLayout.num_kv_heads"),
        ({"head_dim": -8}, "KVCacheLayout.head_dim"),
        ({"page_size": 0}, "KVCacheLayout.page_size"),
        ({"page_size": 16.0}, "KVCacheLayout.page_size"),
        ({"v_head_dim": 0}, "KVCacheLayout.v_head_dim"),
        ({"order": "NDH"}, "KVCacheLayout.order"),
        ({"order": "nhd"}, "KVCacheLayout.order"),
        ({"dtype": torch.float64}, "KVCacheLayout.dtype"),
        ({"dtype": torch.int8}, "KVCacheLayout.dtype"),
        ({"dtype": E4M3}, "KVCacheLayout.dtype"),
        ({"kv_dtype": torch.int8}, "KVCacheLayout.kv_dtype"),
        ({"kv_dtype": torch.float16}, "KVCacheLayout.kv_dtype"),
    ],
)
def test_layout_rejects(kwargs: dict[str, Any], field: str) -> None:
    args: dict[str, Any] = {"num_kv_heads": 2, "head_dim": 16, "page_size": 4, **kwargs}
    with raises_field(field):
        KVCacheLayout(**args)


@pytest.mark.parametrize("num_pages", [0, -1, 2.0])
def test_allocate_rejects(num_pages: Any) -> None:
    with raises_field("num_pages"):
        KVCacheLayout(2, 16, 4).allocate(num_pages)


@pytest.mark.parametrize("order", ["NHD", "HND"])
def test_allocate_shapes(order: str) -> None:
    layout = KVCacheLayout(2, 16, 4, v_head_dim=8, order=order, kv_dtype=E4M3)
    cache = layout.allocate(3)
    k_shape, v_shape = (
        ((3, 4, 2, 16), (3, 4, 2, 8)) if order == "NHD" else ((3, 2, 4, 16), (3, 2, 4, 8))
    )
    assert (tuple(cache.k.shape), tuple(cache.v.shape)) == (k_shape, v_shape)
    assert cache.k.dtype == cache.v.dtype == E4M3
    assert tuple(cache.k_nhd.shape) == (3, 4, 2, 16)
    assert tuple(cache.v_nhd.shape) == (3, 4, 2, 8)


# --- wrap ------------------------------------------------------------------------------------------

WRAP_LAYOUT = KVCacheLayout(2, 16, 4, dtype=torch.float16, v_head_dim=8)


@pytest.mark.parametrize(
    ("k", "v", "field"),
    [
        (torch.zeros(5, 4, 2, 16), torch.zeros(5, 4, 2, 8), "k.dtype"),
        (torch.zeros(5, 4, 2, 16).half(), torch.zeros(5, 4, 2, 8).bfloat16(), "v.dtype"),
        (torch.zeros(5, 4, 32).half(), torch.zeros(5, 4, 2, 8).half(), "k.shape"),
        (torch.zeros(5, 8, 2, 16).half(), torch.zeros(5, 4, 2, 8).half(), "k.shape"),
        (torch.zeros(5, 4, 2, 16).half(), torch.zeros(5, 2, 4, 8).half(), "v.shape"),
        (torch.zeros(5, 4, 2, 16).half(), torch.zeros(5, 4, 2, 16).half(), "v.shape"),
        (torch.zeros(5, 4, 2, 16).half(), torch.zeros(6, 4, 2, 8).half(), "v.shape[0]"),
        (
            torch.zeros(5, 4, 16, 2).half().transpose(2, 3),
            torch.zeros(5, 4, 2, 8).half(),
            "k.stride()",
        ),
        (
            torch.zeros(5, 4, 2, 16).half(),
            torch.zeros(5, 4, 8, 2).half().transpose(2, 3),
            "v.stride()",
        ),
        ([[0.0]], torch.zeros(5, 4, 2, 8).half(), "k"),
    ],
)
def test_wrap_rejects(k: Any, v: Any, field: str) -> None:
    with raises_field(field):
        WRAP_LAYOUT.wrap(k, v)


def test_wrap_rejects_fp8_mismatch() -> None:
    layout = KVCacheLayout(2, 16, 4, kv_dtype=E4M3)
    with raises_field("k.dtype"):
        layout.wrap(
            torch.zeros(3, 4, 2, 16, dtype=torch.bfloat16), torch.zeros(3, 4, 2, 16, dtype=E4M3)
        )


@pytest.mark.parametrize("order", ["NHD", "HND"])
def test_wrap_packed_kv_without_copy(order: str) -> None:
    """vLLM's K‖V packed in the last dim: both halves are strided views of one tensor."""
    d, dv, p, hkv = 16, 8, 4, 2
    layout = KVCacheLayout(hkv, d, p, dtype=torch.float32, v_head_dim=dv, order=order)
    dims = (6, p, hkv) if order == "NHD" else (6, hkv, p)
    packed = torch.randn(*dims, d + dv)
    original = packed.clone()
    k, v = packed[..., :d], packed[..., d:]
    cache = layout.wrap(k, v)
    assert cache.k.data_ptr() == packed.data_ptr()
    assert cache.v.data_ptr() == packed.data_ptr() + d * packed.element_size()
    assert not cache.k.is_contiguous()

    layer = LayerSpec(4, hkv, d, v_head_dim=dv)
    meta = AttentionMetadata.from_seqlens([2, 1], [6, 1], [[3, 1], [5, 0]], page_size=p)
    q, k_new, v_new = torch.randn(3, 4, d), torch.randn(3, hkv, d), torch.randn(3, hkv, dv)
    reference.forward(q, k_new, v_new, cache, reference.plan(meta), layer)
    # Writes land in the packed tensor: slots 4*1+0, 4*1+1 (sequence 0) and 4*5+0 (sequence 1).
    nhd = packed if order == "NHD" else packed.transpose(1, 2)
    expected = (original if order == "NHD" else original.transpose(1, 2)).clone()
    for (page, offset), t in zip([(1, 0), (1, 1), (5, 0)], range(3)):
        expected[page, offset, :, :d] = k_new[t]
        expected[page, offset, :, d:] = v_new[t]
    assert torch.equal(nhd, expected)


def test_wrap_split_kv_engine_tensor() -> None:
    """vLLM's [2, N, P, Hkv, D]: K and V are the two halves of one engine tensor."""
    layout = KVCacheLayout(2, 16, 4, dtype=torch.float32)
    kv = torch.zeros(2, 5, 4, 2, 16)
    cache = layout.wrap(kv[0], kv[1])
    assert cache.k.data_ptr() == kv.data_ptr()
    assert cache.v.data_ptr() == kv[1].data_ptr()


# --- BatchSpec ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "field"),
    [
        (((1, 2), (3,)), "query_lens"),
        (((1, -1), (3, 3)), "query_lens[1]"),
        (((1, 4), (3, 3)), "seq_lens[1]"),
        (((1, 2), (3, 3), "x", (True,)), "padded"),
    ],
)
def test_batch_spec_rejects(args: tuple[Any, ...], field: str) -> None:
    with raises_field(field, InvalidMetadataError):
        BatchSpec(*args)


def test_make_batch_rejects_unknown_page_order() -> None:
    layer, layout = LayerSpec(2, 1, 8), KVCacheLayout(1, 8, 4)
    with raises_field("pages"):
        make_batch(BatchSpec((1,), (3,)), layer, layout, pages="random")  # type: ignore[arg-type]


def test_store_rejects_a_scale_of_the_wrong_size() -> None:
    """A (3,) scale for 2 KV heads must not be silently read as its first element."""
    from attnsdk import KVCacheLayout

    layout = KVCacheLayout(2, 8, 4, dtype=torch.bfloat16, kv_dtype=torch.float8_e4m3fn)
    cache = layout.allocate(3)
    new = torch.randn(1, 2, 8, dtype=torch.bfloat16)
    with pytest.raises(InvalidInputError, match=r"^k_scale: expected shape \(\), \(1,\) or \(2,\)"):
        cache.store(new, new, torch.tensor([4]), k_scale=torch.ones(3))
    assert not cache.k.float().any()  # nothing written


def test_from_seqlens_rejects_negative_pages_in_use() -> None:
    from attnsdk import AttentionMetadata, InvalidMetadataError

    with pytest.raises(InvalidMetadataError, match=r"^page_table\[0, 0\]: expected >= 0"):
        AttentionMetadata.from_seqlens([1], [3], [[-1]], page_size=4)
    # Unused columns may hold anything (engines leave stale entries there).
    AttentionMetadata.from_seqlens([1], [3], [[1, -1]], page_size=4)


def test_assert_close_to_reference_fails_on_a_nan_reference() -> None:
    from attnsdk.testing import assert_close_to_reference

    with pytest.raises(AssertionError, match="non-finite reference"):
        assert_close_to_reference(torch.zeros(2), torch.tensor([0.0, float("nan")]))
