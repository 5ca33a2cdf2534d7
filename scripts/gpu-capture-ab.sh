#!/usr/bin/env bash
# A/B of the capture path in one call on the GPU machine: this tree against another version of the
# sources (BASE, e.g. made before the call with `git archive REV | tar -x -C .carry/base`; the folder
# travels with the call's carry). Both are built side by side; this tree's recording tests run (late
# reports against the CPU's, digests held back on their stream, a recorded generation, the digest
# bits against libxxhash); then bench_capture's cases run for each version in turn, ROUNDS times, and
# a table gives each capture case's ratio against the uncaptured case of the same build and round.
#
# Usage: scripts/gpu-capture-ab.sh [--no-tests] BASE
#   env: ROUNDS (default 1), BENCH_FILTER (default: the forward with late reports, the recorded
#   steps at T = 4096 and the generation), and those of scripts/gpu-env.sh (BUILD_DIR, JOBS, OUT, ...)
set -uo pipefail
cd "$(dirname "$0")/.."
tests=1 base=
for a in "$@"; do
  case "$a" in
    --no-tests) tests=0 ;;
    -h | --help)
      sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//'
      exit 0
      ;;
    -*)
      echo "usage: scripts/gpu-capture-ab.sh [--no-tests] BASE" >&2
      exit 2
      ;;
    *) base=$a ;;
  esac
done
[[ -n $base ]] || { echo "usage: scripts/gpu-capture-ab.sh [--no-tests] BASE" >&2; exit 2; }
[[ -f $base/CMakeLists.txt ]] || { echo "gpu-capture-ab: $base holds no sources (no CMakeLists.txt)" >&2; exit 2; }
source scripts/gpu-env.sh
base=$(cd "$base" && pwd)
filter=${BENCH_FILTER:-'BM_ForwardCuda/(none|observed_late)|BM_RecordStepsCuda/(none|decisions)/4096|BM_GenerateMidCuda'}
configure() {
  cmake -S "$1" -B "$2" -G Ninja -DCMAKE_BUILD_TYPE=Release -DDSV4_CUDA=ON \
    -DCMAKE_CUDA_ARCHITECTURES="${CUDA_ARCH:-90a-real}" -DDSV4_GUI=OFF -DDSV4_PYTHON=OFF \
    ${xx:+-DDSV4_XXHASH_INCLUDE=$xx} >"$logs/configure_$3.log" 2>&1
}
base_build=$base/build-gpu
configure . "$build" tree && configure "$base" "$base_build" base || { tail -20 "$logs"/configure_*.log; exit 1; }
half=$(((jobs + 1) / 2))
ninja -C "$build" -j "$half" dsv4 test_gpu_record test_gpu_decode test_xxh3 bench_capture >"$logs/build_tree.log" 2>&1 &
tree_build=$!
ninja -C "$base_build" -j "$half" bench_capture >"$logs/build_base.log" 2>&1
base_rc=$?
wait $tree_build
tree_rc=$?
if [[ $tree_rc -ne 0 || $base_rc -ne 0 ]]; then
  status build "FAILED (tree $tree_rc, base $base_rc; see build_tree.log, build_base.log)"
  tail -20 "$logs/build_tree.log" "$logs/build_base.log"
  cat "$logs/summary.txt"
  exit 1
fi
status build ok

if [[ $tests == 1 ]]; then
  for t in test_gpu_record "test_gpu_decode --gtest_filter=*Collected*" test_xxh3; do
    name=${t%% *}
    if timeout 300 "$build/tests/gpu/$name" ${t#"$name"} >"$logs/$name.log" 2>&1; then
      status "$name" "$(grep -E '^\[  PASSED  \]' "$logs/$name.log")"
    else
      status "$name" "FAILED or timed out (see $name.log)"
      grep -E "FAILED|Failure" "$logs/$name.log" | head -20
      rc=1
    fi
  done
fi

for ((round = 1; round <= ${ROUNDS:-1}; ++round)); do
  for v in tree base; do
    b=$build
    [[ $v == base ]] && b=$base_build
    timeout 300 "$b/bench/bench_capture" --benchmark_filter="$filter" >"$logs/bench_${v}_$round.log" 2>&1 ||
      status "bench $v round $round" "failed or timed out (see bench_${v}_$round.log)"
  done
done

# Per version and round: each case's ms (ms per step for the recorded steps) and its ratio against the
# uncaptured case of the same log (the forward without reports, the engine alone, the same steps
# without a trace).
python3 - "$logs" "${ROUNDS:-1}" >>"$logs/summary.txt" <<'EOF'
import re, sys
logs, rounds = sys.argv[1], int(sys.argv[2])
scale = {"": 1.0, "k": 1e3, "m": 1e-3, "u": 1e-6, "µ": 1e-6, "n": 1e-9}
def read(path):
    rows = {}
    try:
        lines = open(path).read().splitlines()
    except OSError:
        return rows
    for line in lines:
        m = re.match(r"(BM_\S+?)(/iterations\S*)?\s+([\d.]+) ms", line)
        if not m:
            continue
        per_step = re.search(r"ms_per_step=([\d.eE+-]+)([kmunµ]?)s?\b", line)
        close = re.search(r"close_ms=([\d.eE+-]+)([kmunµ]?)\b", line)
        rows[m.group(1)] = (float(per_step.group(1)) * scale[per_step.group(2)] * 1e3 if per_step else float(m.group(3)),
                            float(close.group(1)) * scale[close.group(2)] if close else None)
    return rows
def reference(name):  # the uncaptured case a case is measured against
    if name.startswith("BM_ForwardCuda/"):
        return "BM_ForwardCuda/none/4096"
    if name.startswith("BM_GenerateMidCuda/"):
        return "BM_GenerateMidCuda/0"
    m = re.match(r"BM_RecordStepsCuda/\w+/(\d+/\d+)", name)
    return f"BM_RecordStepsCuda/none/{m.group(1)}" if m else None
print(f"{'case':42} {'version':8} {'round':>5} {'ms':>9} {'x uncaptured':>13} {'close ms':>9}")
for r in range(1, rounds + 1):
    for v in ("tree", "base"):
        rows = read(f"{logs}/bench_{v}_{r}.log")
        for name, (ms, close) in rows.items():
            ref = rows.get(reference(name)) if reference(name) != name else None
            ratio = f"{ms / ref[0]:.3f}" if ref else ""
            close = f"{close:.1f}" if close is not None else ""
            print(f"{name:42} {v:8} {r:5} {ms:9.2f} {ratio:>13} {close:>9}")
EOF
echo "================ dsv4 GPU capture A/B ================"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1
cat "$logs/summary.txt"
exit $rc
