"""End to end: examples/mini_engine.py through attnsdk vs Hugging Face continuous batching.

One model (Llama-3.2-1B shapes, random weights, bf16), one workload: every request arrives at
once, a fixed prompt length and exactly ``--new`` greedy tokens each (no end-of-sequence token).
Each system first serves a short warm-up batch (kernel JIT, graph capture, allocator), then the
timed one. Reports output tokens/s, time to first token (TTFT, from submission), and for the mini
engine where the time goes (prefill steps, decode steps, and a decode step's graph replay alone).

    python -m benchmarks.bench_engine [--out DIR] [--backend fa3,flashinfer] [--hf sdpa]
        [--requests 64] [--prompt 512] [--new 256] [--quick]

Writes DIR/engine.json and DIR/engine.png. Needs a CUDA GPU and transformers >= 5.17.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

import attnsdk as A

ROOT = Path(__file__).resolve().parents[1]
PAGE_SIZE = 16
LLAMA_3_2_1B: dict[str, Any] = {
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "vocab_size": 128256,
    "rope_theta": 500000.0,
    "max_position_embeddings": 131072,
    "tie_word_embeddings": True,
    "eos_token_id": None,
    "bos_token_id": None,
}


def load_mini_engine() -> Any:
    """examples/mini_engine.py as a module (an example script, not part of the package)."""
    spec = importlib.util.spec_from_file_location("mini_engine", ROOT / "examples/mini_engine.py")
    if spec is None or spec.loader is None:
        raise SystemExit("examples/mini_engine.py not found")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses resolve their annotations through it
    spec.loader.exec_module(module)
    return module


def make_model(quick: bool) -> Any:
    from transformers import AutoModelForCausalLM, LlamaConfig

    shapes = dict(LLAMA_3_2_1B)
    if quick:
        shapes.update(num_hidden_layers=2, vocab_size=4096)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(LlamaConfig(**shapes), dtype=torch.bfloat16)
    return model.eval()


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab, (n, length), generator=g).tolist()


def summarize(
    name: str, seconds: float, ttft: list[float], tokens: int, extra: dict[str, Any]
) -> dict[str, Any]:
    return {
        "system": name,
        "seconds": seconds,
        "output_tokens": tokens,
        "tokens_per_s": tokens / seconds,
        "ttft_mean_s": statistics.fmean(ttft),
        "ttft_p50_s": statistics.median(ttft),
        "ttft_max_s": max(ttft),
        **extra,
    }


def run_mini_engine(mini: Any, model: Any, backend_name: str, args: argparse.Namespace) -> Any:
    max_len = args.prompt + args.new
    pages = mini.pages_for(max_len, PAGE_SIZE) * args.requests + 1
    backend = A.create_backend(backend_name, device="cuda")
    t0 = time.perf_counter()
    engine = mini.MiniEngine(
        model,
        backend,
        num_pages=pages,
        page_size=PAGE_SIZE,
        max_batch=args.requests,
        token_budget=args.token_budget,
        max_model_len=max_len,
    )
    setup_s = time.perf_counter() - t0
    vocab = model.config.vocab_size

    def serve(reqs: list[Any]) -> tuple[float, list[float], dict[str, list[float]]]:
        first: dict[int, float] = {}
        steps: dict[str, list[float]] = {"prefill": [], "decode": []}
        torch.cuda.synchronize()
        start = time.perf_counter()
        for req in reqs:
            engine.submit(req)
        while engine.scheduler.has_work:
            t = time.perf_counter()
            result = engine.step()  # ends in a host read of the sampled tokens: timed exactly
            now = time.perf_counter()
            steps["prefill" if result.num_prefill else "decode"].append(now - t)
            for req, _ in result.emitted:
                first.setdefault(req.rid, now - start)
        return time.perf_counter() - start, [first[r.rid] for r in reqs], steps

    warm = [mini.Request(i, p, 8) for i, p in enumerate(prompts(8, args.prompt, vocab, 1))]
    serve(warm)
    reqs = [
        mini.Request(i, p, args.new)
        for i, p in enumerate(prompts(args.requests, args.prompt, vocab, 2))
    ]
    seconds, ttft, steps = serve(reqs)
    replay_ms = graph_replay_ms(engine, reqs)
    extra = {
        "backend": backend_name,
        "setup_s": setup_s,
        "graphs": engine.graphs is not None,
        "prefill_steps": len(steps["prefill"]),
        "prefill_s": sum(steps["prefill"]),
        "decode_steps": len(steps["decode"]),
        "decode_step_ms": 1e3 * statistics.median(steps["decode"]),
        "decode_replay_ms": replay_ms,
    }
    outputs = [r.output for r in reqs]
    return summarize(
        f"mini_engine/{backend_name}", seconds, ttft, len(reqs) * args.new, extra
    ), outputs


def graph_replay_ms(engine: Any, reqs: list[Any]) -> float | None:
    """GPU time of one full-batch decode step replayed from its graph, without the host work
    around it (metadata, plan, sampling): the floor of the engine's decode step."""
    if engine.graphs is None:
        return None
    capture = next(c for c in engine.graphs._captured if c.batch_size >= len(reqs))
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    capture.graph.replay()
    start.record()
    for _ in range(10):
        capture.graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 10


def run_hf(model: Any, impl: str, args: argparse.Namespace) -> Any:
    from transformers import GenerationConfig

    model.set_attn_implementation(impl)
    config = GenerationConfig(
        max_new_tokens=args.new, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    accepted = inspect.signature(model.generate_batch).parameters
    options = {k: v for k, v in {"record_timestamps": True}.items() if k in accepted}
    vocab = model.config.vocab_size
    model.generate_batch(inputs=prompts(8, args.prompt, vocab, 1), generation_config=config)
    inputs = prompts(args.requests, args.prompt, vocab, 2)
    torch.cuda.synchronize()
    start = time.perf_counter()
    results = model.generate_batch(inputs=inputs, generation_config=config, **options)
    seconds = time.perf_counter() - start
    ran = model.config._attn_implementation  # generate_batch may switch implementations
    by_prompt = {tuple(o.prompt_ids): o for o in results.values()}
    outs = [by_prompt[tuple(p)] for p in inputs]  # submission order (prompts are distinct)
    ttft = [o.timestamps[0] - o.created_time for o in outs if getattr(o, "timestamps", None)]
    tokens = sum(len(o.generated_tokens) for o in outs)
    extra = {"asked": impl, "ran": ran}
    row = summarize(f"hf_generate_batch/{ran}", seconds, ttft or [float("nan")], tokens, extra)
    return row, [list(o.generated_tokens) for o in outs]


def fp32_check(
    model: Any, requests: list[list[int]], outputs: dict[str, list[list[int]]], k: int = 8
) -> dict[str, dict[str, float]]:
    """How each system's greedy tokens compare with the same weights in fp32 (sdpa).

    bf16 systems part ways after a few tokens on a random-weight model (its logits are nearly
    flat), so tokens are not compared between systems. Instead, for the first ``k`` tokens of
    every request, the fp32 model scores the system's own continuation: ``margin`` is the best
    fp32 logit minus that of the token the system chose. A token is within noise when its margin
    is at most twice the largest logit error of HF's own bf16 sdpa against fp32 on the same
    inputs; a wrong attention shows up as large margins.
    """
    import copy

    bf16 = model
    bf16.set_attn_implementation("sdpa")
    fp32 = copy.deepcopy(model).float()

    def logits(m: Any, ids: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            x = torch.tensor([ids], device="cuda")
            return m(input_ids=x, use_cache=False, logits_to_keep=k).logits[0].float()

    first = next(iter(outputs.values()))
    noise = max(
        float((logits(bf16, p + o[: k - 1]) - logits(fp32, p + o[: k - 1])).abs().max())
        for p, o in list(zip(requests, first))[:8]
    )
    found = {}
    for name, outs in outputs.items():
        margins = []
        for prompt, out in zip(requests, outs):
            scores = logits(fp32, prompt + out[: k - 1])
            chosen = scores.gather(1, torch.tensor(out[:k], device="cuda")[:, None])[:, 0]
            margins.append(scores.max(-1).values - chosen)
        m = torch.cat(margins)
        found[name] = {
            "bf16_noise": noise,
            "within_noise": float((m <= 2 * noise).float().mean()),
            "max_margin": float(m.max()),
        }
    del fp32
    torch.cuda.empty_cache()
    return found


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    names = [r["system"] for r in rows]
    left.barh(names, [r["tokens_per_s"] for r in rows], color="tab:blue")
    left.set_xlabel("output tokens / s (higher is better)")
    right.barh(names, [r["ttft_mean_s"] for r in rows], color="tab:orange")
    right.set_xlabel("mean time to first token, s (lower is better)")
    fig.suptitle("64 requests x 512 prompt + 256 new tokens, Llama-3.2-1B shapes, bf16, H200")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="benchmarks/results/engine")
    parser.add_argument("--backend", default="fa3,flashinfer")
    parser.add_argument(
        "--hf", default="sdpa", help="attn_implementation for HF generate_batch ('' to skip)"
    )
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--new", type=int, default=256)
    parser.add_argument("--token-budget", type=int, default=8192)
    parser.add_argument("--quick", action="store_true", help="2 layers, small vocab: a smoke run")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_engine needs a CUDA GPU")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    mini = load_mini_engine()
    model = make_model(args.quick)
    rows, outputs = [], {}
    for name in filter(None, args.backend.split(",")):
        row, tokens = run_mini_engine(mini, model, name, args)
        outputs[row["system"]] = tokens
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.hf:
        row, tokens = run_hf(model, args.hf, args)
        outputs[row["system"]] = tokens
        rows.append(row)
        print(json.dumps(row), flush=True)
    checked = fp32_check(
        model, prompts(args.requests, args.prompt, model.config.vocab_size, 2), outputs
    )
    for r in rows:
        r["fp32_check"] = checked[r["system"]]
    base = rows[-1]["tokens_per_s"] if args.hf else None
    print(f"\n{'system':34} {'tok/s':>9} {'vs HF':>6} {'TTFT mean':>10} {'p50':>7} {'max':>7}")
    for r in rows:
        ratio = f"{r['tokens_per_s'] / base:6.2f}" if base else "     -"
        print(
            f"{r['system']:34} {r['tokens_per_s']:9.0f} {ratio} {r['ttft_mean_s']:10.3f} "
            f"{r['ttft_p50_s']:7.3f} {r['ttft_max_s']:7.3f}"
        )
    for r in rows:
        c = r["fp32_check"]
        print(
            f"{r['system']}: first 8 tokens of every request within bf16 noise of the fp32 "
            f"argmax: {c['within_noise']:.1%} (largest margin {c['max_margin']:.3f}, "
            f"noise {c['bf16_noise']:.3f})"
        )
        if "decode_step_ms" in r:
            print(
                f"  {r['prefill_steps']} prefill steps {r['prefill_s']:.2f} s, "
                f"{r['decode_steps']} decode steps, median {r['decode_step_ms']:.2f} ms/step "
                f"(graph replay alone {r['decode_replay_ms'] or float('nan'):.2f} ms), "
                f"setup {r['setup_s']:.1f} s"
            )
    meta = {k: getattr(args, k) for k in ("requests", "prompt", "new", "token_budget", "quick")}
    meta["device"] = torch.cuda.get_device_name()
    (out / "engine.json").write_text(json.dumps({"config": meta, "rows": rows}, indent=2))
    plot(rows, out / "engine.png")
    print(f"wrote {out / 'engine.json'} and {out / 'engine.png'}")


if __name__ == "__main__":
    main()
