"""Where the eager per-layer time of fa3 goes at a tiny decode (bs 1, context 1k, Llama-3-8B).

At this size the kernel runs in ~10 µs and everything else is host time, so each line is the
wall time per call of a loop of calls (the GPU never becomes the bottleneck). The graph lines
are the kernel alone, replayed from a CUDA graph (``triton.testing.do_bench_cudagraph``).

Only public API: the parts of ``forward`` and ``plan`` are timed through ``BackendBase``'s
documented hooks (``make_plan``, ``layer_state``, ``store``, ``attend``), and the host checks
are what ``plan()`` / ``forward()`` cost beyond those hooks (a difference of two timings of
the same run). Writes DIR/overhead.json.

    python -m benchmarks.bench_overhead [--out DIR]
"""

from __future__ import annotations

import argparse
import importlib
import json
from pathlib import Path

import torch

import attnsdk as A
from attnsdk._bench.common import DTYPE, LAYER, PAGE, Column, format_table, graph_us, host_us
from attnsdk.backends.base import AttendArgs
from attnsdk.backends.fa3 import FA3Options

COLUMNS = [
    Column("what", "what"),
    Column("us", "host us", "us"),
    Column("vs_wrapper", "x wrapper", "ratio"),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    out_dir: Path = parser.parse_args().out
    fai = importlib.import_module("flash_attn_interface")
    hq, hkv, d = LAYER.num_heads, LAYER.num_kv_heads, LAYER.head_dim
    layout = A.KVCacheLayout(hkv, d, PAGE, dtype=DTYPE)
    cache = layout.allocate(1024 // PAGE + 1, "cuda")
    cache.k.normal_()
    cache.v.normal_()
    table_ = torch.arange(1, 1024 // PAGE + 1, dtype=torch.int32).view(1, -1)
    meta = A.AttentionMetadata.from_seqlens([1], [1024], table_, PAGE, device="cuda")
    q = torch.randn(1, hq, d, device="cuda", dtype=DTYPE)
    k = torch.randn(1, hkv, d, device="cuda", dtype=DTYPE)
    v = torch.randn(1, hkv, d, device="cuda", dtype=DTYPE)
    out = torch.empty_like(q)

    def fa3(**options: object) -> A.BackendBase:
        config = A.AttentionConfig(backend="fa3", options=FA3Options(**options))  # type: ignore[arg-type]
        backend = A.create_backend(config, device="cuda", layers=[LAYER], layout=layout)
        assert isinstance(backend, A.BackendBase)  # the hooks below are BackendBase's
        return backend

    def captured_plan(backend: A.BackendBase) -> A.Plan:
        """A plan on the backend's static graph buffers, as ``GraphRunner`` makes them."""
        buffers = backend.graph_state(1, 1, table_.shape[1], page_size=PAGE, device="cuda")
        captured = backend.plan_for_capture(buffers, 1, 1, max_query_len=1)
        backend.plan_for_replay(captured, meta)
        return captured

    pre, nopre = fa3(), fa3(precompute_scheduler=False)
    graph_pre, graph_nopre = captured_plan(pre), captured_plan(nopre)
    plan = pre.plan(meta)
    state = pre.layer_state(LAYER, layout)
    op = torch.ops.flash_attn_3.fwd.default
    args = (
        q, cache.k, cache.v, None, None, None, out, meta.query_start_loc, None, None, None,
        meta.seq_lens, 1, None, meta.page_table, None, None, None, None, None, None, None, None,
        d**-0.5, True, -1, -1, 0, 0.0, True, None, 0, None, 0, None,
    )  # fmt: skip

    def wrapper() -> None:
        fai.flash_attn_with_kvcache(
            q, cache.k, cache.v, cache_seqlens=meta.seq_lens, page_table=meta.page_table,
            cu_seqlens_q=meta.query_start_loc, max_seqlen_q=1, causal=True,
        )  # fmt: skip

    def layers(backend: A.Backend, with_kv: bool, p: A.Plan | None = None) -> None:
        p = p or backend.plan(meta)  # a graph replays a plan made before capture
        for _ in range(32):
            if with_kv:
                backend.forward(q, k, v, cache, p, LAYER, out=out)
            else:
                backend.forward(q, None, None, cache, p, LAYER, out=out)

    def hook_store() -> None:
        pre.store(k, v, cache, plan, state, k_scale=None, v_scale=None)

    def hook_attend() -> None:
        pre.attend(AttendArgs(q, cache, plan, LAYER, state, out))

    def t(fn: object, calls: int = 2000) -> float:
        return host_us(fn, "cuda", calls=calls, repeats=5)  # type: ignore[arg-type]

    forward_no_kv = t(lambda: pre.forward(q, None, None, cache, plan, LAYER, out=out))
    attend_us = t(hook_attend)
    plan_us, make_plan_us = t(lambda: pre.plan(meta)), t(lambda: pre.make_plan(meta))
    rows = [
        {"what": "flash_attn_with_kvcache (Python wrapper)", "us": t(wrapper)},
        {"what": "torch.ops.flash_attn_3.fwd (registered op)", "us": t(lambda: op(*args))},
        {"what": "store() hook: Triton KV store", "us": t(hook_store)},
        {"what": "attend() hook: the FA3 call", "us": attend_us},
        {"what": "forward() without KV write", "us": forward_no_kv},
        {"what": "forward's host checks (forward without KV - attend)", "us": forward_no_kv - attend_us},
        {"what": "plan()", "us": plan_us},
        {"what": "make_plan() hook (plan without its host checks)", "us": make_plan_us},
        {"what": "plan's host checks (plan - make_plan)", "us": plan_us - make_plan_us},
        {"what": "sdk forward, KV write, precompute on", "us": t(lambda: layers(pre, True), 100) / 32},
        {"what": "sdk forward, KV write, precompute off", "us": t(lambda: layers(nopre, True), 100) / 32},
        {"what": "sdk forward, no KV write, precompute on", "us": t(lambda: layers(pre, False), 100) / 32},
        {"what": "sdk forward, no KV write, precompute off", "us": t(lambda: layers(nopre, False), 100) / 32},
        {"what": "kernel under graph replay (wrapper)", "us": graph_us(wrapper)},
        {"what": "sdk layer under graph replay, precompute on", "us": graph_us(lambda: layers(pre, True, graph_pre)) / 32},
        {"what": "sdk layer under graph replay, precompute off", "us": graph_us(lambda: layers(nopre, True, graph_nopre)) / 32},
    ]  # fmt: skip
    base = rows[0]["us"]
    for r in rows:
        r["vs_wrapper"] = r["us"] / base
    print(format_table(rows, COLUMNS))
    out_dir.mkdir(parents=True, exist_ok=True)
    data = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}
    (out_dir / "overhead.json").write_text(json.dumps(data, indent=2) + "\n")


if __name__ == "__main__":
    main()
