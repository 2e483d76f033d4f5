"""``GraphBuffers`` (static CUDA-graph metadata) and the reference backend's graph hooks, on CPU."""

from __future__ import annotations

import random

import pytest
import torch

from attnsdk import (
    AttentionMetadata,
    GraphBuffers,
    InvalidInputError,
    InvalidMetadataError,
    KVCacheLayout,
    LayerSpec,
)
from attnsdk.backends.reference import ReferenceBackend
from attnsdk.testing import BatchSpec, make_batch

P = 4
FIELDS = (
    "query_start_loc",
    "seq_lens",
    "page_table",
    "slot_mapping",
    "query_start_loc_cpu",
    "seq_lens_cpu",
)
reference = ReferenceBackend()


def buffers(max_batch: int = 8, max_tokens: int = 32, max_pages: int = 6) -> GraphBuffers:
    return GraphBuffers(max_batch, max_tokens, max_pages, page_size=P, device="cpu")


def pointers(state: GraphBuffers) -> dict[str, int]:
    return {name: getattr(state, name).data_ptr() for name in FIELDS}


def random_real_batch(
    rng: random.Random, batch_size: int, num_tokens: int, max_pages: int, num_pages: int = 64
) -> AttentionMetadata:
    """A batch that fits a capture of (batch_size, num_tokens): every row has >= 1 token."""
    while True:
        b = rng.randint(1, batch_size)
        t = rng.randint(b, num_tokens - (batch_size - b))
        cuts = sorted(rng.sample(range(1, t), b - 1))
        query_lens = [hi - lo for lo, hi in zip([0, *cuts], [*cuts, t])]
        if max(query_lens) <= max_pages * P:
            break
    seq_lens = [q + rng.randint(0, max_pages * P - q) for q in query_lens]
    width = rng.randint(max(-(-s // P) for s in seq_lens), max_pages + 2)
    pages = rng.sample(range(1, num_pages), b * width) if b * width < num_pages else None
    table = [
        [pages[i * width + j] if pages else rng.randrange(1, num_pages) for j in range(width)]
        for i in range(b)
    ]
    return AttentionMetadata.from_seqlens(query_lens, seq_lens, table, page_size=P)


# --- capture ---------------------------------------------------------------------------------


def test_captured_metadata_views_the_static_buffers() -> None:
    state = buffers()
    captured = state.capture_metadata(batch_size=3, num_tokens=7)
    for name in FIELDS:
        view, static = getattr(captured, name), getattr(state, name)
        assert view.untyped_storage().data_ptr() == static.untyped_storage().data_ptr(), name
        assert view.data_ptr() == static.data_ptr(), name  # a prefix, no copy
    assert captured.page_table.shape == (3, 6)
    assert captured.slot_mapping.shape == (7,)
    state.seq_lens[1] = 42
    state.slot_mapping[6] = 5
    assert int(captured.seq_lens[1]) == 42
    assert int(captured.slot_mapping[6]) == 5


def test_captured_metadata_is_a_padded_batch() -> None:
    state = buffers()
    captured = state.capture_metadata(batch_size=3, num_tokens=7)
    assert captured.query_start_loc.tolist() == [0, 2, 4, 7]
    assert captured.query_start_loc_cpu.tolist() == [0, 2, 4, 7]
    assert captured.seq_lens.tolist() == [2, 2, 3]
    assert (captured.page_table == 0).all()
    assert (captured.slot_mapping == -1).all()
    assert (captured.num_tokens, captured.max_query_len, captured.max_seq_len) == (7, 5, 6 * P)
    captured.validate(KVCacheLayout(1, 8, P).allocate(1))


@pytest.mark.parametrize(
    ("batch_size", "num_tokens", "field"),
    [(0, 4, "batch_size"), (9, 9, "batch_size"), (4, 3, "num_tokens"), (4, 33, "num_tokens")],
)
def test_capture_rejects(batch_size: int, num_tokens: int, field: str) -> None:
    with pytest.raises(InvalidInputError, match=rf"^{field}: expected "):
        buffers().capture_metadata(batch_size, num_tokens)


@pytest.mark.parametrize(
    ("args", "field"),
    [((0, 4, 2), "max_batch"), ((4, -1, 2), "max_tokens"), ((4, 4, 0), "max_pages")],
)
def test_buffers_reject(args: tuple[int, int, int], field: str) -> None:
    with pytest.raises(InvalidInputError, match=rf"^{field}: expected "):
        GraphBuffers(*args, page_size=P, device="cpu")


# --- replay_update ------------------------------------------------------------------------------


def check_replayed(
    state: GraphBuffers, captured: AttentionMetadata, real: AttentionMetadata
) -> None:
    """The captured views hold ``real`` in their first rows and padding rows after it."""
    b, t = real.num_seqs, real.num_tokens
    bs, tokens = captured.num_seqs, captured.num_tokens
    qsl = captured.query_start_loc_cpu
    assert torch.equal(captured.query_start_loc[: b + 1], real.query_start_loc)
    assert torch.equal(captured.seq_lens[:b], real.seq_lens)
    used = real.page_table[:, : state.max_pages]
    assert torch.equal(captured.page_table[:b, : used.shape[1]], used)
    assert (captured.page_table[:b, used.shape[1] :] == state.reserved_page).all()
    assert torch.equal(captured.slot_mapping[:t], real.slot_mapping)
    # Padding rows: the leftover token rows, seq_len >= 1, the reserved page, slot -1.
    assert (captured.slot_mapping[t:] == -1).all()
    assert bool((qsl[1:] >= qsl[:-1]).all())
    if b < bs:
        assert int(qsl[-1]) == tokens
        assert (captured.seq_lens[b:] >= 1).all()
        assert (captured.seq_lens[b:] >= qsl[b + 1 :] - qsl[b:-1]).all()
        assert (captured.page_table[b:] == state.reserved_page).all()
    # Host twins agree with the device buffers.
    assert torch.equal(captured.query_start_loc_cpu, captured.query_start_loc.cpu())
    assert torch.equal(captured.seq_lens_cpu, captured.seq_lens.cpu())


def test_replay_update_docstring_case() -> None:
    state = GraphBuffers(4, 4, 2, page_size=16, device="cpu")
    captured = state.capture_metadata(batch_size=4, num_tokens=4)
    real = AttentionMetadata.from_seqlens([1, 1], [20, 5], [[3, 4], [5, 0]], page_size=16)
    state.replay_update(captured, real)
    assert captured.seq_lens.tolist() == [20, 5, 1, 1]
    assert captured.slot_mapping.tolist() == [67, 84, -1, -1]
    assert captured.page_table.tolist() == [[3, 4], [5, 0], [0, 0], [0, 0]]
    assert captured.query_start_loc.tolist() == [0, 1, 2, 3, 4]


def test_replay_update_random_batches() -> None:
    """Many smaller batches (fewer rows, fewer tokens) replayed into the same captured views,
    one after another: no stale row survives, no buffer is reallocated, and the result is a
    valid batch."""
    rng = random.Random(0)
    state = buffers(max_batch=8, max_tokens=32, max_pages=6)
    cache = KVCacheLayout(1, 8, P).allocate(64)
    before = pointers(state)
    for bs, tokens in [(8, 32), (8, 8), (5, 17), (1, 1), (1, 20), (3, 3), (6, 31)]:
        captured = state.capture_metadata(bs, tokens)
        for _ in range(25):
            real = random_real_batch(rng, bs, tokens, state.max_pages)
            state.replay_update(captured, real)
            check_replayed(state, captured, real)
            if real.num_seqs < bs or real.num_tokens == tokens:
                # With every captured row real, leftover token rows have no owner and
                # query_start_loc[-1] < num_tokens (the captured token count): not a valid batch.
                captured.validate(cache)
    assert pointers(state) == before


def test_replay_update_accepts_a_wider_page_table() -> None:
    """Engines keep a wide page table; only the columns the buffers hold can be in use."""
    state = buffers(max_pages=2)
    captured = state.capture_metadata(2, 2)
    real = AttentionMetadata.from_seqlens([1, 1], [8, 3], [[1, 2, 9, 9], [3, 9, 9, 9]], P)
    state.replay_update(captured, real)
    assert captured.page_table.tolist() == [[1, 2], [3, 9]]


@pytest.mark.parametrize(
    ("query_lens", "seq_lens", "field"),
    [
        ([1] * 5, [3] * 5, "seq_lens"),  # more sequences than captured
        ([3, 3], [3, 3], "num_tokens"),  # more tokens than captured
        ([4], [4], "max_query_len"),  # a longer query than the capture allows
        ([1, 1], [1, 6 * P + 1], "max_seq_len"),  # past max_pages * page_size
    ],
)
def test_replay_update_rejects(query_lens: list[int], seq_lens: list[int], field: str) -> None:
    state = buffers(max_batch=8, max_tokens=32, max_pages=6)
    captured = state.capture_metadata(batch_size=4, num_tokens=5)
    width = max(-(-s // P) for s in seq_lens)
    real = AttentionMetadata.from_seqlens(
        query_lens, seq_lens, [[1] * width] * len(seq_lens), page_size=P
    )
    before = {name: getattr(state, name).clone() for name in FIELDS}
    with pytest.raises(InvalidMetadataError, match=rf"^{field}: expected ") as info:
        state.replay_update(captured, real)
    assert info.value.field == field
    for name in FIELDS:  # a rejected replay changes nothing
        assert torch.equal(getattr(state, name), before[name]), name


def test_replay_without_padding_rows_is_a_valid_batch() -> None:
    """Every captured row is real: the leftover token rows belong to no sequence."""
    state = buffers()
    captured = state.capture_metadata(batch_size=2, num_tokens=6)
    real = AttentionMetadata.from_seqlens([1, 3], [5, 3], [[1, 2], [3, 0]], page_size=P)
    state.replay_update(captured, real)
    captured.validate(KVCacheLayout(1, 8, P).allocate(8))
    assert captured.query_start_loc.tolist() == [0, 1, 4]
    assert captured.num_tokens == 6
    assert captured.slot_mapping[4:].tolist() == [-1, -1]


def test_replay_with_an_empty_real_row_is_a_valid_batch() -> None:
    """Padding rows take at most the captured max_query_len; the rest belongs to no sequence."""
    state = buffers()
    captured = state.capture_metadata(batch_size=4, num_tokens=4)  # max_query_len 1
    real = AttentionMetadata.from_seqlens([1, 0], [5, 3], [[1, 2], [3, 0]], page_size=P)
    state.replay_update(captured, real)
    captured.validate(KVCacheLayout(1, 8, P).allocate(8))
    assert captured.query_start_loc.tolist() == [0, 1, 1, 2, 3]
    assert captured.seq_lens.tolist() == [5, 3, 1, 1]
    assert captured.slot_mapping[1:].tolist() == [-1, -1, -1]


# --- the reference backend's graph hooks -------------------------------------------------------------


def test_plan_for_replay_needs_a_captured_plan() -> None:
    meta = AttentionMetadata.from_seqlens([1], [3], [[1]], page_size=P)
    with pytest.raises(InvalidInputError, match=r"^plan: expected "):
        reference.plan_for_replay(reference.plan(meta), meta)


@pytest.mark.parametrize("padding_rows", [True, False], ids=["padding-rows", "no-padding-rows"])
def test_captured_plan_matches_eager(padding_rows: bool) -> None:
    """forward on a replayed captured plan equals an eager forward on the real rows, and the
    padding (rows and token rows) writes nothing into the cache."""
    rng = random.Random(int(padding_rows))
    layer = LayerSpec(4, 2, 8, sliding_window=9, has_sinks=True)
    layout = KVCacheLayout(2, 8, P, dtype=torch.float32)
    max_batch, max_tokens, max_pages = 8, 40, 8
    state = reference.graph_state(max_batch, max_tokens, max_pages, page_size=P, device="cpu")
    before = pointers(state)
    runs = 0
    for seed in range(40):
        bs = rng.randint(1, max_batch)
        tokens = rng.randint(bs, max_tokens)
        plan = reference.plan_for_capture(state, bs, tokens)
        b = rng.randint(1, bs) if padding_rows else bs
        t = rng.randint(b, tokens - (bs - b))
        cuts = sorted(rng.sample(range(1, t), b - 1))
        query_lens = [hi - lo for lo, hi in zip([0, *cuts], [*cuts, t])]
        if max(query_lens) > max_pages * P:
            continue
        seq_lens = [q + rng.randint(0, max_pages * P - q) for q in query_lens]
        batch = make_batch(BatchSpec(tuple(query_lens), tuple(seq_lens)), layer, layout, seed=seed)
        eager_out, eager_cache = batch.run(reference)

        reference.plan_for_replay(plan, batch.metadata)
        pad = torch.randn(tokens - t, 4, 8)
        q = torch.cat([batch.q, pad])
        k = torch.cat([batch.k, pad[:, :2]])
        v = torch.cat([batch.v, pad[:, 2:]])
        graph_cache = batch.fresh_cache()
        out = torch.full((tokens, 4, 8), float("nan"))
        reference.forward(q, k, v, graph_cache, plan, layer, sinks=batch.sinks, out=out)

        assert torch.equal(out[:t], eager_out), f"seed {seed}: bs={bs} tokens={tokens} b={b} t={t}"
        assert torch.equal(graph_cache.k, eager_cache.k)
        assert torch.equal(graph_cache.v, eager_cache.v)
        runs += 1
    assert runs >= 30
    assert pointers(state) == before


def test_uniform_capture_bounds_query_length_by_tokens_per_row() -> None:
    """A verify-style graph (3 tokens per row) is sized for 3-token queries, not 3 * bs - bs + 1."""
    state = buffers()
    captured = state.capture_metadata(batch_size=4, num_tokens=12, max_query_len=3)
    assert captured.max_query_len == 3
    assert captured.query_start_loc.tolist() == [0, 3, 6, 9, 12]
    real = AttentionMetadata.from_seqlens([3], [7], [[1, 2]], page_size=P)
    state.replay_update(captured, real)
    assert captured.query_start_loc.tolist() == [0, 3, 6, 9, 12]
    assert captured.seq_lens.tolist() == [7, 3, 3, 3]
    captured.validate(KVCacheLayout(1, 8, P).allocate(8))
    longer = AttentionMetadata.from_seqlens([4], [7], [[1, 2]], page_size=P)
    with pytest.raises(InvalidMetadataError, match=r"^max_query_len: expected <= 3"):
        state.replay_update(captured, longer)


@pytest.mark.parametrize("bound", [2, 10])
def test_capture_rejects_an_impossible_query_bound(bound: int) -> None:
    with pytest.raises(InvalidInputError, match=r"^max_query_len: expected 3\.\.9 "):
        buffers().capture_metadata(batch_size=4, num_tokens=12, max_query_len=bound)
