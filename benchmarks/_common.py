"""Timing, ceilings, JSON and plotting shared by the GPU benchmarks (run them via run_gpu.sh)."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from collections.abc import Callable

# Llama-3-8B attention per tensor-parallel rank of 1.
HQ, HKV, D, PAGE = 32, 8, 128, 16
DTYPE = torch.bfloat16


def parse_out(description: str) -> Path:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    out: Path = parser.parse_args().out
    out.mkdir(parents=True, exist_ok=True)
    return out


def gpu_us(fn: Callable[[], object], iters: int, repeats: int = 5) -> float:
    """Median over ``repeats`` of the event-timed mean of ``iters`` back-to-back calls (µs)."""
    fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / iters)
    return statistics.median(samples)


def graph_us(fn: Callable[[], object], iters: int, repeats: int = 5) -> float:
    """Capture one call of ``fn`` and time its replays (µs per replay)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    result = gpu_us(graph.replay, iters, repeats)
    del graph
    return result


def host_us(fn: Callable[[], object], iters: int, repeats: int = 5) -> float:
    """Median wall time per call (µs); for host-bound code such as metadata building."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        samples.append((time.perf_counter() - t0) * 1e6 / iters)
        torch.cuda.synchronize()
    return statistics.median(samples)


def copy_ceiling_gbs(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth, bytes read + written per second (GB/s)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    us = gpu_us(lambda: dst.copy_(src), 10)
    return 2 * nbytes / us / 1e3


def matmul_ceiling_tflops(n: int = 8192) -> float:
    a = torch.randn(n, n, device="cuda", dtype=DTYPE)
    b = torch.randn(n, n, device="cuda", dtype=DTYPE)
    us = gpu_us(lambda: a @ b, 10)
    return 2 * n**3 / us / 1e6


def write(out: Path, name: str, data: dict[str, Any]) -> Path:
    data = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, **data}
    path = out / f"{name}.json"
    path.write_text(json.dumps(data, indent=2))
    return path


def table(rows: list[dict[str, Any]], columns: list[str]) -> str:
    def fmt(v: Any) -> str:
        return f"{v:.3f}" if isinstance(v, float) else str(v)

    widths = [max(len(c), *(len(fmt(r.get(c, ""))) for r in rows)) for c in columns]
    lines = ["  ".join(c.rjust(w) for c, w in zip(columns, widths))]
    lines += ["  ".join(fmt(r.get(c, "")).rjust(w) for c, w in zip(columns, widths)) for r in rows]
    return "\n".join(lines)
