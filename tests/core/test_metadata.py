"""``AttentionMetadata``: construction, host twins, and one test per ``validate`` invariant."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import pytest
import torch

from attnsdk import AttentionMetadata, InvalidMetadataError, KVCacheLayout, LayerSpec
from attnsdk.testing import BatchSpec, make_batch

if TYPE_CHECKING:
    from collections.abc import Callable

PAGE = 4
LAYOUT = KVCacheLayout(num_kv_heads=2, head_dim=8, page_size=PAGE, dtype=torch.float32)
CACHE = LAYOUT.allocate(num_pages=10)
# Sequences: decode over a context, a prefill, an idle row with context, an extend.
QUERY_LENS = [1, 3, 0, 2]
SEQ_LENS = [6, 3, 4, 9]
TABLE = [[7, 2, 0], [4, 0, 0], [5, 0, 0], [1, 8, 3]]


def base() -> AttentionMetadata:
    return AttentionMetadata.from_seqlens(QUERY_LENS, SEQ_LENS, TABLE, page_size=PAGE)


def raises_field(field: str) -> pytest.RaisesContext[InvalidMetadataError]:
    return pytest.raises(InvalidMetadataError, match=rf"^{_escape(field)}: expected ")


def _escape(text: str) -> str:
    import re

    return re.escape(text)


def with_lengths(
    meta: AttentionMetadata, qsl: list[int] | None = None, seq: list[int] | None = None
) -> AttentionMetadata:
    """Replace lengths on the device and the host alike (the twins stay consistent)."""
    changes: dict[str, object] = {}
    if qsl is not None:
        changes["query_start_loc"] = torch.tensor(qsl, dtype=torch.int32)
        changes["query_start_loc_cpu"] = torch.tensor(qsl, dtype=torch.int32)
    if seq is not None:
        changes["seq_lens"] = torch.tensor(seq, dtype=torch.int32)
        changes["seq_lens_cpu"] = torch.tensor(seq, dtype=torch.int32)
    return dataclasses.replace(meta, **changes)  # type: ignore[arg-type]


# --- from_seqlens ---------------------------------------------------------------------------


def test_from_seqlens_fields() -> None:
    meta = base()
    assert meta.query_start_loc.tolist() == [0, 1, 4, 4, 6]
    assert meta.seq_lens.tolist() == SEQ_LENS
    assert meta.page_table.tolist() == TABLE
    # decode at position 5 -> page 2 offset 1; prefill 0..2 on page 4; extend at 7, 8.
    assert meta.slot_mapping.tolist() == [2 * 4 + 1, 16, 17, 18, 8 * 4 + 3, 3 * 4 + 0]
    assert (meta.num_tokens, meta.num_seqs) == (6, 4)
    assert (meta.max_query_len, meta.max_seq_len) == (3, 9)
    assert meta.query_lens_cpu.tolist() == QUERY_LENS
    for t, dtype in (
        (meta.query_start_loc, torch.int32),
        (meta.seq_lens, torch.int32),
        (meta.page_table, torch.int32),
        (meta.slot_mapping, torch.int64),
        (meta.query_start_loc_cpu, torch.int32),
        (meta.seq_lens_cpu, torch.int32),
    ):
        assert t.dtype == dtype
    assert torch.equal(meta.query_start_loc_cpu, meta.query_start_loc.cpu())
    assert torch.equal(meta.seq_lens_cpu, meta.seq_lens.cpu())
    assert meta.validate(CACHE) is meta


@pytest.mark.parametrize("page_size", [1, 2, 16, 64])
@pytest.mark.parametrize("preset", sorted(BatchSpec.presets()))
def test_from_seqlens_slot_mapping(preset: str, page_size: int) -> None:
    spec = BatchSpec.presets(seed=page_size)[preset]
    width = max(1, *(-(-s // page_size) for s in spec.seq_lens))
    gen = torch.Generator().manual_seed(page_size)
    table = torch.randint(0, 10_000, (spec.num_seqs, width), generator=gen, dtype=torch.int32)
    meta = AttentionMetadata.from_seqlens(
        torch.tensor(spec.query_lens), torch.tensor(spec.seq_lens), table, page_size
    )
    expected = []
    for b, (q, s) in enumerate(zip(spec.query_lens, spec.seq_lens)):
        for pos in range(s - q, s):
            expected.append(int(table[b, pos // page_size]) * page_size + pos % page_size)
    assert meta.slot_mapping.tolist() == expected
    assert meta.num_tokens == spec.num_tokens
    assert meta.max_query_len == max(spec.query_lens)
    assert meta.max_seq_len == max(spec.seq_lens)


def test_from_seqlens_device_default_and_explicit() -> None:
    meta = base()
    assert meta.device == torch.device("cpu")
    on_meta = AttentionMetadata.from_seqlens(
        QUERY_LENS, SEQ_LENS, torch.tensor(TABLE, device="meta"), page_size=PAGE
    )
    explicit = AttentionMetadata.from_seqlens(
        QUERY_LENS, SEQ_LENS, TABLE, page_size=PAGE, device="meta"
    )
    for m in (on_meta, explicit):
        assert m.device.type == "meta"
        for name in ("query_start_loc", "seq_lens", "page_table", "slot_mapping"):
            assert getattr(m, name).device.type == "meta", name
        # Host twins and maxima stay on the host: no backend needs a device sync.
        assert m.query_start_loc_cpu.device.type == "cpu"
        assert m.seq_lens_cpu.device.type == "cpu"
        assert m.seq_lens_cpu.tolist() == SEQ_LENS
        assert (m.num_tokens, m.max_query_len, m.max_seq_len) == (6, 3, 9)


def test_from_seqlens_empty_batch() -> None:
    meta = AttentionMetadata.from_seqlens([], [], torch.zeros(0, 1, dtype=torch.int32), PAGE)
    assert (meta.num_seqs, meta.num_tokens, meta.max_query_len, meta.max_seq_len) == (0, 0, 0, 0)
    assert meta.query_start_loc.tolist() == [0]
    meta.validate(CACHE)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"query_lens": [1, 2]}, "query_lens"),
        ({"query_lens": [[1, 1, 1, 1]]}, "query_lens"),
        ({"query_lens": torch.tensor([1.0, 3.0, 0.0, 2.0])}, "query_lens"),
        ({"seq_lens": torch.tensor([6.0, 3.0, 4.0, 9.0])}, "seq_lens"),
        ({"query_lens": [1, -3, 0, 2]}, "query_lens[1]"),
        ({"seq_lens": [6, 2, 4, 9]}, "seq_lens[1]"),
        ({"page_size": 0}, "page_size"),
        ({"page_size": 4.0}, "page_size"),
        ({"page_table": [[7, 2, 0]]}, "page_table"),
        ({"page_table": [7, 2, 0, 1]}, "page_table"),
        ({"page_table": [[7, 2], [4, 0], [5, 0], [1, 8]]}, "page_table"),
    ],
)
def test_from_seqlens_rejects(kwargs: dict[str, object], field: str) -> None:
    args: dict[str, object] = {
        "query_lens": QUERY_LENS,
        "seq_lens": SEQ_LENS,
        "page_table": TABLE,
        "page_size": PAGE,
    }
    args.update(kwargs)
    with raises_field(field) as info:
        AttentionMetadata.from_seqlens(**args)  # type: ignore[arg-type]
    assert info.value.field == field


# --- from_tensors ---------------------------------------------------------------------------


def _engine_tensors() -> dict[str, torch.Tensor]:
    meta = base()
    return {
        "query_start_loc": meta.query_start_loc.clone(),
        "seq_lens": meta.seq_lens.clone(),
        "page_table": meta.page_table.clone(),
        "slot_mapping": meta.slot_mapping.clone(),
        "query_start_loc_cpu": meta.query_start_loc_cpu.clone(),
        "seq_lens_cpu": meta.seq_lens_cpu.clone(),
    }


def test_from_tensors_adopts_without_copy() -> None:
    tensors = _engine_tensors()
    meta = AttentionMetadata.from_tensors(**tensors)
    for name, t in tensors.items():
        adopted = getattr(meta, name)
        assert adopted.data_ptr() == t.data_ptr(), name
    # Writes by the engine after adoption are visible (it is the same storage).
    tensors["seq_lens"][0] = 77
    assert int(meta.seq_lens[0]) == 77
    assert (meta.num_tokens, meta.max_query_len, meta.max_seq_len) == (6, 3, 9)


def test_from_tensors_converts_other_dtypes() -> None:
    tensors = {name: t.to(torch.int64) for name, t in _engine_tensors().items()}
    tensors["slot_mapping"] = tensors["slot_mapping"].to(torch.int32)
    meta = AttentionMetadata.from_tensors(**tensors)
    assert meta.query_start_loc.dtype == torch.int32
    assert meta.seq_lens_cpu.dtype == torch.int32
    assert meta.slot_mapping.dtype == torch.int64
    assert meta.validate(CACHE) is meta


def test_from_tensors_maxima() -> None:
    meta = AttentionMetadata.from_tensors(**_engine_tensors(), max_query_len=8, max_seq_len=64)
    assert (meta.max_query_len, meta.max_seq_len) == (8, 64)
    meta.validate(CACHE)  # upper bounds are allowed (CUDA graphs keep them)


# --- validate: every preset is valid -------------------------------------------------------


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("pages", ["shuffled", "contiguous", "interleaved"])
@pytest.mark.parametrize("preset", sorted(BatchSpec.presets()))
def test_presets_validate(preset: str, pages: str, page_size: int) -> None:
    layer = LayerSpec(num_heads=2, num_kv_heads=1, head_dim=8)
    layout = KVCacheLayout(1, 8, page_size, dtype=torch.float32)
    batch = make_batch(BatchSpec.presets()[preset], layer, layout, pages=pages)  # type: ignore[arg-type]
    assert batch.metadata.validate(batch.cache) is batch.metadata
    batch.metadata.validate(layout)


# --- validate: one test per invariant ------------------------------------------------------


def _set(name: str, value: object) -> Callable[[AttentionMetadata], AttentionMetadata]:
    return lambda m: dataclasses.replace(m, **{name: value})


def _slots(values: list[int]) -> Callable[[AttentionMetadata], AttentionMetadata]:
    return _set("slot_mapping", torch.tensor(values, dtype=torch.int64))


def _table(values: list[list[int]]) -> Callable[[AttentionMetadata], AttentionMetadata]:
    return _set("page_table", torch.tensor(values, dtype=torch.int32))


def _on_meta_device(m: AttentionMetadata) -> AttentionMetadata:
    return dataclasses.replace(
        m,
        query_start_loc=m.query_start_loc.to("meta"),
        seq_lens=m.seq_lens.to("meta"),
        page_table=m.page_table.to("meta"),
        slot_mapping=m.slot_mapping.to("meta"),
    )


# (id, mutation, field named in the error); the base slots are [9, 16, 17, 18, 35, 12].
INVARIANTS: list[tuple[str, Callable[[AttentionMetadata], AttentionMetadata], str]] = [
    (
        "qsl-dtype",
        lambda m: _set("query_start_loc", m.query_start_loc.long())(m),
        "query_start_loc",
    ),
    (
        "qsl-shape",
        _set("query_start_loc", torch.tensor([0, 1, 4, 4], dtype=torch.int32)),
        "query_start_loc",
    ),
    ("seq-dtype", lambda m: _set("seq_lens", m.seq_lens.long())(m), "seq_lens"),
    ("seq-2d", lambda m: _set("seq_lens", m.seq_lens[None])(m), "seq_lens"),
    ("seq-not-tensor", _set("seq_lens", SEQ_LENS), "seq_lens"),
    ("table-1d", _set("page_table", torch.tensor([7, 4, 5, 1], dtype=torch.int32)), "page_table"),
    ("table-rows", _table([[7, 2, 0], [4, 0, 0], [5, 0, 0]]), "page_table"),
    ("table-dtype", lambda m: _set("page_table", m.page_table.long())(m), "page_table"),
    ("table-not-tensor", _set("page_table", TABLE), "page_table"),
    ("slots-dtype", lambda m: _set("slot_mapping", m.slot_mapping.int())(m), "slot_mapping"),
    ("slots-2d", lambda m: _set("slot_mapping", m.slot_mapping[None])(m), "slot_mapping"),
    (
        "qsl-cpu-dtype",
        lambda m: _set("query_start_loc_cpu", m.query_start_loc_cpu.long())(m),
        "query_start_loc_cpu",
    ),
    ("seq-cpu-2d", lambda m: _set("seq_lens_cpu", m.seq_lens_cpu[None])(m), "seq_lens_cpu"),
    ("seq-cpu-not-tensor", _set("seq_lens_cpu", SEQ_LENS), "seq_lens_cpu"),
    (
        "qsl-cpu-device",
        lambda m: _set("query_start_loc_cpu", m.query_start_loc_cpu.to("meta"))(m),
        "query_start_loc_cpu.device",
    ),
    (
        "seq-cpu-device",
        lambda m: _set("seq_lens_cpu", m.seq_lens_cpu.to("meta"))(m),
        "seq_lens_cpu.device",
    ),
    (
        "slots-device",
        lambda m: _set("slot_mapping", m.slot_mapping.to("meta"))(m),
        "slot_mapping.device",
    ),
    ("cache-device", _on_meta_device, "seq_lens.device"),
    (
        "qsl-twin",
        _set("query_start_loc_cpu", torch.tensor([0, 1, 4, 5, 6], dtype=torch.int32)),
        "query_start_loc_cpu[3]",
    ),
    (
        "seq-twin",
        _set("seq_lens_cpu", torch.tensor([6, 3, 4, 8], dtype=torch.int32)),
        "seq_lens_cpu[3]",
    ),
    ("qsl-start", lambda m: with_lengths(m, qsl=[1, 1, 4, 4, 6]), "query_start_loc[0]"),
    ("qsl-decreasing", lambda m: with_lengths(m, qsl=[0, 4, 1, 4, 6]), "query_start_loc[2]"),
    ("num-tokens", _set("num_tokens", 5), "num_tokens"),
    ("seq-below-query", lambda m: with_lengths(m, seq=[6, 2, 4, 9]), "seq_lens[1]"),
    ("max-query-len", _set("max_query_len", 2), "max_query_len"),
    ("max-seq-len", _set("max_seq_len", 8), "max_seq_len"),
    ("table-narrow", _table([[7, 2], [4, 0], [5, 0], [1, 8]]), "page_table"),
    ("table-negative", _table([[7, 2, 0], [4, 0, 0], [-1, 0, 0], [1, 8, 3]]), "page_table[2, 0]"),
    (
        "table-out-of-cache",
        _table([[7, 2, 0], [4, 0, 0], [5, 0, 0], [1, 8, 10]]),
        "page_table[3, 2]",
    ),
    ("slots-short", _slots([9, 16, 17, 18, 35]), "slot_mapping"),
    ("slots-padding-writes", _slots([9, 16, 17, 18, 35, 12, 0]), "slot_mapping[6]"),
    ("slots-wrong-offset", _slots([9, 16, 18, 17, 35, 12]), "slot_mapping[2]"),
    ("slots-wrong-page", _slots([9, 16, 17, 18, 35, 13 + 4]), "slot_mapping[5]"),
    ("slots-other-page-table", _slots([9, 16, 17, 18, 35, 33]), "slot_mapping[5]"),
]


@pytest.mark.parametrize(("mutate", "field"), [pytest.param(m, f, id=i) for i, m, f in INVARIANTS])
def test_validate_invariant(
    mutate: Callable[[AttentionMetadata], AttentionMetadata], field: str
) -> None:
    meta = base()
    assert meta.slot_mapping.tolist() == [9, 16, 17, 18, 35, 12]
    meta.validate(CACHE)
    broken = mutate(meta)
    with raises_field(field) as info:
        broken.validate(CACHE)
    assert info.value.field == field
    assert "expected" in str(info.value)
    assert "found" in str(info.value)


def test_validate_duplicate_slots() -> None:
    """Two sequences sharing a page must not both write the same slot."""
    meta = AttentionMetadata.from_seqlens([1, 1], [1, 1], [[3], [3]], page_size=PAGE)
    with raises_field("slot_mapping") as info:
        meta.validate(CACHE)
    assert "twice" in str(info.value)


def test_validate_page_range_needs_a_cache() -> None:
    """A layout has no page count: page indices are range-checked only against a cache."""
    meta = AttentionMetadata.from_seqlens([1], [1], [[50]], page_size=PAGE)
    meta.validate(LAYOUT)
    with raises_field("page_table[0, 0]"):
        meta.validate(CACHE)


def test_validate_ignores_unused_page_table_columns() -> None:
    """Columns past a sequence's pages may hold anything (engines leave garbage there)."""
    table = [[7, 2, -5], [4, 999, -1], [5, -9, 123], [1, 8, 3]]
    AttentionMetadata.from_seqlens(QUERY_LENS, SEQ_LENS, table, page_size=PAGE).validate(CACHE)


def test_validate_allows_negative_slots_for_real_tokens() -> None:
    """A real token with slot -1 means the caller already wrote it."""
    _slots([-1, 16, 17, -1, 35, 12])(base()).validate(CACHE)


def test_validate_rejects_non_layout() -> None:
    with raises_field("layout_or_cache"):
        base().validate("cache")  # type: ignore[arg-type]


def test_validate_reserved_page_below_a_sliding_window() -> None:
    """vLLM frees a sliding-window sequence's pages wholly below the window and puts its null
    block 0 there: with the layer's window they are not read, so validate accepts them."""
    # One decode at position 12 (page size 4): a window of 5 sees keys 8..12, pages 2 and 3.
    meta = AttentionMetadata.from_seqlens([1], [13], [[0, 0, 5, 6]], page_size=PAGE)
    with raises_field("page_table[0, 0]"):
        meta.validate(CACHE)
    assert meta.validate(CACHE, sliding_window=5) is meta
    # A window of 6 reaches back to key 7, on page 1: the null block there is read.
    with raises_field("page_table[0, 1]"):
        meta.validate(CACHE, sliding_window=6)


def test_validate_reserved_page_before_the_chunk_of_the_first_query() -> None:
    """Pages wholly before the chunk of a row's first query are not read by a chunked layer:
    an engine may free them (null block 0 there), and validate accepts them with the layer's
    attention_chunk_size."""
    # Decode at position 12 (page size 4), chunks of 8: it sees keys 8..12, pages 2 and 3.
    meta = AttentionMetadata.from_seqlens([1], [13], [[0, 0, 5, 6]], page_size=PAGE)
    assert meta.validate(CACHE, attention_chunk_size=8) is meta
    # Chunks of 16: keys 0..12 are read, the null block on pages 0 and 1 too.
    with raises_field("page_table[0, 0]"):
        meta.validate(CACHE, attention_chunk_size=16)
    # An extend of positions 6..12 starts in chunk 0 (keys 0..7): pages 0 and 1 are read.
    extend = AttentionMetadata.from_seqlens([7], [13], [[0, 0, 5, 6]], page_size=PAGE)
    with raises_field("page_table[0, 0]"):
        extend.validate(CACHE, attention_chunk_size=8)
    # With both, the later first key wins: a window of 3 from position 12 starts at key 10.
    assert meta.validate(CACHE, sliding_window=3, attention_chunk_size=16) is meta


def test_debug_mode_validates_a_chunked_layer_with_its_chunk_size() -> None:
    """Debug mode validates each forward with the layer's chunk size: a chunked decode whose
    past chunk's pages an engine freed (null block 0) is served; a global layer reading the same
    table is refused."""
    from attnsdk.backends.reference import ReferenceBackend
    from attnsdk.selection.debug import wrap_debug

    debug = wrap_debug(ReferenceBackend())
    cache = KVCacheLayout(2, 16, PAGE, dtype=torch.float32).allocate(8)
    meta = AttentionMetadata.from_seqlens([1], [13], [[0, 0, 5, 6]], page_size=PAGE)
    q = torch.randn(1, 4, 16)
    chunked = LayerSpec(num_heads=4, num_kv_heads=2, head_dim=16, attention_chunk_size=8)
    out = debug.forward(q, None, None, cache, debug.plan(meta), chunked)
    assert bool(torch.isfinite(out).all())
    with raises_field("page_table[0, 0]"):
        debug.forward(q, None, None, cache, debug.plan(meta), LayerSpec(4, 2, 16))


def test_random_batch_spec_bounds_and_stream() -> None:
    """BatchSpec.random: rows within the bounds, never all empty, the same batches for the same
    seed, and a shared random.Random stream draws different ones."""
    import random

    for seed in range(200):
        spec = BatchSpec.random(seed, max_batch=5, max_context=40, max_query=9)
        assert 1 <= spec.num_seqs <= 5
        assert spec.num_tokens > 0
        assert all(q <= 9 for q in spec.query_lens)
        assert all(s - q <= 40 for q, s in zip(spec.query_lens, spec.seq_lens))
    assert BatchSpec.random(3) == BatchSpec.random(3)
    stream = random.Random(3)
    assert BatchSpec.random(stream) == BatchSpec.random(3)
    assert BatchSpec.random(stream) != BatchSpec.random(3)
