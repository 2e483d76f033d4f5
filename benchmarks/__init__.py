"""GPU benchmark scripts; run them from the repository root as modules, e.g.
``python -m benchmarks.bench_decode --out DIR`` (benchmarks/run_gpu.sh runs them all).

The cross-backend suites (decode, prefill, mixed) live in the package (``attnsdk._bench.common*``)
because the ``attnsdk bench`` command must work from an installed wheel, which has no
benchmarks/ folder; ``bench_decode``, ``bench_prefill`` and ``bench_mixed`` are thin wrappers
over that command. ``bench_plan`` and ``bench_overhead`` are measurements of this checkout's
planning and per-call host cost that have no place in the installed command.
"""
