#!/usr/bin/env bash
# The CPU test suite (GoogleTest/ctest) built with AddressSanitizer + UBSan (scripts/san-build.sh:
# clang, the build shared with scripts/fuzz.sh, build-fuzz/). Every process writes its sanitizer
# reports to build-fuzz/sanitizer-logs/ (log_path), the test binaries and the dsv4 processes they
# start (mpirun ranks included), so a report fails the run even where a test only checks an exit
# code. Library-internal leaks are suppressed in tests/lsan.supp.
# Usage: scripts/sanitize.sh [--subset] [--build-dir DIR] [--no-build]
#   --subset   only the suites labelled `sanitize` in tests/CMakeLists.txt (see there)
set -euo pipefail
cd "$(dirname "$0")/.."
build=build-fuzz
subset=0
do_build=1
while [[ $# -gt 0 ]]; do
  case "$1" in
    --subset) subset=1; shift ;;
    --build-dir) build="$2"; shift 2 ;;
    --no-build) do_build=0; shift ;;
    *) echo "usage: scripts/sanitize.sh [--subset] [--build-dir DIR] [--no-build]" >&2; exit 2 ;;
  esac
done
t0=$SECONDS
if ((do_build)); then
  if ((subset)); then scripts/san-build.sh --build-dir "$build" sanitize_suites; else scripts/san-build.sh --build-dir "$build"; fi
fi
t1=$SECONDS
source scripts/san-env.sh
logs="$PWD/$build/sanitizer-logs"
rm -rf "$logs"
mkdir -p "$logs"
export ASAN_OPTIONS="$ASAN_OPTIONS:log_path=$logs/asan:log_exe_name=1"
export UBSAN_OPTIONS="$UBSAN_OPTIONS:log_path=$logs/ubsan:log_exe_name=1"
select=()
((subset)) && select=(-L sanitize)
jobs=$(nproc 2>/dev/null || echo 2)
# The tests that start dsv4 under mpirun run on their own: Open MPI's leaks at exit (tests/lsan.supp)
# are recognisable only with full unwinding of every allocation's stack, which is slow.
mpi_tests='^ExpertParallelCli\.'
set +e
ctest --test-dir "$build" --output-on-failure -j"$jobs" "${select[@]}" -E "$mpi_tests"
rc=$?
ASAN_OPTIONS="$ASAN_OPTIONS:fast_unwind_on_malloc=0" \
  ctest --test-dir "$build" --output-on-failure -j"$jobs" "${select[@]}" -R "$mpi_tests" || rc=1
set -e
t2=$SECONDS
# A file holds a report when it names an error (LeakSanitizer may also list the suppressions it used).
reports=$(grep -lE 'ERROR: [A-Za-z]+Sanitizer|runtime error' -r "$logs" | sort || true)
if [[ -n "$reports" ]]; then
  echo "sanitize: sanitizer reports:" >&2
  for f in $reports; do echo "---- $f" >&2; cat "$f" >&2; done
  rc=1
fi
echo "sanitize: build $((t1 - t0)) s, tests $((t2 - t1)) s, $( ((subset)) && echo 'subset (label sanitize)' || echo 'whole CPU suite'): $( ((rc == 0)) && echo ok || echo FAILED)"
exit $rc
