#!/usr/bin/env bash
# Builds the libFuzzer harnesses of fuzz/ with clang, AddressSanitizer and UBSan (build-fuzz/), seeds
# their corpora (the sample traces, the presets' configs, small safetensors, policies and JSONL files)
# and runs each harness for N seconds. Any crash, leak, sanitizer report or stall (-timeout) fails
# the run; the input that caused it is kept in build-fuzz/findings/. Prints executions per second and
# total executions per harness. The corpora grow across runs (build-fuzz/corpus/).
# Usage: scripts/fuzz.sh [--seconds N] [--only NAME] [--build-dir DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=60
only=""
build=build-fuzz
while [[ $# -gt 0 ]]; do
  case "$1" in
    --seconds) seconds="$2"; shift 2 ;;
    --only) only="$2"; shift 2 ;;
    --build-dir) build="$2"; shift 2 ;;
    *) echo "usage: scripts/fuzz.sh [--seconds N] [--only NAME] [--build-dir DIR]" >&2; exit 2 ;;
  esac
done
if ! [[ "$seconds" =~ ^[0-9]+$ ]] || [[ "$seconds" -lt 1 ]]; then
  echo "scripts/fuzz.sh: --seconds needs a whole number >= 1, got '$seconds'" >&2; exit 2
fi
command -v clang++ >/dev/null || { echo "scripts/fuzz.sh: clang++ not found (apt-get install clang)" >&2; exit 2; }

harnesses=(fuzz_trace fuzz_safetensors fuzz_config fuzz_policy fuzz_jsonl)
[[ -n "$only" ]] && harnesses=("$only")
launcher=()
command -v ccache >/dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
san="-O1 -g -fno-omit-frame-pointer -fsanitize=address,undefined,fuzzer-no-link -fno-sanitize-recover=undefined"
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Debug -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ \
  -DDSV4_CUDA=OFF -DDSV4_GUI=OFF -DDSV4_BUILD_TESTS=OFF -DDSV4_BUILD_BENCH=OFF -DDSV4_FUZZ=ON \
  -DCMAKE_CXX_FLAGS="$san" -DCMAKE_EXE_LINKER_FLAGS="-fsanitize=address,undefined" "${launcher[@]}" >/dev/null
cmake --build "$build" -j"$(nproc 2>/dev/null || echo 2)" --target fuzz_seeds "${harnesses[@]}"

seeds="$build/seeds"
rm -rf "$seeds"
"$build/fuzz/fuzz_seeds" "$seeds"
rm -rf "$build/findings"
mkdir -p "$seeds/fuzz_trace" "$build/findings"
cp traces/samples/*.h5 "$seeds/fuzz_trace/"  # besides fuzz_seeds' small trace

export ASAN_OPTIONS="detect_leaks=1:abort_on_error=0"
export LSAN_OPTIONS="suppressions=$PWD/fuzz/lsan.supp"
export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1"
export OMP_NUM_THREADS=1
status=0
summary=()
for h in "${harnesses[@]}"; do
  corpus="$build/corpus/$h"
  mkdir -p "$corpus"
  maxlen=65536
  [[ "$h" == fuzz_trace ]] && maxlen=400000
  log="$build/findings/$h.log"
  set +e
  "$build/fuzz/$h" "$corpus" "$seeds/$h" -max_total_time="$seconds" -timeout=20 -rss_limit_mb=4096 \
    -max_len="$maxlen" -print_final_stats=1 -artifact_prefix="$build/findings/$h-" >"$log" 2>&1
  rc=$?
  set -e
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
  rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log" | tail -1)
  if [[ $rc -ne 0 ]]; then
    status=1
    summary+=("$(printf '%-18s FAILED (exit %s): see %s' "$h" "$rc" "$log")")
    grep -E "^==[0-9]+==ERROR|runtime error|SUMMARY|Test unit written" "$log" | head -5 >&2 || true
  else
    summary+=("$(printf '%-18s %10s execs %8s exec/s  ok' "$h" "${execs:-?}" "${rate:-?}")")
  fi
done
echo "fuzzing, ${seconds} s per harness (ASan + UBSan):"
printf '  %s\n' "${summary[@]}"
exit $status
