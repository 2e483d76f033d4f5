"""Tree verify (``AttentionMetadata.tree_mask``, ``attnsdk.features.tree``): the mask's checks, who
refuses what, and the backends that serve it against the float64 oracle on random trees."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from backend_variants import NoTreesBackend
from fake_fa3 import CPUFA3, fake_fa3
from oracle import run_oracle

import attnsdk as A
from attnsdk import tree_mask_from_parents
from attnsdk.backends.flex import FlexBackend, FlexOptions
from attnsdk.backends.reference import ReferenceBackend
from attnsdk.testing import Batch, BatchSpec, assert_close_to_reference, make_batch

LAYER = A.LayerSpec(num_heads=4, num_kv_heads=2, head_dim=32)
LAYOUT = A.KVCacheLayout(2, 32, 16, dtype=torch.float32)
reference = ReferenceBackend()


def _meta(mask: torch.Tensor, query_lens: list[int] | None = None) -> A.AttentionMetadata:
    q = query_lens or [3, 2]
    return A.AttentionMetadata.from_seqlens(
        q, [s + 20 for s in q], [[1, 2], [3, 4]], 16, tree_mask=mask
    )


# -- the mask and its checks -------------------------------------------------------------------


def test_parents_make_ancestor_rows() -> None:
    mask = tree_mask_from_parents([[-1, 0, 1, 0], [], [-1, -1]])
    assert mask.tolist() == [
        [True, False, False, False],
        [True, True, False, False],
        [True, True, True, False],
        [True, False, False, True],
        [True, False, False, False],
        [False, True, False, False],
    ]
    assert tree_mask_from_parents([]).shape == (0, 0)


@pytest.mark.parametrize(("parents", "field"), [([[0]], r"parents\[0\]\[0\]"),
                                                ([[-1, 2, 0]], r"parents\[0\]\[1\]"),
                                                ([[-1], [-2]], r"parents\[1\]\[0\]"),
                                                ([[-1, True]], r"parents\[0\]\[1\]")])  # fmt: skip
def test_a_parent_after_its_child_is_refused(parents: list[list[int]], field: str) -> None:
    with pytest.raises(A.InvalidInputError, match=field):
        tree_mask_from_parents(parents)


def test_the_host_checks_name_the_field() -> None:
    with pytest.raises(A.InvalidMetadataError, match=r"tree_mask.*torch.bool"):
        _meta(torch.ones(5, 3, dtype=torch.int32))
    with pytest.raises(A.InvalidMetadataError, match=r"tree_mask.*torch.bool"):
        _meta(torch.ones(5, dtype=torch.bool))
    for shape in ((4, 3), (5, 2)):  # too few rows (T = 5), too few columns (max query 3)
        meta = _meta(torch.ones(5, 3, dtype=torch.bool))
        short = dataclasses.replace(meta, tree_mask=torch.ones(*shape, dtype=torch.bool))
        with pytest.raises(A.InvalidMetadataError, match=r"tree_mask.*num_tokens=5"):
            reference.plan(short)


def test_validate_wants_every_draft_token_to_see_itself() -> None:
    mask = tree_mask_from_parents([[-1, 0, 0], [-1, 0]])
    _meta(mask).validate(LAYOUT, reserved_page=None)
    mask[4, 1] = False  # row 4 is new token 1 of the second sequence
    with pytest.raises(A.InvalidMetadataError, match=r"tree_mask\[4, 1\]"):
        _meta(mask).validate(LAYOUT, reserved_page=None)


# -- who refuses what --------------------------------------------------------------------------


def test_a_backend_without_tree_masks_refuses_the_step_at_plan() -> None:
    with pytest.raises(A.UnsupportedConfigError, match="cannot serve this step") as err:
        NoTreesBackend().plan(_meta(tree_mask_from_parents([[-1, 0, 0], [-1, 0]])))
    assert [r.field for r in err.value.reasons] == ["tree_mask"]


@pytest.mark.parametrize(
    ("layer", "fields"),
    [
        ({"sliding_window": 8}, ["sliding_window"]),
        ({"attention_chunk_size": 32}, ["attention_chunk_size"]),
        ({"causal": False}, ["causal"]),
    ],
)
def test_layers_a_tree_does_not_define_are_refused_before_writing(
    layer: dict[str, object], fields: list[str]
) -> None:
    spec = BatchSpec.verify(batch_size=3, draft_tokens=4, seed=1)
    batch = make_batch(spec, dataclasses.replace(LAYER, **layer), LAYOUT, tree=True)
    cache = batch.fresh_cache()
    with pytest.raises(A.UnsupportedConfigError) as err:
        batch.run(reference, cache)
    assert [r.field for r in err.value.reasons] == fields
    assert torch.equal(cache.k, batch.cache.k)


def test_a_tree_step_is_not_replayed_from_a_graph() -> None:
    state = reference.graph_state(4, 16, 4, page_size=16, device="cpu")
    captured = reference.plan_for_capture(state, 2, 5, max_query_len=3)
    with pytest.raises(A.UnsupportedConfigError, match="graph") as err:
        reference.plan_for_replay(captured, _meta(tree_mask_from_parents([[-1, 0, 0], [-1, 0]])))
    assert [r.field for r in err.value.reasons] == ["tree_mask"]


def test_routed_declares_trees_when_every_route_serves_them() -> None:
    both = A.create_backend(A.AttentionConfig(backend="routed", decode="reference", prefill="flex"))
    assert A.Feature.TREE_MASK in both.capabilities.features


FA3_LAYER = A.LayerSpec(num_heads=8, num_kv_heads=2, head_dim=64)
"""A layer the fake FA3 kernel (bf16) serves; the fa3 tests below run tree steps of it."""


def _fa3_tree_batch(spec: BatchSpec | None = None, order: str = "NHD", seed: int = 0) -> Batch:
    """A bf16 tree-verify batch of ``FA3_LAYER`` (two sequences of 3 drafts by default)."""
    layout = A.KVCacheLayout(2, 64, 16, dtype=torch.bfloat16, order=order)
    spec = spec or BatchSpec.verify(batch_size=2, draft_tokens=3)
    return make_batch(spec, FA3_LAYER, layout, tree=True, seed=seed)


def test_fa3_refuses_a_tree_on_a_cache_without_token_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_fa3(monkeypatch)
    batch = _fa3_tree_batch(order="HND")
    cache = batch.fresh_cache()
    with pytest.raises(A.UnsupportedConfigError, match="tree verify") as err:
        batch.run(CPUFA3(), cache)
    assert [r.field for r in err.value.reasons] == ["tree_mask"]
    assert torch.equal(cache.k, batch.cache.k)


def test_tree_passes_say_on_the_host_whether_a_sequence_has_no_context() -> None:
    """The two-pass split (fa3) masks the context pass's lse only when some sequence has no
    context: the host twins tell, and the device mask marks exactly its rows."""
    from attnsdk.features.tree import tree_passes

    mask = tree_mask_from_parents([[-1, 0, 0], [-1, 0]])
    with_context = tree_passes(_meta(mask), 16)
    assert not with_context.some_context_empty
    assert not bool(with_context.context_empty.any())
    fresh = A.AttentionMetadata.from_seqlens([3, 2], [23, 2], [[1, 2], [3, 4]], 16, tree_mask=mask)
    passes = tree_passes(fresh, 16)  # the second sequence's drafts are all it has
    assert passes.some_context_empty
    assert passes.context_empty.tolist() == [False, False, False, True, True]
    assert passes.drafts.seq_lens.tolist() == [1, 2, 2, 1, 2]


def test_fa3_refuses_a_tree_with_a_provider_that_returns_no_lse(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The passes are merged by their log-sum-exps: a wrapper without return_softmax_lse
    cannot serve a tree, and says so before anything is written."""
    kernel = fake_fa3(monkeypatch)
    monkeypatch.setattr(type(kernel), "returns_lse", False)
    batch = _fa3_tree_batch()
    cache = batch.fresh_cache()
    with pytest.raises(A.UnsupportedConfigError, match="log-sum-exp") as err:
        batch.run(CPUFA3(), cache)
    assert [r.field for r in err.value.reasons] == ["tree_mask"]
    assert torch.equal(cache.k, batch.cache.k)
    assert kernel.batch_sizes == []


def test_fa3_tree_passes_get_scheduler_metadata_once_per_plan(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With FA3's scheduler op, both passes of a tree step get scheduler metadata (non-causal;
    pages of the cache, then pages of one token), made in plan() for the prepared layer and
    reused by every layer, and each launch gets its own pass's."""
    kernel = fake_fa3(monkeypatch)
    made: list[tuple[object, ...]] = []
    given: list[object] = []

    def scheduler(*args: object) -> torch.Tensor:
        made.append(args)
        return torch.tensor([len(made)])

    real_call = type(kernel).__call__

    def call(self: object, *args: object, **kw: object) -> object:
        given.append(kw["scheduler_metadata"])
        return real_call(self, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(kernel, "scheduler", scheduler, raising=False)
    monkeypatch.setattr(type(kernel), "__call__", call)
    backend = CPUFA3()
    batch = _fa3_tree_batch()
    backend.prepare([FA3_LAYER], batch.cache.layout)  # make_plan plans the declared shapes
    cache = batch.fresh_cache()
    plan = backend.plan(batch.metadata)
    for _ in range(2):  # two layers of one step
        backend.forward(batch.q, batch.k, batch.v, cache, plan, FA3_LAYER)
    # get_scheduler_metadata's page_size and causal arguments, per pass
    assert [(args[14], args[16]) for args in made] == [(16, False), (1, False)]
    assert [int(t) for t in given] == [1, 2, 1, 2]  # type: ignore[call-overload]


def test_fa3_tree_does_not_read_what_the_kernel_leaves_in_empty_rows(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A sequence with no context gives its rows an empty context pass. Whatever a kernel
    leaves there (here: NaN output, +inf log-sum-exp) must not reach the merged result."""
    kernel = fake_fa3(monkeypatch)
    real_call = type(kernel).__call__

    def call(self: object, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             out: torch.Tensor, **kw: object) -> object:  # fmt: skip
        native = real_call(self, q, k, v, out, **kw)  # type: ignore[arg-type]
        lens, qsl = kw["cache_seqlens"], kw["cu_seqlens_q"]
        for b in torch.nonzero(lens == 0).flatten().tolist():  # type: ignore[operator]
            rows = slice(int(qsl[b]), int(qsl[b + 1]))  # type: ignore[index]
            out[rows] = float("nan")
            if native is not None:
                native[rows] = float("inf")
        return native

    monkeypatch.setattr(type(kernel), "__call__", call)
    spec = BatchSpec((3, 2, 4), (3, 22, 9), "verify")  # the first sequence has no context
    batch = _fa3_tree_batch(spec, seed=4)
    want, _ = batch.run(reference)
    got, _ = batch.run(CPUFA3())
    n = batch.metadata.num_tokens
    assert bool(got[:n].isfinite().all())
    assert_close_to_reference(got[:n], want[:n], atol=2e-2, rtol=2e-2)


# -- served: against the float64 oracle --------------------------------------------------------


BACKENDS = {"reference": reference, "flex": FlexBackend(FlexOptions(compile=False))}


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_random_trees_match_the_oracle(name: str) -> None:
    backend = BACKENDS[name]
    r = random.Random(7)
    for seed in range(25):
        spec = BatchSpec.random(r, max_batch=5, max_context=70, max_query=9)
        layer = dataclasses.replace(
            LAYER, has_sinks=r.random() < 0.3, softcap=3.0 if r.random() < 0.3 else None
        )
        batch = make_batch(spec, layer, LAYOUT, seed=seed, tree=True)
        expected = run_oracle(batch)
        out, lse, _ = batch.run_with_lse(backend)
        n = batch.metadata.num_tokens
        assert_close_to_reference(out[:n], expected.out.float(), atol=1e-4, rtol=1e-4)
        assert_close_to_reference(lse[:n], expected.lse.float(), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_a_chain_tree_is_plain_causal_and_a_branch_is_not(name: str) -> None:
    """Against the reference's plain causal step (no mask): a chain-shaped tree gives it
    exactly, and a branch moves only the rows whose ancestors it changes."""
    backend = BACKENDS[name]
    spec = BatchSpec.verify(batch_size=3, draft_tokens=5, seed=2)
    batch = make_batch(spec, LAYER, LAYOUT, seed=2)
    causal, _ = batch.run(reference)

    def with_tree(parents: list[int]) -> torch.Tensor:
        mask = tree_mask_from_parents([parents] * 3)
        meta = dataclasses.replace(batch.metadata, tree_mask=mask)
        out, _ = dataclasses.replace(batch, metadata=meta).run(backend)
        return out

    assert_close_to_reference(with_tree(list(range(-1, 4))), causal, atol=1e-5, rtol=1e-5)
    branch = with_tree([-1, 0, 0, 1, 2])  # token 2 does not see token 1
    assert float((branch[2] - causal[2]).abs().max()) > 1e-2
    assert_close_to_reference(branch[:2], causal[:2], atol=1e-5, rtol=1e-5)


# -- drafts the engine stored itself, and rows the step does not own ---------------------------


TREE_BACKENDS = ("fa3", "flex")


def _tree_backend(name: str, monkeypatch: pytest.MonkeyPatch) -> A.Backend:
    if name == "fa3":
        fake_fa3(monkeypatch)
        return CPUFA3()
    return FlexBackend(FlexOptions(compile=False))


@pytest.mark.parametrize("name", TREE_BACKENDS)
def test_drafts_the_engine_stored_are_read_through_the_page_table(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An engine that wrote the drafts itself passes k = v = None and slots of -1 ("do not
    write"): every key, the drafts included, is where the page table says it is."""
    backend = _tree_backend(name, monkeypatch)
    r = random.Random(11)
    for seed in range(12):
        spec = BatchSpec.random(r, max_batch=4, max_context=40, max_query=6)
        batch = _fa3_tree_batch(spec, seed=seed)
        stored = batch.fresh_cache()
        meta = batch.metadata
        t = meta.num_tokens
        stored.store(batch.k[:t], batch.v[:t], meta.slot_mapping[:t])  # the engine's own write
        unwritten = dataclasses.replace(meta, slot_mapping=torch.full_like(meta.slot_mapping, -1))
        want = reference.forward(batch.q, None, None, stored, reference.plan(unwritten), FA3_LAYER)
        got = backend.forward(batch.q, None, None, stored, backend.plan(unwritten), FA3_LAYER)
        assert_close_to_reference(got[:t], want[:t], atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("name", ["reference", *TREE_BACKENDS])
def test_a_tree_step_serves_extra_rows_and_a_last_sequence_without_queries(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """q may have more rows than ``num_tokens`` (their output is unspecified) and the last
    sequence may have no queries: both are served as the reference serves them, not a crash
    after the store."""
    backend = reference if name == "reference" else _tree_backend(name, monkeypatch)
    spec = BatchSpec((3, 2, 0), (20, 9, 5), "verify")
    batch = _fa3_tree_batch(spec, seed=3)
    t = batch.metadata.num_tokens
    extra = 3
    q, k, v = (torch.cat([x, x[:extra]]) for x in (batch.q, batch.k, batch.v))
    want_cache, got_cache = batch.fresh_cache(), batch.fresh_cache()
    want = reference.forward(q, k, v, want_cache, reference.plan(batch.metadata), FA3_LAYER)
    got = backend.forward(q, k, v, got_cache, backend.plan(batch.metadata), FA3_LAYER)
    assert got.shape[0] == t + extra
    assert_close_to_reference(got[:t], want[:t], atol=2e-2, rtol=2e-2)
    assert torch.equal(got_cache.k, want_cache.k)
