# Sourced by the GPU machine scripts (scripts/gpu-*.sh) after their options: nvcc on PATH, the build
# folder ($BUILD_DIR, default build-gpu), the logs folder ($OUT, else $build/logs), $jobs, and the
# stand-ins for the dev packages the GPU machine lacks: $xx (xxhash.h: $DSV4_XXHASH_INCLUDE, else
# .carry/xxhash) and ISA-L's pkg-config file in .carry/isal (without it the trace chunks are deflated
# with zlib, about 7 times slower). status NAME TEXT adds a line to $logs/summary.txt (emptied here);
# rc starts at 0.
export PATH=/usr/local/cuda/bin:$PATH
build=${BUILD_DIR:-build-gpu}
logs=${OUT:-$build/logs}
mkdir -p "$logs"
jobs=${JOBS:-$(nproc 2>/dev/null || echo 4)}
xx=${DSV4_XXHASH_INCLUDE:-}
[[ -z $xx && -f .carry/xxhash/xxhash.h ]] && xx=$PWD/.carry/xxhash
if ! pkg-config --exists libisal 2>/dev/null && [[ -f .carry/isal/lib/pkgconfig/libisal.pc ]]; then
  export PKG_CONFIG_PATH=$PWD/.carry/isal/lib/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}
fi
rc=0
status() { printf '%-44s %s\n' "$1" "$2" >>"$logs/summary.txt"; }
: >"$logs/summary.txt"
