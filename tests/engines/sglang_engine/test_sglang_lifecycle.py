"""Request lifecycles through SGLang's own objects, served by attnsdk's drop-in backend.

Real ``ReqToTokenPool``, ``MHATokenToKVPool``, KV allocator, ``ForwardBatch``, ``RadixAttention``
layers (GQA, sliding window, softcap, ENCODER_ONLY) and ``EagleVerifyInput``; the drop-in is
registered with SGLang's ``register_attention_backend`` and created from the registry by the model
runner's own code (real_sglang.py). One lifecycle per page size (1, 16) and dtype (bf16, fp32):
chunked prefill, decodes, a MIXED step (as MIXED, and as EXTEND: 0.5.23's eager runner rewrites
it), a radix-cache hit, chain verify, an IDLE batch, a finished request whose row and pages a new
request reuses, and a DP-attention padded extend (``ForwardBatch._pad_inputs_to_size``).

At every step and layer the output and the *whole* K and V buffers must equal a float64 oracle
written from DESIGN §2 and, where SGLang's ``TorchNativeAttnBackend`` serves the step, that
backend run on a twin pool (not in TARGET_VERIFY; not for the softcap layer, whose ``logit_cap``
it ignores, nor on 0.5.12 for the window layer). The IDLE batch must not reach the attnsdk
backend at all. Tree verify (NGRAM, EAGLE topk > 1) is served with SGLang's custom mask (and
refused at start-up by a backend without tree masks); forward keywords SGLang passes with
non-default values (fp8 descales, ...) are refused, never computed as something else; every keyword at its default is accepted, and ``return_lse=True`` returns
``(output, lse)``.
"""

from __future__ import annotations

import dataclasses
import inspect
from types import SimpleNamespace

import pytest
import torch
from real_sglang import (
    DROPIN,
    HKV,
    HQ,
    NEW_HOOKS,
    D,
    Engine,
    EngineRunner,
    Pools,
    attend,
    chain_verify_input,
    create_backend,
    random_qkv,
)
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.speculative.ngram_info import NgramVerifyInput

from attnsdk import Feature, UnsupportedConfigError
from attnsdk.adapters.sglang import SGLangAttentionBackend
from attnsdk.backends.reference import ReferenceBackend

M = ForwardMode


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_lifecycle(page_size, dtype, monkeypatch):
    e = Engine(page_size, dtype)
    t = e.table
    a, b, d = t.admit(), t.admit(), t.admit()

    def commit(items):
        for req, n in items:
            req.length += n

    # Prefill: two whole prompts and the first chunk of D's (chunked prefill).
    items = [(a, 20), (b, 7), (d, 10)]
    e.run(t.batch(M.EXTEND, items))
    commit(items)
    for _ in range(2):  # D is still prefilling: only A and B decode
        items = [(a, 1), (b, 1)]
        e.run(t.batch(M.DECODE, items))
        commit(items)

    # MIXED: D's last chunk with the running decodes. 0.5.12 hands the backend MIXED; 0.5.23's
    # eager runner rewrites it to EXTEND first. Both must give the same step.
    items = [(d, 11), (a, 1), (b, 1)]
    e.gen.manual_seed(1)
    mixed = e.run(t.batch(M.MIXED, items))
    as_extend = t.batch(M.MIXED, items)  # the same slots: they are reserved already
    as_extend.forward_mode = M.EXTEND  # what EagerRunner.execute does on 0.5.23
    e.gen.manual_seed(1)
    for x, y in zip(mixed, e.run(as_extend), strict=True):
        assert torch.equal(x, y)
    commit(items)
    for _ in range(2):
        items = [(a, 1), (b, 1), (d, 1)]
        e.run(t.batch(M.DECODE, items))
        commit(items)

    # Radix-cache hit: C starts with A's first 16 tokens (whole pages) and extends 5.
    c = t.admit()
    t.share_prefix(c, a, 16)
    items = [(c, 5)]
    fb = t.batch(M.EXTEND, items)
    assert fb.extend_prefix_lens_cpu == [16]
    e.run(fb)
    commit(items)

    # EAGLE verify of a 3-token draft chain (topk 1); each request accepts some drafts.
    items = [(a, 3), (b, 3), (c, 3), (d, 3)]
    fb = t.batch(M.TARGET_VERIFY, items, spec_info=chain_verify_input(items))
    seq_after = [r.length + 3 for r, _ in items]
    e.run(fb, native=False, query_lens=[3] * 4, seq_lens=seq_after)
    for (req, _), accepted in zip(items, (3, 1, 0, 2)):
        req.length += accepted  # rejected drafts' slots stay with the request

    # IDLE (a DP rank without requests): no init_forward_metadata, no attnsdk call at all.
    idle = t.batch(M.IDLE, [])
    for name in ("plan", "forward", "plan_for_replay"):
        monkeypatch.setattr(e.dropin.backend, name, _forbidden(name))
    before = [(k.clone(), v.clone()) for k, v in e.pools.buffers()]
    for layer in e.layers:
        q, k, v = random_qkv(0, dtype, e.gen)
        out = attend(e.dropin, layer, q, k, v, idle)
        assert out.shape == (0, q.shape[1])
    assert all(torch.equal(x, y) for pair in zip(e.pools.buffers(), before) for x, y in zip(*pair))
    monkeypatch.undo()

    items = [(a, 1), (b, 1), (c, 1), (d, 1)]
    e.run(t.batch(M.DECODE, items))
    commit(items)

    # B finishes: its row and pages go back to SGLang's pools, and F gets them (every other
    # page is held, as by other requests) while they still hold B's KV.
    alloc = e.pools.allocator
    held = alloc.alloc(alloc.available_size())
    freed = t.finish(b)
    f = t.admit()
    assert f.row == b.row, "the only free request row must be reused"
    items = [(f, 12)]
    fb = t.batch(M.EXTEND, items)
    assert set(f.slots) <= set(freed)
    alloc.free(held)
    e.run(fb)
    commit(items)

    # DP attention pads an extend batch with extra tokens (slot 0) to a common size.
    items = [(f, 6), (a, 3)]
    fb = t.batch(M.EXTEND, items)
    fb._pad_inputs_to_size(SimpleNamespace(attn_backend=e.dropin), 16, fb.batch_size)
    assert fb.out_cache_loc.shape[0] == 16
    assert fb.out_cache_loc[9:].eq(0).all()
    e.run(fb)
    commit(items)

    items = [(a, 1), (c, 1), (d, 1), (f, 1)]
    e.run(t.batch(M.DECODE, items))


@pytest.mark.parametrize("page_size", [1, 16])
def test_llama4_chunked_layers(page_size):
    """Llama 4's iRoPE layers: the model runner's ``attention_chunk_size`` (16) on the layers
    with ``use_irope`` (0 and 2), global attention on the others, as SGLang's FA3 backend
    does: a prefill over two chunks, decodes on a chunk's first and last position, an extend
    across a boundary, checked against the oracle (torch_native, which has no chunks, only
    on the global layers)."""
    e = Engine(page_size, torch.float32, chunk=16)
    assert [layer.use_irope for layer in e.layers] == [True, False, True, False]
    t = e.table
    a, b = t.admit(), t.admit()
    for items in (
        [(a, 31), (b, 15)],  # A ends on position 30 (chunk 1), B on 14
        [(a, 1), (b, 1)],  # A decodes position 31 (last of chunk 1), B 15 (last of chunk 0)
        [(a, 1), (b, 1)],  # first positions of chunks 2 and 1: they see only themselves
        [(a, 5), (b, 1)],  # A extends 33..37, B decodes 17
    ):
        e.run(t.batch(M.EXTEND if max(n for _, n in items) > 1 else M.DECODE, items))
        for req, n in items:
            req.length += n


def _forbidden(name):
    def call(*args, **kwargs):
        raise AssertionError(f"IDLE step called attnsdk Backend.{name}")

    return call


@pytest.fixture
def engine():
    e = Engine(16, torch.bfloat16)
    req = e.table.admit()
    e.run(e.table.batch(M.EXTEND, [(req, 9)]))
    req.length = 9
    return e, req


@pytest.mark.parametrize("kind", ["ngram", "eagle-topk2"])
def test_tree_verify_is_served(engine, kind):
    """NGRAM verify (no topk: always a tree) and EAGLE topk > 1: each draft sees the prefix, its
    ancestors and itself, as the batch's ``custom_mask`` says (the oracle reads SGLang's mask
    itself; a chain would see drafts 1 and 2 from drafts 2 and 3), on the causal layers (GQA,
    softcap)."""
    e, req = engine
    items = [(req, 4)]
    eagle = chain_verify_input(items, topk=2, parents=[-1, 0, 0, 2])
    ngram = NgramVerifyInput(  # positional: 0.5.12 names the mask tree_mask, 0.5.23 custom_mask
        torch.zeros(4, dtype=torch.int64),
        eagle.custom_mask,
        torch.arange(9, 13),
        torch.arange(4).view(1, 4),
        torch.full((1, 4), -1),
        torch.full((1, 4), -1),
        4,
    )
    fb = e.table.batch(M.TARGET_VERIFY, items, spec_info=ngram if kind == "ngram" else eagle)
    e.run(fb, native=False, query_lens=[4], seq_lens=[req.length + 4], layers=[0, 2])
    # A window or a non-causal layer has no meaning over a tree's positions: refused, unwritten.
    before = [(k.clone(), v.clone()) for k, v in e.pools.buffers()]
    for layer in (e.layers[1], e.layers[3]):
        with pytest.raises(UnsupportedConfigError, match="tree"):
            attend(e.dropin, layer, *random_qkv(4, torch.bfloat16, e.gen), fb)
    assert all(torch.equal(x, y) for pair in zip(e.pools.buffers(), before) for x, y in zip(*pair))


class NoTrees(ReferenceBackend):
    """The reference without tree masks (as flashinfer)."""

    name = "no-trees"
    capabilities = dataclasses.replace(
        ReferenceBackend.capabilities,
        features=ReferenceBackend.capabilities.features - {Feature.TREE_MASK},
    )


@pytest.mark.parametrize(("algorithm", "topk"), [("NGRAM", None), ("EAGLE", 4)])
def test_tree_speculation_needs_a_backend_with_tree_masks(algorithm, topk):
    pools = Pools(16, torch.bfloat16)
    args = SimpleNamespace(speculative_algorithm=algorithm, speculative_eagle_topk=topk)
    create_backend(EngineRunner(pools, server_args=args), DROPIN)  # the reference: served
    with pytest.raises(UnsupportedConfigError, match="tree masks"):
        SGLangAttentionBackend(EngineRunner(pools, server_args=args), NoTrees())


def test_forward_keywords(engine):
    """Every keyword SGLang's FA3 backend takes is accepted at its default and changes nothing;
    ``return_lse=True`` returns ``(output, lse)`` as SGLang's FA3 backend does (lse ``[T, Hq]``,
    natural log); any other non-default (fp8 descales, ...) is refused."""
    from sglang.srt.layers.attention.flashattention_backend import FlashAttentionBackend

    e, req = engine
    params = inspect.signature(FlashAttentionBackend.forward_extend).parameters
    defaults = {n: p.default for n, p in list(params.items())[7:]}  # after save_kv_cache
    assert {"q_rope", "k_rope", "sinks"} <= set(defaults)
    assert ("return_lse" in defaults) is NEW_HOOKS, "0.5.12's FA3 has no return_lse"
    fb = e.table.batch(M.DECODE, [(req, 1)])
    e.dropin.init_forward_metadata(fb)
    layer = e.layers[0]
    qkv = random_qkv(1, torch.bfloat16, e.gen)
    plain = e.dropin.forward(*qkv, layer, fb)
    assert torch.equal(e.dropin.forward(*qkv, layer, fb, **defaults), plain)
    out, lse = e.dropin.forward(*qkv, layer, fb, return_lse=True)
    torch.testing.assert_close(out.view(plain.shape), plain, atol=0, rtol=0)
    assert lse.shape == (1, HQ)
    assert lse.dtype == torch.float32
    # float64: the decode row sees every key of its request (layer 0: plain GQA).
    slots = e.pools.req_to_token_pool.req_to_token[fb.req_pool_indices[0], : int(fb.seq_lens[0])]
    keys = e.pools.kv_pool.get_key_buffer(0)[slots.long()].double()
    keys = keys.repeat_interleave(HQ // HKV, dim=1)  # (S, Hq, D)
    scores = torch.einsum("hd,shd->hs", qkv[0].double().view(HQ, D), keys) * layer.scaling
    torch.testing.assert_close(lse[0].double(), torch.logsumexp(scores, -1), atol=2e-3, rtol=0)
    with pytest.raises(UnsupportedConfigError, match="q_descale"):
        e.dropin.forward(*qkv, layer, fb, q_descale=torch.ones(1))


def test_registry_creates_the_dropin():
    e = Engine(16, torch.float32)
    assert isinstance(e.dropin, SGLangAttentionBackend)
    assert e.dropin.token_to_kv_pool is e.pools.kv_pool
    assert e.dropin.req_to_token_pool is e.pools.req_to_token_pool
