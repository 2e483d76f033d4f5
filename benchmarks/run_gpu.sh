#!/usr/bin/env bash
# Run every GPU benchmark and render the plots: benchmarks/run_gpu.sh [OUT_DIR]
# Needs an sm90 GPU with flash_attn_interface (pip install tokenspeed-fa3).
set -euo pipefail
out="${1:-benchmarks/results}"
here="$(cd "$(dirname "$0")" && pwd)"
mkdir -p "$out"
for bench in overhead plan decode prefill; do
    echo "== $bench"
    python "$here/bench_$bench.py" --out "$out"
done
python "$here/plot.py" "$out"
echo "results in $out"
