#!/usr/bin/env bash
# One call on the GPU machine for the capture path: builds what it needs (Hopper only, a few minutes),
# runs the recording tests on CUDA (late reports against the CPU's immediate ones, a several-step
# trace against the CPU's, record on GPU -> replay on CPU, a recorded generation against the CPU's),
# compute-sanitizer memcheck over the late-report test, then bench_capture's CUDA cases, and prints a
# table of each capture mode's step time against the same steps without a trace (also with the trace's
# close left out: it waits on the disk, whose speed varies between machines) and of a generation
# against the engine alone, measured in the same run, and one of where each forward case's wall time
# goes (the host before the first kernel, the kernels' span, the host after the last). Logs under $OUT
# (or build-gpu/logs).
#
# Usage: scripts/gpu-capture-check.sh [--no-tests] [--no-bench]
#   env: BUILD_DIR (default build-gpu), JOBS, CUDA_ARCH (default 90a-real: the sm_90a wgmma GEMM), BENCH_FILTER (default Cuda),
#   DSV4_XXHASH_INCLUDE (default .carry/xxhash when it holds xxhash.h: the GPU machine has no
#   libxxhash dev files); .carry/isal likewise stands in for libisal-dev (see below);
#   EXTRA_TESTS: more GPU test binaries to build and run after the recording tests (e.g.
#   "test_gpu_model test_gpu_train"), each with its own log and summary line
set -uo pipefail
cd "$(dirname "$0")/.."
tests=1 bench=1
for a in "$@"; do
  case "$a" in
    --no-tests) tests=0 ;;
    --no-bench) bench=0 ;;
    *)
      echo "usage: scripts/gpu-capture-check.sh [--no-tests] [--no-bench]" >&2
      exit 2
      ;;
  esac
done
source scripts/gpu-env.sh

cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DDSV4_CUDA=ON \
  -DCMAKE_CUDA_ARCHITECTURES="${CUDA_ARCH:-90a-real}" -DDSV4_GUI=OFF -DDSV4_PYTHON=OFF \
  ${xx:+-DDSV4_XXHASH_INCLUDE=$xx} >"$logs/configure.log" 2>&1 &&
  ninja -C "$build" -j "$jobs" dsv4 test_gpu_record test_gpu_decode bench_capture ${EXTRA_TESTS:-} >"$logs/build.log" 2>&1
if [[ $? -ne 0 ]]; then
  status build "FAILED (see build.log)"
  tail -30 "$logs/build.log"
  cat "$logs/summary.txt"
  exit 1
fi
status build "ok ($(grep -q 'ISA-L (libisal-dev) not found' "$logs/configure.log" && echo 'zlib deflate' || echo 'ISA-L deflate'))"

if [[ $tests == 1 ]]; then
  if "$build/tests/gpu/test_gpu_record" >"$logs/test_gpu_record.log" 2>&1; then
    status "test_gpu_record" "$(grep -E '^\[  PASSED  \]' "$logs/test_gpu_record.log")"
  else
    status "test_gpu_record" "FAILED (see test_gpu_record.log)"
    grep -E "FAILED|Failure|error" "$logs/test_gpu_record.log" | head -20
    rc=1
  fi
  # A recorded generation on the GPU (its collector takes the reports late) against the CPU's.
  if timeout 300 "$build/tests/gpu/test_gpu_decode" --gtest_filter='*Collected*' >"$logs/test_gpu_decode.log" 2>&1; then
    status "test_gpu_decode Collected (recorded generation)" "$(grep -E '^\[  PASSED  \]' "$logs/test_gpu_decode.log")"
  else
    status "test_gpu_decode Collected (recorded generation)" "FAILED (see test_gpu_decode.log)"
    grep -E "FAILED|Failure|error" "$logs/test_gpu_decode.log" | head -20
    rc=1
  fi
  if command -v compute-sanitizer >/dev/null; then
    if timeout 300 compute-sanitizer --tool memcheck --error-exitcode 9 "$build/tests/gpu/test_gpu_record" \
        --gtest_filter='*LateReports*:*LateDigests*:*SeveralSteps*' >"$logs/memcheck.log" 2>&1; then
      status "memcheck (late reports and digests, several steps)" "$(grep -E 'ERROR SUMMARY' "$logs/memcheck.log" | tail -1)"
    else
      status "memcheck (late reports and digests, several steps)" "FAILED or timed out (see memcheck.log)"
      rc=1
    fi
  fi
fi

for t in ${EXTRA_TESTS:-}; do
  if timeout 300 "$build/tests/gpu/$t" >"$logs/$t.log" 2>&1; then
    status "$t" "$(grep -E '^\[  PASSED  \]' "$logs/$t.log")"
  else
    status "$t" "FAILED or timed out (see $t.log)"
    grep -E "FAILED|Failure" "$logs/$t.log" | head -20
    rc=1
  fi
done

if [[ $bench == 1 ]]; then
  timeout 420 "$build/bench/bench_capture" --benchmark_filter="${BENCH_FILTER:-Cuda}" >"$logs/bench_capture.log" 2>&1 ||
    echo "bench_capture failed or timed out" >>"$logs/bench_capture.log"
  # ms per step of each BM_RecordStepsCuda case, and the forward cases' times, with ratios against
  # the uncaptured run of the same T from this log.
  python3 - "$logs/bench_capture.log" >>"$logs/summary.txt" <<'EOF'
import re, sys
scale = {"": 1.0, "k": 1e3, "M": 1e6, "m": 1e-3, "u": 1e-6, "µ": 1e-6, "n": 1e-9}  # the counters' SI prefixes
rows, counters = {}, {}
for line in open(sys.argv[1]):
    m = re.match(r"(BM_\S+)\s+([\d.]+) ms", line)
    if not m:
        continue
    name, ms = m.group(1), float(m.group(2))
    counters[name] = {k: float(v) * scale[p] for k, v, p in re.findall(r"(\w+)=([\d.eE+-]+)([kMmunµ]?)(?=\s|$)", line)}
    # The counter is seconds per step, printed with an SI prefix and/or an "s" ("38.1m", "0.0381s").
    per_step = re.search(r"ms_per_step=([\d.eE+-]+)([kmunµ]?)s?\b", line)
    rows[name] = float(per_step.group(1)) * scale[per_step.group(2)] * 1e3 if per_step else ms
def base(name):
    t = re.search(r"/(\d+)/", name + "/")
    return next((v for k, v in rows.items() if k.startswith("BM_RecordStepsCuda/none/") and t and f"/{t.group(1)}/" in k + "/"), None)
# A trace's close (HDF5's close, the seal) is once a trace and waits on the disk, whose speed varies from
# machine to machine: "close apart" gives the recorded steps' ratio with the close left out.
print(f"{'case':52} {'ms':>9} {'x uncaptured':>13} {'close apart':>12}")
fwd = next((v for k, v in rows.items() if k.startswith("BM_ForwardCuda/none")), None)
# BM_GenerateMidCuda/0: the engine alone; /1 with the recorder's collector; /2 recorded into a trace.
gen = next((v for k, v in rows.items() if k.startswith("BM_GenerateMidCuda/0")), None)
for k, v in rows.items():
    ref = base(k) if k.startswith("BM_RecordStepsCuda") else (fwd if k.startswith("BM_ForwardCuda/observed") else
                                                              gen if k.startswith("BM_GenerateMidCuda") else None)
    ratio = f"{v / ref:.3f}" if ref else ""
    steps = re.match(r"BM_RecordStepsCuda/\w+/\d+/(\d+)", k)
    close = counters[k].get("close_ms")
    apart = f"{(v - close / int(steps.group(1))) / ref:.3f}" if ref and steps and close else ""
    print(f"{k:52} {v:9.2f} {ratio:>13} {apart:>12}")
# Where a forward's wall time goes (bench_capture's kernel_counters, one more forward under CUPTI): the
# host before the first kernel, the GPU span, the host after the last kernel.
parts = ("lead_ms", "span_ms", "after_last_ms", "report_alone_ms", "report_tail_ms")
head = False
for name, got in counters.items():
    if not name.startswith("BM_ForwardCuda") or not any(k in got for k in parts):
        continue
    if not head:
        print(f"{'forward case (ms)':40} " + " ".join(f"{k[:-3]:>12}" for k in parts))
        head = True
    print(f"{re.sub(r'/iterations.*', '', name):40} " + " ".join(f"{got[k]:12.3f}" if k in got else f"{'':12}" for k in parts))
EOF
fi
echo "================ dsv4 GPU capture check ================"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1
cat "$logs/summary.txt"
exit $rc
