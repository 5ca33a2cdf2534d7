#!/usr/bin/env bash
# Replay across CPU builds: traces recorded by one build replay bit-for-bit on another.
#
# Today it checks the x86-64 baseline (DSV4_X86_64_V3=OFF: no AVX2, no FMA instructions) against the
# default x86-64-v3 build, both ways: each build records tiny and tiny-b in both profiles and a batch,
# the other replays every trace and must exit 0 with "bit-identical"; the traces' `isa` must name
# the build that wrote them. It prints a table and the ratio of the two builds' record times.
# (aarch64 under qemu and the GPU architectures are not covered yet: docs/NUMERICS.md says so.)
#
# Usage: scripts/cross-check.sh [--v3 path/to/dsv4] [--jobs N]
#   --v3 PATH   the default build's dsv4 (default: build/cli/dsv4, built here if missing)
#   --jobs N    parallel compile jobs (default: the number of cores)
# The baseline build goes to build-x86-64/ (CLI only). Exit 0 when every replay is bit-identical.
set -euo pipefail
cd "$(dirname "$0")/.."
v3=build/cli/dsv4
jobs=$(nproc)
while (($#)); do
  case "$1" in
    --v3) v3="$2"; shift 2 ;;
    --jobs) jobs="$2"; shift 2 ;;
    -h|--help) sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "cross-check.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
if [[ "$(uname -m)" != x86_64 ]]; then
  echo "cross-check.sh: the x86-64 baseline check needs an x86-64 machine (this is $(uname -m))" >&2; exit 2
fi
if [[ ! -x "$v3" ]]; then
  echo "== building the default (x86-64-v3) CLI in build/"
  cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null
  cmake --build build -j "$jobs" --target dsv4
fi
echo "== building the baseline (x86-64, DSV4_X86_64_V3=OFF) CLI in build-x86-64/"
cmake -S . -B build-x86-64 -DCMAKE_BUILD_TYPE=Release -DDSV4_X86_64_V3=OFF -DDSV4_CUDA=OFF -DDSV4_GUI=OFF \
  -DDSV4_BUILD_TESTS=OFF -DDSV4_BUILD_BENCH=OFF -DDSV4_PYTHON=OFF -DDSV4_ADAPTERS=OFF >/dev/null
cmake --build build-x86-64 -j "$jobs" --target dsv4
base=build-x86-64/cli/dsv4

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
printf '[1, 2, 3, 4, 5, 6, 7]\n{"tokens": [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 11, 12]}\n[42]\n' >"$work/batch.jsonl"

declare -A bin=([x86-64-v3]="$v3" [x86-64]="$base")
failed=0
rows=()
for rec in x86-64-v3 x86-64; do
  for rep in x86-64-v3 x86-64; do
    [[ "$rec" == "$rep" ]] && continue
    for c in "tiny train --random 130" "tiny rollout --random 130" "tiny-b train --random 77" \
             "tiny-b rollout --random 77" "tiny train --batch $work/batch.jsonl"; do
      read -r preset profile input <<<"$c"
      name="$rec-$preset-$profile-$(basename "${input##* }")"
      trace="$work/$name.h5"
      "${bin[$rec]}" record --preset "$preset" --profile "$profile" $input --out "$trace" >/dev/null 2>&1
      out=$("${bin[$rep]}" replay "$trace" 2>&1) && code=0 || code=$?
      verdict=$(tail -n1 <<<"$out")
      # The last line names both builds: "recorded on x86-64 build on x86_64, ..., replayed on x86-64-v3 ...".
      if ((code != 0)) || [[ "$verdict" != *": bit-identical" ]] || [[ "$verdict" != "recorded on $rec build"* ]] ||
         [[ "$verdict" != *"replayed on $rep build"* ]]; then
        failed=1
        echo "FAILED: recorded by $rec, replayed by $rep ($preset $profile $input): exit $code" >&2
        echo "$out" >&2
      fi
      rows+=("$(printf '%-10s %-10s %-7s %-8s %-14s %s' "$rec" "$rep" "$preset" "$profile" \
        "$(basename "${input##* }")" "$( ((code == 0)) && echo bit-identical || echo "exit $code")")")
    done
  done
done

# Speed of the two builds on the same work: the fastest of 5 runs each, taken in turns.
best_v3=999 best_base=999
for _ in 1 2 3 4 5; do
  for which in v3 base; do
    b=$v3; [[ $which == base ]] && b=$base
    rm -f "$work/timed.h5"
    t0=$(date +%s.%N)
    "$b" record --preset tiny --random 4096 --out "$work/timed.h5" >/dev/null 2>&1 ||
      { echo "cross-check.sh: the timed record with $b failed" >&2; exit 1; }
    t=$(echo "$(date +%s.%N) - $t0" | bc -l)
    if [[ $which == v3 ]]; then best_v3=$(echo "if ($t < $best_v3) $t else $best_v3" | bc -l)
    else best_base=$(echo "if ($t < $best_base) $t else $best_base" | bc -l); fi
  done
done

echo
printf '%-10s %-10s %-7s %-8s %-14s %s\n' recorded replayed preset profile input result
printf '%s\n' "${rows[@]}"
printf '\nrecord of 4096 tokens (tiny), fastest of 5: x86-64-v3 %.2f s, x86-64 %.2f s (baseline / v3 = %.2f)\n' \
  "$best_v3" "$best_base" "$(echo "$best_base / $best_v3" | bc -l)"
exit $failed
