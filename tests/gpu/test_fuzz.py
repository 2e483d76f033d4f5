"""Fuzzing fa3 against the reference backend on the GPU, and its guards (sm90 only).

- Thousands of random batches over random layers and layouts (GQA/MQA/MHA, head dims, fp16 /
  bf16 / fp8 KV, windows, sinks, page sizes, NHD / HND), with q/k/v handed as strided views
  as often as contiguous tensors: output and the whole cache must match the reference backend.
- The KV store's guards: a slot past the cache is never written, whatever the backend is
  asked; it is reported as ``InvalidMetadataError`` by a later ``plan`` (never silently) and at
  once in debug mode.
- The bad-input cases of tests/core/test_bad_inputs.py, through fa3: same typed errors, cache
  untouched.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any

import pytest
import torch

import attnsdk as A
from attnsdk.backends.reference import ReferenceBackend
from attnsdk.testing import BatchSpec, assert_close_to_reference, make_batch

if TYPE_CHECKING:
    from attnsdk.testing import Batch

pytestmark = [pytest.mark.gpu, pytest.mark.sm90, pytest.mark.fa3]

DEV = "cuda"
FP8 = torch.float8_e4m3fn
ROUNDS = 40
"""Parametrized rounds; each runs BATCHES_PER_ROUND batches (2,000 in all)."""
BATCHES_PER_ROUND = 50


@pytest.fixture(scope="module")
def fa3() -> A.Backend:
    return A.create_backend("fa3")


@pytest.fixture(scope="module")
def ref() -> A.Backend:
    return ReferenceBackend()


def random_config(r: random.Random) -> tuple[A.LayerSpec, A.KVCacheLayout]:
    """A layer and a cache layout fa3 declares it serves (every reason checked, none skipped)."""
    while True:
        hkv = r.choice([1, 2, 4, 8])
        hq = hkv * r.choice([1, 2, 4, 8])
        d = r.choice([64, 96, 128, 256])
        dtype = r.choice([torch.bfloat16, torch.float16])
        quantized = dtype == torch.bfloat16 and r.random() < 0.2
        layer = A.LayerSpec(
            num_heads=hq,
            num_kv_heads=hkv,
            head_dim=d,
            causal=r.random() < 0.9,
            sliding_window=r.choice([None, None, 1, 7, 64, 500]),
            has_sinks=r.random() < 0.25,
            softcap=r.choice([None, None, None, 30.0]),
        )
        layout = A.KVCacheLayout(
            hkv,
            d,
            r.choice([1, 16, 16, 64, 256]),
            dtype,
            order=r.choice(["NHD", "NHD", "HND"]),
            kv_dtype=FP8 if quantized else None,
        )
        if not A.explain("fa3", layer, layout, DEV)["fa3"]:
            return layer, layout


def random_spec(r: random.Random) -> BatchSpec:
    q, s = [], []
    for _ in range(r.randint(1, 12)):
        kind = r.choice(["decode", "decode", "extend", "prefill", "verify", "empty"])
        ctx = 0 if kind in ("prefill", "empty") else r.randint(1, 700)
        qi = {"decode": 1, "empty": 0, "verify": 4}.get(kind) or r.randint(2, 90)
        q.append(qi)
        s.append(ctx + qi)
    if not sum(q):
        q[0], s[0] = 1, s[0] + 1
    return BatchSpec(tuple(q), tuple(s), "fuzz")


def strided(x: torch.Tensor, r: random.Random) -> torch.Tensor:
    """``x``'s values in a tensor with other strides: every other element of the last dim, or
    heads and tokens swapped in memory."""
    if r.random() < 0.5:
        wide = torch.empty(*x.shape[:-1], 2 * x.shape[-1], dtype=x.dtype, device=x.device)
        view = wide[..., 1::2]
    else:
        view = torch.empty(x.shape[1], x.shape[0], x.shape[2], dtype=x.dtype, device=x.device)
        view = view.transpose(0, 1)
    view.copy_(x)
    return view


def run_both(fa3: A.Backend, ref: A.Backend, batch: Batch, r: random.Random) -> None:
    q, k, v = batch.q, batch.k, batch.v
    if r.random() < 0.5:
        q, k, v = (strided(x, r) for x in (q, k, v))
    fp8 = batch.cache.layout.kv_dtype
    outs = []
    for backend in (fa3, ref):
        cache = batch.fresh_cache()
        # With an fp8 cache FA3 multiplies q in fp8 too (as SGLang does): the reference gets
        # the same rounded q, so the comparison measures attention, not q's rounding.
        qb = q if fp8 is None or backend is fa3 else q.clamp(-448, 448).to(fp8).to(q.dtype)
        out = backend.forward(
            qb, k, v, cache, backend.plan(batch.metadata), batch.layer,
            sinks=batch.sinks, k_scale=batch.k_scale, v_scale=batch.v_scale,
        )  # fmt: skip
        outs.append((out[: batch.metadata.num_tokens], cache))
    (out, cache), (want, want_cache) = outs
    # FA3 also rounds the softmax probabilities through fp8 before the PV product: over 2,000
    # random fp8 batches the worst error reached 0.064, just past the default 0.06.
    atol = None if fp8 is None else 0.1
    assert_close_to_reference(out, want, kv_dtype=fp8, atol=atol)
    if fp8 is None:
        assert torch.equal(cache.k, want_cache.k), "K caches differ"
        assert torch.equal(cache.v, want_cache.v), "V caches differ"
    else:  # one fp8 step apart at most (the store scales by 1/s, the reference divides by s)
        torch.testing.assert_close(cache.k.float(), want_cache.k.float(), rtol=0.13, atol=1e-2)
        torch.testing.assert_close(cache.v.float(), want_cache.v.float(), rtol=0.13, atol=1e-2)


@pytest.mark.parametrize("round_", range(ROUNDS))
def test_random_batches_match_reference(fa3: A.Backend, ref: A.Backend, round_: int) -> None:
    r = random.Random(1000 + round_)
    for i in range(BATCHES_PER_ROUND):
        layer, layout = random_config(r)
        batch = make_batch(random_spec(r), layer, layout, seed=round_ * 1000 + i, device=DEV)
        run_both(fa3, ref, batch, r)


# --- the KV store's guards ---------------------------------------------------------------------


def _slot_past_the_cache(batch: Batch) -> A.AttentionMetadata:
    meta = batch.metadata
    slots = meta.slot_mapping.clone()
    slots[0] = batch.cache.num_pages * batch.cache.layout.page_size + 5
    return A.AttentionMetadata.from_tensors(
        query_start_loc=meta.query_start_loc,
        seq_lens=meta.seq_lens,
        page_table=meta.page_table,
        slot_mapping=slots,
        query_start_loc_cpu=meta.query_start_loc_cpu,
        seq_lens_cpu=meta.seq_lens_cpu,
        page_size=meta.page_size,
    )


def _guard_batch() -> Batch:
    layer = A.LayerSpec(num_heads=8, num_kv_heads=2, head_dim=128)
    layout = A.KVCacheLayout(2, 128, 16, torch.bfloat16)
    return make_batch(BatchSpec.mixed(batch_size=4, seed=3), layer, layout, device=DEV)


def test_a_slot_past_the_cache_is_never_written_and_is_reported() -> None:
    fa3 = A.create_backend("fa3")
    batch = _guard_batch()
    bad = _slot_past_the_cache(batch)
    cache = batch.fresh_cache()
    before_k, before_v = cache.k.clone(), cache.v.clone()
    fa3.forward(batch.q, batch.k, batch.v, cache, fa3.plan(bad), batch.layer)
    torch.cuda.synchronize()
    # Nothing outside the cache (the allocation is exact, so an out-of-bounds write would land
    # in other memory); inside it, only the valid slots changed.
    want = batch.fresh_cache()
    valid = bad.slot_mapping >= 0
    valid[0] = False
    want.k.view(-1, 2, 128)[bad.slot_mapping[valid]] = batch.k[valid]
    want.v.view(-1, 2, 128)[bad.slot_mapping[valid]] = batch.v[valid]
    assert torch.equal(cache.k, want.k)
    assert torch.equal(cache.v, want.v)
    assert not torch.equal(cache.k, before_k)
    assert not torch.equal(cache.v, before_v)
    # Reported by a later plan, without a sync on the step that carried it; then clear.
    error = _reported_by_a_later_plan(fa3, batch.metadata)
    assert error.field == "slot_mapping"
    assert f"slot {int(bad.slot_mapping[0])}" in str(error)
    fa3.plan(batch.metadata)


def _reported_by_a_later_plan(fa3: A.Backend, meta: A.AttentionMetadata) -> A.InvalidMetadataError:
    from attnsdk.kernels.store import DeviceFlag

    for _ in range(2 * DeviceFlag.POLL_EVERY + 1):
        try:
            fa3.plan(meta)
        except A.InvalidMetadataError as exc:
            return exc
        torch.cuda.synchronize()
    raise AssertionError("a slot past the cache was never reported")


def test_debug_mode_reports_a_bad_slot_at_the_forward() -> None:
    fa3 = A.create_backend(A.AttentionConfig(backend="fa3", debug=True))
    batch = _guard_batch()
    cache = batch.fresh_cache()
    before_k = cache.k.clone()
    with pytest.raises(A.InvalidMetadataError, match="slot_mapping"):
        fa3.forward(
            batch.q, batch.k, batch.v, cache, fa3.plan(_slot_past_the_cache(batch)), batch.layer
        )
    assert torch.equal(cache.k, before_k), "debug mode validates before anything is written"


def test_debug_mode_passes_a_valid_batch() -> None:
    fa3 = A.create_backend(A.AttentionConfig(backend="fa3", debug=True))
    batch = _guard_batch()
    out, _ = batch.run(fa3)
    want, _ = batch.run(ReferenceBackend())
    assert_close_to_reference(out, want)


# --- bad inputs through fa3 ---------------------------------------------------------------------


def _page_size_8(batch: Batch) -> A.Plan:
    meta = batch.metadata
    return A.Plan(
        A.AttentionMetadata.from_tensors(
            query_start_loc=meta.query_start_loc,
            seq_lens=meta.seq_lens,
            page_table=meta.page_table,
            slot_mapping=meta.slot_mapping,
            query_start_loc_cpu=meta.query_start_loc_cpu,
            seq_lens_cpu=meta.seq_lens_cpu,
            page_size=8,
        )
    )


BF16 = torch.bfloat16
# (id, changes to forward's arguments, field named in the error)
BAD: list[tuple[str, Any, str]] = [
    (
        "q-heads",
        lambda b: {"q": torch.randn(b.q.shape[0], 9, 128, device=DEV, dtype=BF16)},
        "q.shape",
    ),
    ("q-on-cpu", lambda b: {"q": b.q.cpu()}, "q.device"),
    ("q-fp16", lambda b: {"q": b.q.half()}, "q.dtype"),
    ("k-on-cpu", lambda b: {"k": b.k.cpu()}, "k.device"),
    ("v-fp32", lambda b: {"v": b.v.float()}, "v.dtype"),
    ("k-without-v", lambda b: {"v": None}, "k/v"),
    ("out-on-cpu", lambda b: {"out": torch.empty(b.q.shape, dtype=BF16)}, "out.device"),
    (
        "out-heads",
        lambda b: {"out": torch.empty(b.q.shape[0], 4, 128, device=DEV, dtype=BF16)},
        "out.shape",
    ),
    ("sinks-unexpected", lambda b: {"sinks": torch.zeros(8, device=DEV)}, "sinks"),
    ("metadata-not-plan", lambda b: {"plan": b.metadata}, "plan"),
    ("cache-none", lambda b: {"cache": None}, "cache"),
    ("page-size-mismatch", lambda b: {"plan": _page_size_8(b)}, "plan.metadata.page_size"),
    ("k-scale-on-bf16-cache", lambda b: {"k_scale": torch.ones((), device=DEV)}, "k_scale"),
]


@pytest.mark.parametrize(("case_id", "mutate", "field"), BAD, ids=[c[0] for c in BAD])
def test_bad_forward_arguments_through_fa3(
    fa3: A.Backend, case_id: str, mutate: Any, field: str
) -> None:
    batch = _guard_batch()
    cache = batch.fresh_cache()
    kwargs: dict[str, Any] = {
        "q": batch.q, "k": batch.k, "v": batch.v, "cache": cache,
        "plan": fa3.plan(batch.metadata), "layer": batch.layer,
    }  # fmt: skip
    kwargs.update(mutate(batch))
    before = (cache.k.clone(), cache.v.clone())
    with pytest.raises(A.AttnSDKError) as info:
        fa3.forward(**kwargs)
    assert getattr(info.value, "field", "").startswith(field), str(info.value)
    torch.cuda.synchronize()
    assert torch.equal(cache.k, before[0])
    assert torch.equal(cache.v, before[1])
