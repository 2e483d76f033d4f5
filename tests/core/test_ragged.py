"""Ragged attention (``Backend.forward_ragged``, ``attnsdk.features.ragged``): the metadata, the checks,
who refuses what, and the reference against the float64 oracle on random batches."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from oracle import Semantics, ragged_attention

import attnsdk as A
from attnsdk.backends.flex import FlexBackend, FlexOptions
from attnsdk.backends.reference import ReferenceBackend
from attnsdk.testing import assert_close_to_reference
from attnsdk.testing.conformance._ragged import ragged_step

reference = ReferenceBackend()
# DeepSeek V3's expanded prefill per GPU of 8: 16 heads, q/k 128 nope + 64 rope, v 128.
DEEPSEEK = A.LayerSpec(num_heads=16, num_kv_heads=16, head_dim=192, v_head_dim=128)
LAYERS = {
    "deepseek": DEEPSEEK,
    "gqa": A.LayerSpec(num_heads=8, num_kv_heads=2, head_dim=32),
    "window": A.LayerSpec(num_heads=4, num_kv_heads=2, head_dim=32, sliding_window=7),
    "softcap-sinks": A.LayerSpec(
        num_heads=4, num_kv_heads=1, head_dim=32, softcap=3.0, has_sinks=True
    ),
    "chunked": A.LayerSpec(num_heads=4, num_kv_heads=2, head_dim=32, attention_chunk_size=8),
    "noncausal-window": A.LayerSpec(
        num_heads=4, num_kv_heads=4, head_dim=16, causal=False, sliding_window=5
    ),
}
PREFIX = A.LayerSpec(num_heads=8, num_kv_heads=8, head_dim=48, v_head_dim=32, causal=False)


def _inputs(
    layer: A.LayerSpec, meta: A.AttentionMetadata, dtype: torch.dtype, seed: int, extra: int = 3
) -> tuple[torch.Tensor, ...]:
    """q, k, v (``extra`` key rows past the last sequence's, which must not be read), sinks."""
    gen = torch.Generator().manual_seed(seed)
    keys = int(meta.seq_lens_cpu.sum()) + extra
    q = torch.randn(meta.num_tokens, layer.num_heads, layer.head_dim, generator=gen)
    k = torch.randn(keys, layer.num_kv_heads, layer.head_dim, generator=gen)
    v = torch.randn(keys, layer.num_kv_heads, layer.v_dim, generator=gen)
    sinks = 1.0 + 2.0 * torch.randn(layer.num_heads, generator=gen)
    return q.to(dtype), k.to(dtype), v.to(dtype), sinks if layer.has_sinks else None


def _oracle(layer, meta, q, k, v, sinks):  # type: ignore[no-untyped-def]
    qlen = meta.query_lens_cpu.tolist()
    out, lse = ragged_attention(
        q, k, v, qlen, meta.seq_lens_cpu.tolist(), Semantics.of(layer), sinks=sinks
    )
    return out.float(), lse.float()


# -- the metadata ------------------------------------------------------------------------------


def test_for_ragged_packs_the_keys_and_writes_nothing() -> None:
    meta = A.AttentionMetadata.for_ragged([2, 0, 3], [2, 4, 5])
    assert meta.key_start_loc.tolist() == [0, 2, 6, 11]
    assert meta.slot_mapping.tolist() == [-1] * 5
    assert tuple(meta.page_table.shape) == (3, 0)
    assert meta.page_size is None
    reference.plan(meta)
    with pytest.raises(A.InvalidMetadataError, match=r"seq_lens\[0\]"):
        A.AttentionMetadata.for_ragged([3], [2])  # more queries than keys: a prefix chunk
    chunk = A.AttentionMetadata.for_ragged([3], [2], cross_attention=True)
    assert chunk.cross_attention
    assert chunk.key_start_loc.tolist() == [0, 2]


def test_key_start_loc_is_checked() -> None:
    meta = A.AttentionMetadata.for_ragged([2, 3], [2, 5])
    short = dataclasses.replace(meta, key_start_loc=torch.tensor([0, 2], dtype=torch.int32))
    with pytest.raises(A.InvalidMetadataError, match=r"key_start_loc.*B \+ 1"):
        reference.plan(short)
    wrong = dataclasses.replace(meta, key_start_loc=torch.tensor([0, 2, 6], dtype=torch.int32))
    with pytest.raises(A.InvalidMetadataError, match=r"key_start_loc\[2\].*prefix sum"):
        wrong.validate(None)
    meta.validate(None)
    with pytest.raises(A.InvalidMetadataError, match="layout_or_cache"):
        A.AttentionMetadata.from_seqlens([1], [1], [[1]], 16).validate(None)
    adopted = A.AttentionMetadata.from_tensors(
        query_start_loc=meta.query_start_loc,
        seq_lens=meta.seq_lens,
        page_table=meta.page_table,
        slot_mapping=meta.slot_mapping,
        query_start_loc_cpu=meta.query_start_loc_cpu,
        seq_lens_cpu=meta.seq_lens_cpu,
        key_start_loc=meta.key_start_loc.long(),
    )
    assert adopted.key_start_loc.dtype == torch.int32
    with pytest.raises(A.InvalidMetadataError, match="key_start_loc"):
        A.AttentionMetadata.from_tensors(
            **{f: getattr(meta, f) for f in ("query_start_loc", "seq_lens", "page_table")},
            slot_mapping=meta.slot_mapping,
            query_start_loc_cpu=meta.query_start_loc_cpu,
            seq_lens_cpu=meta.seq_lens_cpu,
            key_start_loc=meta.key_start_loc.float(),
        )


def test_a_paged_forward_refuses_ragged_metadata() -> None:
    layer = LAYERS["gqa"]
    layout = A.KVCacheLayout(2, 32, 16)
    cache = layout.allocate(4)
    meta = A.AttentionMetadata.for_ragged([2], [2])
    q, k, v, _ = _inputs(layer, meta, torch.float32, 0, extra=0)
    with pytest.raises(A.InvalidMetadataError, match="page_table"):
        reference.forward(q, k, v, cache, reference.plan(meta), layer)


# -- the reference against the float64 oracle ----------------------------------------------------


@pytest.mark.parametrize(
    ("name", "kind"),
    [(n, k) for n in sorted(LAYERS) for k in ("prefill", "extend")] + [("prefix", "prefix")],
)
def test_reference_matches_the_oracle(name: str, kind: str) -> None:
    layer = PREFIX if kind == "prefix" else LAYERS[name]
    for seed in range(4):  # odd seeds: no key_start_loc (derived)
        step = ragged_step(layer, kind, seed)
        meta = step.metadata
        lse = torch.full((meta.num_tokens, layer.num_heads), float("nan"))
        out = reference.forward_ragged(
            step.q, step.k, step.v, reference.plan(meta), layer, sinks=step.sinks, lse=lse
        )
        want, want_lse = _oracle(layer, meta, step.q, step.k, step.v, step.sinks)
        assert_close_to_reference(out, want, atol=1e-4, rtol=1e-4)
        seen = ~torch.isneginf(want_lse)
        assert torch.equal(torch.isneginf(lse), ~seen)
        assert_close_to_reference(lse[seen], want_lse[seen], atol=1e-4, rtol=1e-4)


def test_prefix_chunks_merged_with_the_new_tokens_equal_one_pass() -> None:
    """MLA's chunked prefill: new tokens causally over themselves, each prefix chunk without a
    mask (some empty), merged by their log-sum-exps, equals one causal pass over all keys."""
    causal = dataclasses.replace(PREFIX, causal=True)
    rng = random.Random(7)
    for seed in range(5):
        new = [rng.randint(1, 30) for _ in range(rng.randint(1, 5))]
        chunks = [[rng.choice([0, rng.randint(1, 40)]) for _ in new] for _ in range(2)]
        prefix = [a + b for a, b in zip(*chunks)]
        whole = A.AttentionMetadata.for_ragged(new, [p + n for p, n in zip(prefix, new)])
        q, _, _, _ = _inputs(PREFIX, whole, torch.float32, seed)
        gen = torch.Generator().manual_seed(100 + seed)
        parts = []  # per sequence: [chunk 0, chunk 1, new tokens] keys, in position order
        for b, n in enumerate(new):
            for length in (chunks[0][b], chunks[1][b], n):
                parts.append(
                    (
                        torch.randn(length, 8, 48, generator=gen),
                        torch.randn(length, 8, 32, generator=gen),
                    )
                )
        keys = [parts[3 * b : 3 * b + 3] for b in range(len(new))]
        want = reference.forward_ragged(
            q,
            torch.cat([x for seq in keys for x, _ in seq]),
            torch.cat([y for seq in keys for _, y in seq]),
            reference.plan(whole),
            causal,
        )
        acc = lse_acc = None
        for i, layer in ((0, PREFIX), (1, PREFIX), (2, causal)):
            lens = [chunks[i][b] if i < 2 else new[b] for b in range(len(new))]
            meta = A.AttentionMetadata.for_ragged(new, lens, cross_attention=i < 2)
            lse = torch.empty(meta.num_tokens, 8)
            out = reference.forward_ragged(
                q,
                torch.cat([seq[i][0] for seq in keys]),
                torch.cat([seq[i][1] for seq in keys]),
                reference.plan(meta),
                layer,
                lse=lse,
            )
            if acc is None:
                acc, lse_acc = out, lse
            else:
                acc, lse_acc = A.merge_states(acc, lse_acc, out, lse)
        assert_close_to_reference(acc, want, atol=1e-5, rtol=1e-5)


def test_an_empty_prefix_chunk_outputs_zeros_and_the_sink() -> None:
    layer = dataclasses.replace(PREFIX, has_sinks=True)
    meta = A.AttentionMetadata.for_ragged([3, 2], [0, 4], cross_attention=True)
    q, k, v, sinks = _inputs(layer, meta, torch.float32, 0)
    lse = torch.empty(5, 8)
    out = reference.forward_ragged(q, k, v, reference.plan(meta), layer, sinks=sinks, lse=lse)
    assert not out[:3].any()
    assert torch.equal(lse[:3], sinks.expand(3, 8))
    want, _ = _oracle(layer, meta, q, k, v, sinks)
    assert_close_to_reference(out, want, atol=1e-4, rtol=1e-4)


# -- checks and refusals --------------------------------------------------------------------------


def _args(layer: A.LayerSpec = LAYERS["gqa"]):  # type: ignore[no-untyped-def]
    meta = A.AttentionMetadata.for_ragged([2, 3], [4, 3])
    q, k, v, _ = _inputs(layer, meta, torch.float32, 0, extra=0)
    return q, k, v, reference.plan(meta), layer


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (lambda a: (a[0], a[1][:6], a[2][:6], *a[3:]), r"k\.shape\[0\]"),
        (lambda a: (a[0], a[1].half(), *a[2:]), r"k\.dtype"),
        (lambda a: (a[0], a[1], a[2][:, :, :16], *a[3:]), r"v\.shape"),
        (lambda a: (a[0][:4], *a[1:]), r"q\.shape\[0\]"),
        (lambda a: (*a[:3], a[3].metadata, a[4]), "plan"),
        (lambda a: (*a[:4], "layer"), "layer"),
    ],
    ids=["too-few-keys", "k-dtype", "v-dims", "too-few-queries", "metadata-as-plan", "layer"],
)
def test_bad_arguments_name_the_field(change, field: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(A.InvalidInputError, match=field):
        reference.forward_ragged(*change(_args()))


def test_tree_masks_graph_plans_sinks_and_lse_are_checked() -> None:
    q, k, v, plan, layer = _args()
    tree = dataclasses.replace(plan.metadata, tree_mask=torch.ones(5, 3, dtype=torch.bool))
    with pytest.raises(A.InvalidInputError, match="tree_mask"):
        reference.forward_ragged(q, k, v, dataclasses.replace(plan, metadata=tree), layer)
    graph = reference.plan_for_capture(
        reference.graph_state(4, 8, 4, page_size=16, device="cpu"), 2, 5
    )
    with pytest.raises(A.InvalidInputError, match="CUDA-graph plan"):
        reference.forward_ragged(q, k, v, graph, layer)
    with pytest.raises(A.InvalidInputError, match="sinks"):
        reference.forward_ragged(q, k, v, plan, layer, sinks=torch.zeros(8))
    with pytest.raises(A.InvalidInputError, match=r"lse\.shape"):
        reference.forward_ragged(q, k, v, plan, layer, lse=torch.empty(5, 3))


def test_refusals_carry_every_reason() -> None:
    meta = A.AttentionMetadata.for_ragged([2], [3], cross_attention=True)
    q, k, v, _ = _inputs(LAYERS["gqa"], meta, torch.float32, 0)
    with pytest.raises(A.UnsupportedConfigError, match="ragged") as err:
        reference.forward_ragged(q, k, v, reference.plan(meta), LAYERS["gqa"])
    assert [r.field for r in err.value.reasons] == ["causal"]  # cross: every key is seen
    mla = A.LayerSpec.for_mla(16, kv_lora_rank=64, rope_dim=16)
    assert [
        r.field for r in reference.unsupported_reasons(mla, None, "cpu", uses=(A.Feature.RAGGED,))
    ] == ["mla"]
    flex = FlexBackend(FlexOptions(compile=False))
    assert [
        r.field
        for r in flex.unsupported_reasons(LAYERS["gqa"], None, "cpu", uses=(A.Feature.RAGGED,))
    ] == ["ragged"]
    assert A.Feature.RAGGED not in flex.capabilities.features
    meta = A.AttentionMetadata.for_ragged([2], [2])
    q, k, v, _ = _inputs(LAYERS["gqa"], meta, torch.float32, 0)
    with pytest.raises(A.UnsupportedConfigError, match="ragged"):
        flex.forward_ragged(q, k, v, flex.plan(meta), LAYERS["gqa"])


def test_out_is_written_and_returned() -> None:
    q, k, v, plan, layer = _args()
    out = torch.full((5, 8, 32), float("nan"))
    assert reference.forward_ragged(q, k, v, plan, layer, out=out) is out
    assert_close_to_reference(out, reference.forward_ragged(q, k, v, plan, layer), atol=0, rtol=0)


def test_debug_mode_validates_ragged_calls() -> None:
    """Debug mode checks a ragged call as it checks a paged one: ``key_start_loc`` against
    ``seq_lens`` (which the kernels trust), NaN inputs, and a NaN output."""
    from attnsdk.selection.debug import wrap_debug

    debug = wrap_debug(ReferenceBackend())
    meta = A.AttentionMetadata.for_ragged([2, 5], [2, 5])
    q, k, v, _ = _inputs(PREFIX, meta, torch.float32, 0)
    plan = debug.plan(meta)
    assert_close_to_reference(
        debug.forward_ragged(q, k, v, plan, PREFIX),
        reference.forward_ragged(q, k, v, reference.plan(meta), PREFIX),
    )
    gap = dataclasses.replace(meta, key_start_loc=torch.tensor([0, 4, 9], dtype=torch.int32))
    with pytest.raises(A.InvalidMetadataError, match="key_start_loc"):
        debug.forward_ragged(q, k, v, debug.plan(gap), PREFIX)
    bad = q.clone()
    bad[1, 3, 0] = float("nan")
    with pytest.raises(A.InvalidInputError, match=r"q: .*finite"):
        debug.forward_ragged(bad, k, v, plan, PREFIX)
    bad = v.clone()
    bad[6, 0, 0] = float("nan")  # a key row of sequence 1
    with pytest.raises(A.InvalidInputError, match=r"v: .*finite"):
        debug.forward_ragged(q, k, bad, plan, PREFIX)
    tail = v.clone()
    tail[-1] = float("nan")  # past the last sequence's keys: never read, not checked
    debug.forward_ragged(q, k, tail, plan, PREFIX)


def test_debug_mode_refuses_ragged_on_a_backend_without_it() -> None:
    """A backend without ``Feature.RAGGED`` (its ``forward_ragged`` is BackendBase's default)
    refuses a ragged call, typed and named, through debug mode as without it."""
    from attnsdk.selection.debug import DebugBackend

    class Paged(ReferenceBackend):
        name = "paged-only"
        capabilities = dataclasses.replace(
            reference.capabilities, features=reference.capabilities.features - {A.Feature.RAGGED}
        )

    meta = A.AttentionMetadata.for_ragged([1], [1])
    q, k, v = _inputs(PREFIX, meta, torch.float32, 0)[:3]
    for backend in (Paged(), DebugBackend(Paged())):
        with pytest.raises(A.UnsupportedConfigError, match="forward_ragged") as info:
            backend.forward_ragged(q, k, v, backend.plan(meta), PREFIX)
        assert [r.field for r in info.value.reasons] == ["ragged"]


def test_host_facts_are_read_once_per_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every layer of a step shares its plan's host facts (key rows, key starts, keyless rows):
    read on the first call only, also with plans used in turn (SGLang's chunks); a new
    metadata is read anew, and its keyless rows are its own."""
    import attnsdk.backends.base as base

    calls: list[A.AttentionMetadata] = []
    real = base.ragged_step

    def counting(meta: A.AttentionMetadata) -> object:
        calls.append(meta)
        return real(meta)

    monkeypatch.setattr(base, "ragged_step", counting)
    backend = ReferenceBackend()
    chunks = [
        A.AttentionMetadata.for_ragged([2, 3], lens, cross_attention=True)
        for lens in ([4, 0], [0, 5])
    ]
    plans = [backend.plan(meta) for meta in chunks]
    for _ in range(3):  # layers
        for meta, plan in zip(chunks, plans, strict=True):
            q, k, v, _ = _inputs(PREFIX, meta, torch.float32, 0)
            lse = torch.empty(5, PREFIX.num_heads)
            out = backend.forward_ragged(q, k, v, plan, PREFIX, lse=lse)
            empty, full = (
                (slice(0, 2), slice(2, 5)) if meta is chunks[1] else (slice(2, 5), slice(0, 2))
            )
            assert bool((out[empty] == 0).all())
            assert bool(torch.isneginf(lse[empty]).all())
            assert bool(torch.isfinite(lse[full]).all())
    assert [id(meta) for meta in calls] == [id(meta) for meta in chunks]
