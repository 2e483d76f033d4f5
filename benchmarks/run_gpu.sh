#!/usr/bin/env bash
# Every GPU benchmark, then the plots: benchmarks/run_gpu.sh [OUT_DIR] [attnsdk bench flags...]
#   e.g. benchmarks/run_gpu.sh "$OUT" --backend fa3,flashinfer
# Writes into OUT_DIR: decode.json, prefill.json, mixed.json (every backend that can run here
# next to its raw kernel), plan.json, overhead.json (fa3 only), *.png, and one .log per step.
# Needs a CUDA GPU; raw kernels need their libraries (pip install tokenspeed-fa3
# flashinfer-python); plots need matplotlib. A failing step is reported and the rest still run.
set -uo pipefail
out="$(mkdir -p "${1:-benchmarks/results}" && cd "${1:-benchmarks/results}" && pwd)"
shift $(( $# > 0 ? 1 : 0 ))
cd "$(dirname "$0")/.."   # python -m benchmarks.* runs from the repository root
failed=()
step() {  # step NAME COMMAND...: run it, tee its output into OUT/NAME.log
    echo "== $1"
    local name="$1"; shift
    "$@" 2>&1 | tee "$out/$name.log" || failed+=("$name")
}
# One process per suite: each JSON is written as soon as its suite ends.
for suite in decode prefill mixed; do
    step "$suite" python -m attnsdk bench --suite "$suite" --out "$out" "$@"
done
step plan python -m benchmarks.bench_plan --out "$out"
step overhead python -m benchmarks.bench_overhead --out "$out"
step tree python -m benchmarks.bench_tree --out "$out"
step plot python -m benchmarks.plot "$out"
echo "results in $out"
if (( ${#failed[@]} )); then
    echo "failed: ${failed[*]} (see their .log files)"
    exit 1
fi
