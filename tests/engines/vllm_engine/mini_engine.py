"""A few-layer model run the way vLLM's engine core and GPU worker run it, on the CPU.

Engine core: ``resolve_kv_cache_layout``, ``get_global_kv_cache_groups``,
``get_kv_cache_configs``. Worker (``vllm.v1.worker.gpu.attn_utils``): ``get_kv_cache_spec``,
``init_attn_backend`` (attention groups, builders), ``init_kv_cache`` (``allocate_kv_cache`` ->
``create_kv_cache_views``, bound to the layers), and per step ``build_attn_metadata`` +
``build_slot_mappings_by_layer`` + ``set_forward_context`` around the real ``Attention`` layers
(and first, before any KV cache exists, the memory-profiling run without attention metadata).

What this module does itself is the scheduler's part, as vLLM's does it: block allocation
from one pool shared by the KV cache groups (block 0 is the null block), sliding-window blocks
freed once wholly below the window of a request's first new token and replaced by the null
block, CUDA-graph padding (requests with query length 0 and seq_len 0 and null-block rows,
token rows with slot -1). Freed blocks are filled with NaN: a backend that reads a block it no
longer owns shows it. ``Oracle`` is written from DESIGN §2, independently of attnsdk.
"""

from __future__ import annotations

import importlib.metadata
import math
import os
from dataclasses import dataclass, field
from typing import Any

import torch
from tests.v1.attention.utils import create_vllm_config
from vllm.config import set_current_vllm_config
from vllm.forward_context import set_forward_context
from vllm.model_executor.layers.attention import Attention
from vllm.v1.attention.backends.registry import AttentionBackendEnum
from vllm.v1.attention.backends.utils import (
    get_supported_kv_cache_layouts,
    resolve_kv_cache_layout,
)
from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs
from vllm.v1.kv_cache_interface import KVCacheLayout, SlidingWindowSpec
from vllm.v1.worker.gpu import attn_utils

H, HKV, D, BS, WINDOW, MAX_LEN, NUM_BLOCKS = 4, 2, 32, 16, 24, 128, 48
CPU = torch.device("cpu")
FP8 = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
NEW_034 = tuple(int(x) for x in importlib.metadata.version("vllm").split(".")[:2]) >= (0, 34)


@dataclass(frozen=True)
class LayerDef:
    window: int | None = None
    sinks: bool = False
    shares: str | None = None  # kv_sharing_target_layer_name
    scales: tuple[float, float] = (1.0, 1.0)  # k/v scales, as a checkpoint would set them


def name(i: int) -> str:
    return f"model.layers.{i}.self_attn.attn"


LAYERS: dict[str, LayerDef] = {
    name(0): LayerDef(scales=(0.5, 2.0)),
    name(1): LayerDef(window=WINDOW, scales=(1.5, 0.25)),
    name(2): LayerDef(sinks=True, scales=(0.75, 1.25)),
    name(3): LayerDef(window=WINDOW, sinks=True, scales=(2.0, 0.5)),
    name(4): LayerDef(shares=name(0), scales=(0.5, 2.0)),
}


@dataclass
class Request:
    prompt: int
    computed: int = 0
    blocks: list[list[int]] = field(default_factory=list)  # per KV cache group
    keys: dict[str, list[torch.Tensor]] = field(default_factory=dict)  # float64, by position
    values: dict[str, list[torch.Tensor]] = field(default_factory=dict)


class MiniEngine:
    """The model's layers, KV cache and step loop (see the module docstring)."""

    def __init__(
        self,
        layout: str,
        kv_cache_dtype: str,
        dtype: torch.dtype,
        *,
        hybrid: bool = True,
        fast_prefill: bool = False,
        per_head_scales: bool = False,
    ) -> None:
        self.dtype, self.kv_cache_dtype = dtype, kv_cache_dtype
        self.fp8 = FP8.get(kv_cache_dtype)
        self.gen = torch.Generator().manual_seed(0)
        self.sinks: dict[str, torch.Tensor | None] = {}
        vc = create_vllm_config(
            block_size=BS, max_model_len=MAX_LEN, dtype=dtype, num_gpu_blocks=NUM_BLOCKS
        )
        vc.attention_config.backend = AttentionBackendEnum.CUSTOM
        vc.cache_config.cache_dtype = kv_cache_dtype
        vc.cache_config.kv_cache_layout = None  # resolved below, as the engine core does
        vc.cache_config.num_gpu_blocks_override = NUM_BLOCKS
        # On a GPU platform the hybrid KV cache manager is on (one group per attention type);
        # off (KV connectors, CPU), sliding-window layers share the full-attention group.
        vc.scheduler_config.disable_hybrid_kv_cache_manager = not hybrid
        # YOCO-style models: trailing KV-sharing layers run only on the logits rows of a
        # prefill step (vLLM subclasses our builder and metadata class for them).
        vc.cache_config.kv_sharing_fast_prefill = fast_prefill
        self.vllm_config = vc
        default = torch.get_default_dtype()
        torch.set_default_dtype(dtype)  # model loading sets the activation dtype
        try:
            with set_current_vllm_config(vc):
                self.layers = {n: self._layer(n, d) for n, d in LAYERS.items()}
                self._profile_run()
                self._init_cache(KVCacheLayout[layout])
        finally:
            torch.set_default_dtype(default)
        self.scales: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for n, d in LAYERS.items():
            layer = self.layers[n]
            if NEW_034:  # what the model loader calls; scales go back to 1.0 without a quant method
                layer.process_weights_after_loading()
            else:
                layer.process_weights_after_loading(dtype)
            assert float(layer._k_scale) == 1.0
            # ...then a checkpoint's KV-cache scales, per tensor or per KV head ("attn_head")
            per_head = torch.tensor([1.0, 1.5]) if per_head_scales else torch.tensor(1.0)
            layer._k_scale, layer._v_scale = d.scales[0] * per_head, d.scales[1] * per_head
            layer._k_scale_float = float(layer._k_scale.max())
            layer._v_scale_float = float(layer._v_scale.max())
            shape = (HKV, 1) if per_head_scales else ()
            self.scales[n] = (layer._k_scale.view(shape), layer._v_scale.view(shape))
        self.free = list(range(NUM_BLOCKS - 1, 0, -1))  # LIFO: freed blocks come back first
        self.oracle = Oracle(self)

    def _layer(self, n: str, d: LayerDef) -> Attention:
        sinks = torch.randn(H, generator=self.gen) if d.sinks else None
        self.sinks[n] = sinks
        return Attention(
            H, D, D**-0.5, HKV,
            cache_config=self.vllm_config.cache_config, prefix=n,
            per_layer_sliding_window=d.window, kv_sharing_target_layer_name=d.shares,
            **({"sinks": sinks} if sinks is not None else {}),
        )  # fmt: skip

    def _profile_run(self) -> None:
        """vLLM's memory-profiling run: no attention metadata, no KV cache bound yet."""
        with set_forward_context(None, self.vllm_config, num_tokens=8):
            for layer in self.layers.values():
                assert layer.kv_cache.numel() == 0
                assert bool((layer(*self._inputs(8)) == 0).all())

    def _init_cache(self, layout: KVCacheLayout) -> None:
        vc = self.vllm_config
        specs = attn_utils.get_kv_cache_spec(vc)
        names = [m.name for m in get_supported_kv_cache_layouts({self.backend_cls})]
        before = os.environ.get("VLLM_KV_CACHE_LAYOUT")
        os.environ["VLLM_KV_CACHE_LAYOUT"] = layout.name  # the user's choice of layout
        try:
            resolved = resolve_kv_cache_layout(vc, [names], specs.values())
        finally:
            if before is None:
                del os.environ["VLLM_KV_CACHE_LAYOUT"]
            else:
                os.environ["VLLM_KV_CACHE_LAYOUT"] = before
        assert resolved is layout, (resolved, layout)
        groups = get_global_kv_cache_groups(vc, [specs])
        (config,) = get_kv_cache_configs(vc, [specs], [1 << 40], groups)
        config.kv_cache_layout = resolved.name
        self.kv_cache_config = config
        self.attn_groups, _, kernel_block_sizes = attn_utils.init_attn_backend(config, vc, CPU)
        self.fast_layers = attn_utils.get_kv_sharing_fast_prefill_eligible_layers(vc)
        self.caches = attn_utils.init_kv_cache(
            vc.compilation_config.static_forward_context, config, CPU, kernel_block_sizes, vc,
            attn_groups=[g for groups in self.attn_groups for g in groups],
        )  # fmt: skip
        self.group_of = {
            n: g for g, grp in enumerate(config.kv_cache_groups) for n in grp.layer_names
        }
        self.sliding = [
            isinstance(g.kv_cache_spec, SlidingWindowSpec) for g in config.kv_cache_groups
        ]
        storage = self.caches[name(0)].untyped_storage()
        assert all(
            c.untyped_storage().data_ptr() == storage.data_ptr() for c in self.caches.values()
        )
        self.raw = torch.empty(0, dtype=torch.int8).set_(storage, 0, (storage.nbytes(),), (1,))

    @property
    def backend_cls(self) -> type:
        return self.layers[name(0)].get_attn_backend()

    # ---- the scheduler's part ----------------------------------------------------------------

    def add(self, prompt: int) -> Request:
        return Request(prompt, blocks=[[] for _ in self.sliding])

    def finish(self, req: Request) -> None:
        for blocks in req.blocks:
            self._release([b for b in blocks if b])
            blocks.clear()

    def _release(self, blocks: list[int]) -> None:
        for cache in self.caches.values():  # poison every layer's bytes of the blocks
            cache[blocks] = 0x7F if cache.dtype == torch.uint8 else math.nan  # fp8 NaN: 0x7F
        self.free.extend(blocks)

    def _schedule(self, req: Request, n: int) -> None:
        start, end = req.computed, req.computed + n
        for g, blocks in enumerate(req.blocks):
            while len(blocks) < -(-end // BS):
                blocks.append(self.free.pop())
            if self.sliding[g]:  # vLLM frees blocks wholly below the window of `start`
                for j in range(max(0, start - WINDOW + 1) // BS):
                    if blocks[j]:
                        self._release([blocks[j]])
                        blocks[j] = 0

    # ---- one step ----------------------------------------------------------------------------

    def step(
        self,
        work: list[tuple[Request, int]],
        *,
        pad_requests: int = 0,
        pad_tokens: int = 0,
        causal: bool = True,
    ) -> dict[str, torch.Tensor]:
        """Schedule ``work`` ((request, new tokens) in batch order), run every layer, check."""
        for req, n in work:
            self._schedule(req, n)
        query_lens = [n for _, n in work] + [0] * pad_requests
        seq_lens = [r.computed + n for r, n in work] + [0] * pad_requests
        num_reqs, num_tokens = len(query_lens), sum(query_lens) + pad_tokens
        qsl = torch.zeros(num_reqs + 1, dtype=torch.int32)
        qsl[1:] = torch.tensor(query_lens).cumsum(0)
        tables = torch.zeros(len(self.sliding), num_reqs, MAX_LEN // BS, dtype=torch.int32)
        slots = torch.full((len(self.sliding), num_tokens), -1, dtype=torch.int64)
        for b, (req, n) in enumerate(work):
            pos = torch.arange(req.computed, req.computed + n)
            for g, blocks in enumerate(req.blocks):
                tables[g, b, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
                slots[g, qsl[b] : qsl[b + 1]] = tables[g, b, pos // BS].long() * BS + pos % BS
        seq = torch.tensor(seq_lens, dtype=torch.int32)
        fast = None
        if self.fast_layers and max(query_lens) > 1:  # armed for steps with a prefill
            logits = qsl[1 : len(work) + 1] - 1  # each request's last row, padded by 2
            fast = attn_utils.FastPrefillBatchMetadata(
                logits_indices_padded=torch.cat([logits, logits[-1:].repeat(2)]),
                num_logits_indices=len(work),
                max_logits_per_req=1,
            )
        metadata = attn_utils.build_attn_metadata(
            attn_groups=self.attn_groups, num_reqs=num_reqs, num_tokens=num_tokens,
            query_start_loc_gpu=qsl, query_start_loc_cpu=qsl.clone(),
            max_query_len=max(query_lens), seq_lens=seq, max_seq_len=max(seq_lens),
            block_tables=list(tables), slot_mappings=slots,
            kv_cache_config=self.kv_cache_config, seq_lens_cpu_upper_bound=seq.clone(),
            causal=causal, fast_prefill=fast,
        )  # fmt: skip
        slot_by_layer = attn_utils.build_slot_mappings_by_layer(slots, self.kv_cache_config)
        inputs = {n: self._inputs(num_tokens) for n in LAYERS}
        expected_raw = self.oracle.expected_cache(inputs, slots, sum(query_lens))
        with set_forward_context(
            metadata, self.vllm_config, num_tokens=num_tokens, slot_mapping=slot_by_layer
        ):
            outputs = {}
            for n in LAYERS:
                q, k, v = inputs[n]
                if fast is not None and n in self.fast_layers:  # the logits rows only
                    assert type(metadata[n]).__name__ == "KVSharingFastPrefillAttentionMetadata"
                    assert metadata[n].num_actual_tokens == len(work)
                    assert bool((metadata[n].slot_mapping < 0).all())  # a reader: no writes
                    rows = fast.logits_indices_padded.long()
                    q, k, v = q[rows], k[rows], v[rows]
                outputs[n] = self.layers[n](q, k, v)
        assert outputs[name(0)].shape == (num_tokens, H * D)
        changed = (self.raw != expected_raw).nonzero()
        assert changed.numel() == 0, f"KV buffer bytes differ from the oracle at {changed[:8]}"
        self.oracle.record(work, inputs, qsl)
        reduced = self.fast_layers if fast is not None else set()
        self.oracle.check_outputs(work, inputs, outputs, qsl, causal, reduced)
        for req, n in work:
            req.computed += n
        return outputs

    def _inputs(self, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        def randn(width: int) -> torch.Tensor:
            return torch.randn(rows, width, generator=self.gen).to(self.dtype)

        return randn(H * D), randn(HKV * D), randn(HKV * D)


class Oracle:
    """Float64 reference from DESIGN §2: where each new K/V lands, and each layer's output."""

    def __init__(self, engine: MiniEngine) -> None:
        self.e = engine

    def stored(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """x (..., Hkv, D) as the cache holds it: vLLM's fp8 store is fp8(float(x) / scale),
        in uint8 storage; an unquantised cache ignores the scales."""
        if self.e.fp8 is None:
            return x
        return (x.float() / scale.float()).to(self.e.fp8).view(torch.uint8)

    def read(self, stored: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        if self.e.fp8 is None:
            return stored.double()
        return stored.view(self.e.fp8).double() * scale.double()

    def expected_cache(
        self, inputs: dict[str, Any], slots: torch.Tensor, real: int
    ) -> torch.Tensor:
        raw = self.e.raw.clone()
        for n, d in LAYERS.items():
            if d.shares is not None:
                continue  # a KV-sharing layer reads its target's cache and writes nothing
            cache = self.e.caches[n]
            view = raw.view(cache.dtype).as_strided(
                cache.shape, cache.stride(), cache.storage_offset()
            )
            _, k, v = inputs[n]
            k_scale, v_scale = self.e.scales[n]
            for t, slot in enumerate(slots[self.e.group_of[n], :real].tolist()):
                if slot >= 0:
                    block, offset = divmod(slot, BS)
                    view[block, :, offset, :D] = self.stored(k[t].view(HKV, D), k_scale)
                    view[block, :, offset, D:] = self.stored(v[t].view(HKV, D), v_scale)
        return raw

    def record(
        self, work: list[tuple[Request, int]], inputs: dict[str, Any], qsl: torch.Tensor
    ) -> None:
        for b, (req, _) in enumerate(work):
            for n, d in LAYERS.items():
                if d.shares is None:
                    _, k, v = inputs[n]
                    rows = slice(int(qsl[b]), int(qsl[b + 1]))
                    ks, vs = self.e.scales[n]
                    kk = self.read(self.stored(k[rows].view(-1, HKV, D), ks), ks)
                    vv = self.read(self.stored(v[rows].view(-1, HKV, D), vs), vs)
                    req.keys.setdefault(n, []).extend(kk)
                    req.values.setdefault(n, []).extend(vv)

    def check_outputs(
        self,
        work: list[tuple[Request, int]],
        inputs: dict[str, Any],
        outputs: dict[str, torch.Tensor],
        qsl: torch.Tensor,
        causal: bool,
        reduced: set[str],
    ) -> None:
        """Each real row of every layer; ``reduced`` layers ran on each request's last row."""
        tol = 1e-4 if self.e.dtype == torch.float32 else 2e-2
        for n, d in LAYERS.items():
            source = d.shares or n
            sinks = self.e.sinks[n]
            for b, (req, _) in enumerate(work):
                rows = slice(int(qsl[b]), int(qsl[b + 1]))
                q = inputs[n][0][rows].view(-1, H, D)
                got_rows = rows
                if n in reduced:
                    q, got_rows = q[-1:], slice(b, b + 1)
                k, v = torch.stack(req.keys[source]), torch.stack(req.values[source])
                want = attention(q, k, v, causal=causal, window=d.window, sinks=sinks)
                got = outputs[n][got_rows].view(-1, H, D).double()
                torch.testing.assert_close(
                    got, want, atol=tol, rtol=tol, msg=lambda m, n=n: f"{n}: {m}"
                )


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    window: int | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """q (n, Hq, D) at the last n of L positions; k/v (L, Hkv, D) float64 -> (n, Hq, D)."""
    n, length = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * D**-0.5
    q_pos = torch.arange(length - n, length)[:, None]
    k_pos = torch.arange(length)[None, :]
    visible = (k_pos <= q_pos) if causal else torch.ones(n, length, dtype=torch.bool)
    if window is not None:  # W keys including the query's own; symmetric when non-causal
        visible &= (q_pos - k_pos).abs() <= window - 1
    scores = scores.masked_fill(~visible, -math.inf)
    if sinks is not None:  # one extra logit per head, with no value
        scores = torch.cat([scores, sinks.double()[:, None, None].expand(-1, n, 1)], dim=-1)
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1)[..., :length], v)
