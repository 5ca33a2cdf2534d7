#!/usr/bin/env bash
# One call on the GPU machine for the exact kernels of a layer: builds bench_gpu and test_backend_ops
# (Hopper only), checks every CUDA op against the CPU bit for bit (test_backend_ops), then prints the
# per-op tables of the mid and Flash-shaped layers (bench_gpu --layers-only). With BASE_DIR (another
# source tree, e.g. `git archive BASE | tar -x -C .carry/base`), the same bench is built from it and run
# in the same call, and a table gives each op's time before and after. Logs under $OUT (or
# build-gpu/logs).
#
# Usage: scripts/gpu-layer-check.sh [--no-tests]
#   env: BUILD_DIR (default build-gpu), JOBS, CUDA_ARCH (default 90a-real: the sm_90a wgmma GEMM), BASE_DIR, FLASH_T,
#   DSV4_XXHASH_INCLUDE (default .carry/xxhash when it holds xxhash.h)
set -uo pipefail
cd "$(dirname "$0")/.."
tests=1
for a in "$@"; do
  case "$a" in
    --no-tests) tests=0 ;;
    *)
      echo "usage: scripts/gpu-layer-check.sh [--no-tests]" >&2
      exit 2
      ;;
  esac
done
source scripts/gpu-env.sh

# build SRC DIR TARGETS...: configure and build in DIR from the tree SRC.
build_tree() {
  local src=$1 dir=$2
  shift 2
  cmake -S "$src" -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=Release -DDSV4_CUDA=ON \
    -DCMAKE_CUDA_ARCHITECTURES="${CUDA_ARCH:-90a-real}" -DDSV4_GUI=OFF -DDSV4_PYTHON=OFF \
    ${xx:+-DDSV4_XXHASH_INCLUDE=$xx} >"$logs/configure-$(basename "$dir").log" 2>&1 &&
    ninja -C "$dir" -j "$jobs" "$@" >"$logs/build-$(basename "$dir").log" 2>&1
}
flash=()
[[ -n ${FLASH_T:-} ]] && flash=(--flash-T "$FLASH_T")

if [[ -n ${BASE_DIR:-} ]]; then
  if build_tree "$BASE_DIR" "$PWD/$build-base" bench_gpu; then
    "$build-base/bench/bench_gpu" --layers-only "${flash[@]}" >"$logs/bench_base.log" 2>&1
    status "base bench" "ok"
  else
    status "base build" "FAILED (see build-$(basename "$build")-base.log)"
  fi
fi
if ! build_tree . "$build" bench_gpu test_backend_ops; then
  status build "FAILED (see build-$(basename "$build").log)"
  tail -30 "$logs/build-$(basename "$build").log"
  cat "$logs/summary.txt"
  exit 1
fi
if [[ $tests == 1 ]]; then
  if timeout 400 "$build/tests/gpu/test_backend_ops" >"$logs/test_backend_ops.log" 2>&1; then
    status test_backend_ops "$(grep -E '^\[  PASSED  \]' "$logs/test_backend_ops.log")"
  else
    status test_backend_ops "FAILED or timed out (see test_backend_ops.log)"
    grep -E "FAILED|Failure" "$logs/test_backend_ops.log" | head -20
    rc=1
  fi
fi
"$build/bench/bench_gpu" --layers-only "${flash[@]}" >"$logs/bench.log" 2>&1 || rc=1
grep -vE "^RESULT" "$logs/bench.log"
if [[ -f $logs/bench_base.log ]]; then
  python3 - "$logs/bench_base.log" "$logs/bench.log" >>"$logs/summary.txt" <<'PY'
import re, sys
def ops(path):
    out = {}
    for line in open(path):
        m = re.match(r"RESULT op (\S+) (.+) T=(\d+) ([\d.]+) ms", line)
        if m:
            out[(m.group(1), m.group(2))] = float(m.group(4))
    return out
a, b = ops(sys.argv[1]), ops(sys.argv[2])
print(f"\n{'layer':10} {'op':28} {'base ms':>9} {'now ms':>9} {'base/now':>9}")
for k in b:
    if k in a:
        print(f"{k[0]:10} {k[1]:28} {a[k]:9.3f} {b[k]:9.3f} {a[k] / b[k]:9.2f}")
PY
fi
echo "================ dsv4 GPU layer check ================"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1
cat "$logs/summary.txt"
exit $rc
