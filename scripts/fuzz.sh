#!/usr/bin/env bash
# Builds the libFuzzer harnesses of fuzz/ with clang, AddressSanitizer and UBSan (scripts/san-build.sh,
# build-fuzz/, shared with scripts/sanitize.sh), seeds their corpora (fuzz_seeds: small traces, the
# presets' configs, small safetensors, policies, JSONL, training samples and rewards files)
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
harnesses=(fuzz_trace fuzz_safetensors fuzz_config fuzz_policy fuzz_jsonl fuzz_samples fuzz_import fuzz_profile)
[[ -n "$only" ]] && harnesses=("$only")
scripts/san-build.sh --build-dir "$build" fuzz_seeds "${harnesses[@]}"

seeds="$build/seeds"
rm -rf "$seeds"
"$build/fuzz/fuzz_seeds" "$seeds"
rm -rf "$build/findings"
mkdir -p "$build/findings"

source scripts/san-env.sh
export LSAN_OPTIONS="suppressions=$PWD/fuzz/lsan.supp"
export OMP_NUM_THREADS=1
status=0
summary=()
for h in "${harnesses[@]}"; do
  corpus="$build/corpus/$h"
  mkdir -p "$corpus"
  maxlen=65536
  [[ "$h" == fuzz_trace || "$h" == fuzz_samples ]] && maxlen=400000
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
