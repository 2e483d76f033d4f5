"""The bad-input matrix, core half: records, metadata, backends, config, registry, graph buffers.

Every case makes one call that is one change away from a valid one and must be refused with a
typed ``AttnSDKError`` naming the field (tests/bad_input_kit.py says how that is checked); calls
that reach a KV cache or static graph buffers must leave them bit for bit as they were. The
baseline tests at the end run the unchanged calls, so each case fails for its one change only.
tests/adapters/test_adapter_bad_inputs.py is the engine-adapter half; tests/core/test_bad_inputs.py
holds the older forward-argument cases this file does not repeat.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch
from bad_input_kit import Case, assert_refused, params
from pydantic import BaseModel, ConfigDict

import attnsdk as A
from attnsdk import (
    AttentionConfig,
    AttentionMetadata,
    GraphBuffers,
    InvalidInputError,
    InvalidMetadataError,
    KVCacheLayout,
    LayerSpec,
    Plan,
    UnsupportedConfigError,
)
from attnsdk.backends.reference import ReferenceBackend, ReferenceOptions
from attnsdk.selection.debug import wrap_debug
from attnsdk.testing import BatchSpec, make_batch

if TYPE_CHECKING:
    from collections.abc import Iterator

    from attnsdk.testing import Batch

IIE, IME, UCE = InvalidInputError, InvalidMetadataError, UnsupportedConfigError
E4M3 = torch.float8_e4m3fn
NAN, INF = math.nan, math.inf
I32_MAX = 2**31 - 1
UNREACHABLE = f"cuda:{torch.cuda.device_count()}" if torch.cuda.is_available() else "cuda"
"""A device this machine cannot make tensors on: CUDA on a CPU-only torch build (torch itself
raises AssertionError "Torch not compiled with CUDA enabled" there), else the first GPU index
past the count."""

REF = ReferenceBackend()
DEBUG = A.create_backend(AttentionConfig(backend="reference", debug=True))

# The forward batch: decode over a context, an extend, a chunked prefill (T = 9 token rows).
HQ, HKV, D, DV, P = 4, 2, 16, 8, 4
SPEC = BatchSpec((1, 5, 3), (7, 5, 10))
T = SPEC.num_tokens
NUM_PAGES = 11  # 2 + 2 + 3 pages in use, page 0 reserved, 3 spare (make_batch's sizing)

# A hand-built batch for the metadata cases: decode, prefill, idle row, extend.
QUERY_LENS, SEQ_LENS = [1, 3, 0, 2], [6, 3, 4, 9]
TABLE = [[7, 2, 0], [4, 0, 0], [5, 0, 0], [1, 8, 3]]


def base_meta() -> AttentionMetadata:
    return AttentionMetadata.from_seqlens(QUERY_LENS, SEQ_LENS, TABLE, page_size=P)


def i32(values: Any) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


def replace(meta: AttentionMetadata, **changes: Any) -> AttentionMetadata:
    return dataclasses.replace(meta, **changes)


def lengths(meta: AttentionMetadata, qsl: list[int] | None = None, seq: list[int] | None = None):
    """New lengths on the device and on the host alike (the twins stay consistent)."""
    changes: dict[str, Any] = {}
    if qsl is not None:
        changes.update(query_start_loc=i32(qsl), query_start_loc_cpu=i32(qsl))
    if seq is not None:
        changes.update(seq_lens=i32(seq), seq_lens_cpu=i32(seq))
    return replace(meta, **changes)


def entry(meta: AttentionMetadata, field: str, index: tuple[int, ...], value: int):
    """``meta`` with one element of a device tensor field changed (a copy)."""
    t = getattr(meta, field).clone()
    t[index] = value
    return replace(meta, **{field: t})


def poisoned(t: torch.Tensor, row: int, value: float) -> torch.Tensor:
    out = t.clone()
    out[row].view(-1)[0] = value
    return out


# --- records: LayerSpec, KVCacheLayout, allocate, wrap, store -------------------------------------


def layer_case(name: str, field: str, **kwargs: Any) -> Case:
    args: dict[str, Any] = {"num_heads": 4, "num_kv_heads": 2, "head_dim": 16, **kwargs}
    return Case(f"layer/{name}", lambda: LayerSpec(**args), IIE, f"LayerSpec.{field}")


LAYER_CASES = [
    layer_case("num-heads-bool", "num_heads", num_heads=True),
    layer_case("num-heads-none", "num_heads", num_heads=None),
    layer_case("num-heads-str", "num_heads", num_heads="4"),
    layer_case("num-heads-tensor", "num_heads", num_heads=torch.tensor(4)),
    layer_case("num-heads-past-int32", "num_heads", num_heads=2**32, num_kv_heads=1),
    layer_case("num-kv-heads-negative", "num_kv_heads", num_kv_heads=-2),
    layer_case("num-kv-heads-float", "num_kv_heads", num_kv_heads=2.0),
    layer_case("num-kv-heads-bool", "num_kv_heads", num_kv_heads=True),
    layer_case("head-dim-none", "head_dim", head_dim=None),
    layer_case("head-dim-negative", "head_dim", head_dim=-16),
    layer_case("head-dim-float", "head_dim", head_dim=16.0),
    layer_case("v-head-dim-negative", "v_head_dim", v_head_dim=-8),
    layer_case("v-head-dim-bool", "v_head_dim", v_head_dim=True),
    layer_case("v-head-dim-str", "v_head_dim", v_head_dim="8"),
    layer_case("heads-not-a-multiple", "num_heads", num_heads=3),
    layer_case("fewer-q-than-kv-heads", "num_heads", num_heads=2, num_kv_heads=4),
    layer_case("scale-inf", "scale", scale=INF),
    layer_case("scale-minus-inf", "scale", scale=-INF),
    layer_case("scale-str", "scale", scale="0.1"),
    layer_case("scale-bool", "scale", scale=True),
    layer_case("scale-tensor", "scale", scale=torch.tensor(0.1)),
    layer_case("scale-complex", "scale", scale=0.1j),
    layer_case("causal-str", "causal", causal="no"),
    layer_case("causal-int", "causal", causal=1),
    layer_case("causal-none", "causal", causal=None),
    layer_case("window-bool", "sliding_window", sliding_window=True),
    layer_case("window-str", "sliding_window", sliding_window="4096"),
    layer_case("window-past-int32", "sliding_window", sliding_window=2**40),
    layer_case("chunk-bool", "attention_chunk_size", attention_chunk_size=True),
    layer_case("chunk-str", "attention_chunk_size", attention_chunk_size="8192"),
    layer_case("chunk-past-int32", "attention_chunk_size", attention_chunk_size=2**40),
    layer_case("softcap-nan", "softcap", softcap=NAN),
    layer_case("softcap-inf", "softcap", softcap=INF),
    layer_case("softcap-str", "softcap", softcap="30"),
    layer_case("softcap-bool", "softcap", softcap=True),
    layer_case("has-sinks-int", "has_sinks", has_sinks=1),
    layer_case("has-sinks-str", "has_sinks", has_sinks="yes"),
    layer_case("has-sinks-none", "has_sinks", has_sinks=None),
]


def layout_case(name: str, field: str, **kwargs: Any) -> Case:
    args: dict[str, Any] = {"num_kv_heads": 2, "head_dim": 16, "page_size": 4, **kwargs}
    return Case(f"layout/{name}", lambda: KVCacheLayout(**args), IIE, f"KVCacheLayout.{field}")


LAYOUT_CASES = [
    layout_case("num-kv-heads-bool", "num_kv_heads", num_kv_heads=True),
    layout_case("num-kv-heads-str", "num_kv_heads", num_kv_heads="2"),
    layout_case("num-kv-heads-none", "num_kv_heads", num_kv_heads=None),
    layout_case("head-dim-none", "head_dim", head_dim=None),
    layout_case("head-dim-fraction", "head_dim", head_dim=16.5),
    layout_case("page-size-negative", "page_size", page_size=-16),
    layout_case("page-size-bool", "page_size", page_size=True),
    layout_case("page-size-past-int32", "page_size", page_size=2**31),
    layout_case("page-size-none", "page_size", page_size=None),
    layout_case("v-head-dim-negative", "v_head_dim", v_head_dim=-1),
    layout_case("v-head-dim-fraction", "v_head_dim", v_head_dim=2.5),
    layout_case("v-head-dim-bool", "v_head_dim", v_head_dim=True),
    layout_case("order-none", "order", order=None),
    layout_case("order-int", "order", order=3),
    layout_case("order-list", "order", order=["NHD"]),
    layout_case("order-hdn", "order", order="HDN"),
    layout_case("dtype-str", "dtype", dtype="bfloat16"),
    layout_case("dtype-none", "dtype", dtype=None),
    layout_case("dtype-complex", "dtype", dtype=torch.complex64),
    layout_case("dtype-uint8", "dtype", dtype=torch.uint8),
    layout_case("dtype-e5m2", "dtype", dtype=torch.float8_e5m2),
    layout_case("kv-dtype-uint8", "kv_dtype", kv_dtype=torch.uint8),
    layout_case("kv-dtype-str", "kv_dtype", kv_dtype="fp8"),
    layout_case("kv-dtype-other-compute", "kv_dtype", dtype=torch.float32, kv_dtype=torch.bfloat16),
    layout_case("kv-dtype-float64", "kv_dtype", kv_dtype=torch.float64),
    layout_case("kv-dtype-int32", "kv_dtype", kv_dtype=torch.int32),
]

ALLOC_LAYOUT = KVCacheLayout(2, 16, 4)
ALLOCATE_CASES = [
    Case(f"allocate/{name}", lambda n=n, d=d: ALLOC_LAYOUT.allocate(n, device=d), IIE, field)
    for name, n, d, field in [
        ("pages-bool", True, "cpu", "num_pages"),
        ("pages-str", "4", "cpu", "num_pages"),
        ("pages-none", None, "cpu", "num_pages"),
        ("pages-past-int32", 2**31, "cpu", "num_pages"),
        ("pages-tensor", torch.tensor(4), "cpu", "num_pages"),
        ("device-bad-string", 4, "gpu0", "device"),
        ("device-float", 4, 1.5, "device"),
        ("device-none", 4, None, "device"),
        ("device-unreachable", 4, UNREACHABLE, "device"),
        # torch keeps device indices in 8 bits: it would read this as cuda:-24.
        ("device-index-past-torch", 4, "cuda:1000", "device"),
        ("device-index-wrapping-to-0", 4, "cuda:256", "device"),
    ]
]

WRAP_LAYOUT = KVCacheLayout(2, 16, 4, dtype=torch.float16, v_head_dim=8)
HND_LAYOUT = KVCacheLayout(2, 16, 4, dtype=torch.float16, v_head_dim=8, order="HND")
FP8_LAYOUT = KVCacheLayout(2, 16, 4, dtype=torch.bfloat16, kv_dtype=E4M3)


def f16(*shape: int) -> torch.Tensor:
    return torch.zeros(*shape, dtype=torch.float16)


def wrap_case(name: str, field: str, k: Any, v: Any, layout: KVCacheLayout = WRAP_LAYOUT) -> Case:
    return Case(f"wrap/{name}", lambda: layout.wrap(k, v), IIE, field)


WRAP_CASES = [
    wrap_case("k-none", "k", None, f16(5, 4, 2, 8)),
    wrap_case("v-none", "v", f16(5, 4, 2, 16), None),
    wrap_case("v-list", "v", f16(5, 4, 2, 16), [[0.0]]),
    wrap_case("k-5d", "k.shape", f16(1, 5, 4, 2, 16), f16(5, 4, 2, 8)),
    wrap_case("v-3d", "v.shape", f16(5, 4, 2, 16), f16(5, 4, 16)),
    wrap_case("k-kv-heads", "k.shape", f16(5, 4, 3, 16), f16(5, 4, 2, 8)),
    wrap_case("v-kv-heads", "v.shape", f16(5, 4, 2, 16), f16(5, 4, 1, 8)),
    wrap_case("nhd-tensors-for-hnd", "k.shape", f16(5, 4, 2, 16), f16(5, 4, 2, 8), HND_LAYOUT),
    wrap_case("k-int16", "k.dtype", torch.zeros(5, 4, 2, 16, dtype=torch.int16), f16(5, 4, 2, 8)),
    wrap_case(
        "fp8-v-bf16",
        "v.dtype",
        torch.zeros(3, 4, 2, 16, dtype=E4M3),
        torch.zeros(3, 4, 2, 16, dtype=torch.bfloat16),
        FP8_LAYOUT,
    ),
    wrap_case(
        "k-expanded-pages", "k.stride()", f16(1, 4, 2, 16).expand(5, 4, 2, 16), f16(5, 4, 2, 8)
    ),
    wrap_case(
        "v-expanded-heads", "v.stride()", f16(5, 4, 2, 16), f16(5, 4, 1, 8).expand(5, 4, 2, 8)
    ),
    wrap_case("v-other-device", "v.device", f16(5, 4, 2, 16), f16(5, 4, 2, 8).to("meta")),
    wrap_case("k-fewer-pages", "v.shape[0]", f16(4, 4, 2, 16), f16(5, 4, 2, 8)),
]


STORE_LAYOUT = KVCacheLayout(2, 16, 4, dtype=torch.float32, v_head_dim=8)
STORE_FP8 = KVCacheLayout(2, 16, 4, dtype=torch.float32, v_head_dim=8, kv_dtype=E4M3)


def store_case(
    name: str, field: str, error: type[A.AttnSDKError] = IIE, *, fp8: bool = False, **changes: Any
) -> Case:
    cache = (STORE_FP8 if fp8 else STORE_LAYOUT).allocate(6)
    gen = torch.Generator().manual_seed(3)
    cache.k.copy_(torch.randn(cache.k.shape, generator=gen).to(cache.k.dtype))
    cache.v.copy_(torch.randn(cache.v.shape, generator=gen).to(cache.v.dtype))
    args: dict[str, Any] = {
        "k": torch.randn(3, 2, 16),
        "v": torch.randn(3, 2, 8),
        "slot_mapping": torch.tensor([4, 5, 9]),
        **changes,
    }
    return Case(f"store/{name}", lambda: cache.store(**args), error, field, (cache.k, cache.v))


STORE_CASES = [
    store_case("slots-list", "slot_mapping", IME, slot_mapping=[4, 5, 9]),
    store_case("slots-float", "slot_mapping", IME, slot_mapping=torch.tensor([4.0, 5.0, 9.0])),
    store_case("slots-bool", "slot_mapping", IME, slot_mapping=torch.tensor([True, True, False])),
    store_case("slots-2d", "slot_mapping", IME, slot_mapping=torch.tensor([[4, 5, 9]])),
    store_case(
        "slots-other-device",
        "slot_mapping.device",
        IME,
        slot_mapping=torch.tensor([4, 5, 9], device="meta"),
    ),
    store_case("slot-past-cache", "slot_mapping[2]", IME, slot_mapping=torch.tensor([4, 5, 24])),
    store_case("k-fewer-rows", "k.shape", k=torch.randn(2, 2, 16)),
    store_case("k-kv-heads", "k.shape", k=torch.randn(3, 3, 16)),
    store_case("v-head-dim", "v.shape", v=torch.randn(3, 2, 16)),
    store_case("k-not-tensor", "k", k=[[0.0]]),
    store_case("v-int", "v.dtype", v=torch.ones(3, 2, 8, dtype=torch.int32)),
    store_case("k-other-device", "k.device", k=torch.randn(3, 2, 16, device="meta")),
    store_case(
        "fp8-v-scale-size", "v_scale", fp8=True, k_scale=torch.ones(()), v_scale=torch.ones(3)
    ),
    store_case("fp8-k-scale-float", "k_scale", fp8=True, k_scale=0.5),
    store_case("fp8-v-scale-list", "v_scale", fp8=True, v_scale=[1.0, 1.0]),
]


# --- AttentionMetadata.from_seqlens / from_tensors ------------------------------------------------


def seqlens_case(name: str, field: str, error: type[A.AttnSDKError] = IME, **kwargs: Any) -> Case:
    args: dict[str, Any] = {
        "query_lens": QUERY_LENS,
        "seq_lens": SEQ_LENS,
        "page_table": TABLE,
        "page_size": P,
        **kwargs,
    }
    return Case(
        f"from_seqlens/{name}", lambda: AttentionMetadata.from_seqlens(**args), error, field
    )


def table_with(row: int, col: int, value: int) -> list[list[int]]:
    table = [list(r) for r in TABLE]
    table[row][col] = value
    return table


FROM_SEQLENS_CASES = [
    seqlens_case("query-lens-none", "query_lens", query_lens=None),
    seqlens_case("query-lens-str", "query_lens", query_lens="1302"),
    seqlens_case("query-lens-bools", "query_lens", query_lens=[True, False, True, True]),
    seqlens_case(
        "query-lens-on-device", "query_lens.device", query_lens=i32(QUERY_LENS).to("meta")
    ),
    seqlens_case("query-lens-past-int32", "query_lens[1]", query_lens=[1, 2**40, 0, 2]),
    seqlens_case("query-lens-ragged", "query_lens", query_lens=[[1], [3, 0]]),
    seqlens_case("seq-lens-2d", "seq_lens", seq_lens=[SEQ_LENS]),
    seqlens_case("seq-lens-bool-tensor", "seq_lens", seq_lens=torch.ones(4, dtype=torch.bool)),
    seqlens_case("seq-lens-none", "seq_lens", seq_lens=None),
    seqlens_case("seq-lens-shorter", "query_lens", seq_lens=[6, 3, 4]),
    seqlens_case("seq-lens-negative-idle-row", "seq_lens[2]", seq_lens=[6, 3, -1, 9]),
    seqlens_case("page-size-bool", "page_size", page_size=True),
    seqlens_case("page-size-negative", "page_size", page_size=-4),
    seqlens_case("page-size-none", "page_size", page_size=None),
    seqlens_case("page-size-str", "page_size", page_size="4"),
    seqlens_case("table-floats", "page_table", page_table=[[float(x) for x in r] for r in TABLE]),
    seqlens_case(
        "table-float-tensor", "page_table", page_table=torch.tensor(TABLE, dtype=torch.float32)
    ),
    seqlens_case("table-bool-tensor", "page_table", page_table=torch.ones(4, 3, dtype=torch.bool)),
    seqlens_case("table-ragged", "page_table", page_table=[[7, 2, 0], [4], [5], [1, 8, 3]]),
    seqlens_case("table-none", "page_table", page_table=None),
    seqlens_case("table-str", "page_table", page_table="7,2,0"),
    seqlens_case("table-past-int32", "page_table[3, 2]", page_table=table_with(3, 2, 2**40)),
    seqlens_case("table-3d", "page_table", page_table=[TABLE]),
    seqlens_case("table-negative-in-use", "page_table[3, 1]", page_table=table_with(3, 1, -5)),
    seqlens_case("table-empty", "page_table", page_table=[[]]),
    seqlens_case("device-bad-string", "device", IIE, device="gpu0"),
    seqlens_case("device-float", "device", IIE, device=1.5),
    seqlens_case("device-unreachable", "device", IIE, device=UNREACHABLE),
    # query_start_loc is the int32 prefix sum of query_lens: a sum past int32 would wrap.
    seqlens_case(
        "query-lens-sum-past-int32",
        "query_lens",
        query_lens=[2**30, 2**30, 0, 2],
        seq_lens=[2**30, 2**30, 4, 9],
    ),
]


def ragged_case(name: str, field: str, error: type[A.AttnSDKError] = IME, **kwargs: Any) -> Case:
    args: dict[str, Any] = {"query_lens": [2, 3], "seq_lens": [2, 5], **kwargs}
    return Case(f"for_ragged/{name}", lambda: AttentionMetadata.for_ragged(**args), error, field)


FOR_RAGGED_CASES = [
    ragged_case("device-bad-string", "device", IIE, device="gpu0"),
    ragged_case("device-float", "device", IIE, device=1.5),
    ragged_case("device-dict", "device", IIE, device={"type": "cpu"}),
    ragged_case("device-unreachable", "device", IIE, device=UNREACHABLE),
    ragged_case(
        "query-lens-sum-past-int32", "query_lens", query_lens=[2**30, 2**30], seq_lens=[2**30] * 2
    ),
    # key_start_loc is the int32 prefix sum of seq_lens.
    ragged_case("seq-lens-sum-past-int32", "seq_lens", query_lens=[1, 1], seq_lens=[2**30] * 2),
]


# --- tree_mask_from_parents ---------------------------------------------------------------------


def parents_case(name: str, field: str, parents: Any, device: Any = None) -> Case:
    return Case(
        f"tree_mask_from_parents/{name}",
        lambda: A.tree_mask_from_parents(parents, device=device),
        IIE,
        field,
    )


TREE_CASES = [
    parents_case("parents-none", "parents", None),
    parents_case("parents-int", "parents", 3),
    parents_case("parents-str", "parents", "-10"),
    parents_case("parents-dict", "parents", {0: [-1]}),
    parents_case("parents-flat-list", "parents[0]", [-1, 0, 0]),
    parents_case("row-none", "parents[1]", [[-1, 0], None]),
    parents_case("row-str", "parents[1]", [[-1, 0], "-10"]),
    parents_case("row-int", "parents[0]", [5, [-1]]),
    parents_case("parent-float", "parents[0][1]", [[-1, 0.0]]),
    parents_case("device-bad-string", "device", [[-1, 0]], device="gpu0"),
    parents_case("device-unreachable", "device", [[-1, 0]], device=UNREACHABLE),
]


def engine_tensors() -> dict[str, Any]:
    m = base_meta()
    return {
        "query_start_loc": m.query_start_loc.clone(),
        "seq_lens": m.seq_lens.clone(),
        "page_table": m.page_table.clone(),
        "slot_mapping": m.slot_mapping.clone(),
        "query_start_loc_cpu": m.query_start_loc_cpu.clone(),
        "seq_lens_cpu": m.seq_lens_cpu.clone(),
    }


def tensors_case(name: str, field: str, **changes: Any) -> Case:
    args = {**engine_tensors(), **changes}
    return Case(f"from_tensors/{name}", lambda: AttentionMetadata.from_tensors(**args), IME, field)


FROM_TENSORS_CASES = [
    tensors_case("qsl-float", "query_start_loc", query_start_loc=torch.zeros(5)),
    tensors_case("qsl-list", "query_start_loc", query_start_loc=[0, 1, 4, 4, 6]),
    tensors_case("seq-lens-bool", "seq_lens", seq_lens=torch.ones(4, dtype=torch.bool)),
    tensors_case("seq-lens-none", "seq_lens", seq_lens=None),
    tensors_case(
        "table-complex", "page_table", page_table=torch.zeros(4, 3, dtype=torch.complex64)
    ),
    tensors_case("table-float", "page_table", page_table=torch.zeros(4, 3, dtype=torch.float16)),
    tensors_case("slots-bool", "slot_mapping", slot_mapping=torch.ones(6, dtype=torch.bool)),
    tensors_case("slots-list", "slot_mapping", slot_mapping=[9, 16, 17, 18, 35, 12]),
    tensors_case("qsl-cpu-empty", "query_start_loc_cpu", query_start_loc_cpu=i32([])),
    tensors_case(
        "qsl-cpu-on-device",
        "query_start_loc_cpu.device",
        query_start_loc_cpu=i32([0, 1, 4, 4, 6]).to("meta"),
    ),
    tensors_case("qsl-cpu-float", "query_start_loc_cpu", query_start_loc_cpu=torch.zeros(5)),
    tensors_case("qsl-cpu-2d", "query_start_loc_cpu", query_start_loc_cpu=i32([[0, 1, 4, 4, 6]])),
    tensors_case(
        "seq-cpu-past-int32", "seq_lens_cpu[3]", seq_lens_cpu=torch.tensor([6, 3, 4, 2**33])
    ),
    tensors_case("seq-cpu-floats", "seq_lens_cpu", seq_lens_cpu=[6.0, 3.0, 4.0, 9.0]),
    tensors_case("page-size-zero", "page_size", page_size=0),
    tensors_case("page-size-bool", "page_size", page_size=True),
    tensors_case("page-size-str", "page_size", page_size="4"),
    tensors_case("max-query-len-str", "max_query_len", max_query_len="3"),
    tensors_case("max-query-len-negative", "max_query_len", max_query_len=-1),
    tensors_case("max-seq-len-float", "max_seq_len", max_seq_len=9.0),
    tensors_case("max-seq-len-bool", "max_seq_len", max_seq_len=True),
]


# --- hand-built metadata through plan (host checks) -------------------------------------------------


def plan_case(
    name: str,
    field: str,
    make: Callable[[AttentionMetadata], Any],
    error: type[A.AttnSDKError] = IME,
    backend: Any = REF,
) -> Case:
    meta = make(base_meta())
    return Case(f"plan/{name}", lambda: backend.plan(meta), error, field)


def on_meta(t: torch.Tensor) -> torch.Tensor:
    return t.to("meta")


PLAN_CASES = [
    plan_case("none", "meta", lambda m: None, IIE),
    plan_case("dict", "meta", lambda m: {"seq_lens": m.seq_lens}, IIE),
    plan_case("a-plan", "meta", lambda m: Plan(m), IIE),
    plan_case("seq-cpu-list", "seq_lens_cpu", lambda m: replace(m, seq_lens_cpu=SEQ_LENS)),
    plan_case(
        "seq-cpu-int64", "seq_lens_cpu", lambda m: replace(m, seq_lens_cpu=m.seq_lens_cpu.long())
    ),
    plan_case(
        "seq-cpu-on-device",
        "seq_lens_cpu.device",
        lambda m: replace(m, seq_lens_cpu=on_meta(m.seq_lens_cpu)),
    ),
    plan_case("seq-none", "seq_lens", lambda m: replace(m, seq_lens=None)),
    plan_case("seq-b-plus-one", "seq_lens", lambda m: replace(m, seq_lens=i32([6, 3, 4, 9, 1]))),
    plan_case("seq-float", "seq_lens", lambda m: replace(m, seq_lens=m.seq_lens.float())),
    plan_case(
        "qsl-b-entries", "query_start_loc", lambda m: replace(m, query_start_loc=i32([0, 1, 4, 4]))
    ),
    plan_case(
        "qsl-int64",
        "query_start_loc",
        lambda m: replace(m, query_start_loc=m.query_start_loc.long()),
    ),
    plan_case(
        "qsl-other-device",
        "query_start_loc.device",
        lambda m: replace(m, query_start_loc=on_meta(m.query_start_loc)),
    ),
    plan_case("table-3d", "page_table", lambda m: replace(m, page_table=m.page_table[None])),
    plan_case(
        "table-b-plus-one-rows",
        "page_table",
        lambda m: replace(m, page_table=i32([*TABLE, [0, 0, 0]])),
    ),
    plan_case("table-int16", "page_table", lambda m: replace(m, page_table=m.page_table.short())),
    plan_case(
        "table-other-device",
        "page_table.device",
        lambda m: replace(m, page_table=on_meta(m.page_table)),
    ),
    plan_case(
        "slots-int32", "slot_mapping", lambda m: replace(m, slot_mapping=m.slot_mapping.int())
    ),
    plan_case("slots-0d", "slot_mapping", lambda m: replace(m, slot_mapping=torch.tensor(9))),
    plan_case(
        "slots-list", "slot_mapping", lambda m: replace(m, slot_mapping=m.slot_mapping.tolist())
    ),
    plan_case(
        "slots-other-device",
        "slot_mapping.device",
        lambda m: replace(m, slot_mapping=on_meta(m.slot_mapping)),
    ),
    plan_case(
        "qsl-cpu-none", "query_start_loc_cpu", lambda m: replace(m, query_start_loc_cpu=None)
    ),
    plan_case(
        "qsl-cpu-b-entries",
        "query_start_loc_cpu",
        lambda m: replace(m, query_start_loc_cpu=i32([0, 1, 4, 4])),
    ),
    plan_case(
        "qsl-cpu-int16",
        "query_start_loc_cpu",
        lambda m: replace(m, query_start_loc_cpu=m.query_start_loc_cpu.short()),
    ),
    plan_case("num-tokens-negative", "num_tokens", lambda m: replace(m, num_tokens=-1)),
    plan_case("num-tokens-str", "num_tokens", lambda m: replace(m, num_tokens="6")),
    plan_case("num-tokens-bool", "num_tokens", lambda m: replace(m, num_tokens=True)),
    plan_case("num-tokens-float", "num_tokens", lambda m: replace(m, num_tokens=6.0)),
    plan_case("max-query-len-none", "max_query_len", lambda m: replace(m, max_query_len=None)),
    plan_case("max-query-len-negative", "max_query_len", lambda m: replace(m, max_query_len=-3)),
    plan_case("max-seq-len-float", "max_seq_len", lambda m: replace(m, max_seq_len=9.5)),
    plan_case("max-seq-len-bool", "max_seq_len", lambda m: replace(m, max_seq_len=True)),
    plan_case("page-size-zero", "page_size", lambda m: replace(m, page_size=0)),
    plan_case("page-size-bool", "page_size", lambda m: replace(m, page_size=True)),
    plan_case("page-size-str", "page_size", lambda m: replace(m, page_size="4")),
    plan_case("qsl-starts-at-2", "query_start_loc[0]", lambda m: lengths(m, qsl=[2, 3, 6, 6, 8])),
    plan_case("qsl-decreasing", "query_start_loc[3]", lambda m: lengths(m, qsl=[0, 1, 4, 3, 6])),
    plan_case("num-tokens-below-owned", "num_tokens", lambda m: replace(m, num_tokens=5)),
    plan_case(
        "slots-fewer-than-tokens",
        "slot_mapping",
        lambda m: replace(m, slot_mapping=m.slot_mapping[:5]),
    ),
    plan_case("seq-below-query", "seq_lens[3]", lambda m: lengths(m, seq=[6, 3, 4, 1])),
    plan_case("seq-negative-idle-row", "seq_lens[2]", lambda m: lengths(m, seq=[6, 3, -1, 9])),
    plan_case("max-query-len-too-small", "max_query_len", lambda m: replace(m, max_query_len=2)),
    plan_case("max-seq-len-too-small", "max_seq_len", lambda m: replace(m, max_seq_len=5)),
    plan_case(
        "table-too-narrow", "page_table", lambda m: replace(m, page_table=m.page_table[:, :2])
    ),
    # Debug mode's plan runs the full validation (device values too) when the page size is known.
    plan_case("debug-none", "meta", lambda m: None, IIE, DEBUG),
    plan_case(
        "debug-negative-page",
        "page_table[3, 2]",
        lambda m: entry(m, "page_table", (3, 2), -1),
        IME,
        DEBUG,
    ),
    plan_case(
        "debug-slot-off-its-page",
        "slot_mapping[5]",
        lambda m: entry(m, "slot_mapping", (5,), 13),
        IME,
        DEBUG,
    ),
    plan_case(
        "debug-seq-twin", "seq_lens_cpu[0]", lambda m: entry(m, "seq_lens", (0,), 5), IME, DEBUG
    ),
    plan_case(
        "debug-qsl-twin",
        "query_start_loc_cpu[2]",
        lambda m: entry(m, "query_start_loc", (2,), 3),
        IME,
        DEBUG,
    ),
]


# --- forward: arguments, device values, the debug wrapper --------------------------------------------


def make(*, quantized: bool = False, sinks: bool = False) -> Batch:
    layer = LayerSpec(HQ, HKV, D, v_head_dim=DV, has_sinks=sinks)
    layout = KVCacheLayout(
        HKV, D, P, dtype=torch.float32, v_head_dim=DV, kv_dtype=E4M3 if quantized else None
    )
    return make_batch(SPEC, layer, layout, seed=1, per_head_scales=quantized)


def forward_kwargs(batch: Batch, meta: AttentionMetadata | None = None) -> dict[str, Any]:
    return {
        "q": batch.q,
        "k": batch.k,
        "v": batch.v,
        "cache": batch.fresh_cache(),
        "plan": REF.plan(batch.metadata if meta is None else meta),
        "layer": batch.layer,
        "sinks": batch.sinks,
        "k_scale": batch.k_scale,
        "v_scale": batch.v_scale,
        "out": None,
        "lse": None,
    }


Changes = Callable[["Batch"], dict[str, Any]]


def forward_case(
    name: str,
    field: str,
    changes: Changes = lambda b: {},
    *,
    via: str = "reference",
    error: type[A.AttnSDKError] = IIE,
    quantized: bool = False,
    sinks: bool = False,
    meta: Callable[[AttentionMetadata], AttentionMetadata] | None = None,
) -> Case:
    batch = make(quantized=quantized, sinks=sinks)
    kwargs = forward_kwargs(batch, None if meta is None else meta(batch.metadata))
    cache = kwargs["cache"]
    kwargs.update(changes(batch))
    watch: tuple[torch.Tensor, ...] = (cache.k, cache.v)
    for buffer in (kwargs["out"], kwargs["lse"]):
        if isinstance(buffer, torch.Tensor) and buffer.device.type != "meta":
            watch += (buffer.fill_(7.0),)
    backend = DEBUG if via == "debug" else REF
    return Case(f"{via}/{name}", lambda: backend.forward(**kwargs), error, field, watch)


def dev(t: torch.Tensor) -> torch.Tensor:
    return t.to("meta")


# Argument cases, refused alike by the reference backend and by the debug wrapper.
ARGUMENTS: list[tuple[str, str, Changes, dict[str, bool]]] = [
    ("plan-is-metadata", "plan", lambda b: {"plan": b.metadata}, {}),
    ("plan-none", "plan", lambda b: {"plan": None}, {}),
    ("plan-str", "plan", lambda b: {"plan": "plan"}, {}),
    ("plan-without-metadata", "plan.metadata", lambda b: {"plan": Plan(None)}, {}),  # type: ignore[arg-type]
    ("plan-metadata-dict", "plan.metadata", lambda b: {"plan": Plan({})}, {}),  # type: ignore[arg-type]
    ("cache-none", "cache", lambda b: {"cache": None}, {}),
    ("cache-is-a-tensor", "cache", lambda b: {"cache": b.cache.k}, {}),
    ("cache-is-a-layout", "cache", lambda b: {"cache": b.cache.layout}, {}),
    ("layer-none", "layer", lambda b: {"layer": None}, {}),
    ("layer-dict", "layer", lambda b: {"layer": {"num_heads": HQ}}, {}),
    ("q-none", "q", lambda b: {"q": None}, {}),
    ("q-int32", "q.dtype", lambda b: {"q": b.q.int()}, {}),
    ("q-4d", "q.shape", lambda b: {"q": b.q[None]}, {}),
    ("q-other-device", "q.device", lambda b: {"q": dev(b.q)}, {}),
    ("k-other-device", "k.device", lambda b: {"k": dev(b.k)}, {}),
    ("v-other-device", "v.device", lambda b: {"v": dev(b.v)}, {}),
    ("k-list", "k", lambda b: {"k": b.k.tolist()}, {}),
    ("v-str", "v", lambda b: {"v": "v"}, {}),
    (
        "out-other-device",
        "out.device",
        lambda b: {"out": torch.empty(T, HQ, DV, device="meta")},
        {},
    ),
    ("out-list", "out", lambda b: {"out": [0.0]}, {}),
    ("out-int32", "out.dtype", lambda b: {"out": torch.zeros(T, HQ, DV, dtype=torch.int32)}, {}),
    ("lse-list", "lse", lambda b: {"lse": [0.0] * HQ}, {}),
    ("lse-bf16", "lse.dtype", lambda b: {"lse": torch.zeros(T, HQ, dtype=torch.bfloat16)}, {}),
    ("lse-other-device", "lse.device", lambda b: {"lse": torch.empty(T, HQ, device="meta")}, {}),
    ("lse-3d", "lse.shape", lambda b: {"lse": torch.zeros(T, HQ, 1)}, {}),
    ("lse-head-major", "lse.shape", lambda b: {"lse": torch.zeros(HQ, T)}, {}),
    ("lse-transposed-view", "lse.stride()", lambda b: {"lse": torch.zeros(HQ, T).t()}, {}),
    ("sinks-list", "sinks", lambda b: {"sinks": [0.0] * HQ}, {"sinks": True}),
    ("sinks-other-device", "sinks.device", lambda b: {"sinks": dev(b.sinks)}, {"sinks": True}),
    ("k-scale-float", "k_scale", lambda b: {"k_scale": 0.5}, {"quantized": True}),
    ("v-scale-list", "v_scale", lambda b: {"v_scale": [1.0, 1.0]}, {"quantized": True}),
    (
        "k-scale-other-device",
        "k_scale.device",
        lambda b: {"k_scale": dev(b.k_scale)},
        {"quantized": True},
    ),
    (
        "v-scale-other-device",
        "v_scale.device",
        lambda b: {"v_scale": dev(b.v_scale)},
        {"quantized": True},
    ),
    (
        "k-scale-int32",
        "k_scale.dtype",
        lambda b: {"k_scale": torch.ones(HKV, dtype=torch.int32)},
        {"quantized": True},
    ),
]

# tests/core/test_bad_inputs.py runs these on the reference backend; here through debug mode.
DEBUG_ONLY_ARGUMENTS: list[tuple[str, str, Changes, dict[str, bool]]] = [
    ("k-without-v", "k/v", lambda b: {"v": None}, {}),
    ("sinks-missing", "sinks", lambda b: {"sinks": None}, {"sinks": True}),
    ("v-scale-on-fp32-cache", "v_scale", lambda b: {"v_scale": torch.ones(())}, {}),
    ("out-fewer-rows", "out.shape", lambda b: {"out": torch.empty(T - 1, HQ, DV)}, {}),
    ("lse-fewer-rows", "lse.shape", lambda b: {"lse": torch.empty(T - 1, HQ)}, {}),
]

# Finite, positive values: only debug mode reads the tensors' values.
DEBUG_VALUES: list[tuple[str, str, Changes, dict[str, bool]]] = [
    ("q-nan", "q", lambda b: {"q": poisoned(b.q, 0, NAN)}, {}),
    ("q-inf-in-last-real-row", "q", lambda b: {"q": poisoned(b.q, T - 1, INF)}, {}),
    ("k-nan", "k", lambda b: {"k": poisoned(b.k, 4, NAN)}, {}),
    ("v-minus-inf", "v", lambda b: {"v": poisoned(b.v, 2, -INF)}, {}),
    ("sinks-nan", "sinks", lambda b: {"sinks": poisoned(b.sinks, 1, NAN)}, {"sinks": True}),
    # -inf is a valid sink (it adds exp(-inf) = 0); +inf is not.
    ("sinks-plus-inf", "sinks", lambda b: {"sinks": poisoned(b.sinks, 2, INF)}, {"sinks": True}),
    (
        "k-scale-zero",
        "k_scale",
        lambda b: {"k_scale": torch.zeros_like(b.k_scale)},
        {"quantized": True},
    ),
    ("k-scale-negative", "k_scale", lambda b: {"k_scale": -b.k_scale}, {"quantized": True}),
    (
        "k-scale-one-head-zero",
        "k_scale",
        lambda b: {"k_scale": poisoned(b.k_scale, 1, 0.0)},
        {"quantized": True},
    ),
    (
        "v-scale-nan",
        "v_scale",
        lambda b: {"v_scale": poisoned(b.v_scale, 0, NAN)},
        {"quantized": True},
    ),
    (
        "v-scale-inf",
        "v_scale",
        lambda b: {"v_scale": torch.full_like(b.v_scale, INF)},
        {"quantized": True},
    ),
]


def slot_past_cache(m: AttentionMetadata) -> AttentionMetadata:
    return entry(m, "slot_mapping", (3,), NUM_PAGES * P + 1)


def narrow_table(m: AttentionMetadata) -> AttentionMetadata:
    # Without a recorded page size plan cannot know the table is too narrow; forward can.
    return replace(m, page_size=None, page_table=m.page_table[:, :2].contiguous())


def page_size_8(m: AttentionMetadata) -> AttentionMetadata:
    table = torch.tensor([[1, 2], [3, 0], [4, 5]], dtype=torch.int32)
    return AttentionMetadata.from_seqlens(SPEC.query_lens, SPEC.seq_lens, table, page_size=8)


# Device values (pages, slots): the reference backend checks them before writing anything.
DEVICE_VALUES: list[tuple[str, str, Callable[[AttentionMetadata], AttentionMetadata], type]] = [
    ("slot-past-cache", "slot_mapping[3]", slot_past_cache, IME),
    ("slot-huge", "slot_mapping[0]", lambda m: entry(m, "slot_mapping", (0,), 2**40), IME),
    ("page-negative", "page_table[1, 1]", lambda m: entry(m, "page_table", (1, 1), -3), IME),
    (
        "page-equals-num-pages",
        "page_table[2, 2]",
        lambda m: entry(m, "page_table", (2, 2), NUM_PAGES),
        IME,
    ),
    ("page-int32-max", "page_table[0, 0]", lambda m: entry(m, "page_table", (0, 0), I32_MAX), IME),
    ("table-too-narrow", "page_table", narrow_table, IME),
    ("page-size-mismatch", "plan.metadata.page_size", page_size_8, IIE),
]


def duplicate_slot(m: AttentionMetadata) -> AttentionMetadata:
    """Sequence 1's first page is sequence 0's last: both write offset 2 of that page."""
    table = m.page_table.clone()
    table[1, 0] = table[0, 1]
    return AttentionMetadata.from_seqlens(SPEC.query_lens, SPEC.seq_lens, table, page_size=P)


def padding_row_writes(m: AttentionMetadata) -> AttentionMetadata:
    """Token row 8 now belongs to no sequence (graph padding), but its slot is still >= 0."""
    return replace(lengths(m, qsl=[0, 1, 6, 8], seq=[7, 5, 9]), max_seq_len=9)


# What only debug mode's full validation sees (the reference backend would write them).
DEBUG_METADATA: list[tuple[str, str, Callable[[AttentionMetadata], AttentionMetadata]]] = [
    (
        "slot-off-its-page",
        "slot_mapping[1]",
        lambda m: entry(m, "slot_mapping", (1,), int(m.slot_mapping[2])),
    ),
    ("slot-duplicate", "slot_mapping", duplicate_slot),
    ("padding-row-writes", "slot_mapping[8]", padding_row_writes),
    ("reserved-page-in-use", "page_table[2, 0]", lambda m: entry(m, "page_table", (2, 0), 0)),
    ("seq-twin-mismatch", "seq_lens_cpu[2]", lambda m: entry(m, "seq_lens", (2,), 11)),
    ("qsl-twin-mismatch", "query_start_loc_cpu[3]", lambda m: entry(m, "query_start_loc", (3,), 8)),
]

FORWARD_CASES = [
    *(
        forward_case(name, field, changes, via=via, **variant)
        for via in ("reference", "debug")
        for name, field, changes, variant in ARGUMENTS
    ),
    *(
        forward_case(name, field, changes, via="debug", **variant)
        for name, field, changes, variant in DEBUG_ONLY_ARGUMENTS + DEBUG_VALUES
    ),
    *(
        forward_case(name, field, meta=change, via=via, error=error)
        for via in ("reference", "debug")
        for name, field, change, error in DEVICE_VALUES
    ),
    *(
        forward_case(name, field, meta=change, via="debug", error=IME)
        for name, field, change in DEBUG_METADATA
    ),
]


# --- config: AttentionConfig, from_file, from_env ---------------------------------------------------


def config_case(
    name: str,
    field: str,
    data: Any,
    error: type[A.AttnSDKError] = IIE,
    match: str | None = None,
) -> Case:
    def call() -> object:
        if isinstance(data, dict):
            return AttentionConfig(**data)
        return AttentionConfig.model_validate(data)

    return Case(f"config/{name}", call, error, field, match=match)


def unknown(name: str) -> str:
    return rf"unknown attention backend '{name}'"


CONFIG_CASES = [
    config_case("backend-int", "backend", {"backend": 123}),
    config_case("backend-none", "backend", {"backend": None}),
    config_case("backend-float", "backend", {"backend": 1.5}),
    config_case("backend-list", "backend", {"backend": ["reference"]}),
    config_case("backend-bytes", "backend", {"backend": b"reference"}),
    config_case("backend-misspelled", "backend", {"backend": "refrence"}, UCE, unknown("refrence")),
    config_case("backend-empty", "backend", {"backend": ""}, UCE, unknown("")),
    config_case(  # names ignore case ("Reference" is valid), suggestions too
        "backend-capitalised-misspelled",
        "backend",
        {"backend": "Refrence"},
        UCE,
        "Did you mean 'reference'",
    ),
    config_case("backend-padded", "backend", {"backend": " reference"}, UCE, unknown(" reference")),
    config_case("backend-not-yet", "backend", {"backend": "fa4"}, UCE, unknown("fa4")),
    config_case("debug-str", "debug", {"backend": "reference", "debug": "yes"}),
    config_case("debug-int", "debug", {"backend": "reference", "debug": 1}),
    config_case("debug-none", "debug", {"debug": None}),
    config_case("debug-str-true", "debug", {"debug": "true"}),
    config_case("options-list", "options", {"backend": "reference", "options": [1]}),
    config_case("options-str", "options", {"backend": "reference", "options": "max_scores=4"}),
    config_case(
        "options-auto-model-for-reference",
        "options",
        {"backend": "reference", "options": A.AutoOptions()},
    ),
    config_case(
        "options-reference-model-for-fa3",
        "options",
        {"backend": "fa3", "options": ReferenceOptions()},
    ),
    config_case(
        "reference-max-scores-zero", "options.max_scores", {"backend": "reference", "max_scores": 0}
    ),
    config_case(
        "reference-max-scores-negative",
        "options.max_scores",
        {"backend": "reference", "max_scores": -1},
    ),
    config_case(
        "reference-max-scores-fraction",
        "options.max_scores",
        {"backend": "reference", "max_scores": 1.5},
    ),
    config_case(
        "reference-max-scores-word",
        "options.max_scores",
        {"backend": "reference", "max_scores": "many"},
    ),
    config_case(
        "reference-max-scores-none",
        "options.max_scores",
        {"backend": "reference", "max_scores": None},
    ),
    config_case("reference-unknown-option", "options.chunk", {"backend": "reference", "chunk": 8}),
    config_case(
        "reference-nested-bad-value",
        "options.max_scores",
        {"backend": "reference", "options": {"max_scores": 0}},
    ),
    config_case("fa3-provider-unknown", "options.provider", {"backend": "fa3", "provider": "cuda"}),
    config_case("fa3-provider-none", "options.provider", {"backend": "fa3", "provider": None}),
    config_case(
        "fa3-num-splits-negative", "options.num_splits", {"backend": "fa3", "num_splits": -1}
    ),
    config_case(
        "fa3-num-splits-too-many", "options.num_splits", {"backend": "fa3", "num_splits": 257}
    ),
    config_case(
        "fa3-num-splits-fraction", "options.num_splits", {"backend": "fa3", "num_splits": 2.5}
    ),
    config_case(
        "fa3-num-splits-word", "options.num_splits", {"backend": "fa3", "num_splits": "auto"}
    ),
    config_case("fa3-pack-gqa-word", "options.pack_gqa", {"backend": "fa3", "pack_gqa": "maybe"}),
    config_case("fa3-pack-gqa-two", "options.pack_gqa", {"backend": "fa3", "pack_gqa": 2}),
    config_case(
        "fa3-precompute-two",
        "options.precompute_scheduler",
        {"backend": "fa3", "precompute_scheduler": 2},
    ),
    config_case(
        "fa3-precompute-word",
        "options.precompute_scheduler",
        {"backend": "fa3", "precompute_scheduler": "sometimes"},
    ),
    config_case(
        "fa3-misspelled-option",
        "options.num_split",
        {"backend": "fa3", "num_split": 2},
        match="Did you mean 'num_splits'",
    ),
    config_case(
        "fa3-unknown-option", "options.window_size", {"backend": "fa3", "window_size": 128}
    ),
    config_case("auto-candidates-str", "options.candidates", {"candidates": "reference"}),
    config_case("auto-candidates-ints", "options.candidates.0", {"candidates": [1, 2]}),
    config_case("auto-candidates-dict", "options.candidates", {"candidates": {"reference": 1}}),
    config_case(
        "auto-candidates-empty",
        "options.candidates",
        {"candidates": []},
        match="omit candidates",
    ),
    config_case("auto-unknown-option", "options.prefer", {"backend": "auto", "prefer": "fa3"}),
    config_case("model-validate-str", "config", "reference"),
    config_case("model-validate-none", "config", None),
    config_case("model-validate-list", "config", ["reference"]),
    config_case("model-validate-int", "config", 42),
]


def from_file(name: str, content: str | bytes) -> Callable[[], object]:
    def call() -> object:
        with tempfile.TemporaryDirectory() as d:
            path = Path(d) / name
            if isinstance(content, bytes):
                path.write_bytes(content)
            else:
                path.write_text(content)
            return AttentionConfig.from_file(path)

    return call


def file_case(
    name: str,
    filename: str,
    content: str | bytes,
    error: type[A.AttnSDKError] = UCE,
    field: str | None = None,
    match: str | None = None,
) -> Case:
    """A bad config file; the error names the file (and, for a bad entry, the field)."""
    return Case(
        f"from_file/{name}",
        from_file(filename, content),
        error,
        field or filename,
        match=match or rf"{filename}\b",
    )


def missing_file() -> object:
    with tempfile.TemporaryDirectory() as d:
        return AttentionConfig.from_file(Path(d) / "nope.json")


def directory_as_file() -> object:
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "attn.json").mkdir()
        return AttentionConfig.from_file(Path(d) / "attn.json")


FROM_FILE_CASES = [
    Case("from_file/missing", missing_file, UCE, "nope.json", match="does not exist"),
    Case("from_file/a-directory", directory_as_file, UCE, "attn.json", match="does not exist"),
    file_case(
        "suffix-txt", "attn.txt", '{"backend": "reference"}', match=r"\.json, \.toml, \.yaml"
    ),
    file_case("suffix-cfg", "attn.cfg", "backend = reference", match=r"\.json, \.toml, \.yaml"),
    file_case(
        "no-suffix", "attnconfig", '{"backend": "reference"}', match=r"\.json, \.toml, \.yaml"
    ),
    file_case("suffix-bak", "attn.json.bak", '{"backend": "reference"}', match=r"\.json, \.toml"),
    file_case("json-unclosed", "attn.json", "{", match="cannot be parsed"),
    file_case("json-empty", "attn.json", "", match="cannot be parsed"),
    file_case(
        "json-trailing-comma", "attn.json", '{"backend": "reference",}', match="cannot be parsed"
    ),
    file_case("json-not-utf8", "attn.json", b'{"backend": "\xff\xfe"}', match="cannot be parsed"),
    file_case("toml-no-value", "attn.toml", "backend = ", match="cannot be parsed"),
    file_case(
        "toml-duplicate-key",
        "attn.toml",
        'backend = "a"\nbackend = "b"\n',
        match="cannot be parsed",
    ),
    file_case("yaml-unclosed", "attn.yaml", "backend: [reference", match="cannot be parsed"),
    file_case(
        "yml-tab-indent", "attn.yml", "options:\n\tmax_scores: 1\n", match="cannot be parsed"
    ),
    file_case("json-str", "attn.json", '"reference"', match="expected a mapping, found str"),
    file_case("json-null", "attn.json", "null", match="expected a mapping, found NoneType"),
    file_case("json-number", "attn.json", "5", match="expected a mapping, found int"),
    file_case("toml-section-is-str", "attn.toml", 'attnsdk = "reference"\n', match="found str"),
    file_case("yaml-list", "attn.yaml", "- reference\n", match="expected a mapping, found list"),
    file_case(
        "misspelled-option",
        "attn.json",
        '{"backend": "reference", "max_scroes": 1}',
        IIE,
        "options.max_scroes",
    ),
    file_case("backend-int", "attn.json", '{"backend": 5}', IIE, "backend"),
    file_case("debug-str", "attn.json", '{"debug": "yes"}', IIE, "debug"),
    file_case(
        "fa3-bad-splits",
        "attn.json",
        '{"backend": "fa3", "num_splits": -1}',
        IIE,
        "options.num_splits",
    ),
    file_case(
        "toml-section-misspelled",
        "attn.toml",
        '[attnsdk]\nbackend = "reference"\nmax_score = 1\n',
        IIE,
        "options.max_score",
    ),
    file_case(
        "yaml-nested-bad-value",
        "attn.yaml",
        "backend: reference\noptions: {max_scores: 0}\n",
        IIE,
        "options.max_scores",
    ),
    file_case(
        "flat-and-nested",
        "attn.json",
        '{"backend": "reference", "options": {"max_scores": 1}, "max_scores": 2}',
        IIE,
        "options",
    ),
    file_case("unknown-backend", "attn.toml", 'backend = "refrence"\n', UCE, "backend"),
]

ENV_KEYS = ("ATTNSDK_BACKEND", "ATTNSDK_CONFIG", "ATTNSDK_DEBUG")


@contextlib.contextmanager
def environ(**values: str) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in ENV_KEYS}
    try:
        for k in ENV_KEYS:
            os.environ.pop(k, None)
        os.environ.update(values)
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def env_case(
    name: str,
    field: str,
    call: Callable[[], object],
    error: type[A.AttnSDKError] = UCE,
    match: str | None = None,
    file: tuple[str, str] | None = None,
    **env: str,
) -> Case:
    def run() -> object:
        with tempfile.TemporaryDirectory() as d, contextlib.ExitStack() as stack:
            values = dict(env)
            if file is not None:
                path = Path(d) / file[0]
                path.write_text(file[1])
                values["ATTNSDK_CONFIG"] = str(path)
            stack.enter_context(environ(**values))
            return call()

    return Case(f"env/{name}", run, error, field, match=match)


REF_FILE = ("attn.json", '{"backend": "reference"}')
FROM_ENV_CASES = [
    env_case(
        "auto-contradicts-file",
        "ATTNSDK_BACKEND",
        AttentionConfig.from_env,
        match="'auto' contradicts backend 'reference'",
        file=REF_FILE,
        ATTNSDK_BACKEND="auto",
    ),
    env_case(
        "name-contradicts-auto-file",
        "ATTNSDK_BACKEND",
        AttentionConfig.from_env,
        match="'reference' contradicts backend 'auto'",
        file=("attn.json", "{}"),
        ATTNSDK_BACKEND="reference",
    ),
    env_case("unknown-backend", "backend", AttentionConfig.from_env, ATTNSDK_BACKEND="refernce"),
    env_case(
        "config-bad-suffix",
        "attn.txt",
        AttentionConfig.from_env,
        match=r"\.json, \.toml",
        file=("attn.txt", "{}"),
    ),
    env_case(
        "config-is-a-directory",
        "ATTNSDK_CONFIG",
        AttentionConfig.from_env,
        match="does not exist",
        ATTNSDK_CONFIG=tempfile.gettempdir(),
    ),
    env_case(
        "debug-word",
        "ATTNSDK_DEBUG",
        lambda: A.create_backend("reference"),
        IIE,
        ATTNSDK_DEBUG="maybe",
    ),
    env_case("debug-two", "ATTNSDK_DEBUG", lambda: A.create_backend(None), IIE, ATTNSDK_DEBUG="2"),
    env_case(
        "create-none-unknown", "backend", lambda: A.create_backend(None), ATTNSDK_BACKEND="fa"
    ),
]


# --- registry: register_backend, create_backend, explain --------------------------------------------


def reg_case(case_id: str, field: str, error: type[A.AttnSDKError] = IIE, **kwargs: Any) -> Case:
    args: dict[str, Any] = {
        "name": f"matrix-{case_id}",
        "factory": ReferenceBackend,
        "priority": -1,
    }
    args.update(kwargs)

    def call() -> object:
        handle = A.register_backend(**args)
        handle.remove()  # only reached if the registration was wrongly accepted
        return handle

    return Case(f"register/{case_id}", call, error, field)


class _Opts(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


REGISTER_CASES = [
    reg_case("name-bytes", "name", UCE, name=b"x"),
    reg_case("name-list", "name", UCE, name=["x"]),
    reg_case("name-float", "name", UCE, name=1.5),
    reg_case("factory-int", "factory", factory=42),
    reg_case("factory-none", "factory", factory=None),
    reg_case("factory-object", "factory", factory=object()),
    reg_case("factory-path-without-colon", "factory", factory="attnsdk.backends.reference"),
    reg_case("factory-path-without-attr", "factory", factory="attnsdk.backends.reference:"),
    reg_case("factory-path-without-module", "factory", factory=":ReferenceBackend"),
    reg_case("priority-str", "priority", priority="high"),
    reg_case("priority-float", "priority", priority=1.5),
    reg_case("priority-bool", "priority", priority=True),
    reg_case("auto-str", "auto", auto="no"),
    reg_case("options-dict", "options", options={"tile": int}),
    reg_case("options-path-without-colon", "options", options="attnsdk.backends.reference"),
    reg_case("options-not-a-model", "options", options=int),
    reg_case("options-an-instance", "options", options=ReferenceOptions()),
    reg_case("options-int", "options", options=3),
    reg_case("replace-str", "replace", replace="yes"),
    reg_case("replace-int", "replace", replace=1),
    reg_case("replace-none", "replace", replace=None),
]


def with_backend(
    name: str,
    factory: Any,
    call: Callable[[str], object],
    options: Any = None,
) -> Callable[[], object]:
    """Register ``factory`` (priority < 0: "auto" never picks it) for one call, then remove it."""

    def run() -> object:
        handle = A.register_backend(f"matrix-{name}", factory, priority=-1, options=options)
        try:
            return call(f"matrix-{name}")
        finally:
            handle.remove()

    return run


def raising(exc: Exception) -> Callable[[Any], Any]:
    def factory(options: Any) -> Any:
        raise exc

    return factory


class _NoEnv:
    """A factory whose environment probe itself crashes."""

    def __init__(self, options: Any) -> None:
        self.options = options

    @classmethod
    def environment_reasons(cls, device: Any = None) -> list[Any]:
        raise RuntimeError("probe crashed")


class _NoDevice:
    @classmethod
    def environment_reasons(cls, device: Any = None) -> list[Any]:
        return [A.Reason(A.ReasonKind.ENVIRONMENT, "device", "needs a device this machine lacks")]

    def __init__(self, options: Any) -> None:
        raise AssertionError("never created")


class _BadOptionsAttr:
    Options = dict

    def __init__(self, options: Any) -> None:
        self.options = options


def create_case(
    name: str,
    field: str,
    factory: Any,
    error: type[A.AttnSDKError] = UCE,
    match: str | None = None,
    options: Any = None,
    debug: bool = False,
) -> Case:
    def call(registered: str) -> object:
        if debug:
            return A.create_backend(AttentionConfig(backend=registered, debug=True))
        return A.create_backend(registered)

    return Case(
        f"create/{name}", with_backend(name, factory, call, options), error, field, match=match
    )


CREATE_CASES = [
    Case("create/config-int", lambda: A.create_backend(123), IIE, "config"),  # type: ignore[arg-type]
    Case("create/config-list", lambda: A.create_backend(["reference"]), IIE, "config"),  # type: ignore[arg-type]
    Case("create/config-bytes", lambda: A.create_backend(b"reference"), IIE, "config"),  # type: ignore[arg-type]
    Case(
        "create/config-options-model", lambda: A.create_backend(ReferenceOptions()), IIE, "config"
    ),  # type: ignore[arg-type]
    Case("create/config-dict", lambda: A.create_backend({"backend": "reference"}), IIE, "config"),  # type: ignore[arg-type]
    Case("create/unknown-name", lambda: A.create_backend("nope"), UCE, "backend"),
    Case(
        "create/device-bad-string",
        lambda: A.create_backend("reference", device="gpu0"),
        IIE,
        "device",
    ),
    Case(
        "create/device-index-past-torch",
        lambda: A.create_backend("reference", device="cuda:1000"),
        IIE,
        "device",
    ),
    Case(
        "create/device-unreachable",
        lambda: A.create_backend("reference", device=UNREACHABLE),
        UCE,
        "device",
    ),
    create_case("factory-raises-runtime-error", "create", raising(RuntimeError("no kernel"))),
    create_case("factory-raises-key-error", "create", raising(KeyError("tile"))),
    create_case("factory-raises-in-debug-mode", "create", raising(ValueError("bad")), debug=True),
    create_case("factory-returns-none", "factory", lambda o: None, match="returned NoneType"),
    create_case("factory-returns-object", "factory", lambda o: object(), match="returned object"),
    create_case("factory-returns-str", "factory", lambda o: "reference", match="returned str"),
    create_case(
        "factory-raises-typed", "options.tile", raising(IIE("options.tile", "a power of 2", 3)), IIE
    ),
    create_case("factory-missing-module", "import", "attnsdk_no_such_module:Backend"),
    create_case("factory-missing-attr", "import", "attnsdk.backends.reference:NoSuchBackend"),
    create_case("environment-probe-crashes", "environment_reasons", _NoEnv),
    create_case("environment-refuses", "device", _NoDevice),
    create_case(
        "options-path-missing", "options", ReferenceBackend, options="attnsdk:NoSuchOptions"
    ),
    create_case(
        "options-path-not-a-model", "options", ReferenceBackend, options="attnsdk:LayerSpec"
    ),
    create_case("options-attr-not-a-model", "options", _BadOptionsAttr),
]

EXPLAIN_CASES = [
    Case("explain/unknown-name", lambda: A.explain("nope"), UCE, "backend"),
    Case("explain/config-int", lambda: A.explain(123), IIE, "config"),  # type: ignore[arg-type]
    Case("explain/config-none", lambda: A.explain(None), IIE, "config"),  # type: ignore[arg-type]
    Case("explain/layer-str", lambda: A.explain("reference", "x"), IIE, "layer"),  # type: ignore[arg-type]
    Case("explain/layer-is-a-layout", lambda: A.explain("reference", ALLOC_LAYOUT), IIE, "layer"),  # type: ignore[arg-type]
    Case(
        "explain/layout-is-a-layer",
        lambda: A.explain("auto", None, LayerSpec(4, 2, 16)),  # type: ignore[arg-type]
        IIE,
        "layout",
    ),
    Case("explain/device-bad-string", lambda: A.explain("reference", device="gpu0"), IIE, "device"),
    Case(
        "explain/unknown-in-config",
        lambda: A.explain(AttentionConfig(backend="nope")),
        UCE,
        "backend",
    ),
]


# --- graph buffers ----------------------------------------------------------------------------------


def buffers_case(name: str, field: str, **kwargs: Any) -> Case:
    args: dict[str, Any] = {
        "max_batch": 4,
        "max_tokens": 8,
        "max_pages": 3,
        "page_size": P,
        "device": "cpu",
        **kwargs,
    }
    return Case(f"graph/buffers-{name}", lambda: GraphBuffers(**args), IIE, field)


def fresh_buffers() -> GraphBuffers:
    return GraphBuffers(4, 8, 3, page_size=P, device="cpu")


def static(state: GraphBuffers) -> tuple[torch.Tensor, ...]:
    return (
        state.query_start_loc,
        state.seq_lens,
        state.page_table,
        state.slot_mapping,
        state.query_start_loc_cpu,
        state.seq_lens_cpu,
    )


def capture_case(name: str, field: str, *args: Any, **kwargs: Any) -> Case:
    state = fresh_buffers()
    return Case(
        f"graph/capture-{name}",
        lambda: state.capture_metadata(*args, **kwargs),
        IIE,
        field,
        static(state),
    )


def real(
    query_lens: list[int], seq_lens: list[int], page_size: int | None = P
) -> AttentionMetadata:
    width = max(1, *(-(-s // (page_size or P)) for s in seq_lens))
    table = [[1 + b * width + i for i in range(width)] for b in range(len(seq_lens))]
    return AttentionMetadata.from_seqlens(query_lens, seq_lens, table, page_size=page_size or P)


def understated(
    meta: AttentionMetadata, s: int | None = None, *, q: int | None = None
) -> AttentionMetadata:
    """``meta`` whose host ``max_seq_len`` (``s``) or ``max_query_len`` (``q``) is below its
    real lengths (``from_tensors`` takes them as given)."""
    changes = {"max_seq_len": s} if s is not None else {"max_query_len": q}
    return replace(meta, **changes)


def replay_case(
    name: str,
    field: str,
    meta: Any,
    *,
    error: type[A.AttnSDKError] = IME,
    via: str = "buffers",
    captured: Any = ...,
) -> Case:
    """A capture of 2 rows and 4 tokens (max query length 3), then a replay of ``meta``."""
    state = fresh_buffers()
    plan = REF.plan_for_capture(state, 2, 4)
    if via == "buffers":
        target = plan.metadata if captured is ... else captured
        call: Callable[[], object] = lambda: state.replay_update(target, meta)  # noqa: E731
    else:
        backend = DEBUG if via == "debug" else REF
        target = plan if captured is ... else captured
        call = lambda: backend.plan_for_replay(target, meta)  # noqa: E731
    return Case(f"graph/{via}-replay-{name}", call, error, field, static(state))


GRAPH_CASES = [
    buffers_case("max-batch-bool", "max_batch", max_batch=True),
    buffers_case("max-batch-str", "max_batch", max_batch="4"),
    buffers_case("max-batch-past-int32", "max_batch", max_batch=2**31),
    buffers_case("max-batch-none", "max_batch", max_batch=None),
    buffers_case("max-tokens-zero", "max_tokens", max_tokens=0),
    buffers_case("max-tokens-fraction", "max_tokens", max_tokens=2.5),
    buffers_case("max-pages-negative", "max_pages", max_pages=-1),
    buffers_case("max-pages-str", "max_pages", max_pages="3"),
    buffers_case("page-size-zero", "page_size", page_size=0),
    buffers_case("page-size-none", "page_size", page_size=None),
    buffers_case("page-size-fraction", "page_size", page_size=1.5),
    buffers_case("reserved-page-negative", "reserved_page", reserved_page=-1),
    buffers_case("reserved-page-float", "reserved_page", reserved_page=1.0),
    buffers_case("reserved-page-bool", "reserved_page", reserved_page=True),
    buffers_case("seq-len-fill-negative", "seq_len_fill", seq_len_fill=-1),
    buffers_case("seq-len-fill-past-capacity", "seq_len_fill", seq_len_fill=3 * P + 1),
    buffers_case("seq-len-fill-str", "seq_len_fill", seq_len_fill="1"),
    buffers_case("device-bad-string", "device", device="gpu0"),
    buffers_case("device-none", "device", device=None),
    buffers_case("device-unreachable", "device", device=UNREACHABLE),
    capture_case("batch-size-str", "batch_size", "2", 4),
    capture_case("batch-size-float", "batch_size", 2.0, 4),
    capture_case("batch-size-none", "batch_size", None, 4),
    capture_case("batch-size-negative", "batch_size", -1, 4),
    capture_case("num-tokens-float", "num_tokens", 2, 4.0),
    capture_case("num-tokens-str", "num_tokens", 2, "4"),
    capture_case("num-tokens-none", "num_tokens", 2, None),
    capture_case("max-query-len-bool", "max_query_len", 2, 4, max_query_len=True),
    capture_case("max-query-len-str", "max_query_len", 2, 4, max_query_len="3"),
    capture_case("max-query-len-zero", "max_query_len", 2, 4, max_query_len=0),
    capture_case("max-query-len-fraction", "max_query_len", 2, 4, max_query_len=2.5),
    replay_case("more-seqs", "seq_lens", real([1, 1, 1], [2, 3, 4])),
    replay_case("more-tokens", "num_tokens", real([2, 3], [5, 5])),
    replay_case("longer-query", "max_query_len", real([4], [6])),
    replay_case("page-size-mismatch", "page_size", real([1], [5], page_size=8)),
    replay_case("longer-seq-than-capacity", "max_seq_len", real([1], [3 * P + 1])),
    replay_case("captured-none", "captured", real([1], [5]), error=IIE, captured=None),
    replay_case("captured-dict", "captured", real([1], [5]), error=IIE, captured={}),
    replay_case("meta-none", "meta", None, error=IIE),
    replay_case("meta-is-a-plan", "meta", Plan(real([1], [5])), error=IIE),
    replay_case("plan-none", "plan", real([1], [5]), error=IIE, via="reference", captured=None),
    replay_case(
        "plan-is-metadata",
        "plan",
        real([1], [5]),
        error=IIE,
        via="reference",
        captured=real([1], [5]),
    ),
    replay_case(
        "plan-eager",
        "plan",
        real([1], [5]),
        error=IIE,
        via="debug",
        captured=REF.plan(real([1], [5])),
    ),
    replay_case("meta-none", "meta", None, error=IIE, via="reference"),
    replay_case(
        "qsl-starts-at-1",
        "query_start_loc[0]",
        lengths(real([1], [5]), qsl=[1, 2]),
        via="reference",
    ),
    replay_case("page-size-mismatch", "page_size", real([1], [5], page_size=8), via="reference"),
    replay_case(
        "table-too-narrow",
        "page_table",
        replace(real([1], [9]), page_size=None, page_table=i32([[1, 2]])),
        via="reference",
    ),
    # Host maxima that understate the host twins: the captured kernels are sized by them.
    replay_case("max-seq-len-understated", "max_seq_len", understated(real([1], [9]), 5)),
    replay_case(
        "max-seq-len-understated-past-capacity",
        "max_seq_len",
        understated(real([1], [3 * P + 1]), 5),
    ),
    replay_case("max-query-len-understated", "max_query_len", understated(real([4], [6]), q=3)),
    replay_case(
        "max-seq-len-understated",
        "max_seq_len",
        understated(real([1], [3 * P + 1]), 5),
        via="reference",
    ),
    replay_case(
        "max-query-len-understated",
        "max_query_len",
        understated(real([4], [6]), q=3),
        via="reference",
    ),
    replay_case("more-seqs", "seq_lens", real([1, 1, 1], [2, 3, 4]), via="debug"),
    replay_case("longer-seq-than-capacity", "max_seq_len", real([1], [3 * P + 1]), via="debug"),
]

# --- merge_states -------------------------------------------------------------------------------


def merge_case(name: str, field: str, **changes: Any) -> Case:
    """merge_states with one bad argument; the out / lse_out buffers it was given stay as they
    were (a refused merge writes nothing)."""
    args: dict[str, Any] = {
        "out_a": torch.randn(T, HQ, DV),
        "lse_a": torch.randn(T, HQ),
        "out_b": torch.randn(T, HQ, DV),
        "lse_b": torch.randn(T, HQ),
        "out": torch.full((T, HQ, DV), 7.0),
        "lse_out": torch.full((T, HQ), 7.0),
    }
    args.update(changes)
    watch = tuple(t for t in (args["out"], args["lse_out"]) if isinstance(t, torch.Tensor))
    return Case(f"merge_states/{name}", lambda: A.merge_states(**args), IIE, field, watch)


def lse_with(where: tuple[int, int], value: float) -> torch.Tensor:
    lse = torch.randn(T, HQ)
    lse[1, 0] = -INF  # a part that saw no key: valid
    lse[where] = value
    return lse


MERGE_CASES = [
    merge_case("out-a-list", "out_a", out_a=[0.0]),
    merge_case("out-a-2d", "out_a.shape", out_a=torch.randn(T, HQ)),
    merge_case("out-a-int32", "out_a.dtype", out_a=torch.zeros(T, HQ, DV, dtype=torch.int32)),
    merge_case("out-a-fp64", "out_a.dtype", out_a=torch.zeros(T, HQ, DV, dtype=torch.float64)),
    merge_case("out-b-fewer-rows", "out_b.shape", out_b=torch.randn(T - 1, HQ, DV)),
    merge_case("out-b-bf16", "out_b.dtype", out_b=torch.randn(T, HQ, DV).bfloat16()),
    merge_case("out-b-other-device", "out_b.device", out_b=torch.empty(T, HQ, DV, device="meta")),
    merge_case("lse-a-none", "lse_a", lse_a=None),
    merge_case("lse-a-head-major", "lse_a.shape", lse_a=torch.randn(HQ, T)),
    merge_case("lse-a-bf16", "lse_a.dtype", lse_a=torch.randn(T, HQ).bfloat16()),
    merge_case("lse-b-3d", "lse_b.shape", lse_b=torch.randn(T, HQ, 1)),
    merge_case("lse-b-other-device", "lse_b.device", lse_b=torch.empty(T, HQ, device="meta")),
    merge_case("out-fp16", "out.dtype", out=torch.zeros(T, HQ, DV, dtype=torch.float16)),
    merge_case("out-wider", "out.shape", out=torch.zeros(T, HQ, DV + 1)),
    merge_case("lse-out-fewer-heads", "lse_out.shape", lse_out=torch.zeros(T, HQ - 1)),
    merge_case("lse-out-fp16", "lse_out.dtype", lse_out=torch.zeros(T, HQ, dtype=torch.float16)),
    # A log-sum-exp is finite, or -inf for a part that saw no key: +inf and NaN would be NaN rows.
    merge_case("lse-a-plus-inf", "lse_a[2, 1]", lse_a=lse_with((2, 1), INF)),
    merge_case("lse-b-nan", "lse_b[0, 3]", lse_b=lse_with((0, 3), NAN)),
]


# --- prepare / warmup (BackendBase) and GraphRunner ------------------------------------------------

WARM_LAYER = LayerSpec(4, 2, 16)


def prepare_case(name: str, field: str, layers: Any = (WARM_LAYER,), device: Any = "cpu") -> Case:
    return Case(
        f"prepare/{name}",
        lambda: ReferenceBackend().prepare(layers, ALLOC_LAYOUT, device),
        IIE,
        field,
    )


def warmup_case(name: str, field: str, *, prepared: bool = True, **kwargs: Any) -> Case:
    backend = ReferenceBackend()
    if prepared:
        backend.prepare([WARM_LAYER], KVCacheLayout(2, 16, 1, dtype=torch.float32))
    return Case(f"warmup/{name}", lambda: backend.warmup(**kwargs), IIE, field)


PREPARE_CASES = [
    prepare_case("layers-int", "layers", layers=3),
    prepare_case("layers-none", "layers", layers=None),
    prepare_case("layers-one-spec", "layers", layers=WARM_LAYER),
    prepare_case("layers-str", "layers", layers="layers"),
    prepare_case("device-bad-string", "device", device="gpu0"),
    prepare_case("device-float", "device", device=1.5),
    warmup_case("num-pages-zero", "num_pages", num_pages=0),
    warmup_case("num-pages-negative", "num_pages", num_pages=-3),
    warmup_case("num-pages-str", "num_pages", num_pages="8"),
    warmup_case("num-pages-bool", "num_pages", num_pages=True),
    warmup_case("num-pages-fraction", "num_pages", num_pages=2.5),
    warmup_case("num-pages-none", "num_pages", num_pages=None),
    warmup_case("unprepared-num-pages-zero", "num_pages", prepared=False, num_pages=0),
    warmup_case("device-bad-string", "device", device="gpu0"),
    warmup_case("device-float", "device", device=1.5),
    warmup_case("device-unreachable", "device", device=UNREACHABLE),
]


class _Capturable:
    """What ``GraphRunner`` reads of a backend before it builds the graph buffers."""

    name = "capturable"
    capabilities = dataclasses.replace(
        ReferenceBackend.capabilities, graph_support=A.GraphSupport.ANY_BATCH
    )

    def graph_state(self, *args: Any, **kwargs: Any) -> GraphBuffers:
        return GraphBuffers(*args, **kwargs)


def runner_case(name: str, field: str, **kwargs: Any) -> Case:
    args: dict[str, Any] = {
        "batch_sizes": [1, 4],
        "max_pages": 3,
        "page_size": P,
        "device": "cuda",
        **kwargs,
    }
    return Case(
        f"graph_runner/{name}",
        lambda: A.GraphRunner(_Capturable(), lambda plan, *x: x[0], **args),  # type: ignore[arg-type]
        IIE,
        field,
    )


RUNNER_CASES = [
    runner_case("batch-sizes-int", "batch_sizes", batch_sizes=3),
    runner_case("batch-sizes-empty", "batch_sizes", batch_sizes=[]),
    runner_case("batch-sizes-str", "batch_sizes", batch_sizes="14"),
    runner_case("batch-sizes-none", "batch_sizes", batch_sizes=None),
    runner_case("batch-size-str", "batch_sizes[0]", batch_sizes=["a"]),
    runner_case("batch-size-fraction", "batch_sizes[1]", batch_sizes=[1, 1.5]),
    runner_case("batch-size-zero", "batch_sizes[1]", batch_sizes=[2, 0]),
    runner_case("batch-size-bool", "batch_sizes[0]", batch_sizes=[True]),
    runner_case("tokens-per-seq-bool", "tokens_per_seq", tokens_per_seq=True),
    runner_case("tokens-per-seq-zero", "tokens_per_seq", tokens_per_seq=0),
    runner_case("device-bad-string", "device", device="gpu0"),
    runner_case("device-cpu", "device", device="cpu"),
    runner_case("device-unreachable", "device", device=UNREACHABLE),
]

CORE_CASES = [
    *LAYER_CASES,
    *LAYOUT_CASES,
    *ALLOCATE_CASES,
    *WRAP_CASES,
    *STORE_CASES,
    *FROM_SEQLENS_CASES,
    *FOR_RAGGED_CASES,
    *TREE_CASES,
    *FROM_TENSORS_CASES,
    *PLAN_CASES,
    *FORWARD_CASES,
    *CONFIG_CASES,
    *FROM_FILE_CASES,
    *FROM_ENV_CASES,
    *REGISTER_CASES,
    *CREATE_CASES,
    *EXPLAIN_CASES,
    *GRAPH_CASES,
    *MERGE_CASES,
    *PREPARE_CASES,
    *RUNNER_CASES,
]


@pytest.mark.parametrize("case", params(CORE_CASES))
def test_refused(case: Case) -> None:
    if case.id.startswith("from_file/yaml") or case.id.startswith("from_file/yml"):
        pytest.importorskip("yaml", reason="PyYAML is not installed")
    assert_refused(case)


# --- baselines: the unchanged calls are valid ----------------------------------------------------


@pytest.mark.parametrize(
    ("via", "variant"),
    [
        (via, variant)
        for via in ("reference", "debug")
        for variant in ({}, {"quantized": True}, {"sinks": True})
    ],
)
def test_forward_baseline(via: str, variant: dict[str, bool]) -> None:
    batch = make(**variant)
    kwargs = forward_kwargs(batch)
    (DEBUG if via == "debug" else REF).forward(**kwargs)


@pytest.mark.parametrize("via", ["reference", "debug"])
def test_forward_baseline_with_lse(via: str) -> None:
    kwargs = forward_kwargs(make(sinks=True))
    kwargs["lse"] = torch.full((T, HQ), NAN)
    (DEBUG if via == "debug" else REF).forward(**kwargs)
    assert bool(torch.isfinite(kwargs["lse"]).all())


@pytest.mark.parametrize(("value", "refused"), [(NAN, True), (INF, True), (-INF, False)])
def test_debug_mode_checks_the_lse_a_backend_wrote(value: float, refused: bool) -> None:
    """-inf is a valid log-sum-exp (a row that sees no key and no sink); NaN and +inf are not."""

    class Faulty(ReferenceBackend):
        def attend(self, call: Any) -> torch.Tensor:
            out = super().attend(call)
            lse = call.lse
            if lse is not None:
                lse[T - 1, 1] = value
            return out

    kwargs = forward_kwargs(make())
    kwargs["lse"] = torch.empty(T, HQ)
    debug = wrap_debug(Faulty())
    if refused:
        with pytest.raises(A.AttnSDKError, match=r"at lse\[8, 1\]"):
            debug.forward(**kwargs)
    else:
        debug.forward(**kwargs)


def test_other_baselines(tmp_path: Path) -> None:
    merge_case("baseline", "").call()
    LayerSpec(4, 2, 16)
    KVCacheLayout(2, 16, 4)
    ALLOC_LAYOUT.allocate(4, device="cpu")
    WRAP_LAYOUT.wrap(f16(5, 4, 2, 16), f16(5, 4, 2, 8))
    STORE_LAYOUT.allocate(6).store(
        torch.randn(3, 2, 16), torch.randn(3, 2, 8), torch.tensor([4, 5, 9])
    )
    STORE_FP8.allocate(6).store(
        torch.randn(3, 2, 16), torch.randn(3, 2, 8), torch.tensor([4, 5, 9]),
        k_scale=torch.ones(()), v_scale=torch.ones(2),
    )  # fmt: skip
    meta = base_meta()
    AttentionMetadata.from_tensors(**engine_tensors(), page_size=P, max_query_len=3, max_seq_len=9)
    REF.plan(meta)
    DEBUG.plan(meta)
    AttentionConfig(backend="fa3", provider="auto", num_splits=2, pack_gqa=True)
    AttentionConfig(backend="reference", max_scores=4096, debug=True)
    AttentionConfig(candidates=["reference"])
    path = tmp_path / "attn.json"
    path.write_text('{"backend": "reference", "max_scores": 1}')
    with environ(ATTNSDK_CONFIG=str(path), ATTNSDK_BACKEND="reference", ATTNSDK_DEBUG="0"):
        assert AttentionConfig.from_env().backend == "reference"
        A.create_backend(None)
    A.register_backend("matrix-baseline", ReferenceBackend, priority=-1).remove()
    assert A.explain("reference", LayerSpec(4, 2, 16), ALLOC_LAYOUT, device="cpu") == {
        "reference": []
    }
    state = fresh_buffers()
    state.capture_metadata(2, 4, max_query_len=3)
    plan = REF.plan_for_capture(state, 2, 4)
    REF.plan_for_replay(plan, real([1, 1], [5, 3]))
    DEBUG.plan_for_replay(plan, real([3], [9]))
