#!/usr/bin/env bash
# One call on the GPU machine: builds dsv4 with the CUDA backend, runs the gpu-labelled tests, the
# compute-sanitizer pass (memcheck and racecheck) over the kernel tests and the GPU benchmark, and
# prints a short table at the end. Logs go to $OUT when set, else to <build>/logs.
#
# At most 8 log files are written (gpu-check.log holds the summary table at its end).
#
# The whole project is configured first; when a dependency of the trace/CLI layers is missing there
# (the GPU machine has no libxxhash dev files, no Qt), it falls back to the GPU-only build of
# tests/gpu/CMakeLists.txt (kernels, model, GPU tests, bench_gpu). Where libxxhash's pkg-config file
# is missing, a copy of xxhash.h in .carry/xxhash/ (or DSV4_XXHASH_INCLUDE=DIR) is compiled in
# header-only. The whole-project build also checks "record on GPU -> replay on CPU" through the dsv4
# binary (the trace must hold CUPTI kernel records and replay bit-identically on the CPU).
#
# Usage: scripts/gpu-check.sh [--quick] [--no-bench] [--no-tests] [--no-sanitizer] [--gpu-only] [--cpu-long]
#   --quick  smaller benchmark sizes; --no-tests skips the tests and the GPU record/replay check;
#   --cpu-long also times the CPU at T = 16384 (slow)
#   env: SANITIZER_TIMEOUT (240 s per tool), SANITIZER_FILTER (gtest filter, default all cases),
#        BUILD_DIR (default build-gpu; the GPU-only build uses BUILD_DIR-only), JOBS,
#        CUDA_ARCH (CMake's CUDA_ARCHITECTURES; default 80-real;90a-real;100-real;120-real;80-virtual)
# Across architectures: the SASS of every embedded architecture is audited (scripts/kernel-audit.py
# sass, against the PTX the build audits), and a recording is made twice on this GPU, with its own
# SASS and through the driver's JIT of the compute_80 PTX (CUDA_FORCE_PTX_JIT=1); each replays
# bit-identically on the CPU and on the GPU.
set -uo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
export PATH=/opt/torch/.venv/bin:/usr/local/cuda/bin:$PATH

quick=0 bench=1 tests=1 sanitizer=1 force_gpu_only=0 cpu_long=0
for a in "$@"; do
  case "$a" in
    --quick) quick=1 ;;
    --no-bench) bench=0 ;;
    --no-tests) tests=0 ;;
    --cpu-long) cpu_long=1 ;;
    --no-sanitizer) sanitizer=0 ;;
    --gpu-only) force_gpu_only=1 ;;
    *)
      echo "usage: scripts/gpu-check.sh [--quick] [--no-bench] [--no-tests] [--no-sanitizer] [--gpu-only] [--cpu-long]" >&2
      exit 2
      ;;
  esac
done

build=${BUILD_DIR:-build-gpu}
logs=${OUT:-$build/logs}
mkdir -p "$logs"
jobs=${JOBS:-$(nproc 2>/dev/null || echo 4)}
# Default: one binary for Ampere, Hopper and both Blackwells, plus compute_80 PTX for the driver's JIT
# (the "PTX JIT" record below runs it on this GPU).
arch=${CUDA_ARCH:-"80-real;90a-real;100-real;120-real;80-virtual"}
gen=()
command -v ninja >/dev/null 2>&1 && gen=(-G Ninja)
say() { printf '== %s\n' "$*" | tee -a "$logs/gpu-check.log"; }

: >"$logs/gpu-check.log"
device=$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | head -1)
device=${device:-"nvidia-smi failed"}
say "device: $device"

# ---- configure ------------------------------------------------------------------------------------
xxh=()
xxh_dir=${DSV4_XXHASH_INCLUDE:-}
[[ -z "$xxh_dir" && -f "$root/.carry/xxhash/xxhash.h" ]] && xxh_dir=$root/.carry/xxhash
[[ -n "$xxh_dir" ]] && xxh=(-DDSV4_XXHASH_INCLUDE="$xxh_dir")
mode=full
if [[ $force_gpu_only == 0 ]] &&
  cmake -S . -B "$build" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release -DDSV4_CUDA=ON -DDSV4_GUI=OFF \
    -DDSV4_BUILD_TESTS=ON -DDSV4_BUILD_BENCH=ON -DCMAKE_CUDA_ARCHITECTURES="$arch" "${xxh[@]}" \
    >"$logs/configure.log" 2>&1; then
  say "configured the whole project (DSV4_CUDA=ON) in $build"
else
  mode=gpu-only
  [[ $force_gpu_only == 0 ]] && say "whole-project configure failed (see configure.log); using the GPU-only build"
  build=$build-only
  if ! cmake -S tests/gpu -B "$build" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_CUDA_ARCHITECTURES="$arch" "${xxh[@]}" >>"$logs/configure.log" 2>&1; then
    tail -30 "$logs/configure.log"
    say "configure failed"
    exit 1
  fi
  say "configured the GPU-only build in $build"
fi

# ---- build ----------------------------------------------------------------------------------------
targets=(test_backend_ops test_grad_linear_gpu test_grad_attention_gpu test_grad_mhc_gpu test_grad_indexer_gpu test_gpu_model test_xxh3
  bench_gpu dsv4_kernels_ptx)
[[ $mode == full ]] && targets+=(dsv4 test_gpu_record test_gpu_decode test_gpu_train bench_capture bench_decode
  bench_train)
build_ok=1
if ! cmake --build "$build" -j"$jobs" --target "${targets[@]}" >"$logs/build.log" 2>&1; then
  build_ok=0
  tail -40 "$logs/build.log"
  say "build failed (see build.log)"
fi
find_bin() { find "$build" -name "$1" -type f -perm -u+x 2>/dev/null | head -1; }
ops_bin=$(find_bin test_backend_ops)
bench_bin=$(find_bin bench_gpu)
capture_bin=$([[ $mode == full ]] && find_bin bench_capture)
decode_bin=$([[ $mode == full ]] && find_bin bench_decode)
cli_bin=$([[ $mode == full ]] && find_bin dsv4)

# ---- gpu-labelled tests ---------------------------------------------------------------------------
tests_total=0 tests_failed=0 tests_skipped=0
if [[ $build_ok == 1 && $tests == 1 ]]; then
  say "ctest -L gpu"
  ctest --test-dir "$build" -L gpu -j"$jobs" --output-on-failure --timeout 1800 >"$logs/ctest.log" 2>&1
  # "100% tests passed out of N" or "P% tests passed, F tests failed out of N"; skipped tests count
  # as passed there and are listed under "The following tests did not run".
  summary=$(grep -E "% tests passed" "$logs/ctest.log" | tail -1)
  tests_total=$(sed -nE 's/.* out of ([0-9]+).*/\1/p' <<<"$summary")
  tests_failed=$(sed -nE 's/.*, ([0-9]+) tests? failed.*/\1/p' <<<"$summary")
  tests_failed=${tests_failed:-0}
  tests_skipped=$(grep -cE "\(Skipped\)$" "$logs/ctest.log" || true)
  if [[ -z "$tests_total" ]]; then
    tests_total=0 tests_failed=1
  fi
  grep -E "Failed|\*\*\*Timeout|Not Run" "$logs/ctest.log" | head -20
fi

# ---- record on the GPU, replay on the CPU (whole-project build) -------------------------------------
gpu_record="not run (needs the whole-project build)"
[[ $tests == 0 ]] && gpu_record="not run (--no-tests)"
if [[ $build_ok == 1 && $tests == 1 && -n "$cli_bin" ]]; then
  say "dsv4 record --device cuda -> dsv4 replay --device cpu"
  t=$logs/gpu-record.h5
  rm -f "$t" "$t.incomplete"
  {
    "$cli_bin" record --preset tiny --seed 7 --random 64 --device cuda --out "$t" &&
      "$cli_bin" replay "$t" --device cpu --json "$logs/gpu-record-replay.json"
  } >"$logs/gpu-record.log" 2>&1
  rc=$?
  kernels=$(grep -oE '"recorded": *[0-9]+' "$logs/gpu-record-replay.json" 2>/dev/null | head -1 | grep -oE '[0-9]+$')
  if [[ $rc == 0 ]]; then
    gpu_record="replay exit 0, ${kernels:-?} kernel records"
    [[ "${kernels:-0}" == 0 ]] && gpu_record+=" (NO KERNEL RECORDS)"
  else
    gpu_record="FAILED (exit $rc, see gpu-record.log)"
    tests_failed=$((tests_failed + 1))
  fi
  rm -f "$t"
fi

# ---- across GPU architectures: SASS audit, native SASS and PTX JIT recordings ------------------------
sass_audit="not run" archs_in="?"
: >"$logs/arch-check.log"
declare -A arch_record=([sass]="not run" [ptx-jit]="not run")
if [[ $build_ok == 1 && -n "$cli_bin" ]] && command -v cuobjdump >/dev/null 2>&1; then
  say "cuobjdump -sass $(basename "$cli_bin") | kernel-audit.py sass"
  archs_in=$(cuobjdump --list-elf "$cli_bin" 2>/dev/null | grep -oE 'sm_[0-9]+a?' | sort -u | tr '\n' ' ')
  archs_in+=$(cuobjdump --list-ptx "$cli_bin" 2>/dev/null | grep -oE 'sm_[0-9]+a?' | sort -u | sed 's/^/+ptx /' | tr '\n' ' ')
  ptx=$(find "$build" -path '*kernels/ptx/*.ptx' 2>/dev/null | sort)
  cuobjdump -sass "$cli_bin" >"$logs/sass.txt" 2>&1
  if [[ -z "$ptx" ]]; then
    sass_audit="not run (the build made no audit PTX)"
  elif python3 scripts/kernel-audit.py sass "$logs/sass.txt" --ptx $ptx >"$logs/arch-check.log" 2>&1; then
    sass_audit="clean: $(tail -1 "$logs/arch-check.log" | sed -E 's/.*: ([0-9]+ instructions).*/\1/')"
  else
    sass_audit="FAILED (see arch-check.log)"
    head -20 "$logs/arch-check.log"
    tests_failed=$((tests_failed + 1))
  fi
  rm -f "$logs/sass.txt"
fi
if [[ $build_ok == 1 && $tests == 1 && -n "$cli_bin" ]]; then
  for path in sass ptx-jit; do
    say "dsv4 record --device cuda ($path) -> replay on the CPU and on the GPU"
    t=$logs/record-$path.h5
    rm -f "$t" "$t.incomplete"
    jit=()
    [[ $path == ptx-jit ]] && jit=(env CUDA_FORCE_PTX_JIT=1 CUDA_CACHE_DISABLE=1)
    {
      "${jit[@]}" "$cli_bin" record --preset tiny-b --seed 11 --random 96 --device cuda --out "$t" &&
        "$cli_bin" replay "$t" --device cpu && "${jit[@]}" "$cli_bin" replay "$t" --device cuda
    } >"$logs/record.tmp" 2>&1
    rc=$?
    n=$(grep -c ": bit-identical" "$logs/record.tmp")
    { echo "==== record --device cuda ($path)"; cat "$logs/record.tmp"; } >>"$logs/arch-check.log"
    rm -f "$logs/record.tmp"
    if [[ $rc == 0 && $n -ge 2 ]]; then
      arch_record[$path]="replay exit 0 on CPU and GPU"
    else
      arch_record[$path]="FAILED (exit $rc, see arch-check.log)"
      tests_failed=$((tests_failed + 1))
    fi
    rm -f "$t"
  done
fi

# ---- compute-sanitizer over the kernel tests --------------------------------------------------------
# Racecheck over every case of test_backend_ops takes minutes; SANITIZER_TIMEOUT (seconds per tool)
# keeps the whole call bounded and SANITIZER_FILTER (a gtest filter) picks a subset.
san_timeout=${SANITIZER_TIMEOUT:-240}
san_filter=${SANITIZER_FILTER:-*}
declare -A san
for tool in memcheck racecheck; do san[$tool]="not run"; done
if [[ $sanitizer == 1 && -n "$ops_bin" ]] && command -v compute-sanitizer >/dev/null 2>&1; then
  for tool in memcheck racecheck; do
    say "compute-sanitizer --tool $tool $(basename "$ops_bin")"
    extra=()
    [[ $tool == memcheck ]] && extra=(--leak-check full)
    timeout "$san_timeout" compute-sanitizer --tool "$tool" "${extra[@]}" "$ops_bin" --gtest_brief=1 \
      --gtest_filter="$san_filter" >"$logs/sanitizer-$tool.log" 2>&1
    rc=$?
    # memcheck: "ERROR SUMMARY: N errors"; racecheck: "RACECHECK SUMMARY: H hazards displayed (E errors,
    # W warnings)".
    line=$(grep -E "(ERROR|RACECHECK) SUMMARY" "$logs/sanitizer-$tool.log" | tail -1)
    if [[ $line =~ RACECHECK\ SUMMARY:.*\(([0-9]+)\ errors?,\ ([0-9]+)\ warnings? ]]; then
      san[$tool]="${BASH_REMATCH[1]} errors, ${BASH_REMATCH[2]} warnings"
    elif [[ $line =~ ERROR\ SUMMARY:\ ([0-9]+)\ error ]]; then
      san[$tool]="${BASH_REMATCH[1]} errors"
    else
      san[$tool]="no summary (rc $rc)"
    fi
    [[ $rc == 124 ]] && san[$tool]="timed out after ${san_timeout} s (set SANITIZER_FILTER to a subset)"
    grep -qE "FAILED" "$logs/sanitizer-$tool.log" && san[$tool]+=", test failures under the tool"
  done
fi

# ---- benchmark ----------------------------------------------------------------------------------------
if [[ $bench == 1 && -n "$bench_bin" ]]; then
  say "bench_gpu"
  bargs=()
  [[ $quick == 1 ]] && bargs+=(--quick)
  [[ $cpu_long == 1 ]] && bargs+=(--cpu-long)
  "$bench_bin" "${bargs[@]}" >"$logs/bench_gpu.log" 2>&1 || say "bench_gpu failed (see bench_gpu.log)"
  grep -vE "^RESULT" "$logs/bench_gpu.log"
  if [[ -n "$capture_bin" ]]; then
    say "bench_capture (GPU cases: capture cost with device digests)"
    "$capture_bin" --benchmark_filter=Cuda >"$logs/bench_capture.log" 2>&1 ||
      say "bench_capture failed (see bench_capture.log)"
    grep -E "^BM_" "$logs/bench_capture.log"
  fi
  if [[ -n "$decode_bin" ]]; then
    say "bench_decode (decode tokens/s on the GPU; the CPU cases are measured on the CPU machines)"
    "$decode_bin" --benchmark_filter=Cuda >"$logs/bench_decode.log" 2>&1 || say "bench_decode failed (see bench_decode.log)"
    grep -E "^BM_" "$logs/bench_decode.log"
  fi
fi

# ---- summary --------------------------------------------------------------------------------------------
{
  echo
  echo "================ dsv4 GPU check ($mode build) ================"
  printf '%-34s %s\n' "device" "$device"
  printf '%-34s %s\n' "build" "$([[ $build_ok == 1 ]] && echo ok || echo FAILED)"
  if [[ $tests == 1 ]]; then
    printf '%-34s %s\n' "gpu tests (ctest -L gpu)" \
      "$((tests_total - tests_failed - tests_skipped)) passed, $tests_failed failed, $tests_skipped skipped of $tests_total"
  else
    printf '%-34s %s\n' "gpu tests (ctest -L gpu)" "not run (--no-tests)"
  fi
  printf '%-34s %s\n' "record on GPU -> replay on CPU" "$gpu_record"
  printf '%-34s %s\n' "architectures in the binary" "$archs_in"
  printf '%-34s %s\n' "SASS audit (kernel-audit.py)" "$sass_audit"
  printf '%-34s %s\n' "record with sm_90 SASS" "${arch_record[sass]}"
  printf '%-34s %s\n' "record through the PTX JIT" "${arch_record[ptx-jit]}"
  printf '%-34s %s\n' "compute-sanitizer memcheck" "${san[memcheck]}"
  printf '%-34s %s\n' "compute-sanitizer racecheck" "${san[racecheck]}"
  if [[ -f "$logs/bench_gpu.log" ]]; then
    grep -E "^RESULT (tokens_per_s|copy_gbs|exact_gemm_gflops|tiled_gemm_gflops|bf16_gemm_gflops)" "$logs/bench_gpu.log" |
      sed -E 's/^RESULT //' | while read -r key rest; do
        case "$key" in
          tokens_per_s) set -- $rest; printf '%-34s %s tokens/s\n' "tokens/s $1 $2 $3" "$4" ;;
          copy_gbs) printf '%-34s %s GB/s\n' "device copy bandwidth" "$rest" ;;
          exact_gemm_gflops) printf '%-34s %s GFLOP/s\n' "exact fp32 GEMM" "$rest" ;;
          tiled_gemm_gflops) printf '%-34s %s GFLOP/s\n' "exact fp32 GEMM (tiled kernel)" "$rest" ;;
          bf16_gemm_gflops) printf '%-34s %s GFLOP/s\n' "bf16 tensor-core GEMM (cuBLAS)" "$rest" ;;
        esac
      done
  fi
  if [[ -f "$logs/bench_capture.log" ]]; then
    # "BM_ForwardCuda/decisions/4096   123 ms   ... tokens/s=33.3k/s ..."
    grep -E "^BM_ForwardCuda/" "$logs/bench_capture.log" | while read -r name ms unit rest; do
      policy=${name#BM_ForwardCuda/}
      policy=${policy%%/*}
      printf '%-34s %s %s\n' "record mid capture $policy" "$ms $unit (T=$([[ $policy == full ]] && echo 512 || echo 4096))"
    done
  fi
  if [[ -f "$logs/bench_decode.log" ]]; then
    # "BM_DecodeMidCuda/64/4096/iterations:16/real_time  12.3 ms ... decode tok/s=5.2k/s ..."
    grep -E "^BM_Decode" "$logs/bench_decode.log" | while read -r name rest; do
      tps=$(grep -oE 'decode tok/s=[^ ]+' <<<"$rest" | cut -d= -f2)
      ratio=$(grep -oE 'decode/prefill cost=[^ ]+' <<<"$rest" | cut -d= -f2)
      case=${name#BM_Decode}
      printf '%-34s %s tok/s (decode/prefill cost per token %s)\n' "decode ${case%%/iter*}" "$tps" "$ratio"
    done
  fi
  echo "logs: $logs"
} | tee -a "$logs/gpu-check.log"

[[ $build_ok == 1 && $tests_failed == 0 ]]
