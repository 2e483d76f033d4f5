"""What ``attnsdk bench`` and benchmarks/ share: the cases, the hardware floors, timing, the table.

It lives in the package because ``attnsdk bench`` must work from an installed wheel, which has no
benchmarks/ folder; the scripts there are thin wrappers over these modules (``_bench_suite``
runs the cases, ``_bench_raw`` the raw kernels they are compared with).

Floors (DESIGN §7): decode is memory-bound, floor = bytes of K and V read / device copy
bandwidth; prefill is compute-bound, floor = causal FLOPs / dense matmul rate; a mixed step's
floor is the larger of the two. Both rates are measured in the same run (``measure_ceilings``),
so every "% of floor" is a ratio of two numbers from one run, never a bare time.

Timing. Graph replays use ``triton.testing.do_bench_cudagraph`` (many calls captured in one
graph, one replay timed: kernel time without launch cost). Ceilings use ``triton.testing.do_bench``.
Eager time keeps its own event-timed loop of back-to-back calls (``eager_us``): an engine's eager
step is a loop of layers, and when it is host-bound that host time is the SDK overhead we want to
see, whereas ``do_bench`` clears L2 with a large kernel before each call, which hides the host
time of the call behind that kernel. Decode cases rotate over several layers' caches instead
(see ``rotation``) so that small caches do not sit in L2.
"""

from __future__ import annotations

import importlib
import json
import math
import statistics
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch

from attnsdk.contract.capabilities import GraphSupport
from attnsdk.contract.layer import LayerSpec

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence
    from pathlib import Path

__all__ = [
    "COLUMNS",
    "DTYPE",
    "LAYER",
    "PAGE",
    "SUITES",
    "Case",
    "Ceilings",
    "Column",
    "cases_for",
    "eager_us",
    "format_table",
    "graph_us",
    "host_us",
    "measure_ceilings",
    "rotation",
    "tokens_text",
]

LAYER = LayerSpec(num_heads=32, num_kv_heads=8, head_dim=128)
"""Llama-3-8B attention at tensor-parallel 1."""
PAGE = 16
DTYPE = torch.bfloat16

Suite = Literal["decode", "prefill", "mixed"]
SUITES: tuple[Suite, ...] = ("decode", "prefill", "mixed")

ROTATE_BYTES = 256 << 20
"""A decode case rotates over enough layers' caches to read at least this much KV per sweep,
so that L2 (50 MB on an H200) cannot hold it."""
MAX_LAYERS = 32


def tokens_text(n: int) -> str:
    """``4096`` -> ``"4k"``; counts that are not whole thousands of 1024 stay as they are.

    >>> tokens_text(4096), tokens_text(512), tokens_text(1536)
    ('4k', '512', '1536')
    """
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


@dataclass(frozen=True, slots=True)
class Case:
    """One batch shape of a suite: ``query_lens[b]`` new tokens at the end of ``seq_lens[b]``."""

    suite: Suite
    name: str
    query_lens: tuple[int, ...]
    seq_lens: tuple[int, ...]

    @classmethod
    def decode(cls, batch: int, context: int) -> Case:
        """``batch`` sequences each adding one token to a KV of ``context`` tokens."""
        return cls("decode", f"{batch}x{tokens_text(context)}", (1,) * batch, (context,) * batch)

    @classmethod
    def prefill(cls, query_lens: Sequence[int], cached: int = 0) -> Case:
        """Sequences of ``query_lens`` new tokens after ``cached`` tokens already in the cache."""
        n = len(query_lens)
        size = tokens_text(query_lens[0]) if len(set(query_lens)) == 1 else "var"
        name = (
            f"prefill {n}x{size}" if not cached else f"extend {n}x{size} on {tokens_text(cached)}"
        )
        return cls("prefill", name, tuple(query_lens), tuple(q + cached for q in query_lens))

    @classmethod
    def mixed(cls, decodes: int, context: int, chunk: int, cached: int) -> Case:
        """``decodes`` decode rows over ``context`` tokens and one prefill chunk of ``chunk``
        tokens after ``cached`` (chunked prefill), in one step, the chunk last."""
        name = f"{decodes}x{tokens_text(context)} decode + {tokens_text(chunk)} chunk"
        name += f" on {tokens_text(cached)}" if cached else ""
        return cls(
            "mixed",
            name,
            (1,) * decodes + (chunk,),
            (context,) * decodes + (chunk + cached,),
        )

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens)

    def kv_bytes(self, layer: LayerSpec = LAYER, itemsize: int = DTYPE.itemsize) -> int:
        """Bytes of K and V the step reads, each cached token once.

        >>> Case.decode(64, 4096).kv_bytes()  # 64 x 4096 tokens x 8 heads x (128 + 128) x 2 B
        1073741824
        """
        per_token = layer.num_kv_heads * (layer.head_dim + layer.v_dim) * itemsize
        return sum(self.seq_lens) * per_token

    def flops(self, layer: LayerSpec = LAYER) -> float:
        """FLOPs of QK^T and PV (2 per multiply-add) over the scores a causal mask leaves visible.

        >>> Case.prefill([2]).flops(LayerSpec(1, 1, 1))  # 3 visible scores x (2 + 2) FLOPs
        12.0
        """
        visible = sum(
            n * (s - n) + n * (n + 1) // 2 for n, s in zip(self.query_lens, self.seq_lens)
        )
        return 2.0 * layer.num_heads * (layer.head_dim + layer.v_dim) * visible

    @property
    def graph_level(self) -> GraphSupport:
        """What a backend's ``capabilities.graph_support`` must be to capture this step."""
        if self.max_query_len == 1:
            return GraphSupport.DECODE_ONLY
        if len(set(self.query_lens)) == 1:
            return GraphSupport.UNIFORM_BATCH
        return GraphSupport.ANY_BATCH


def rotation(case: Case) -> int:
    """Layers' caches a case cycles through per step: decode reads too little KV per layer to
    leave L2 otherwise; prefill and mixed steps are long enough to use one cache (as before).

    >>> rotation(Case.decode(1, 1024)), rotation(Case.decode(256, 32768)), rotation(Case.prefill([1024]))
    (32, 1, 1)
    """
    if case.suite != "decode":
        return 1
    return max(1, min(MAX_LAYERS, math.ceil(ROTATE_BYTES / case.kv_bytes())))


def cases_for(suite: Suite, device: str, quick: bool) -> list[Case]:
    """The cases of ``suite``: the full grid on a GPU, a small one with ``quick``, and a tiny one
    on a CPU (the reference and flex backends, seconds in all).

    >>> [c.name for c in cases_for("decode", "cuda", quick=True)]
    ['8x4k', '64x4k']
    """
    if device != "cuda":
        return {
            "decode": [Case.decode(4, 256)],
            "prefill": [Case.prefill([128])],
            "mixed": [Case.mixed(3, 256, 64, 64)],
        }[suite]
    if quick:
        return {
            "decode": [Case.decode(8, 4096), Case.decode(64, 4096)],
            "prefill": [Case.prefill([1024]), Case.prefill([4096])],
            "mixed": [Case.mixed(63, 4096, 2048, 2048)],
        }[suite]
    if suite == "decode":
        return [Case.decode(b, c) for b in (1, 8, 64, 256) for c in (1024, 4096, 16384, 32768)]
    if suite == "prefill":
        return [
            Case.prefill([1024]),
            Case.prefill([4096]),
            Case.prefill([8192]),
            Case.prefill([16384]),
            Case.prefill([4096] * 4),
            Case.prefill([1024] * 4, cached=8192),
            Case.prefill([512] * 8, cached=2048),
        ]
    return [Case.mixed(63, 4096, 2048, 2048), Case.mixed(7, 4096, 8192, 0)]


# --- floors ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Ceilings:
    """Rates measured in this run: device copy (bytes read + written per second) and dense matmul."""

    copy_gbs: float
    matmul_tflops: float
    matmul_dtype: str

    def floor_us(self, kv_bytes: float, flops: float) -> tuple[float, str]:
        """(the step's lower bound in µs, "memory" or "compute": which bound it is).

        >>> Ceilings(4250.0, 790.0, "bfloat16").floor_us(kv_bytes=4.25e9, flops=7.9e11)
        (1000.0, 'memory')
        """
        memory = kv_bytes / self.copy_gbs / 1e3
        compute = flops / self.matmul_tflops / 1e6
        return (memory, "memory") if memory >= compute else (compute, "compute")


def measure_ceilings(device: str, quick: bool = False) -> Ceilings:
    """Copy bandwidth and matmul rate of ``device``, measured now (bf16 on CUDA, fp32 on CPU:
    the reference backend computes in fp32)."""
    if device == "cuda":
        bench = _triton_testing().do_bench
        nbytes = (256 if quick else 2048) << 20
        src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_()
        dst = torch.empty_like(src)
        copy_us = bench(lambda: dst.copy_(src), return_mode="median") * 1e3
        n = 4096 if quick else 8192
        a = torch.randn(n, n, device="cuda", dtype=DTYPE)
        b = torch.randn(n, n, device="cuda", dtype=DTYPE)
        mm_us = bench(lambda: a @ b, return_mode="median") * 1e3
        del src, dst, a, b
        return Ceilings(2 * nbytes / copy_us / 1e3, 2 * n**3 / mm_us / 1e6, str(DTYPE)[6:])
    # A shared CPU is noisy: the fastest of several calls is the ceiling.
    nbytes = 64 << 20
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    copy_us = _fastest_us(lambda: dst.copy_(src))
    n = 1024
    a, b = torch.randn(n, n), torch.randn(n, n)
    mm_us = _fastest_us(lambda: a @ b)
    return Ceilings(2 * nbytes / copy_us / 1e3, 2 * n**3 / mm_us / 1e6, "float32")


def _fastest_us(fn: Callable[[], object], calls: int = 5) -> float:
    fn()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times) * 1e6


# --- timing ------------------------------------------------------------------------------------


def _triton_testing() -> Any:
    try:
        return importlib.import_module("triton.testing")
    except ImportError as exc:
        raise RuntimeError(
            "GPU benchmarks time with triton.testing (do_bench, do_bench_cudagraph); "
            "install triton (it comes with torch's CUDA builds)"
        ) from exc


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _calls(fn: Callable[[], object], device: str, budget_s: float, max_calls: int) -> int:
    """Calls that fill about ``budget_s`` seconds, from one timed call after a warm-up call."""
    fn()
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    once = max(time.perf_counter() - t0, 1e-7)
    return max(1, min(max_calls, int(budget_s / once)))


def eager_us(
    fn: Callable[[], object],
    device: str,
    *,
    budget_s: float = 0.1,
    repeats: int = 3,
    max_calls: int = 2000,
) -> float:
    """µs per call of back-to-back calls of ``fn``: the median over ``repeats`` loops.

    On CUDA the loop is timed with events (GPU time of the loop, which includes any host time
    that leaves the GPU idle); on a CPU with ``perf_counter``.
    """
    calls = _calls(fn, device, budget_s, max_calls)
    samples = []
    for _ in range(repeats):
        if device == "cuda":
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(calls):
                fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) * 1e3 / calls)
        else:
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            samples.append((time.perf_counter() - t0) * 1e6 / calls)
    return statistics.median(samples)


def graph_us(fn: Callable[[], object], rep_ms: float = 20.0) -> float:
    """µs per call of ``fn`` replayed from a CUDA graph (``do_bench_cudagraph``, median)."""
    ms = _triton_testing().do_bench_cudagraph(fn, rep=rep_ms, return_mode="median")
    return float(ms) * 1e3


def host_us(fn: Callable[[], object], device: str, *, calls: int = 200, repeats: int = 3) -> float:
    """Median wall µs per call of a host-bound function (planning), the device drained between
    loops so queued kernels do not slow the host."""
    for _ in range(min(10, calls)):
        fn()
    _sync(device)
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - t0) * 1e6 / calls)
        _sync(device)
    return statistics.median(samples)


# --- the table ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Column:
    """One column of the printed table: the row key, its header and how a value prints."""

    key: str
    header: str
    kind: Literal["text", "us", "ratio", "percent", "error"] = "text"

    def cell(self, value: Any) -> str:
        """``value`` as printed; None (not measured) prints as ``-``.

        >>> Column("x", "x", "percent").cell(0.9831), Column("x", "x", "us").cell(None)
        ('98.3%', '-')
        """
        if value is None:
            return "-"
        if self.kind == "us":
            return f"{value:.1f}"
        if self.kind == "ratio":
            return f"{value:.3f}"
        if self.kind == "percent":
            return f"{100 * value:.1f}%"
        if self.kind == "error":
            return f"{value:.1e}"
        return str(value)


COLUMNS = (
    Column("suite", "suite"),
    Column("case", "case"),
    Column("backend", "backend"),
    Column("sdk_fwd_eager_us", "SDK us", "us"),
    Column("raw_eager_us", "raw us", "us"),
    Column("fwd_eager_ratio", "SDK/raw", "ratio"),
    Column("sdk_graph_us", "SDK graph us", "us"),
    Column("raw_graph_us", "raw graph us", "us"),
    Column("graph_ratio", "SDK/raw graph", "ratio"),
    Column("frac_of_floor", "of floor", "percent"),
    Column("bound", "bound"),
    Column("sdk_plan_host_us", "plan us", "us"),
    Column("raw_plan_host_us", "raw plan us", "us"),
    Column("max_abs_err", "max err", "error"),
)
"""The printed table: per layer, forward only (each side's per-step plan in its own column);
"of floor" is floor time / the SDK's time (graph replay where captured, else eager)."""


def format_table(rows: Sequence[dict[str, Any]], columns: Sequence[Column] = COLUMNS) -> str:
    """Rows as an aligned text table, text left-aligned and numbers right-aligned.

    >>> print(format_table([{"case": "1x1k", "raw_eager_us": 12.34}],
    ...                    [Column("case", "case"), Column("raw_eager_us", "raw us", "us")]))
    case  raw us
    1x1k    12.3
    """
    cells = [[c.cell(r.get(c.key)) for c in columns] for r in rows]
    widths = [
        max([len(c.header), *(len(line[i]) for line in cells)]) for i, c in enumerate(columns)
    ]

    def line(values: Sequence[str]) -> str:
        parts = [
            v.ljust(w) if c.kind == "text" else v.rjust(w)
            for v, w, c in zip(values, widths, columns)
        ]
        return "  ".join(parts).rstrip()

    return "\n".join([line([c.header for c in columns]), *(line(v) for v in cells)])


def write_results(
    out: Path,
    name: str,
    rows: list[dict[str, Any]],
    plot: Callable[[list[dict[str, Any]], Path], None],
    *,
    device: str = "cuda",
    **config: Any,
) -> None:
    """A benchmark script's results: ``out/name.json`` (``{"config", "rows"}``, the config being
    the device, torch and attnsdk versions plus ``config``) and ``out/name.png`` from ``plot``."""
    from attnsdk import __version__

    meta = {
        "device": torch.cuda.get_device_name() if device == "cuda" else device,
        "torch": torch.__version__,
        "attnsdk": __version__,
        **config,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(dumps({"config": meta, "rows": rows}))
    plot(rows, out / f"{name}.png")
    print(f"wrote {out / f'{name}.json'} and {out / f'{name}.png'}")


def dumps(data: dict[str, Any]) -> str:
    """JSON text of a result (NaN and infinity are not JSON: they become null)."""

    def clean(x: Any) -> Any:
        if isinstance(x, float) and not math.isfinite(x):
            return None
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [clean(v) for v in x]
        return x

    return json.dumps(clean(data), indent=2) + "\n"
