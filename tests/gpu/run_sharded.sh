#!/usr/bin/env bash
# The whole GPU pass on the lent H200, from the repository root, in one device call:
#
#   bash tests/gpu/run_sharded.sh                 # tests only (~4 min with FlashInfer JIT)
#   BENCH=1 bash tests/gpu/run_sharded.sh         # then attnsdk bench (decode, prefill, mixed),
#                                                 # benchmarks/bench_tree.py and bench_mla.py
#   BENCH="tree mla" bash tests/gpu/run_sharded.sh   # only the benchmarks named
#   ENGINE=1 bash tests/gpu/run_sharded.sh        # then examples/mini_engine.py and the
#                                                 # end-to-end benchmarks/bench_engine.py
#   SHARDS="flex_lse models" bash tests/gpu/run_sharded.sh   # only the shards named
#
# Needs .gpu/site.tar.xz (../shared/gpu/stage-site.sh) and .gpu/flashinfer.tar.xz
# (../shared/gpu/stage-flashinfer.sh), carried with `carry: [".gpu"]`. Logs and JSON go to $OUT.
# That FlashInfer bundle is pruned to the non-MLA attention sources; MLA layers JIT-compile
# FlashInfer's batch_mla_* sources, which .gpu/fi_mla.tar.xz adds back (docs/benchmarks.md,
# "MLA", says how to make it from the unpruned wheel).
# Each shard is its own process: a CUDA error (an illegal address poisons the whole context)
# fails one shard, not every test after it. The shards run in parallel, each under LIMIT
# seconds: FlashInfer variants JIT-compile on first use (8-30 s each) and flex compiles each
# layer kind, so the slowest shards set the wall time (~4-7 min).
set -u
OUT=${OUT:-/tmp/attnsdk-gpu}
mkdir -p "$OUT" /tmp/site /tmp/fi
tar -xJf .gpu/site.tar.xz -C /tmp/site
[ -f .gpu/flashinfer.tar.xz ] && tar -xJf .gpu/flashinfer.tar.xz -C /tmp/fi
[ -f .gpu/fi_mla.tar.xz ] && tar -xJf .gpu/fi_mla.tar.xz -C /tmp/fi
export PYTHONPATH=/tmp/site:/tmp/fi FLASHINFER_WORKSPACE_BASE=/tmp/fiws \
    FLASHINFER_CUDA_ARCH_LIST=9.0a MAX_JOBS=16
python -m pip install -q --no-deps --no-build-isolation -e . || exit 9
LIMIT=${LIMIT:-420}

ONLY=" ${SHARDS:-all} "  # e.g. SHARDS="flex_lse models": run only the shards named

shard() {
    local name=$1
    shift
    [ "$ONLY" = " all " ] || [[ "$ONLY" == *" $name "* ]] || return 0
    timeout "$LIMIT" python -m pytest -q -p no:cacheprovider -rs -rf --durations=5 "$@" \
        > "$OUT/$name.log" 2>&1
    echo "rc=$?" >> "$OUT/$name.log"
}

# Flex compiles every layer kind on first use (Inductor, CPU-bound): its conformance class is
# split four ways to use the box's cores.
FLEXC=tests/gpu/test_conformance_flex_cuda.py
FLEX_REST="not test_chunked and not test_lse and not test_feature and not test_dtype"
shard flashinfer_ref tests/gpu/test_flashinfer.py -k matches_reference &
shard flashinfer_rest tests/gpu/test_flashinfer.py -k "not matches_reference" &
shard flashinfer_conformance tests/gpu/test_conformance_flashinfer.py -k "not mla" &
shard flex tests/gpu/test_flex_gpu.py tests/gpu/test_merge_states_cuda.py &
shard flex_chunked "$FLEXC" -k test_chunked &
shard flex_lse "$FLEXC" -k test_lse &
shard flex_features "$FLEXC" -k "test_feature or test_dtype" &
shard flex_rest "$FLEXC" -k "$FLEX_REST" &
shard models tests/gpu/test_models_gpu.py &
shard chunked tests/gpu/test_chunked_gpu.py &
shard mla tests/gpu/test_conformance_flashinfer.py tests/gpu/test_conformance_fa3.py -k mla &
shard ragged tests/gpu/test_ragged_gpu.py tests/gpu/test_conformance_flashinfer.py \
    tests/gpu/test_conformance_fa3.py -k ragged &
shard fa3 tests/gpu/test_fa3.py tests/gpu/test_fuzz.py tests/gpu/test_graphs.py \
    tests/gpu/test_sglang_fa3.py tests/gpu/test_vllm_fa3.py tests/gpu/test_conformance_fa3.py &
wait

status=0
for f in "$OUT"/*.log; do
    echo "== $(basename "$f" .log)"
    grep -E "^(FAILED|ERROR)" "$f" | head -10
    grep -E "[0-9]+ (passed|failed|skipped)" "$f" | tail -1
    grep -q "^rc=0$" "$f" || status=1
done

BENCHES=" ${BENCH:-0} "
[ "$BENCHES" = " 1 " ] && BENCHES=" suites tree mla ragged "
if [[ "$BENCHES" == *" suites "* ]]; then
    for suite in decode prefill mixed; do
        timeout 200 python -m attnsdk bench --suite "$suite" --out "$OUT/bench" \
            > "$OUT/bench_$suite.txt" 2>&1 || status=1
        tail -22 "$OUT/bench_$suite.txt"
    done
fi
for bench in tree mla ragged; do
    [[ "$BENCHES" == *" $bench "* ]] || continue
    timeout 200 python -m "benchmarks.bench_$bench" --out "$OUT/$bench" \
        > "$OUT/bench_$bench.txt" 2>&1 || status=1
    tail -12 "$OUT/bench_$bench.txt"
done
if [ "${ENGINE:-0}" = 1 ]; then
    timeout 60 python examples/mini_engine.py > "$OUT/mini_engine.txt" 2>&1 || status=1
    tail -3 "$OUT/mini_engine.txt"
    timeout 400 python -m benchmarks.bench_engine --out "$OUT/engine" \
        > "$OUT/bench_engine.txt" 2>&1 || status=1
    tail -12 "$OUT/bench_engine.txt"
fi
exit $status
