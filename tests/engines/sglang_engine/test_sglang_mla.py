"""MLA through SGLang's own objects, both releases: a real ``MLATokenToKVPool``, DeepSeek's
absorbed ``RadixAttention`` (``attn_mqa``: one KV head of kv_lora_rank + rope dims, V the
latent), ``ForwardBatch`` steps from SGLang's allocator, and the drop-in created from SGLang's
registry for a model config whose ``attention_arch`` is MLA.

Each step goes through ``RadixAttention.forward`` in both call forms SGLang uses: DeepSeek's
``forward_absorb`` (q ``[T, H, rank]``, k the normalised latent ``[T, 1, rank]``, with
``q_rope`` / ``k_rope`` keywords; the backend writes the latent) and the whole-row form
(q ``[T, H, rank + rope]``, k the whole latent row). The output and the *whole* latent buffer
must equal a float64 oracle that reads SGLang's pool through ``req_to_token``, also for an
EAGLE topk-2 tree verify (the oracle applies SGLang's own ``custom_mask``). DeepSeek's
expanded prefill layer (``attn_mha``) runs ragged: new prompts, one shot over the cached
prefix, and SGLang's own chunked-prefix metadata merged by the log-sum-exps; an MLA model on a
backend that cannot serve its dims is refused at start-up.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from real_sglang import (
    DROPIN,
    NEW_HOOKS,
    EngineRunner,
    Pools,
    RequestTable,
    TinyModelConfig,
    attend,
    chain_verify_input,
    create_backend,
    tolerance,
)
from sglang.srt.configs.model_config import AttentionArch
from sglang.srt.layers.radix_attention import RadixAttention
from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool
from sglang.srt.model_executor.forward_batch_info import ForwardMode as M

from attnsdk import UnsupportedConfigError
from attnsdk.adapters.sglang import SGLangAttentionBackend

H, RANK, ROPE = 4, 32, 16
SCALE = (24 + ROPE) ** -0.5  # DeepSeek's: (qk_nope + rope) ** -0.5, not (rank + rope) ** -0.5


class MLAConfig(TinyModelConfig):
    def __init__(self) -> None:
        super().__init__(num_heads=H, num_kv_heads=1, head_dim=RANK + ROPE)
        self.attention_arch = AttentionArch.MLA
        self.kv_lora_rank, self.qk_rope_head_dim = RANK, ROPE
        self.v_head_dim = RANK


class MLAEngine:
    def __init__(self, page_size: int, dtype: torch.dtype, backend: str = DROPIN) -> None:
        self.pools = Pools(page_size, dtype, num_pages=24 if page_size == 16 else 384, rows=6)
        size = self.pools.num_pages * page_size
        self.pool = MLATokenToKVPool(size, page_size, dtype, RANK, ROPE, 1, "cpu", False)
        self.pools.kv_pool = self.pool  # what 0.5.12's ForwardBatch carries
        buf = self.pool.get_key_buffer(0)
        buf.copy_(torch.randn(buf.shape, generator=torch.Generator().manual_seed(3)))
        # DeepSeek's attention holds both of layer 0's RadixAttentions: attn_mqa (absorbed,
        # over the latent pool) and attn_mha (expanded prefill, no cache).
        self.layer = RadixAttention(H, RANK + ROPE, SCALE, 1, layer_id=0, v_head_dim=RANK)
        runner = EngineRunner(self.pools, kv_pool=self.pool, layers=[self.layer, mha_layer()])
        runner.model_config = MLAConfig()
        self.runner = runner
        self.dropin = create_backend(runner, backend)
        self.table = RequestTable(self.pools)
        self.gen = torch.Generator().manual_seed(page_size)
        self.tol = tolerance(dtype)

    def run(self, fb, *, absorbed: bool, query_lens=None, seq_lens=None, mask=None) -> None:
        """One step; ``query_lens`` / ``seq_lens`` (after the step) default to the batch's,
        ``mask`` is a verify's ``custom_mask`` in SGLang's layout."""
        dtype, t = self.pools.dtype, fb.out_cache_loc.shape[0]

        def rand(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=self.gen).to(dtype)

        q_nope, q_rope = rand(t, H, RANK), rand(t, H, ROPE)
        k_nope, k_rope = rand(t, 1, RANK), rand(t, 1, ROPE)
        want_buf = self.pool.get_key_buffer(0).clone()
        want_buf[fb.out_cache_loc] = torch.cat([k_nope, k_rope], -1)
        self.dropin.init_forward_metadata(fb)
        if absorbed:  # DeepSeek's forward_absorb: the backend writes the latent
            got = attend(self.dropin, self.layer, q_nope, k_nope, k_nope, fb,
                         q_rope=q_rope, k_rope=k_rope)  # fmt: skip
        else:
            row = torch.cat([k_nope, k_rope], -1)
            q = torch.cat([q_nope, q_rope], -1).flatten(1)
            got = attend(self.dropin, self.layer, q, row.flatten(1), row[..., :RANK].flatten(1), fb)
        assert torch.equal(self.pool.get_key_buffer(0), want_buf), "the latent buffer differs"
        want = self.oracle(
            fb, torch.cat([q_nope, q_rope], -1), want_buf, query_lens, seq_lens, mask
        )
        assert got.shape == (t, H * RANK)
        torch.testing.assert_close(got.double(), want, **self.tol)

    def oracle(self, fb, q, buf, query_lens=None, seq_lens=None, mask=None) -> torch.Tensor:
        """float64: head h of the query at position p over latents 0..p of its request (and,
        with a verify's ``mask``, only those the mask's row shows)."""
        r2t = self.pools.req_to_token_pool.req_to_token
        lens = seq_lens or fb.seq_lens_cpu.tolist()
        new = query_lens or fb.extend_seq_lens_cpu or [1] * len(lens)
        out, start, offset = [], 0, 0
        for row, total, n in zip(fb.req_pool_indices.tolist(), lens, new):
            latent = buf[r2t[row, :total].long(), 0].double()  # (L, rank + rope)
            scores = torch.einsum("nhd,ld->hnl", q[start : start + n].double(), latent) * SCALE
            hidden = torch.arange(total)[None, :] > torch.arange(total - n, total)[:, None]
            if mask is not None:
                hidden |= ~mask[offset : offset + n * total].view(n, total)
                offset += n * total
            probs = torch.softmax(scores.masked_fill(hidden, float("-inf")), -1)
            out.append(torch.einsum("hnl,lr->nhr", probs, latent[:, :RANK]).flatten(1))
            start += n
        return torch.cat(out)


@pytest.mark.parametrize("absorbed", [True, False], ids=["forward_absorb", "whole-row"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_mla_lifecycle(page_size: int, dtype: torch.dtype, absorbed: bool) -> None:
    e = MLAEngine(page_size, dtype)
    assert isinstance(e.dropin, SGLangAttentionBackend)
    a, b = e.table.admit(), e.table.admit()
    e.run(e.table.batch(M.EXTEND, [(a, 9)]), absorbed=absorbed)
    a.length = 9
    e.run(e.table.batch(M.EXTEND, [(a, 5), (b, 20)]), absorbed=absorbed)  # extend + prefill
    a.length, b.length = 14, 20
    for _ in range(3):
        e.run(e.table.batch(M.DECODE, [(a, 1), (b, 1)]), absorbed=absorbed)
        a.length, b.length = a.length + 1, b.length + 1


@pytest.mark.parametrize("absorbed", [True, False], ids=["forward_absorb", "whole-row"])
def test_eagle_tree_verify_on_mla(absorbed: bool) -> None:
    """EAGLE topk 2 on an MLA model: each draft sees the prefix, its ancestors and itself, as
    the batch's ``custom_mask`` says (a chain would let draft 3 see drafts 1 and 2)."""
    e = MLAEngine(16, torch.float32)
    req = e.table.admit()
    e.run(e.table.batch(M.EXTEND, [(req, 11)]), absorbed=absorbed)
    req.length = 11
    items = [(req, 4)]
    eagle = chain_verify_input(items, topk=2, parents=[-1, 0, 0, 2])
    fb = e.table.batch(M.TARGET_VERIFY, items, spec_info=eagle)
    e.run(fb, absorbed=absorbed, query_lens=[4], seq_lens=[15], mask=eagle.custom_mask)


@pytest.fixture
def one_rank():
    """0.5.23's pool reads the published parallel config: one rank, no context parallelism."""
    if not NEW_HOOKS:
        yield
        return
    from sglang.srt.runtime_context import get_parallel

    with get_parallel().override(attn_dcp_size=1, attn_dcp_rank=0):
        yield


@pytest.mark.usefixtures("one_rank")
@pytest.mark.parametrize("page_size", [1, 16])
def test_padded_decode_replay_writes_the_latent_through_the_pool(page_size, monkeypatch) -> None:
    """SGLang's decode CUDA-graph protocol (test_sglang_graphs.GraphRunner: the release's own
    static inputs and hooks, no graphs recorded) on an MLA model in DeepSeek's call form: a
    captured forward writes the latent through the pool's ``set_kv_buffer`` at the static
    ``out_cache_loc``; real rows equal the oracle, and padding rows write only page 0.

    0.5.12's ``set_mla_kv_buffer`` is a Triton kernel, replaced here
    by the same write in PyTorch (latent at ``[:rank]``, rope after it)."""
    from test_sglang_graphs import GraphRunner

    e = MLAEngine(page_size, torch.float32)
    if not NEW_HOOKS:

        def set_mla_kv_buffer(layer, loc, nope, rope):
            e.pool.get_key_buffer(layer.layer_id)[loc] = torch.cat([nope, rope], -1)

        monkeypatch.setattr(e.pool, "set_mla_kv_buffer", set_mla_kv_buffer)
    e.layers = [e.layer]
    reqs = [e.table.admit() for _ in range(5)]
    lengths = [19, 33, 5, 16, 40]
    e.run(e.table.batch(M.EXTEND, list(zip(reqs, lengths))), absorbed=True)
    for req, n in zip(reqs, lengths):
        req.length = n

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=e.gen)

    def inputs(layer, n):
        k_nope = rand(n, 1, RANK)
        return (rand(n, H, RANK), k_nope, k_nope), {
            "q_rope": rand(n, H, ROPE),
            "k_rope": rand(n, 1, ROPE),
        }

    runner = GraphRunner(e, [2, 4], M.DECODE, 1, inputs=inputs)
    p = page_size
    for rows in (3, 1):
        live = e.table.batch(M.DECODE, [(req, 1) for req in reqs[:rows]])
        static = runner.replay_prepare(live)
        pad = static.batch_size - rows
        assert pad > 0, "the replay must be padded"
        (q, k, _), kw = inputs(e.layer, rows)
        want_buf = e.pool.get_key_buffer(0).clone()
        want_buf[live.out_cache_loc] = torch.cat([k, kw["k_rope"]], -1)

        def padded(x: torch.Tensor, pad: int = pad) -> torch.Tensor:
            return torch.cat([x, x.new_zeros(pad, *x.shape[1:])])

        got = attend(e.dropin, e.layer, padded(q), padded(k), padded(k), static,
                     q_rope=padded(kw["q_rope"]), k_rope=padded(kw["k_rope"]))[:rows]  # fmt: skip
        buf = e.pool.get_key_buffer(0)
        assert torch.equal(buf[p:], want_buf[p:]), "the latent buffer differs past page 0"
        want = e.oracle(live, torch.cat([q, kw["q_rope"]], -1), want_buf)
        torch.testing.assert_close(got.double(), want, **e.tol)
        for req in reqs[:rows]:
            req.length += 1


# -- DeepSeek's expanded prefill (attn_mha): ragged attention, as SGLang's FA3 backend runs it --

NOPE, V = 24, 20  # qk_nope and v dims (DeepSeek V3: 128 and 128; V differs here on purpose)


def mha_layer() -> RadixAttention:
    """DeepSeek's ``attn_mha``: H heads of their own, q / k nope + rope dims, v ``V`` dims."""
    return RadixAttention(H, NOPE + ROPE, SCALE, H, layer_id=0, v_head_dim=V)


def mha_oracle(q, keys, values, causal: bool):  # type: ignore[no-untyped-def]
    """float64 (out [n, H, V], lse [n, H]) of one sequence's n queries, which sit at the last n
    of len(keys) positions (causal) or see every key."""
    n, total = q.shape[0], keys.shape[0]
    scores = torch.einsum("nhd,lhd->hnl", q.double(), keys.double()) * SCALE
    if causal:
        hidden = torch.arange(total)[None, :] > torch.arange(total - n, total)[:, None]
        scores = scores.masked_fill(hidden, float("-inf"))
    lse = torch.logsumexp(scores, -1).T  # (n, H); -inf for a row that sees nothing
    probs = torch.softmax(scores, -1).nan_to_num(0.0)
    return torch.einsum("hnl,lhv->nhv", probs, values.double()), lse


class Prompts:
    """Per request, every key and value of its sequence (the model's kv_b_proj expansion of
    the latent, cached prefix then new tokens)."""

    def __init__(self, e: MLAEngine, fb, prefix: list[int], new: list[int]) -> None:
        self.prefix, self.new = prefix, new
        self.q = torch.randn(sum(new), H, NOPE + ROPE, generator=e.gen)
        self.k = [torch.randn(p + n, H, NOPE + ROPE, generator=e.gen) for p, n in zip(prefix, new)]
        self.v = [torch.randn(p + n, H, V, generator=e.gen) for p, n in zip(prefix, new)]

    def new_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The new tokens' K / V, packed as the model passes them ([T, H*D] like SGLang)."""
        k = torch.cat([k[p:] for k, p in zip(self.k, self.prefix)])
        v = torch.cat([v[p:] for v, p in zip(self.v, self.prefix)])
        return k.flatten(1), v.flatten(1)

    def oracle(self, keys=None):  # type: ignore[no-untyped-def]
        """Each request's queries over ``keys`` (default: all of them), causally."""
        out, lse, start = [], [], 0
        for b, n in enumerate(self.new):
            ks, vs = (self.k[b], self.v[b]) if keys is None else keys(b)
            o, l_ = mha_oracle(self.q[start : start + n], ks, vs, causal=keys is None)
            out.append(o)
            lse.append(l_)
            start += n
        return torch.cat(out), torch.cat(lse)


@pytest.mark.parametrize("attend_prefix", [False, None], ids=["flag-false", "flag-unset"])
def test_expanded_prefill_of_new_prompts(attend_prefix) -> None:
    """A prefill without cached prefix (SGLang's MHA / MHA_ONE_SHOT without prefix): each
    request's new tokens over themselves, causally; ``[T, H, V]`` out, nothing written."""
    e = MLAEngine(16, torch.float32)
    a, b = e.table.admit(), e.table.admit()
    fb = e.table.batch(M.EXTEND, [(a, 9), (b, 5)])
    fb.attn_attend_prefix_cache = attend_prefix
    e.dropin.init_forward_metadata(fb)
    prompts = Prompts(e, fb, [0, 0], [9, 5])
    before = e.pool.get_key_buffer(0).clone()
    got = attend(e.dropin, mha_layer(), prompts.q.flatten(1), *prompts.new_kv(), fb,
                 save_kv_cache=False)  # fmt: skip
    assert got.shape == (14, H, V)
    torch.testing.assert_close(got.double(), prompts.oracle()[0], **e.tol)
    assert torch.equal(e.pool.get_key_buffer(0), before), "attn_mha wrote the cache"


def test_expanded_prefill_in_one_shot_over_the_cached_prefix() -> None:
    """MHA_ONE_SHOT with a cached prefix (``mha_one_shot``): the model passes every key of each
    sequence, prefix then new, and the new tokens attend over them causally."""
    e = MLAEngine(16, torch.float32)
    a, b = e.table.admit(), e.table.admit()
    e.run(e.table.batch(M.EXTEND, [(a, 11)]), absorbed=True)
    a.length = 11
    fb = e.table.batch(M.EXTEND, [(a, 5), (b, 7)])
    fb.attn_attend_prefix_cache, fb.mha_one_shot = False, True
    e.dropin.init_forward_metadata(fb)
    prompts = Prompts(e, fb, [11, 0], [5, 7])
    k, v = torch.cat(prompts.k).flatten(1), torch.cat(prompts.v).flatten(1)
    got = attend(e.dropin, mha_layer(), prompts.q.flatten(1), k, v, fb, save_kv_cache=False)
    torch.testing.assert_close(got.double(), prompts.oracle()[0], **e.tol)


def test_chunked_prefix_passes_merged_by_their_lse_equal_one_pass(monkeypatch) -> None:
    """DeepSeek's MHA_CHUNKED_KV: SGLang's own ``prepare_chunked_prefix_cache_info`` splits the
    cached prefixes into chunks (capacity 24 here: several chunks, some empty for short
    prefixes); the new tokens attend causally over themselves, then non-causally over each
    chunk with ``mha_return_lse``, and the parts merged by their log-sum-exps equal attention
    over prefix and new tokens at once."""
    import sglang.srt.model_executor.forward_batch_deepseek_mha_mixin as mixin

    from attnsdk import merge_states

    e = MLAEngine(16, torch.float32)
    reqs = [e.table.admit() for _ in range(3)]
    e.run(e.table.batch(M.EXTEND, [(reqs[0], 37), (reqs[1], 3)]), absorbed=True)
    reqs[0].length, reqs[1].length = 37, 3
    fb = e.table.batch(M.EXTEND, [(reqs[0], 5), (reqs[1], 6), (reqs[2], 4)])
    cls = type(fb)
    monkeypatch.setattr(cls, "get_max_chunk_capacity", lambda self: 24)
    monkeypatch.setattr(cls, "prepare_chunked_kv_indices", lambda self, *a, **kw: None)  # Triton
    if NEW_HOOKS:
        monkeypatch.setattr(mixin, "get_token_to_kv_pool", lambda: e.pool)
    fb.prepare_chunked_prefix_cache_info("cpu")
    assert fb.num_prefix_chunks == 5  # chunks of 24 // 3 = 8 tokens over the 37-token prefix
    e.dropin.init_forward_metadata(fb)
    prompts = Prompts(e, fb, [37, 3, 0], [5, 6, 4])
    layer, q = mha_layer(), prompts.q.flatten(1)
    fb.mha_return_lse = True
    fb.set_attn_attend_prefix_cache(False)
    out, lse = attend(e.dropin, layer, q, *prompts.new_kv(), fb, save_kv_cache=False)
    assert out.shape == (15, H, V)
    assert lse.shape == (15, H)
    for i in range(fb.num_prefix_chunks):
        fb.set_prefix_chunk_idx(i)
        fb.set_attn_attend_prefix_cache(True)
        size = fb.prefix_chunk_len
        spans = [(min(p, i * size), min(p, (i + 1) * size)) for p in prompts.prefix]
        k = torch.cat([prompts.k[b][s:t] for b, (s, t) in enumerate(spans)]).flatten(1)
        v = torch.cat([prompts.v[b][s:t] for b, (s, t) in enumerate(spans)]).flatten(1)
        part, part_lse = attend(e.dropin, layer, q, k, v, fb, save_kv_cache=False)
        want, want_lse = prompts.oracle(
            lambda b, s=spans: (prompts.k[b][s[b][0] : s[b][1]], prompts.v[b][s[b][0] : s[b][1]])
        )
        torch.testing.assert_close(part.double(), want, **e.tol)
        assert torch.equal(torch.isneginf(part_lse), torch.isneginf(want_lse))
        out, lse = merge_states(out, lse, part, part_lse)
    want, want_lse = prompts.oracle()
    torch.testing.assert_close(out.double(), want, **e.tol)
    torch.testing.assert_close(lse.double(), want_lse, **e.tol)


def test_expanded_prefill_refusals_name_what_to_do() -> None:
    e = MLAEngine(16, torch.float32)
    e.dropin = SGLangAttentionBackend(e.runner, backend="flex")  # MLA yes, ragged steps no
    a = e.table.admit()
    fb = e.table.batch(M.EXTEND, [(a, 4)])
    e.dropin.init_forward_metadata(fb)
    prompts = Prompts(e, fb, [0], [4])
    q, (k, v) = prompts.q.flatten(1), prompts.new_kv()
    with pytest.raises(UnsupportedConfigError, match="pin DeepSeek's dispatch") as err:
        attend(e.dropin, mha_layer(), q, k, v, fb, save_kv_cache=False)
    assert "ragged" in [r.field for r in err.value.reasons]
    e = MLAEngine(16, torch.float32)
    a = e.table.admit()
    fb = e.table.batch(M.EXTEND, [(a, 4)])
    e.dropin.init_forward_metadata(fb)
    with pytest.raises(UnsupportedConfigError, match="save_kv_cache"):
        attend(e.dropin, mha_layer(), q, k, v, fb)
    e.run(fb, absorbed=True)
    a.length = 4
    fb = e.table.batch(M.EXTEND, [(a, 3)])  # a cached prefix, and no word on it
    e.dropin.init_forward_metadata(fb)
    with pytest.raises(ValueError, match="attn_attend_prefix_cache"):
        attend(e.dropin, mha_layer(), q[:3], k[:3], v[:3], fb, save_kv_cache=False)


def test_an_mla_model_on_a_backend_without_its_dims_is_refused_at_start_up() -> None:
    pools = Pools(16, torch.bfloat16)
    runner = EngineRunner(pools)
    runner.model_config = MLAConfig()
    runner.model_config.kv_lora_rank, runner.model_config.qk_rope_head_dim = 512, 64
    with pytest.raises(UnsupportedConfigError, match="head_dim must be <= 256"):
        SGLangAttentionBackend(runner, backend="flex")
    runner.model_config.attention_arch = SimpleNamespace(name="MLA")
    del runner.model_config.kv_lora_rank
    with pytest.raises(ValueError, match=r"model_config\.kv_lora_rank"):
        SGLangAttentionBackend(runner, backend="reference")


def test_deepseeks_dispatch_can_be_pinned_or_given_fa3s_paths() -> None:
    """What docs/adapters/sglang.md tells integrators: DeepSeek picks absorbed or expanded
    attention by backend name, and an unknown name (the drop-in's) gets the Triton handler,
    which sends prompts without a cached prefix to ``attn_mha``. One registered handler pins
    every step to the absorbed layer; FA3's adds its one-shot and chunked-prefix paths."""
    from sglang.srt.models.deepseek_common import attention_backend_handler as handlers
    from sglang.srt.models.deepseek_common.attention_forward_methods.forward_methods import (
        AttnForwardMethod,
    )

    registry = handlers.AttentionBackendRegistry
    assert registry.get_handler(DROPIN) is registry.get_handler("triton")
    saved = dict(registry._handlers)
    try:
        registry.register(DROPIN, lambda attn, forward_batch: AttnForwardMethod.MLA)
        assert registry.get_handler(DROPIN)(None, None) is AttnForwardMethod.MLA
        registry.register(DROPIN, handlers.handle_attention_fa3)  # the expanded paths too
        assert registry.get_handler(DROPIN) is registry.get_handler("fa3")
    finally:
        registry._handlers.clear()
        registry._handlers.update(saved)
