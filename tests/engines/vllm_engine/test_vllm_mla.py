"""The MLA drop-in (``AttnSDKMLABackend``) inside vLLM's own MLA layer, on the CPU.

A DeepSeek-V2-shaped ``MLAAttention`` (4 heads, kv_lora_rank 512, rope 64, nope 32, v 32) runs
its real ``forward``: vLLM projects the queries, writes the latent cache (the CPU
``concat_and_cache_mla`` of tests/engines/fakes.py), runs new-token prefills with its CPU prefill
backend, and hands the decode rows to the drop-in's ``forward_mqa`` on attnsdk's reference
backend. The oracle is the un-absorbed attention in float64, written here from the model's
definition: K = [W_UK c ; k_pe], V = W_UV c, causal, scale (nope + rope) ** -0.5.
"""

from __future__ import annotations

import contextlib
import random
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import pytest
import torch
from tests.v1.attention.utils import BatchSpec, create_common_attn_metadata, create_vllm_config
from vllm.config import set_current_vllm_config
from vllm.forward_context import set_forward_context
from vllm.model_executor.layers.attention.mla_attention import MLAAttention
from vllm.v1.attention.backends.mla.prefill.cpu_sdpa import CPUSDPAMLAPrefillBackend
from vllm_engine.attnsdk_ref import (
    FLEX_MLA_PREFILL,
    REF_MLA_PREFILL,
    FlexMLA,
    RefMLA,
    RefMLAPrefill,
)

import attnsdk as A
from attnsdk.adapters.vllm import AttnSDKAttentionBackend

if TYPE_CHECKING:
    from collections.abc import Iterator

H, RANK, ROPE, NOPE, DV, BS = 4, 512, 64, 32, 32, 16
BLOCKS = 1024  # the block ids vLLM's create_common_attn_metadata hands out reach ~1000
MODEL = "attnsdk-test/tiny-deepseek-v2"
SCALE = (NOPE + ROPE) ** -0.5
FP8_SCALE = 0.02  # latents ~N(0, 1): |x| / 0.02 stays inside e4m3's 448
DTYPE = torch.bfloat16


@contextlib.contextmanager
def model_dtype() -> Iterator[None]:
    """The default dtype the model's, as vLLM's model loader sets it while it builds and
    post-processes the layers (W_UK / W_UV come out in it)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(DTYPE)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


class KVBProj(torch.nn.Module):
    """``kv_b_proj`` without a tensor-parallel group: latent -> per head [k_nope ; v]."""

    def __init__(self, gen: torch.Generator) -> None:
        super().__init__()
        self.quant_method = None
        w = torch.randn(H * (NOPE + DV), RANK, generator=gen) / 8
        self.weight = torch.nn.Parameter(w.to(DTYPE), requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        return x @ self.weight.T, None


class Model:
    """One MLA layer with its cache, bound the way vLLM's worker binds it."""

    def __init__(
        self,
        backend: type = RefMLA,
        speculative_tokens: int = 0,
        prefill: type | None = CPUSDPAMLAPrefillBackend,
        workspace: int | None = None,
        prefill_slot: Any = None,
        kv_cache_dtype: str = "auto",
    ) -> None:
        """``prefill``: the MLA prefill backend class, or None for vLLM's selection (with
        ``attention_config.mla_prefill_backend = prefill_slot``); ``workspace``: the rows of
        vLLM's context-gather workspace (small values split a context into several chunks);
        ``kv_cache_dtype`` "fp8": an e4m3 latent cache (uint8, as vLLM allocates it) with the
        layer's ``_k_scale`` set to ``FP8_SCALE``."""
        self.config = create_vllm_config(
            model_name=MODEL, max_model_len=256, block_size=BS, num_gpu_blocks=BLOCKS
        )
        self.config.attention_config.mla_prefill_backend = prefill_slot
        self.config.cache_config.cache_dtype = kv_cache_dtype
        self.fp8 = kv_cache_dtype != "auto"
        if speculative_tokens:
            # The fields vLLM's builders read of a SpeculativeConfig (MTP drafts; a full one
            # needs the draft model's config).
            self.config.speculative_config = SimpleNamespace(
                num_speculative_tokens=speculative_tokens,
                max_num_new_slots_for_drafting=0,
                parallel_drafting=False,
                method="mtp",
            )
        gen = torch.Generator().manual_seed(0)
        self.kv_b_proj = KVBProj(gen)
        with set_current_vllm_config(self.config), model_dtype():
            self.layer = MLAAttention(
                num_heads=H, scale=SCALE, qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE,
                v_head_dim=DV, q_lora_rank=None, kv_lora_rank=RANK, kv_b_proj=self.kv_b_proj,
                cache_config=self.config.cache_config, prefix="model.layers.0.self_attn.attn",
                attn_backend=backend, prefill_backend_cls=prefill,
            )  # fmt: skip
            try:
                self.layer.process_weights_after_loading()  # vLLM 0.34
            except TypeError:
                self.layer.process_weights_after_loading(DTYPE)  # vLLM 0.33
            spec = self.layer.get_kv_cache_spec(self.config)
            kv = torch.zeros(BLOCKS, 1, BS, RANK + ROPE, dtype=torch.uint8 if self.fp8 else DTYPE)
            if self.fp8:  # the scale a checkpoint's k_scale would load; not 1, so it must be read
                self.layer._k_scale.fill_(FP8_SCALE)
                self.layer._k_scale_float = FP8_SCALE
            if hasattr(self.layer, "bind_kv_cache"):
                self.layer.bind_kv_cache(kv)
            else:
                self.layer.kv_cache = kv
            self.builder = backend.get_builder_cls()(
                spec, [self.layer.layer_name], self.config, torch.device("cpu")
            )
        if workspace is not None:  # read by each build's chunk planning
            self.builder.chunked_prefill_workspace_size = workspace

    @property
    def cache(self) -> torch.Tensor:
        """(blocks, block_size, rank + rope): the latent rows as vLLM keeps them."""
        return self.layer.kv_cache.view(-1, BS, RANK + ROPE)

    def step(self, seq_lens: list[int], query_lens: list[int], seed: int) -> dict[str, Any]:
        """One step: the context already cached (random latents), the new tokens run through
        the layer. Returns the output, the float64 oracle and vLLM's metadata."""
        gen = torch.Generator().manual_seed(seed)
        spec = BatchSpec(seq_lens=seq_lens, query_lens=query_lens)
        cm = create_common_attn_metadata(spec, BS, torch.device("cpu"))
        table = cm.block_table_tensor  # vLLM's helper draws ids that may collide: distinct ones
        ids = 1 + torch.randperm(BLOCKS - 1, generator=gen)[: table.numel()]
        table.copy_(ids.view(table.shape).to(table.dtype))
        with set_current_vllm_config(self.config):
            md = self.builder.build(0, cm)
        tokens = cm.num_actual_tokens
        q = torch.randn(tokens, H, NOPE + ROPE, generator=gen).to(DTYPE)
        kv_c = torch.randn(tokens, RANK, generator=gen).to(DTYPE)
        k_pe = torch.randn(tokens, 1, ROPE, generator=gen).to(DTYPE)
        flat = self.cache.view(-1, RANK + ROPE)
        w = self.kv_b_proj.weight.T.double().view(RANK, H, NOPE + DV)
        w_uk, w_uv = w[..., :NOPE], w[..., NOPE:]
        starts, want = cm.query_start_loc_cpu.tolist(), []
        for r, (s, n) in enumerate(zip(seq_lens, query_lens, strict=True)):
            pos = torch.arange(s)
            slots = cm.block_table_tensor[r, pos // BS].long() * BS + pos % BS
            context = torch.randn(s - n, RANK + ROPE, generator=gen).to(DTYPE).double()
            new = torch.cat((kv_c, k_pe[:, 0]), -1)[starts[r] : starts[r + 1]].double()
            if self.fp8:
                stored, context = _e4m3(context)
                if r < md.num_decodes:  # decode rows read their own latents back from the cache
                    new = _e4m3(new)[1]
                flat[slots[: s - n]] = stored
            else:
                flat[slots[: s - n]] = context.to(DTYPE)
            cm.slot_mapping[starts[r] : starts[r + 1]] = slots[s - n :]
            latent = torch.cat((context, new))
            c, pe = latent[:, :RANK], latent[:, RANK:]
            k = torch.cat((torch.einsum("sl,lhp->shp", c, w_uk), pe[:, None].expand(-1, H, -1)), -1)
            v = torch.einsum("sl,lhv->shv", c, w_uv)
            scores = torch.einsum("qhd,khd->hqk", q[starts[r] : starts[r + 1]].double(), k) * SCALE
            mask = pos[None, None, :] > torch.arange(s - n, s)[None, :, None]
            p = scores.masked_fill(mask, float("-inf")).softmax(-1)
            want.append(torch.einsum("hqk,khv->qhv", p, v).reshape(n, H * DV))
        with set_forward_context(
            {self.layer.layer_name: md},
            self.config,
            slot_mapping={self.layer.layer_name: cm.slot_mapping},
        ):
            out = self.layer(q, kv_c, k_pe, output_shape=torch.Size([tokens, H * DV]))
        return {"out": out, "want": torch.cat(want), "md": md, "slots": cm.slot_mapping}


def _e4m3(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's fp8 latent of ``x``: the cache bytes (e4m3 of x / scale, saturated) and the
    values a reader gets back (e4m3 * scale)."""
    scale = torch.tensor(FP8_SCALE, dtype=torch.float32)
    limit = torch.finfo(torch.float8_e4m3fn).max
    q = (x.to(DTYPE).float() / scale).clamp(-limit, limit).to(torch.float8_e4m3fn)
    return q.view(torch.uint8), q.double() * scale.double()


@pytest.fixture(scope="module")
def model() -> Model:
    return Model()


def _close(out: torch.Tensor, want: torch.Tensor) -> None:
    """bf16 activations, weights and cache (q absorbed by a bf16 bmm): within 1 % of the
    output's largest value (~10 here) of the float64 oracle; measured up to 0.43 %."""
    err = (out.double() - want).abs().max().item()
    scale = want.abs().max().item()
    assert err < 0.01 * scale, f"max error {err} against the float64 oracle (max |want| {scale})"


@pytest.mark.parametrize(
    ("seq_lens", "query_lens"),
    [
        ([20, 33, 1], [1, 1, 1]),  # decodes only (one of a single token)
        ([5, 7], [5, 7]),  # new prompts only: vLLM's prefill, no decode plan
        ([40, 17, 9], [1, 1, 9]),  # decodes first, then a new prompt
    ],
)
def test_steps_match_the_oracle(model: Model, seq_lens: list[int], query_lens: list[int]) -> None:
    result = model.step(seq_lens, query_lens, seed=len(seq_lens))
    _close(result["out"], result["want"])
    md = result["md"]
    decodes = sum(1 for n in query_lens if n == 1)
    assert md.num_decodes == decodes
    if decodes:
        meta = md.decode.plan.metadata
        assert meta.seq_lens_cpu.tolist() == seq_lens[:decodes]
        assert bool((meta.slot_mapping == -1).all())  # vLLM wrote the latents itself
    else:
        assert md.decode is None


def test_random_steps_match_the_oracle(model: Model) -> None:
    """Random batches: decodes over contexts crossing block boundaries, then new prompts."""
    rng = random.Random(0)
    for seed in range(6):
        decodes = [rng.randint(1, 120) for _ in range(rng.randint(0, 5))]
        prompts = [rng.randint(1, 30) for _ in range(rng.randint(0 if decodes else 1, 2))]
        result = model.step(decodes + prompts, [1] * len(decodes) + prompts, seed)
        _close(result["out"], result["want"])


def test_decode_rows_run_on_the_attnsdk_backend(
    model: Model, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The decode rows go through the attnsdk backend's forward, once per layer call, with
    the latent layer and cache; a wrong answer there would show in the output."""
    impl = model.layer.impl
    calls: list[tuple[A.LayerSpec, A.KVCacheLayout, int]] = []
    real = impl.backend.forward

    def spy(
        q: torch.Tensor,
        k: Any,
        v: Any,
        cache: A.KVCache,
        plan: A.Plan,
        layer: A.LayerSpec,
        **kw: Any,
    ) -> torch.Tensor:
        calls.append((layer, cache.layout, q.shape[0]))
        return real(q, k, v, cache, plan, layer, **kw)

    monkeypatch.setattr(impl.backend, "forward", spy)
    model.step([30, 12], [1, 1], seed=7)
    ((layer, layout, rows),) = calls
    assert (layer.mla, layer.head_dim, layer.v_dim, layer.num_heads) == (True, 576, 512, H)
    assert layer.softmax_scale == pytest.approx(SCALE)
    assert (layout.mla, layout.page_size) == (True, BS)
    assert rows == 2
    monkeypatch.setattr(impl.backend, "forward", lambda *a, **k: torch.zeros_like(real(*a, **k)))
    result = model.step([30, 12], [1, 1], seed=7)
    assert (result["out"] - result["want"]).abs().max() > 0.1


def test_backend_choice_and_refusals() -> None:
    """vLLM's selection asks the MLA drop-in (MLA: yes) and the plain one (MLA: refused, naming
    the class that serves it); the impl refuses what it does not map, naming the field."""
    assert RefMLA.is_mla()
    assert (
        RefMLA.supports_combination(576, DTYPE, "auto", BS, True, False, False, False, None) is None
    )
    reasons = AttnSDKAttentionBackend.validate_configuration(576, DTYPE, "auto", BS, use_mla=True)
    assert any("AttnSDKMLABackend" in r for r in reasons), reasons
    assert not RefMLA.supports_device_cpu_query_lens_mismatch()  # adaptive verification
    assert not RefMLA.get_impl_cls().supports_pcp
    mixed = RefMLA.supports_combination(576, DTYPE, "float16", BS, True, False, False, False, None)
    assert mixed is not None
    assert "float16" in mixed
    assert (
        RefMLA.supports_combination(576, DTYPE, "fp8", BS, True, False, False, False, None) is None
    )
    packed = RefMLA.supports_combination(
        576, DTYPE, "fp8_ds_mla", BS, True, False, False, False, None
    )
    assert packed is not None
    assert "fp8_ds_mla" in packed
    flex_fp8 = FlexMLA.supports_combination(576, DTYPE, "fp8", BS, True, False, False, False, None)
    assert flex_fp8 is not None
    assert "kv_dtype" in flex_fp8  # the attnsdk backend's own reason reaches vLLM
    impl_cls = RefMLA.get_impl_cls()
    base = {
        "num_heads": H, "head_size": RANK + ROPE, "scale": SCALE, "num_kv_heads": 1,
        "alibi_slopes": None, "sliding_window": None, "kv_cache_dtype": "auto",
        "logits_soft_cap": None, "attn_type": "decoder", "kv_sharing_target_layer_name": None,
        "q_lora_rank": None, "kv_lora_rank": RANK, "qk_nope_head_dim": NOPE,
        "qk_rope_head_dim": ROPE, "qk_head_dim": NOPE + ROPE, "v_head_dim": DV,
        "kv_b_proj": KVBProj(torch.Generator().manual_seed(0)),
    }  # fmt: skip
    config = create_vllm_config(model_name=MODEL, max_model_len=256, block_size=BS)
    with set_current_vllm_config(config):
        impl_cls(**base)
        impl_cls(**{**base, "kv_cache_dtype": "fp8"})  # an e4m3 latent with _k_scale
        for field, value in (
            ("sliding_window", 64),
            ("kv_cache_dtype", "fp8_ds_mla"),  # DeepSeek's packed fp8 rows
            ("logits_soft_cap", 30.0),
        ):
            with pytest.raises(A.UnsupportedConfigError, match=field):
                impl_cls(**{**base, field: value})


def test_speculative_verifies_run_as_decode_rows() -> None:
    """With speculative decoding (3 MTP drafts) vLLM itself raises the builder's threshold to
    the verify length (4): a request of up to 4 new tokens, a verify or a short prompt, is a
    decode row, causal over the latent cache, bottom-right aligned, through the attnsdk
    backend; longer prompts stay vLLM's prefill."""
    model = Model(speculative_tokens=3)
    assert model.builder.reorder_batch_threshold == 4
    seq_lens, query_lens = [40, 17, 25, 3, 9], [4, 1, 3, 3, 9]
    result = model.step(seq_lens, query_lens, seed=11)
    _close(result["out"], result["want"])
    md = result["md"]
    assert (md.num_decodes, md.num_decode_tokens, md.num_prefills) == (4, 11, 1)
    meta = md.decode.plan.metadata
    assert meta.query_lens_cpu.tolist() == [4, 1, 3, 3]
    assert meta.seq_lens_cpu.tolist() == [40, 17, 25, 3]
    rng = random.Random(1)
    for seed in range(4):
        n = rng.randint(1, 5)
        decodes = [(rng.randint(4, 90), rng.randint(1, 4)) for _ in range(n)]
        lens = [s for s, _ in decodes] + [12]
        result = model.step(lens, [q for _, q in decodes] + [12], seed)
        _close(result["out"], result["want"])


def test_speculative_steps_plan_from_exact_lengths(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU the adapter's host copy of seq_lens is vLLM's ``seq_lens_cpu_upper_bound``,
    which takes every draft as accepted. Under speculative decoding the decode plan reads the
    exact lengths instead (host-planning backends would attend past them)."""
    from attnsdk.adapters.vllm import VLLMAdapter

    def upper_bound(self: VLLMAdapter, cm: Any, num_reqs: int) -> torch.Tensor:
        return cm.seq_lens[:num_reqs] + 2  # two drafts that the device lengths rejected

    monkeypatch.setattr(VLLMAdapter, "host_seq_lens", upper_bound)
    model = Model(speculative_tokens=3)
    result = model.step([40, 17, 9], [4, 1, 9], seed=5)
    assert result["md"].decode.plan.metadata.seq_lens_cpu.tolist() == [40, 17]
    _close(result["out"], result["want"])


# --- The expanded prefill on attnsdk: AttnSDKMLAPrefillBackend ---------------------------------

CONTEXT_STEPS = [  # (seq_lens, query_lens): decodes first, then prefills over a cached context
    ([40, 17, 30, 50], [1, 1, 10, 6]),  # two prefills with 20 and 44 cached tokens
    ([25, 9, 60], [5, 9, 12]),  # a new prompt (no context) between two with context
    ([100], [3]),  # one prefill, 97 cached tokens
]


@pytest.mark.parametrize(
    "prefill", [CPUSDPAMLAPrefillBackend, RefMLAPrefill], ids=["vllm", "attnsdk"]
)
@pytest.mark.parametrize("workspace", [None, 32], ids=["one-chunk", "32-row-chunks"])
def test_prefill_over_cached_context(prefill: type, workspace: int | None) -> None:
    """Prefills whose requests have a cached context (prefix caching, chunked prefill): vLLM
    gathers and up-projects the context chunk by chunk (32 rows: a context split across chunks,
    continuations) and merges the parts by log-sum-exp; every attention call goes to the prefill
    backend. vLLM's own CPU backend is the control for the harness."""
    model = Model(prefill=prefill, workspace=workspace)
    for seed, (seq_lens, query_lens) in enumerate(CONTEXT_STEPS):
        result = model.step(seq_lens, query_lens, seed)
        _close(result["out"], result["want"])
        chunks = result["md"].prefill.chunked_context.chunks
        assert len(chunks) > 1 if workspace and max(seq_lens) > 64 else len(chunks) >= 1


def test_random_prefill_steps_on_attnsdk() -> None:
    """Random steps of decodes, new prompts and prefills over a context, through the attnsdk
    prefill backend with chunks of 16 to 64 rows."""
    rng = random.Random(3)
    for seed in range(8):
        model = Model(prefill=RefMLAPrefill, workspace=rng.choice([16, 32, 64, None]))
        decodes = [rng.randint(1, 120) for _ in range(rng.randint(0, 3))]
        prefills = [(rng.randint(2, 20), rng.randint(0, 90)) for _ in range(rng.randint(1, 4))]
        seq_lens = decodes + [n + ctx for n, ctx in prefills]
        query_lens = [1] * len(decodes) + [n for n, _ in prefills]
        result = model.step(seq_lens, query_lens, seed)
        _close(result["out"], result["want"])


def test_prefill_calls_reach_the_attnsdk_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    """The step's plans are made by the builder (``prepare_metadata``), one per part, none in
    the attention calls; the expanded layer's dims; and the result used: zeroing the context
    chunks' output shows in the layer's output."""
    model = Model(prefill=RefMLAPrefill, workspace=32)
    backend = model.builder._prefill_backend
    assert isinstance(backend, RefMLAPrefill)
    calls: list[tuple[A.LayerSpec, A.AttentionMetadata]] = []
    plans: list[tuple[int, A.AttentionMetadata]] = []  # (attention calls before it, metadata)
    real, real_plan = backend.backend.forward_ragged, backend.backend.plan

    def spy(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: A.Plan,
            layer: A.LayerSpec, **kw: Any) -> torch.Tensor:  # fmt: skip
        calls.append((layer, plan.metadata))
        return real(q, k, v, plan, layer, **kw)

    def plan_spy(meta: A.AttentionMetadata) -> A.Plan:
        if meta.key_start_loc is not None:  # the decode drop-in shares the backend: not its plan
            plans.append((len(calls), meta))
        return real_plan(meta)

    monkeypatch.setattr(backend.backend, "forward_ragged", spy)
    monkeypatch.setattr(backend.backend, "plan", plan_spy)
    seq_lens, query_lens = [40, 70], [1, 6]  # a decode, then a prefill over 64 cached tokens
    result = model.step(seq_lens, query_lens, seed=4)
    _close(result["out"], result["want"])
    assert [before for before, _ in plans] == [0, 0, 0]  # new tokens + 2 chunks, all at build
    assert [meta for _, meta in plans] == [meta for _, meta in calls]
    (new_layer, new_meta), *chunk_calls = calls
    assert (new_layer.head_dim, new_layer.v_dim, new_layer.num_heads) == (NOPE + ROPE, DV, H)
    assert new_layer.causal
    assert not new_meta.cross_attention
    assert new_meta.query_lens_cpu.tolist() == new_meta.seq_lens_cpu.tolist() == [6]
    assert [m.seq_lens_cpu.tolist() for _, m in chunk_calls] == [[32], [32]]
    assert all(not layer.causal and meta.cross_attention for layer, meta in chunk_calls)

    def zero_chunks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: A.Plan,
                    layer: A.LayerSpec, **kw: Any) -> torch.Tensor:  # fmt: skip
        out = real(q, k, v, plan, layer, **kw)
        return out.zero_() if plan.metadata.cross_attention else out

    monkeypatch.setattr(backend.backend, "forward_ragged", zero_chunks)
    result = model.step(seq_lens, query_lens, seed=4)
    assert (result["out"] - result["want"]).abs().max() > 0.1


def test_prefill_registration_and_selection() -> None:
    """``register_mla_prefill`` puts the class in vLLM's MLA prefill registry; vLLM's own
    selection (``attention_config.mla_prefill_backend``) then builds it for the layer. A
    backend without ragged attention is refused at selection, naming why."""
    from vllm.v1.attention.backends.mla.prefill import get_mla_prefill_backend
    from vllm.v1.attention.backends.mla.prefill.registry import MLAPrefillBackendEnum

    from attnsdk.adapters.vllm import register_mla_prefill

    slot = register_mla_prefill(REF_MLA_PREFILL)
    try:
        assert slot is MLAPrefillBackendEnum.CUSTOM
        model = Model(prefill=None, prefill_slot=slot)
        assert get_mla_prefill_backend(model.config) is RefMLAPrefill
        assert isinstance(model.layer.prefill_backend, RefMLAPrefill)
        result = model.step([30, 50], [4, 9], seed=2)
        _close(result["out"], result["want"])

        register_mla_prefill(FLEX_MLA_PREFILL)
        with pytest.raises(ValueError, match="ragged"):
            get_mla_prefill_backend(model.config)
    finally:
        MLAPrefillBackendEnum.CUSTOM.clear_override()


def test_prefill_refusals() -> None:
    """Fused fp8 output is refused naming ``output_scale``; a prefill without this step's
    ``prepare_metadata``, a chunk that is not one of the planned ones and query rows other
    than the planned ones are refused rather than run on the wrong plan."""
    model = Model(prefill=RefMLAPrefill, workspace=32)
    backend = model.builder._prefill_backend
    q = torch.zeros(3, H, NOPE + ROPE, dtype=DTYPE)
    k, v = torch.zeros_like(q), torch.zeros(3, H, DV, dtype=DTYPE)
    with pytest.raises(A.InvalidMetadataError, match="prepare_metadata"):
        backend.run_prefill_new_tokens(q, k, v, return_softmax_lse=False)
    model.step([3], [3], seed=0)
    with pytest.raises(A.UnsupportedConfigError, match="output_scale"):
        backend.run_prefill_new_tokens(q, k, v, False, output_scale=torch.ones(()))
    with pytest.raises(A.InvalidInputError, match=r"q\.shape\[0\]"):
        backend.run_prefill_new_tokens(torch.zeros(4, H, NOPE + ROPE, dtype=DTYPE), k, v, False)
    out = backend.run_prefill_new_tokens(q, k, v, return_softmax_lse=True)
    assert isinstance(out, tuple)
    assert out[0].shape == (3, H, DV)
    assert out[1].shape == (H, 3)
    assert out[1].is_contiguous()
    old = model.step([50], [3], seed=1)["md"].prefill.chunked_context.chunks[0]
    model.step([60], [3], seed=2)  # a new step: new chunk objects and plans
    with pytest.raises(A.InvalidMetadataError, match="chunk"):
        backend.run_prefill_context_chunk(old, q, k, v)


def test_prefill_writes_into_vllms_out() -> None:
    """``supports_out()``: given ``out`` (vLLM's Kimi path writes chunks straight into its
    accumulator), both calls write there and return that buffer, with the values they return
    without it."""
    model = Model(prefill=RefMLAPrefill, workspace=32)
    backend = model.builder._prefill_backend
    assert backend.supports_out()
    md = model.step([70], [5], seed=3)["md"]
    gen = torch.Generator().manual_seed(9)
    q = torch.randn(5, H, NOPE + ROPE, generator=gen).to(DTYPE)
    k_new, v_new = (
        torch.randn(5, H, NOPE + ROPE, generator=gen).to(DTYPE),
        torch.randn(5, H, DV, generator=gen).to(DTYPE),
    )
    chunk = md.prefill.chunked_context.chunks[0]
    keys = int(chunk.seq_lens.sum())
    k_ctx = torch.randn(keys, H, NOPE + ROPE, generator=gen).to(DTYPE)
    v_ctx = torch.randn(keys, H, DV, generator=gen).to(DTYPE)
    for call in (
        lambda out: backend.run_prefill_new_tokens(q, k_new, v_new, True, out=out),
        lambda out: backend.run_prefill_context_chunk(chunk, q, k_ctx, v_ctx, out=out),
    ):
        want, want_lse = call(None)
        out = torch.full((5, H, DV), float("nan"), dtype=DTYPE)
        got, lse = call(out)
        assert got.data_ptr() == out.data_ptr()
        assert torch.equal(out, want)
        assert torch.equal(lse, want_lse)


# --- fp8 latent caches ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "prefill", [CPUSDPAMLAPrefillBackend, RefMLAPrefill], ids=["vllm", "attnsdk"]
)
def test_fp8_latent_cache(prefill: type) -> None:
    """``kv_cache_dtype="fp8"``: vLLM writes e4m3 latents of row / ``_k_scale`` into a uint8
    cache and views it as e4m3 for the decode; the drop-in reads it with the layer's scale
    (0.02 here, so a scale left out is off by 50x). Prefills gather their context dequantized
    (vLLM's gather) and attend their new tokens unquantized, as vLLM does."""
    model = Model(prefill=prefill, workspace=32, kv_cache_dtype="fp8")
    assert model.layer.kv_cache.dtype == torch.uint8
    rng = random.Random(5)
    steps = [([30, 12, 70], [1, 1, 8])] + [
        (
            [rng.randint(1, 100) for _ in range(3)] + [40],
            [1, 1, 1, rng.randint(2, 12)],
        )
        for _ in range(4)
    ]
    for seed, (seq_lens, query_lens) in enumerate(steps):
        result = model.step(seq_lens, query_lens, seed)
        _close(result["out"], result["want"])


def test_fp8_latent_scale_is_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """The decode passes ``layer._k_scale`` to the attnsdk backend as k_scale (fp32), over an
    attnsdk MLA cache whose storage is e4m3 and whose compute dtype is the model's."""
    model = Model(kv_cache_dtype="fp8")
    impl = model.layer.impl
    seen: list[tuple[Any, A.KVCacheLayout]] = []
    real = impl.backend.forward

    def spy(*args: Any, **kw: Any) -> torch.Tensor:
        seen.append((kw.get("k_scale"), args[3].layout))
        return real(*args, **kw)

    monkeypatch.setattr(impl.backend, "forward", spy)
    _close(**{k: v for k, v in model.step([20, 9], [1, 1], seed=3).items() if k in ("out", "want")})
    ((k_scale, layout),) = seen
    assert k_scale.dtype == torch.float32
    assert float(k_scale) == pytest.approx(FP8_SCALE)
    assert (layout.storage_dtype, layout.dtype, layout.mla) == (torch.float8_e4m3fn, DTYPE, True)
