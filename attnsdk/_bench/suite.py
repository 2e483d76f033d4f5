"""Runs ``attnsdk bench``'s cases: every backend and its raw kernel on the same inputs, one row
per (case, backend), each output checked against the reference backend first.

Per case, one set of inputs (page table, caches, q/k/v) is made and shared by every backend and
raw kernel, so all rows of a case see the same shapes, pages and values. Times are per layer;
a decode case cycles through ``rotation(case)`` layers' caches per step. What each row holds is
documented in docs/benchmarks.md ("What the JSON holds").
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from attnsdk._bench.common import DTYPE, PAGE, Case, Ceilings, eager_us, graph_us, host_us, rotation
from attnsdk._bench.raw import RAW_FAMILY, raw_kernel, write_kv
from attnsdk.contract.kv import KVCacheLayout
from attnsdk.contract.metadata import AttentionMetadata
from attnsdk.selection.create import create_backend
from attnsdk.testing import tolerance

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from attnsdk.contract.backend import Backend
    from attnsdk.contract.kv import KVCache
    from attnsdk.contract.layer import LayerSpec

__all__ = ["MAX_KV_BYTES", "Inputs", "Settings", "make_inputs", "run_suite"]

MAX_KV_BYTES = 60 << 30
"""A case whose caches (all rotated layers) would hold more KV than this is skipped."""


@dataclass(frozen=True, slots=True)
class Settings:
    """How long to time: ``budget_s`` per eager loop, ``repeats`` loops, graph ``rep_ms``."""

    budget_s: float = 0.1
    repeats: int = 3
    rep_ms: float = 20.0
    plan_calls: int = 200


@dataclass(frozen=True, slots=True)
class Inputs:
    """One case's shared inputs, on the device."""

    case: Case
    layer: LayerSpec
    meta: AttentionMetadata
    caches: list[KVCache]
    """``rotation(case)`` layers' caches, each with every page filled."""
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    device: str


def make_inputs(case: Case, layer: LayerSpec, device: str, seed: int = 0) -> Inputs:
    """Shuffled pages (page 0 reserved, as in every engine) and random values."""
    gen = torch.Generator().manual_seed(seed)
    pages = [-(-s // PAGE) for s in case.seq_lens]
    pool = (torch.randperm(sum(pages), generator=gen) + 1).to(torch.int32)
    table = torch.zeros(case.num_seqs, max(pages), dtype=torch.int32)
    start = 0
    for b, n in enumerate(pages):
        table[b, :n] = pool[start : start + n]
        start += n
    meta = AttentionMetadata.from_seqlens(
        case.query_lens, case.seq_lens, table, PAGE, device=device
    )
    layout = KVCacheLayout(layer.num_kv_heads, layer.head_dim, PAGE, dtype=DTYPE)
    caches = []
    for _ in range(rotation(case) if device == "cuda" else 1):
        cache = layout.allocate(sum(pages) + 1, device)
        cache.k.normal_()
        cache.v.normal_()
        caches.append(cache)
    t, hq, hkv, d = case.num_tokens, layer.num_heads, layer.num_kv_heads, layer.head_dim

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device=device, dtype=DTYPE)

    return Inputs(
        case, layer, meta, caches, rand(t, hq, d), rand(t, hkv, d), rand(t, hkv, d), device
    )


def too_big(case: Case, device: str) -> str | None:
    """Why ``case`` is skipped on ``device`` (its KV does not fit), or None."""
    layers = rotation(case) if device == "cuda" else 1
    need = case.kv_bytes() * layers
    limit = MAX_KV_BYTES
    if device == "cuda":
        limit = min(limit, int(0.7 * torch.cuda.mem_get_info()[0]))
    if need > limit:
        return f"{need / 2**30:.1f} GiB of KV over {layers} layers > {limit / 2**30:.1f} GiB"
    return None


def run_suite(
    cases: Sequence[Case],
    backends: dict[str, Backend],
    layer: LayerSpec,
    device: str,
    ceilings: Ceilings,
    settings: Settings,
    log: Callable[[dict[str, Any]], None] = lambda row: None,
) -> dict[str, Any]:
    """Every backend (and its raw kernel) on every case: ``{"rows": [...], "skipped": [...]}``."""
    rows: list[dict[str, Any]] = []
    skipped: list[str] = []
    reference = create_backend("reference", device=device)
    for case in cases:
        why = too_big(case, device)
        if why:
            skipped.append(f"{case.name}: {why}")
            continue
        inputs = make_inputs(case, layer, device)
        expected = _run_once(reference, inputs)
        raws: dict[str, dict[str, Any]] = {}
        for name, backend in backends.items():
            family = RAW_FAMILY.get(name) if device == "cuda" else None
            if family is not None and family not in raws:
                raws[family] = _bench_raw(family, inputs, expected, settings)
            row = _row(case, name, inputs)
            row.update(_bench_sdk(backend, inputs, expected, settings))
            row.update(raws.get(family, {}) if family else {})
            _finish(row, case, ceilings)
            rows.append(row)
            log(row)
        del inputs
        if device == "cuda":
            torch.cuda.empty_cache()
    return {"rows": rows, "skipped": skipped}


def _row(case: Case, backend: str, inputs: Inputs) -> dict[str, Any]:
    row: dict[str, Any] = {"suite": case.suite, "case": case.name, "backend": backend}
    if case.suite == "decode":
        row.update(bs=case.num_seqs, ctx=case.seq_lens[0])
    row.update(
        num_seqs=case.num_seqs,
        num_tokens=case.num_tokens,
        layers=len(inputs.caches),
        kv_bytes=case.kv_bytes(inputs.layer, DTYPE.itemsize),
        flops=case.flops(inputs.layer),
    )
    return row


def _run_once(backend: Backend, inputs: Inputs, plan: Any = None) -> torch.Tensor:
    """One forward on the first cache, into a NaN-poisoned output (rows a backend forgets show)."""
    out = torch.full_like(inputs.q, float("nan"))
    plan = plan if plan is not None else backend.plan(inputs.meta)
    backend.forward(inputs.q, inputs.k, inputs.v, inputs.caches[0], plan, inputs.layer, out=out)
    return out[: inputs.meta.num_tokens]


def _check(out: torch.Tensor, expected: torch.Tensor, prefix: str = "") -> dict[str, Any]:
    atol, rtol = tolerance(DTYPE)
    o, r = out.float(), expected.float()
    err = (o - r).abs()
    finite = bool(torch.isfinite(o).all())
    correct = finite and bool((err <= atol + rtol * r.abs()).all())
    return {
        f"{prefix}max_abs_err": float(err.max()) if finite else math.inf,
        f"{prefix}correct": correct,
    }


def _error(exc: BaseException) -> str:
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {first}"[:300]


def _bench_sdk(
    backend: Backend, inputs: Inputs, expected: torch.Tensor, settings: Settings
) -> dict[str, Any]:
    meta, caches, layer, dev = inputs.meta, inputs.caches, inputs.layer, inputs.device
    q, k, v = inputs.q, inputs.k, inputs.v
    n = len(caches)
    result: dict[str, Any] = {}
    try:
        t0 = time.perf_counter()
        plan = backend.plan(meta)
        out = _run_once(backend, inputs, plan)
        if dev == "cuda":
            torch.cuda.synchronize()
        result["setup_s"] = time.perf_counter() - t0  # first step: compiles and JIT included
        result.update(_check(out, expected))
        buf = torch.empty_like(q)

        def forward_only() -> None:
            for c in caches:
                backend.forward(q, k, v, c, plan, layer, out=buf)

        def step() -> None:
            p = backend.plan(meta)
            for c in caches:
                backend.forward(q, k, v, c, p, layer, out=buf)

        result["sdk_fwd_eager_us"] = (
            eager_us(forward_only, dev, budget_s=settings.budget_s, repeats=settings.repeats) / n
        )
        result["sdk_step_eager_us"] = (
            eager_us(step, dev, budget_s=settings.budget_s, repeats=settings.repeats) / n
        )
        result["sdk_plan_host_us"] = host_us(
            lambda: backend.plan(meta), dev, calls=settings.plan_calls, repeats=settings.repeats
        )
    except Exception as exc:  # one broken backend is a row with its error, not a dead run
        result["error"] = _error(exc)
        return result
    result.update(_bench_sdk_graph(backend, inputs, buf, settings))
    return result


def _bench_sdk_graph(
    backend: Backend, inputs: Inputs, buf: torch.Tensor, settings: Settings
) -> dict[str, Any]:
    """Per-layer time under graph replay, through the backend's own graph hooks (as
    ``GraphRunner`` uses them): static buffers, a captured plan refreshed for this batch."""
    case, meta, caches = inputs.case, inputs.meta, inputs.caches
    level = backend.capabilities.graph_support
    if inputs.device != "cuda":
        return {"graph": "not on a GPU"}
    if level < case.graph_level:
        return {"graph": f"graph_support {level.name} < {case.graph_level.name}"}
    try:
        state = backend.graph_state(
            meta.num_seqs, meta.num_tokens, meta.page_table.shape[1],
            page_size=PAGE, device=inputs.device,
        )  # fmt: skip
        plan = backend.plan_for_capture(
            state, meta.num_seqs, meta.num_tokens, max_query_len=case.max_query_len
        )
        backend.plan_for_replay(plan, meta)

        def layers() -> None:
            for c in caches:
                backend.forward(inputs.q, inputs.k, inputs.v, c, plan, inputs.layer, out=buf)

        return {"graph": None, "sdk_graph_us": graph_us(layers, settings.rep_ms) / len(caches)}
    except Exception as exc:
        return {"graph": f"capture failed: {_error(exc)}"}


def _bench_raw(
    family: str, inputs: Inputs, expected: torch.Tensor, settings: Settings
) -> dict[str, Any]:
    case, meta, caches, dev = inputs.case, inputs.meta, inputs.caches, inputs.device
    k, v = inputs.k, inputs.v
    n = len(caches)
    result: dict[str, Any] = {"raw_kernel": family}
    try:
        raw = raw_kernel(family, case, meta, inputs.q, inputs.layer)
        result["raw_kernel"] = raw.kernel
        write_kv(caches[0], meta, k, v)
        result.update(_check(raw.attend(caches[0])[: meta.num_tokens], expected, "raw_"))

        def with_kv(attend: Callable[[KVCache], torch.Tensor]) -> Callable[[], None]:
            def run() -> None:
                for c in caches:
                    write_kv(c, meta, k, v)
                    attend(c)

            return run

        def attention_only(attend: Callable[[KVCache], torch.Tensor]) -> Callable[[], None]:
            def run() -> None:
                for c in caches:
                    attend(c)

            return run

        result["raw_eager_us"] = (
            eager_us(with_kv(raw.attend), dev, budget_s=settings.budget_s, repeats=settings.repeats)
            / n
        )
        result["raw_attn_only_eager_us"] = (
            eager_us(
                attention_only(raw.attend),
                dev,
                budget_s=settings.budget_s,
                repeats=settings.repeats,
            )
            / n
        )
        if raw.plan is not None:
            result["raw_plan_host_us"] = host_us(
                raw.plan, dev, calls=max(10, settings.plan_calls // 10), repeats=settings.repeats
            )
    except Exception as exc:
        result["raw_error"] = _error(exc)
        return result
    try:
        attend = raw.graph_attend or raw.attend
        result["raw_graph_us"] = graph_us(with_kv(attend), settings.rep_ms) / n
        result["raw_attn_only_graph_us"] = graph_us(attention_only(attend), settings.rep_ms) / n
    except Exception as exc:
        result["raw_graph_error"] = _error(exc)
    return result


def _ratio(a: Any, b: Any) -> float | None:
    return a / b if isinstance(a, float) and isinstance(b, float) and b > 0 else None


def _finish(row: dict[str, Any], case: Case, ceilings: Ceilings) -> None:
    """Ratios, floors and the legacy fields of decode.json / prefill.json (same meaning as
    before the cross-backend suite; docs/benchmarks.md lists them)."""
    row["fwd_eager_ratio"] = _ratio(row.get("sdk_fwd_eager_us"), row.get("raw_eager_us"))
    row["graph_ratio"] = _ratio(row.get("sdk_graph_us"), row.get("raw_graph_us"))
    floor, bound = ceilings.floor_us(row["kv_bytes"], row["flops"])
    row["floor_us"], row["bound"] = floor, bound
    best = row.get("sdk_graph_us") or row.get("sdk_fwd_eager_us")
    row["floor_basis"] = "graph" if row.get("sdk_graph_us") else "eager"
    row["frac_of_floor"] = _ratio(floor, best)
    if case.suite == "decode":
        row["sdk_eager_us"] = row.get("sdk_step_eager_us")
        row["eager_ratio"] = _ratio(row.get("sdk_step_eager_us"), row.get("raw_eager_us"))
        row["kv_gbs"] = row["kv_bytes"] / best / 1e3 if best else None
        row["kv_frac_of_copy"] = row["kv_gbs"] / ceilings.copy_gbs if best else None
    elif case.suite == "prefill":
        row["sdk_us"] = row.get("sdk_step_eager_us")
        row["raw_us"] = row.get("raw_eager_us")
        row["sdk_tflops"] = row["flops"] / row["sdk_us"] / 1e6 if row["sdk_us"] else None
        row["raw_tflops"] = row["flops"] / row["raw_us"] / 1e6 if row["raw_us"] else None
        row["ratio"] = _ratio(row["sdk_tflops"], row["raw_tflops"])
        sdk = row["sdk_tflops"]
        row["frac_of_matmul"] = sdk / ceilings.matmul_tflops if sdk else None
