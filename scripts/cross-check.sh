#!/usr/bin/env bash
# Replay across CPU instruction sets: traces recorded by one build replay bit-for-bit on another.
#
# Three builds of the CLI:
#   x86-64-v3  the default build (AVX2 + FMA instructions), build/ (built here if missing)
#   x86-64     the baseline (DSV4_X86_64_V3=OFF: no AVX2, no FMA instructions), build-x86-64/
#   aarch64    Debian's cross toolchain (cmake/aarch64-linux-gnu.cmake), build-aarch64/, run under
#              qemu-user-static (binfmt_misc, registered here when missing)
# Each of x86-64 and aarch64 is checked against x86-64-v3 both ways: each build records tiny and
# tiny-b in both profiles and a batch, the other replays every trace and must exit 0 with
# "bit-identical", and the report must name the build that recorded and the one that replayed.
# The aarch64 build also runs its CPU test suites under emulation (the list and why it is a subset:
# DSV4_CROSS_SUITES in tests/CMakeLists.txt). The end is a table, the time of each part and the
# speed of the x86-64 baseline against x86-64-v3 (record of 4096 tokens, fastest of 5).
#
# Usage: scripts/cross-check.sh [--only x86-64|aarch64] [--no-install] [--no-tests] [--jobs N] [--v3 PATH]
#   --only B      check one build against x86-64-v3 (default: both)
#   --no-install  do not install packages (scripts/install-deps.sh --arm64 otherwise; root or sudo)
#   --no-tests    skip the aarch64 test suites (the cross replays still run)
#   --jobs N      parallel compile and test jobs (default: the number of cores)
#   --v3 PATH     the default build's dsv4 (default: build/cli/dsv4)
# Exit 0 when every replay is bit-identical and every test passes.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
v3=build/cli/dsv4
jobs=$(nproc)
only="" install=1 tests=1
while (($#)); do
  case "$1" in
    --only) only="$2"; shift 2 ;;
    --no-install) install=0; shift ;;
    --no-tests) tests=0; shift ;;
    --jobs) jobs="$2"; shift 2 ;;
    --v3) v3="$2"; shift 2 ;;
    -h|--help) sed -n '2,22p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "cross-check.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
case "$only" in
  "") others=(x86-64 aarch64) ;;
  x86-64|aarch64) others=("$only") ;;
  *) echo "cross-check.sh: --only takes x86-64 or aarch64, not '$only'" >&2; exit 2 ;;
esac
if [[ "$(uname -m)" != x86_64 ]]; then
  echo "cross-check.sh: the builds are checked against x86-64-v3, which needs an x86-64 machine (this is $(uname -m))" >&2
  exit 2
fi
launcher=()
command -v ccache >/dev/null && launcher=(-DCMAKE_C_COMPILER_LAUNCHER=ccache -DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
common=(-DCMAKE_BUILD_TYPE=Release -DDSV4_CUDA=OFF -DDSV4_GUI=OFF -DDSV4_PYTHON=OFF -DDSV4_ADAPTERS=OFF
        -DDSV4_BUILD_BENCH=OFF "${launcher[@]}")
timings=()
timed() {  # timed LABEL COMMAND...: runs it, notes its time
  local label="$1" t=$SECONDS
  shift
  "$@"
  timings+=("$(printf '%-34s %5d s' "$label" $((SECONDS - t)))")
}
configure() {  # configure DIR ARGS...: quiet unless it fails
  local dir="$1"
  shift
  mkdir -p "$dir"
  cmake -S . -B "$dir" "$@" >"$dir/configure.log" 2>&1 || { cat "$dir/configure.log" >&2; return 1; }
}

if [[ ! -x "$v3" ]]; then
  echo "== building the default (x86-64-v3) CLI in build/"
  configure build -DCMAKE_BUILD_TYPE=Release
  timed "build x86-64-v3 CLI" cmake --build build -j "$jobs" --target dsv4
fi
declare -A bin=([x86-64-v3]="$v3")

# ---- x86-64 baseline ----------------------------------------------------------------------------
if [[ " ${others[*]} " == *" x86-64 "* ]]; then
  echo "== building the baseline (x86-64, DSV4_X86_64_V3=OFF) CLI in build-x86-64/"
  configure build-x86-64 "${common[@]}" -DDSV4_X86_64_V3=OFF -DDSV4_BUILD_TESTS=OFF
  timed "build x86-64 CLI" cmake --build build-x86-64 -j "$jobs" --target dsv4
  bin[x86-64]=build-x86-64/cli/dsv4
fi

# ---- aarch64 under qemu ---------------------------------------------------------------------------
# binfmt_misc lets the tests start the aarch64 dsv4 by its path, as they do on the host.
register_binfmt() {
  local conf=/usr/lib/binfmt.d/qemu-aarch64.conf
  [[ -e /proc/sys/fs/binfmt_misc/qemu-aarch64 ]] && return 0
  [[ -e /proc/sys/fs/binfmt_misc/register ]] ||
    mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc 2>/dev/null ||
    { echo "cross-check.sh: cannot mount binfmt_misc (needs root): aarch64 programs cannot start" >&2; return 1; }
  [[ -r "$conf" ]] || { echo "cross-check.sh: $conf missing: install qemu-user-static" >&2; return 1; }
  cat "$conf" >/proc/sys/fs/binfmt_misc/register 2>/dev/null ||
    { echo "cross-check.sh: cannot register qemu-aarch64 with binfmt_misc (needs root)" >&2; return 1; }
}
# libhdf5-dev:arm64 cannot be installed beside the amd64 one: its files (headers with the arm64
# H5pubconf.h) are unpacked into build-aarch64/sysroot, matching the installed libhdf5-103-1:arm64.
prepare_sysroot() {
  local sysroot=build-aarch64/sysroot debs=build-aarch64/debs want have=""
  want=$(dpkg-query -W -f='${Version}' libhdf5-103-1:arm64 2>/dev/null) ||
    { echo "cross-check.sh: libhdf5-103-1:arm64 is not installed (scripts/install-deps.sh --arm64)" >&2; return 1; }
  [[ -f $sysroot/version ]] && have=$(<"$sysroot/version")
  [[ "$have" == "$want" && -f $sysroot/usr/include/hdf5/serial/hdf5.h ]] && return 0
  mkdir -p "$debs"
  local deb
  deb=$(ls "$debs"/libhdf5-dev_"${want//:/%3a}"_arm64.deb 2>/dev/null | head -1) || true
  if [[ -z "$deb" ]]; then
    (cd "$debs" && apt-get download "libhdf5-dev:arm64=$want" 2>&1 | grep -v "^W: Download is performed unsandboxed") ||
      { echo "cross-check.sh: apt-get download libhdf5-dev:arm64=$want failed" >&2; return 1; }
    deb=$(ls "$debs"/libhdf5-dev_*_arm64.deb | head -1)
  fi
  rm -rf "$sysroot" && mkdir -p "$sysroot"
  dpkg-deb -x "$deb" "$sysroot.tmp" && mkdir -p "$sysroot/usr/include" &&
    mv "$sysroot.tmp/usr/include/hdf5" "$sysroot/usr/include/" && rm -rf "$sysroot.tmp"
  echo "$want" >"$sysroot/version"
}
a64_tests="not run"
if [[ " ${others[*]} " == *" aarch64 "* ]]; then
  if ((install)); then timed "install arm64 packages" scripts/install-deps.sh --no-gui --arm64; fi
  register_binfmt
  prepare_sysroot
  echo "== building the aarch64 CLI$( ((tests)) && echo " and CPU test suites") in build-aarch64/"
  configure build-aarch64 --toolchain cmake/aarch64-linux-gnu.cmake -DDSV4_ARM64_SYSROOT="$root/build-aarch64/sysroot" \
    "${common[@]}" -DDSV4_BUILD_TESTS=$( ((tests)) && echo ON || echo OFF)
  if ((tests)); then
    timed "build aarch64 CLI + tests" cmake --build build-aarch64 -j "$jobs"
  else
    timed "build aarch64 CLI" cmake --build build-aarch64 -j "$jobs" --target dsv4
  fi
  bin[aarch64]=build-aarch64/cli/dsv4
  if ((tests)); then
    echo "== aarch64 test suites under qemu (ctest in build-aarch64)"
    t=$SECONDS
    if ctest --test-dir build-aarch64 -j "$jobs" --timeout 900 --output-on-failure >build-aarch64/ctest.log 2>&1; then
      a64_tests="passed"
    else
      a64_tests="FAILED"
      grep -E "\*\*\*Failed|Timeout|Not Run" build-aarch64/ctest.log | head -20 >&2
    fi
    a64_tests="$(grep -E "tests passed" build-aarch64/ctest.log | tail -1) ($a64_tests)"
    timings+=("$(printf '%-34s %5d s' "aarch64 tests under qemu" $((SECONDS - t)))")
    echo "   $a64_tests"
  fi
fi

# ---- no libm in the numerics --------------------------------------------------------------------------
# libm's transcendental functions differ between ISAs and glibc versions; the libraries that compute
# what a trace records (kernels, model, rollout, train, capture) and what replay and diff report
# (replay) must call none of them (sqrt and fma are IEEE-exact and allowed). Each build's static libraries are checked with nm.
libm_re='^(__)?(exp|exp2|expm1|exp10|log|log2|log10|log1p|sin|cos|tan|sincos|sinh|cosh|tanh|asin|acos|atan|atan2|asinh|acosh|atanh|pow|erf|erfc|cbrt|hypot|lgamma|tgamma)(f|l|f32|f64)?(_finite)?(@.*)?$'
libm_audit=()
for b in x86-64-v3 "${others[@]}"; do
  dir=$(dirname "$(dirname "${bin[$b]}")")
  nm_tool=nm
  [[ $b == aarch64 ]] && nm_tool=aarch64-linux-gnu-nm
  calls=""
  for lib in kernels model rollout train capture replay; do
    a="$dir/$lib/libdsv4_$lib.a"
    [[ -f "$a" ]] || { calls+=" (no $a)"; continue; }
    calls+=$("$nm_tool" -u -A "$a" 2>/dev/null | awk '{print $1 " " $NF}' | while read -r where sym; do
      if [[ "$sym" =~ $libm_re ]]; then printf ' %s:%s' "${where##*/}" "$sym"; fi; done)
  done
  if [[ -n "$calls" ]]; then
    failed_libm=1
    libm_audit+=("$(printf '%-10s FAILED:%s' "$b" "$calls")")
  else
    libm_audit+=("$(printf '%-10s no libm transcendental call in kernels, model, rollout, train, capture, replay' "$b")")
  fi
done

# ---- cross replays ----------------------------------------------------------------------------------
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
printf '[1, 2, 3, 4, 5, 6, 7]\n{"tokens": [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 11, 12]}\n[42]\n' >"$work/batch.jsonl"
cases=("tiny train --random 130" "tiny rollout --random 130" "tiny-b train --random 77"
       "tiny-b rollout --random 77" "tiny train --batch $work/batch.jsonl")
failed=${failed_libm:-0}
[[ "$a64_tests" == *FAILED* ]] && failed=1
rows=()
t=$SECONDS
for other in "${others[@]}"; do
  for pair in "x86-64-v3 $other" "$other x86-64-v3"; do
    read -r rec rep <<<"$pair"
    for c in "${cases[@]}"; do
      read -r preset profile input <<<"$c"
      name="$rec-$preset-$profile-$(basename "${input##* }")"
      trace="$work/$name.h5"
      [[ -f "$trace" ]] || "${bin[$rec]}" record --preset "$preset" --profile "$profile" $input --out "$trace" \
        >"$work/$name.log" 2>&1 || { failed=1; echo "FAILED: $rec could not record $c:" >&2; cat "$work/$name.log" >&2; }
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
timings+=("$(printf '%-34s %5d s' "cross records and replays" $((SECONDS - t)))")

# ---- speed of the baseline against x86-64-v3: the fastest of 5 runs each, taken in turns ---------
speed=""
if [[ -n "${bin[x86-64]:-}" ]]; then
  best_v3=999 best_base=999
  for _ in 1 2 3 4 5; do
    for which in x86-64-v3 x86-64; do
      rm -f "$work/timed.h5"
      t0=$(date +%s.%N)
      "${bin[$which]}" record --preset tiny --random 4096 --out "$work/timed.h5" >/dev/null 2>&1 ||
        { echo "cross-check.sh: the timed record with ${bin[$which]} failed" >&2; exit 1; }
      dt=$(echo "$(date +%s.%N) - $t0" | bc -l)
      if [[ $which == x86-64-v3 ]]; then best_v3=$(echo "if ($dt < $best_v3) $dt else $best_v3" | bc -l)
      else best_base=$(echo "if ($dt < $best_base) $dt else $best_base" | bc -l); fi
    done
  done
  speed=$(printf 'record of 4096 tokens (tiny), fastest of 5: x86-64-v3 %.2f s, x86-64 %.2f s (baseline / v3 = %.2f)' \
    "$best_v3" "$best_base" "$(echo "$best_base / $best_v3" | bc -l)")
fi

echo
printf '%-10s %-10s %-7s %-8s %-14s %s\n' recorded replayed preset profile input result
printf '%s\n' "${rows[@]}"
echo
printf 'libm audit: %s\n' "${libm_audit[@]}"
[[ " ${others[*]} " == *" aarch64 "* ]] && echo "aarch64 test suites under qemu: $a64_tests"
[[ -n "$speed" ]] && echo "$speed"
printf '%s\n' "${timings[@]}"
if ((failed)); then echo "cross-check: FAILED" >&2; else echo "cross-check: every replay bit-identical"; fi
exit $failed
