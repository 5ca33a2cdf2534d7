#!/usr/bin/env bash
# On the GPU machine: one C4 layer's gradients against PyTorch autograd. bench_train_layer runs the
# training forward + backward of the tiny preset on one sequence (CUDA when a device is usable) and
# dumps the layer's attention-sublayer input, weights, index rows, incoming gradient and our gradients;
# bench/torch_train_layer.py recomputes the sublayer in fp32 torch from MODEL.md and compares every
# gradient (rel-L2, three modes: fp32 / bf16 straight-through / pinned to our activations).
#
# Usage: scripts/torch-train-check.sh [--build] [-- ARGS for bench_train_layer]
#   --build  first configure and build bench_train_layer with the GPU-only configuration
#            (cmake -S tests/gpu, as scripts/torch-check.sh --build does)
# env: PY (the python with torch), BUILD_DIR (default build-gpu; also searched: BUILD_DIR-only, build), BIN (a bench_train_layer
# to use instead), CUDA_ARCH (90), JOBS, DUMP_DIR (default /tmp/dsv4-train-dump). Logs go to $OUT when
# set, else to /tmp/dsv4-torch-train-check. Exit status: the python check's (1 = a bound exceeded).
set -uo pipefail
cd "$(dirname "$0")/.."
export PATH=/opt/torch/.venv/bin:/usr/local/cuda/bin:$PATH
py=${PY:-/opt/torch/.venv/bin/python}
[[ -x $py ]] || py=python3

build_first=0 bargs=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --build) build_first=1 ;;
    --) shift; bargs=("$@"); break ;;
    *) echo "usage: scripts/torch-train-check.sh [--build] [-- ARGS for bench_train_layer]" >&2; exit 2 ;;
  esac
  shift
done
build=${BUILD_DIR:-build-gpu}
logs=${OUT:-/tmp/dsv4-torch-train-check}
dump=${DUMP_DIR:-/tmp/dsv4-train-dump}
mkdir -p "$logs"

if [[ $build_first == 1 ]]; then
  gen=()
  command -v ninja >/dev/null 2>&1 && gen=(-G Ninja)
  xxh=()
  [[ -f .carry/xxhash/xxhash.h ]] && xxh=(-DDSV4_XXHASH_INCLUDE="$(pwd)/.carry/xxhash")
  cmake -S tests/gpu -B "$build-only" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_CUDA_ARCHITECTURES="${CUDA_ARCH:-90}" "${xxh[@]}" >"$logs/configure.log" 2>&1 &&
    cmake --build "$build-only" -j"${JOBS:-$(nproc)}" --target bench_train_layer >"$logs/build.log" 2>&1 ||
    { tail -30 "$logs/configure.log" "$logs/build.log" 2>/dev/null; echo "build failed" >&2; exit 1; }
fi

bin=${BIN:-$(find "$build" "$build-only" build -name bench_train_layer -type f -perm -u+x 2>/dev/null | head -1)}
[[ -n "$bin" && -x "$bin" ]] || { echo "bench_train_layer not found under $build, $build-only or build (use --build)" >&2; exit 1; }
rm -rf "$dump"
echo "== $bin ${bargs[*]} --dump $dump"
"$bin" "${bargs[@]}" --dump "$dump" >"$logs/bench_train_layer.log" 2>&1 ||
  { tail -20 "$logs/bench_train_layer.log"; echo "bench_train_layer failed" >&2; exit 1; }
grep -E "^dumped" "$logs/bench_train_layer.log"
echo "== torch_train_layer.py"
"$py" bench/torch_train_layer.py "$dump" >"$logs/torch_train_layer.log" 2>&1
rc=$?
grep -v "^RESULT" "$logs/torch_train_layer.log"
rm -rf "$dump"
exit "$rc"
