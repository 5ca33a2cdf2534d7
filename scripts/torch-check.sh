#!/usr/bin/env bash
# On the GPU machine: runs bench_gpu with --dump for the Flash-shaped layer, then bench/torch_layer.py
# over the dump (correctness cross-check of the attention path, torch vs dsv4 per-op times, and the
# card's bf16 GEMM rate). bench_gpu is looked up in BUILD_DIR (default build-gpu) and then in
# BUILD_DIR-only, the two places scripts/gpu-check.sh builds it.
#
# Usage: scripts/torch-check.sh [--build] [--quick] [--flash-T N]
#   --build   first configure and build bench_gpu with the GPU-only configuration of gpu-check.sh
#   --quick   bench_gpu --quick (T = 1024 unless --flash-T)
# env: BUILD_DIR, CUDA_ARCH (90), JOBS, DUMP_DIR (default /tmp/dsv4-dump; not $OUT, the dump is
# several GiB at T = 8192). Logs go to $OUT when set, else to /tmp/dsv4-torch-check.
set -uo pipefail
cd "$(dirname "$0")/.."
export PATH=/opt/torch/.venv/bin:/usr/local/cuda/bin:$PATH
py=/opt/torch/.venv/bin/python
[[ -x $py ]] || py=python3

build_first=0 bargs=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --build) build_first=1 ;;
    --quick) bargs+=(--quick) ;;
    --flash-T) bargs+=(--flash-T "$2"); shift ;;
    *) echo "usage: scripts/torch-check.sh [--build] [--quick] [--flash-T N]" >&2; exit 2 ;;
  esac
  shift
done
build=${BUILD_DIR:-build-gpu}
logs=${OUT:-/tmp/dsv4-torch-check}
dump=${DUMP_DIR:-/tmp/dsv4-dump}
mkdir -p "$logs"

if [[ $build_first == 1 ]]; then
  gen=()
  command -v ninja >/dev/null 2>&1 && gen=(-G Ninja)
  xxh=()
  [[ -f .carry/xxhash/xxhash.h ]] && xxh=(-DDSV4_XXHASH_INCLUDE="$(pwd)/.carry/xxhash")
  cmake -S tests/gpu -B "$build-only" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_CUDA_ARCHITECTURES="${CUDA_ARCH:-90}" "${xxh[@]}" >"$logs/configure.log" 2>&1 &&
    cmake --build "$build-only" -j"${JOBS:-$(nproc)}" --target bench_gpu >"$logs/build.log" 2>&1 ||
    { tail -30 "$logs/configure.log" "$logs/build.log" 2>/dev/null; echo "build failed" >&2; exit 1; }
fi

bin=$(find "$build" "$build-only" -name bench_gpu -type f -perm -u+x 2>/dev/null | head -1)
[[ -n "$bin" ]] || { echo "bench_gpu not found under $build or $build-only (use --build)" >&2; exit 1; }
rm -rf "$dump"
echo "== $bin ${bargs[*]} --dump $dump"
"$bin" "${bargs[@]}" --dump "$dump" >"$logs/bench_gpu.log" 2>&1 ||
  { tail -20 "$logs/bench_gpu.log"; echo "bench_gpu failed" >&2; exit 1; }
grep -E "^dumped" "$logs/bench_gpu.log"
echo "== torch_layer.py"
"$py" bench/torch_layer.py "$dump" --dsv4-log "$logs/bench_gpu.log" 2>&1 | tee "$logs/torch_layer.log"
rc=${PIPESTATUS[0]}
rm -rf "$dump"
exit "$rc"
