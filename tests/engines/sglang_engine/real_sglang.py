"""Real SGLang objects on a CPU, shared by the SGLang engine tests (a helper, not a test module).

Everything here is SGLang's own code: ``ReqToTokenPool``, ``MHATokenToKVPool``, the KV allocators,
``ForwardBatch``, ``RadixAttention``, ``EagleVerifyInput``, the attention registry and
``TorchNativeAttnBackend``. The one stand-in is ``EngineRunner``: a subclass of SGLang's real
``ModelRunner`` whose ``__init__`` only sets the attributes attention backends read (SGLang's own
test kit does the same), because a real start-up loads a model onto a GPU. Backends are created
by SGLang's own code path from the registry (``create_backend``), as a model runner does.

Release differences are handled with an explicit ``if NEW_HOOKS`` (0.5.13+) branch each.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import inspect
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch
from sglang.srt.configs.model_config import AttentionArch
from sglang.srt.layers.attention.attention_registry import register_attention_backend
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from sglang.srt.layers.radix_attention import AttentionType, RadixAttention
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from sglang.srt.model_executor.forward_batch_info import (
    CaptureHiddenMode,
    ForwardBatch,
    ForwardMode,
)
from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.srt.speculative.eagle_info import EagleVerifyInput

from attnsdk.adapters.sglang import SGLangAttentionBackend

VERSION = importlib.metadata.version("sglang")
NEW_HOOKS = not VERSION.startswith("0.5.12")
"""0.5.13+: pools read off the backend, ``forward_context``, the 3-method graph contract."""

if NEW_HOOKS:
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context
    from sglang.srt.model_executor.model_runner_components.attention_backend_setup import (
        _build_backend_from_str,
    )
else:
    from sglang.srt.mem_cache.allocator import (
        PagedTokenToKVPoolAllocator,
        TokenToKVPoolAllocator,
    )

DROPIN = "attnsdk"
HQ, HKV, D = 4, 2, 16


@register_attention_backend(DROPIN)
def create_attnsdk_backend(runner: Any) -> Any:
    """The factory docs/adapters/sglang.md registers (on the CPU reference backend)."""
    return SGLangAttentionBackend(runner, backend="reference")


class TinyModelConfig:
    """The ``ModelConfig`` attributes SGLang's backend setup and the drop-in read."""

    def __init__(self, num_heads: int = HQ, num_kv_heads: int = HKV, head_dim: int = D) -> None:
        self.attention_arch = AttentionArch.MHA
        self.num_attention_heads = num_heads
        self.num_key_value_heads = num_kv_heads
        self.head_dim = head_dim
        self.v_head_dim = head_dim
        self.context_len = 256
        self.hidden_size = num_heads * head_dim
        self.is_encoder_decoder = False
        self.quantization = None
        self.linear_attn_registry_result = None
        self.hf_config = SimpleNamespace(architectures=["TinyForCausalLM"])
        self.hf_config.get_text_config = lambda: self.hf_config
        self.hf_text_config = self.hf_config

    def get_total_num_kv_heads(self) -> int:
        return self.num_key_value_heads

    def get_num_kv_heads(self, tensor_parallel_size: int, dcp_size: int = 1) -> int:
        return self.num_key_value_heads // (tensor_parallel_size // dcp_size)


class EngineRunner(ModelRunner):
    """A real ``ModelRunner`` without the GPU start-up: only what attention backends read."""

    # 0.5.12 reads these model properties while wrapping a backend; the tiny model has none.
    hybrid_gdn_config = mambaish_config = mamba2_config = None
    hybrid_lightning_config = kimi_linear_config = linear_attn_model_spec = None

    def __init__(
        self,
        pools: Pools,
        *,
        kv_pool: Any = None,
        server_args: Any = None,
        attention_chunk_size: int | None = None,
        layers: list[RadixAttention] | None = None,
    ) -> None:
        self.device = "cpu"
        self.gpu_id = 0
        self.dtype = self.kv_cache_dtype = pools.dtype
        self.page_size = pools.page_size
        self.model_config = TinyModelConfig()
        self.req_to_token_pool = pools.req_to_token_pool
        self.token_to_kv_pool = pools.kv_pool if kv_pool is None else kv_pool
        self.token_to_kv_pool_allocator = pools.allocator
        self.is_draft_worker = False
        self.use_mla_backend = False
        # The real runner copies it from the model config (Llama 4's chunked local attention).
        self.attention_chunk_size = attention_chunk_size
        self.server_args = server_args or SimpleNamespace(
            speculative_algorithm=None, speculative_eagle_topk=None
        )
        # The loaded model (set before SGLang builds the attention backend): its RadixAttention
        # layers are what the drop-in declares at start-up. None: a runner without one.
        self.model = None if layers is None else torch.nn.ModuleList(layers)
        if NEW_HOOKS:
            self.init_kv_index_translator()  # SGLang's own; batches bind their KV ids to it


def create_backend(runner: EngineRunner, name: str) -> Any:
    """``ATTENTION_BACKENDS[name](runner)`` through the model runner's own code path."""
    if NEW_HOOKS:
        return _build_backend_from_str(
            model_runner=runner, backend_str=name, init_new_workspace=False
        )
    return runner._get_attention_backend_from_str(name)


@dataclass
class Pools:
    """SGLang's request pool, one MHA KV pool (one buffer per layer) and its allocator."""

    page_size: int
    dtype: torch.dtype
    num_pages: int = 24
    rows: int = 6
    context: int = 128
    layers: int = 4
    req_to_token_pool: Any = field(init=False)
    kv_pool: Any = field(init=False)
    allocator: Any = field(init=False)

    def __post_init__(self) -> None:
        self.req_to_token_pool = ReqToTokenPool(
            size=self.rows, max_context_len=self.context, device="cpu", enable_memory_saver=False
        )
        self.kv_pool = self.new_kv_pool()
        size = self.num_pages * self.page_size
        if self.page_size == 1:  # SGLang's choice of allocator for page size 1
            self.allocator = TokenToKVPoolAllocator(
                size=size, dtype=self.dtype, device="cpu", kvcache=self.kv_pool, need_sort=False
            )
        else:
            self.allocator = PagedTokenToKVPoolAllocator(
                size=size,
                page_size=self.page_size,
                dtype=self.dtype,
                device="cpu",
                kvcache=self.kv_pool,
                need_sort=False,
            )

    def new_kv_pool(self) -> Any:
        pool = MHATokenToKVPool(
            size=self.num_pages * self.page_size,
            page_size=self.page_size,
            dtype=self.dtype,
            head_num=HKV,
            head_dim=D,
            layer_num=self.layers,
            device="cpu",
            enable_memory_saver=False,
        )
        gen = torch.Generator().manual_seed(7)
        for i in range(self.layers):  # stale noise everywhere: a wrong read cannot pass
            for buf in pool.get_kv_buffer(i):
                buf.copy_(torch.randn(buf.shape, generator=gen))
        return pool

    def buffers(self, pool: Any = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        pool = self.kv_pool if pool is None else pool
        return [pool.get_kv_buffer(i) for i in range(self.layers)]


def make_layers(irope: bool = False) -> list[RadixAttention]:
    """GQA decoder, sliding window (SGLang's W - 1 = 5: six keys), softcap, ENCODER_ONLY.
    ``irope``: the GQA and softcap layers are Llama 4's chunked (``use_irope``) layers."""
    return [
        RadixAttention(HQ, D, D**-0.5, HKV, layer_id=0, use_irope=irope),
        RadixAttention(HQ, D, D**-0.5, HKV, layer_id=1, sliding_window_size=5),
        RadixAttention(HQ, D, 1.0, HKV, layer_id=2, logit_cap=2.0, use_irope=irope),
        RadixAttention(HQ, D, D**-0.5, HKV, layer_id=3, attn_type=AttentionType.ENCODER_ONLY),
    ]


def native_serves(layer: RadixAttention) -> bool:
    """Whether SGLang's ``TorchNativeAttnBackend`` honours every feature of ``layer``: it never
    reads ``logit_cap`` nor ``use_irope``, and 0.5.12's ignores ``sliding_window_size`` (read
    from its source)."""
    source = inspect.getsource(TorchNativeAttnBackend)
    return all(
        getattr(layer, name) == unset or name in source
        for name, unset in (("logit_cap", 0.0), ("sliding_window_size", -1), ("use_irope", False))
    )


def attend(backend: Any, layer: RadixAttention, q, k, v, fb: ForwardBatch, **kwargs) -> Any:
    """``layer(q, k, v, fb)`` with ``backend`` installed the way each release looks it up."""
    if NEW_HOOKS:  # RadixAttention.forward -> get_attn_backend().forward(...)
        with forward_context(ForwardContext(attn_backend=backend)):
            return layer(q, k, v, fb, **kwargs)
    # 0.5.12: RadixAttention.forward -> forward_batch.attn_backend.forward(...)
    fb.attn_backend = backend
    return layer(q, k, v, fb, **kwargs)


def oracle(
    layer: RadixAttention,
    q: torch.Tensor,
    k_buf,
    v_buf,
    r2t,
    rows,
    seq_lens,
    query_lens,
    chunk,
    custom_mask=None,
):
    """float64 attention of DESIGN §2, gathering keys through ``req_to_token`` (SGLang's own
    map): query b's tokens sit at the last ``query_lens[b]`` of ``seq_lens[b]`` positions.
    ``chunk``: the model's chunk size, applied to ``use_irope`` layers (as SGLang's FA3 does).
    ``custom_mask``: a verify's ``spec_info.custom_mask`` as SGLang lays it out, per request
    ``query_lens[b] x seq_lens[b]`` booleans, row-major, requests after one another."""
    out = torch.zeros(sum(query_lens), HQ, D, dtype=torch.float64)
    qd = q[: out.shape[0]].double().view(-1, HQ, D)
    causal = layer.attn_type != AttentionType.ENCODER_ONLY
    window = layer.sliding_window_size + 1 if layer.sliding_window_size >= 0 else None
    start = 0
    offset = 0
    for row, total, n in zip(rows, seq_lens, query_lens):
        slots = r2t[row, :total].long()
        keys = k_buf[slots].double().repeat_interleave(HQ // HKV, dim=1)
        values = v_buf[slots].double().repeat_interleave(HQ // HKV, dim=1)
        qpos = torch.arange(total - n, total)[:, None]
        kpos = torch.arange(total)[None, :]
        allowed = kpos <= qpos if causal else torch.ones(n, total, dtype=torch.bool)
        if window is not None:
            allowed = allowed & (kpos >= qpos - window + 1)
            if not causal:
                allowed = allowed & (kpos <= qpos + window - 1)
        if chunk is not None and layer.use_irope:
            allowed = allowed & (kpos // chunk == qpos // chunk)
        if custom_mask is not None:
            block = custom_mask[offset : offset + n * total].cpu().view(n, total)
            allowed = allowed & block
            offset += n * total
        scores = torch.einsum("nhd,lhd->hnl", qd[start : start + n], keys) * layer.scaling
        if layer.logit_cap > 0:
            scores = layer.logit_cap * torch.tanh(scores / layer.logit_cap)
        probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
        out[start : start + n] = torch.einsum("hnl,lhd->nhd", probs, values)
        start += n
    return out.view(-1, HQ * D)


@dataclass
class Request:
    """One request: its ``req_to_token`` row and the KV slot of each position it holds."""

    row: int
    slots: list[int] = field(default_factory=list)
    length: int = 0
    """Committed tokens (the KV the next step attends over)."""
    handle: Any = None
    """What SGLang's ``ReqToTokenPool`` keeps for the row (0.5.12 ``Req``-like object)."""


class RequestTable:
    """Request rows and KV slots through SGLang's own pools, as its scheduler uses them."""

    def __init__(self, pools: Pools) -> None:
        self.pools = pools

    def admit(self) -> Request:
        rtp = self.pools.req_to_token_pool
        if NEW_HOOKS:
            (row,) = rtp.alloc_rows(1)
            return Request(row)
        req = SimpleNamespace(req_pool_idx=None, is_chunked=0, kv_committed_len=0)
        (row,) = rtp.alloc([req])  # 0.5.12: rows are bound to Req objects
        return Request(row, handle=req)

    def reserve(self, req: Request, upto: int) -> list[int]:
        """Slots for positions ``len(req.slots) .. upto - 1``, written into ``req_to_token``."""
        have, p, alloc = len(req.slots), self.pools.page_size, self.pools.allocator
        if upto <= have:
            return req.slots[:upto]
        if p == 1:
            new = alloc.alloc(upto - have).tolist()
        elif NEW_HOOKS:  # the scheduler's calls: decode tokens one by one, extends in a run
            last = torch.tensor([req.slots[-1] if have else -1])
            if upto == have + 1 and have:
                new = alloc.alloc_decode(torch.tensor([upto]), torch.tensor([upto]), last)
            else:
                prefix, seq = torch.tensor([have]), torch.tensor([upto])
                new = alloc.alloc_extend(prefix, prefix, seq, seq, last, upto - have)
            new = new.tolist()
        else:  # 0.5.12's alloc_extend / alloc_decode launch Triton: whole pages via alloc()
            new = []
            for pos in range(have, upto):
                base = int(alloc.alloc(p)[0]) if pos % p == 0 else (req.slots + new)[pos - pos % p]
                new.append(base + pos % p)
        req.slots += new
        r2t = self.pools.req_to_token_pool.req_to_token
        r2t[req.row, have:upto] = torch.tensor(new, dtype=r2t.dtype)
        return req.slots[:upto]

    def share_prefix(self, dst: Request, src: Request, n: int) -> None:
        """A radix-cache hit: ``dst`` starts with ``src``'s first ``n`` tokens' KV."""
        dst.slots, dst.length = src.slots[:n], n
        r2t = self.pools.req_to_token_pool.req_to_token
        r2t[dst.row, :n] = r2t[src.row, :n]

    def finish(self, req: Request, *, keep: int = 0) -> list[int]:
        """Free the row and every slot past the first ``keep`` (kept by the radix cache)."""
        freed = req.slots[keep:]
        if freed:
            self.pools.allocator.free(torch.tensor(freed, dtype=torch.int64))
        rtp = self.pools.req_to_token_pool
        if NEW_HOOKS:
            rtp.free_rows([req.row])
        else:
            rtp.free(req.handle)
        return freed

    def batch(
        self,
        mode: ForwardMode,
        items: list[tuple[Request, int]],
        *,
        spec_info: Any = None,
    ) -> ForwardBatch:
        """A ``ForwardBatch`` with the fields attention reads, as ``ForwardBatch.init_new``
        fills them: ``items`` are (request, new tokens); TARGET_VERIFY's ``seq_lens`` exclude
        the drafts."""
        verify = mode.is_target_verify()
        prefix = [r.length for r, _ in items]
        new = [n for _, n in items]
        loc = [s for (r, n) in items for s in self.reserve(r, r.length + n)[r.length :]]
        seq = prefix if verify else [p + n for p, n in zip(prefix, new)]
        rows = torch.tensor([r.row for r, _ in items], dtype=torch.int64)
        tokens = sum(new)
        fb = ForwardBatch(
            forward_mode=mode,
            batch_size=len(items),
            input_ids=torch.zeros(tokens, dtype=torch.int64),
            req_pool_indices=rows,
            seq_lens=torch.tensor(seq, dtype=torch.int64),
            seq_lens_cpu=torch.tensor(seq, dtype=torch.int64),
            out_cache_loc=torch.tensor(loc, dtype=torch.int64),
            seq_lens_sum=sum(seq),
            positions=torch.tensor(
                [i for p, n in zip(prefix, new) for i in range(p, p + n)], dtype=torch.int64
            ),
            spec_info=spec_info,
            lora_ids=[None] * len(items),
        )
        if mode.is_extend() and not verify:
            fb.extend_num_tokens = tokens
            fb.extend_seq_lens = torch.tensor(new, dtype=torch.int32)
            fb.extend_prefix_lens = torch.tensor(prefix, dtype=torch.int32)
            fb.extend_seq_lens_cpu, fb.extend_prefix_lens_cpu = list(new), list(prefix)
            fb.extend_start_loc = torch.tensor([0, *new[:-1]]).cumsum(0)
        if NEW_HOOKS:
            fb.req_pool_indices_cpu = rows.clone()
        else:
            fb.req_to_token_pool = self.pools.req_to_token_pool
            fb.token_to_kv_pool = self.pools.kv_pool
        return fb


def chain_verify_input(
    items: list[tuple[Request, int]],
    *,
    topk: int = 1,
    cls: type = EagleVerifyInput,
    parents: list[int] | None = None,
) -> Any:
    """SGLang's ``EagleVerifyInput`` for a draft chain (a causal custom mask per request), or
    with ``parents`` (token i's parent among the drafts, -1 for a root) a draft tree: each
    draft sees the prefix, its ancestors and itself."""
    n = items[0][1]
    drafts = torch.ones(n, n, dtype=torch.bool).tril()
    if parents is not None:
        drafts = torch.eye(n, dtype=torch.bool)
        for i, parent in enumerate(parents):
            if parent >= 0:
                drafts[i] |= drafts[parent]
    masks = []
    for req, _ in items:
        mask = torch.ones(n, req.length + n, dtype=torch.bool)
        mask[:, req.length :] = drafts
        masks.append(mask.flatten())
    seq = torch.tensor([r.length for r, _ in items])
    return cls(
        draft_token=torch.zeros(len(items) * n, dtype=torch.int64),
        custom_mask=torch.cat(masks),
        positions=torch.cat([torch.arange(r.length, r.length + n) for r, _ in items]),
        retrieve_index=torch.arange(len(items) * n).view(len(items), n),
        retrieve_next_token=torch.full((len(items), n), -1),
        retrieve_next_sibling=torch.full((len(items), n), -1),
        retrieve_cum_len=None,
        spec_steps=n - 1,
        topk=topk,
        draft_token_num=n,
        capture_hidden_mode=CaptureHiddenMode.FULL,
        seq_lens_sum=int(seq.sum()),
        seq_lens_cpu=seq,
    )


def twin_batch(fb: ForwardBatch, twin_pool: Any) -> ForwardBatch:
    """The same step for a backend serving ``twin_pool`` (0.5.12 batches carry their pool)."""
    if NEW_HOOKS:
        return dataclasses.replace(fb)
    return dataclasses.replace(fb, token_to_kv_pool=twin_pool)


def random_qkv(tokens: int, dtype: torch.dtype, gen: torch.Generator) -> list[torch.Tensor]:
    """q ``[T, Hq*D]``, k and v ``[T, Hkv*D]`` as a model hands them to RadixAttention."""
    return [torch.randn(tokens, h * D, generator=gen).to(dtype) for h in (HQ, HKV, HKV)]


def expected_step(layer, qkv, buffers, r2t, fb: ForwardBatch, query_lens, seq_lens, chunk=None):
    """(float64 output of the real tokens, K buffer, V buffer) one layer must produce: the
    real tokens' K/V stored at ``out_cache_loc`` first, then the oracle."""
    q, k, v = qkv
    n = sum(query_lens)
    loc = fb.out_cache_loc[:n].long()
    k_buf, v_buf = (b.clone() for b in buffers)
    k_buf[loc] = k[:n].view(n, HKV, D).to(k_buf.dtype)
    v_buf[loc] = v[:n].view(n, HKV, D).to(v_buf.dtype)
    rows = fb.req_pool_indices[: len(query_lens)].tolist()
    # A tree verify (EAGLE topk > 1; NGRAM, which has no topk) is what its custom mask says; a
    # chain's mask is causal, and a captured chain's mask buffer is not read at all.
    topk = getattr(fb.spec_info, "topk", None)
    tree = fb.forward_mode.is_target_verify() and (topk is None or topk > 1)
    mask = fb.spec_info.custom_mask if tree else None
    out = oracle(layer, q, k_buf, v_buf, r2t, rows, seq_lens, query_lens, chunk, mask)
    return out, k_buf, v_buf


def tolerance(dtype: torch.dtype) -> dict[str, float]:
    """SGLang's kit tolerance in half precision (DENSE_ATOL); tight in fp32."""
    tol = 3e-2 if dtype in (torch.float16, torch.bfloat16) else 1e-4
    return {"atol": tol, "rtol": tol}


class Engine:
    """Runs steps on the drop-in and on SGLang's torch_native (twin pool) and checks both."""

    def __init__(
        self, page_size: int, dtype: torch.dtype, *, rows: int = 4, chunk: int | None = None
    ) -> None:
        self.pools = Pools(page_size, dtype, num_pages=12 if page_size == 16 else 192, rows=rows)
        self.table = RequestTable(self.pools)
        self.layers = make_layers(irope=chunk is not None)
        runner = EngineRunner(self.pools, attention_chunk_size=chunk, layers=self.layers)
        self.dropin = create_backend(runner, DROPIN)
        self.twin = self.pools.new_kv_pool()
        self.native = create_backend(EngineRunner(self.pools, kv_pool=self.twin), "torch_native")
        self.chunk = chunk
        self.gen = torch.Generator().manual_seed(page_size)
        self.tol = tolerance(dtype)

    def run(self, fb, *, native: bool = True, query_lens=None, seq_lens=None, layers=None):
        """One step of every layer (or of the ``layers`` indices); ``query_lens`` / ``seq_lens``
        (after the step) default to the batch's extend lengths / ``seq_lens``."""
        bs = fb.batch_size
        query_lens = query_lens or (fb.extend_seq_lens_cpu or [1] * bs)[:bs]
        seq_lens = seq_lens or fb.seq_lens_cpu[:bs].tolist()
        n, p = sum(query_lens), self.pools.page_size
        padded = fb.out_cache_loc.shape[0] > n  # DP padding writes garbage into page 0 only
        before = [(k.clone(), v.clone()) for k, v in self.pools.buffers()]
        r2t = self.pools.req_to_token_pool.req_to_token
        self.dropin.init_forward_metadata(fb)
        if native:
            for (k, v), (k0, v0) in zip(self.pools.buffers(self.twin), before):
                k.copy_(k0), v.copy_(v0)
            twin_fb = twin_batch(fb, self.twin)
            self.native.init_forward_metadata(twin_fb)
        outs = []
        for i, (layer, buffers) in enumerate(zip(self.layers, before)):
            if layers is not None and i not in layers:
                continue
            qkv = random_qkv(fb.out_cache_loc.shape[0], self.pools.dtype, self.gen)
            want, want_k, want_v = expected_step(
                layer, qkv, buffers, r2t, fb, query_lens, seq_lens, self.chunk
            )
            got = attend(self.dropin, layer, *qkv, fb)
            assert got.shape == (qkv[0].shape[0], want.shape[1])
            assert got.dtype == qkv[0].dtype
            torch.testing.assert_close(got[:n].double(), want, **self.tol)
            pools = [self.pools.kv_pool]
            if native:
                theirs = attend(self.native, layer, *qkv, twin_fb)
                if native_serves(layer):
                    torch.testing.assert_close(got[:n], theirs[:n], **self.tol)
                pools.append(self.twin)
            for pool in pools:
                for buf, ref in zip(pool.get_kv_buffer(layer.layer_id), (want_k, want_v)):
                    assert torch.equal(buf[p:], ref[p:]), f"layer {layer.layer_id}: K/V differ"
                    assert padded or torch.equal(buf[:p], ref[:p]), "the padding page changed"
            outs.append(got[:n])
        return outs
