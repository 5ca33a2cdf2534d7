#!/usr/bin/env bash
# Configures and builds the one instrumented build shared by scripts/fuzz.sh and scripts/sanitize.sh:
# clang, Debug (-O1 -g), AddressSanitizer + UBSan (-fno-sanitize-recover=undefined) and libFuzzer's
# coverage instrumentation (fuzzer-no-link) on every target, GoogleTest suites and fuzz harnesses on,
# CUDA, GUI and benchmarks off. The libraries are compiled once for both.
# Usage: scripts/san-build.sh [--build-dir DIR] [TARGET...]   (no target: everything)
set -euo pipefail
cd "$(dirname "$0")/.."
build=build-fuzz
if [[ "${1:-}" == "--build-dir" ]]; then build="$2"; shift 2; fi
command -v clang++ >/dev/null || { echo "scripts/san-build.sh: clang++ not found (apt-get install clang)" >&2; exit 2; }
launcher=()
if command -v ccache >/dev/null; then
  launcher=(-DCMAKE_C_COMPILER_LAUNCHER=ccache -DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
  # Cache hits across clone folders: paths under the source root are hashed relative to it, and the
  # working directory (which -g would otherwise hash) is left out.
  export CCACHE_BASEDIR="$PWD" CCACHE_NOHASHDIR=1
fi
# gtest_discover_tests runs the test binaries at build time: same sanitizer settings as the runs. No
# Python package: an instrumented extension module does not load into an uninstrumented interpreter.
source scripts/san-env.sh
mkdir -p "$build"
san="-O1 -g -fno-omit-frame-pointer -fsanitize=address,undefined,fuzzer-no-link -fno-sanitize-recover=undefined"
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Debug -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ \
  -DDSV4_CUDA=OFF -DDSV4_GUI=OFF -DDSV4_BUILD_TESTS=ON -DDSV4_BUILD_BENCH=OFF -DDSV4_FUZZ=ON -DDSV4_PYTHON=OFF \
  -DCMAKE_CXX_FLAGS="$san" -DCMAKE_EXE_LINKER_FLAGS="-fsanitize=address,undefined" \
  -DCMAKE_SHARED_LINKER_FLAGS="-fsanitize=address,undefined" "${launcher[@]}" >"$build/configure.log" 2>&1 \
  || { cat "$build/configure.log"; exit 1; }
targets=()
for t in "$@"; do targets+=(--target "$t"); done
cmake --build "$build" -j"$(nproc 2>/dev/null || echo 2)" "${targets[@]}"
