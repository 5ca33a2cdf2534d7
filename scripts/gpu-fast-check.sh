#!/usr/bin/env bash
# One call on the GPU machine for the fast numerics (GEMMs, experts, indexer and attention in the
# tensor_core order): builds what it needs (Hopper only), runs the tensor-core GEMM, indexer and attention
# tests (float64 bounds, run-to-run, batch, head and padding invariance, alignment), the whole-model fast
# tests (run-to-run, batch composition, fast against exact with the per-tensor rel-L2 table), the CLI
# record/replay of a fast trace (GPU bitwise, the CPU refusing or comparing within tolerance),
# compute-sanitizer memcheck and racecheck over the kernels' tests, then `bench_gpu --fast --layers-only`
# (the fast GEMM against cuBLAS bf16 at the same shapes, the Flash-shaped layer exact and fast, the mid
# model exact against fast), and prints a summary table. Logs under $OUT (or
# build-gpu/logs).
#
# Usage: scripts/gpu-fast-check.sh [--no-tests] [--no-bench]
#   env: BUILD_DIR (default build-gpu), JOBS, CUDA_ARCH (default 90a-real: the sm_90a wgmma GEMM), DSV4_XXHASH_INCLUDE (default
#   .carry/xxhash when it holds xxhash.h), .carry/isal for libisal-dev (as scripts/gpu-capture-check.sh)
set -uo pipefail
cd "$(dirname "$0")/.."
tests=1 bench=1
for a in "$@"; do
  case "$a" in
    --no-tests) tests=0 ;;
    --no-bench) bench=0 ;;
    *) echo "usage: scripts/gpu-fast-check.sh [--no-tests] [--no-bench]" >&2; exit 2 ;;
  esac
done
source scripts/gpu-env.sh

cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DDSV4_CUDA=ON \
  -DCMAKE_CUDA_ARCHITECTURES="${CUDA_ARCH:-90a-real}" -DDSV4_GUI=OFF -DDSV4_PYTHON=OFF \
  ${xx:+-DDSV4_XXHASH_INCLUDE=$xx} >"$logs/configure.log" 2>&1 &&
  ninja -C "$build" -j "$jobs" dsv4 test_gpu_fast test_gpu_model test_gpu_record bench_gpu >"$logs/build.log" 2>&1
if [[ $? -ne 0 ]]; then
  status build "FAILED (see build.log)"
  grep -E "error" "$logs/build.log" | head -30
  cat "$logs/summary.txt"
  exit 1
fi
status build ok

# run NAME LOG BINARY [ARGS...]: a test binary (at most 300 s), its PASSED line or FAILED.
run() {
  local name=$1 log=$2
  shift 2
  if timeout 300 "$@" >"$logs/$log" 2>&1; then
    status "$name" "$(grep -E '^\[  PASSED  \]' "$logs/$log" | tail -1)"
  else
    status "$name" "FAILED (see $log)"
    grep -E "FAILED|Failure|error|Expected|Which is|worst" "$logs/$log" | head -30
    rc=1
  fi
}
if [[ $tests == 1 ]]; then
  t=$build/tests/gpu
  run "test_gpu_fast (GEMM, indexer, attention)" test_gpu_fast.log "$t/test_gpu_fast"
  run "test_gpu_model GpuFast (whole model)" test_gpu_model_fast.log "$t/test_gpu_model" --gtest_filter='*GpuFast*'
  run "test_gpu_record Fast (CLI record/replay)" test_gpu_record_fast.log "$t/test_gpu_record" \
    --gtest_filter='*FastNumerics*'
  if command -v compute-sanitizer >/dev/null; then
    for tool in memcheck racecheck; do
      if timeout 240 compute-sanitizer --tool $tool --error-exitcode 9 "$t/test_gpu_fast" \
          --gtest_filter='*RunToRun*:*Alignment*:*Empty*:*InputsAreBf16*:*IsNotTheExactOrder*' >"$logs/$tool.log" 2>&1; then
        status "compute-sanitizer $tool (fast kernels)" "$(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$logs/$tool.log" | tail -1)"
      else
        status "compute-sanitizer $tool (fast kernels)" "FAILED or timed out (see $tool.log)"
        tail -5 "$logs/$tool.log"
        rc=1
      fi
    done
  fi
  grep -h '^\[fast vs exact\]' "$logs/test_gpu_model_fast.log" >"$logs/fast_vs_exact.txt" 2>/dev/null || true
fi

if [[ $bench == 1 ]]; then
  if timeout 400 "$build/bench/bench_gpu" --fast --layers-only >"$logs/bench_gpu.log" 2>&1; then
    status "bench_gpu --fast" ok
  else
    status "bench_gpu --fast" "FAILED (see bench_gpu.log)"
    tail -20 "$logs/bench_gpu.log"
    rc=1
  fi
fi

echo "================ dsv4 fast numerics on $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1) ================"
cat "$logs/summary.txt"
[[ -f $logs/fast_vs_exact.txt ]] && { echo; cat "$logs/fast_vs_exact.txt"; }
if [[ -f $logs/bench_gpu.log ]]; then
  echo
  sed -n '/^Fast GEMM/,/^$/p' "$logs/bench_gpu.log"
  sed -n '/^Whole model, preset mid (train profile) on CUDA/,$p' "$logs/bench_gpu.log" | head -6
  grep -E '^(Per-op times, flash|total|gemm|moe_experts|sparse_attention|indexer_topk )' "$logs/bench_gpu.log"
fi
exit $rc
