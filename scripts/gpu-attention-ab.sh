#!/usr/bin/env bash
# A/B of versions of the fast attention kernel (kernels/cuda/attention_tc.cu) in one call on the GPU
# machine: for each round, each version in turn is copied over the file, bench_gpu is rebuilt (only that
# file recompiles) and `bench_gpu --fast-layer-only` is run; then a table of the attention's and the
# layer's times per version and round. The tree's file is restored at the end. Tests are not run: run
# scripts/gpu-fast-check.sh on the version to be kept.
#
# Usage: scripts/gpu-attention-ab.sh LABEL=FILE [LABEL=FILE ...]
#   FILE `tree` is this tree's attention_tc.cu; any other is a path (e.g. a copy made before the call
#   with `git show REV:kernels/cuda/attention_tc.cu > .carry/attention_tc_REV.cu`).
#   env: ROUNDS (default 2), and those of scripts/gpu-env.sh (BUILD_DIR, JOBS, OUT, ...)
set -uo pipefail
cd "$(dirname "$0")/.."
[[ $# -ge 1 ]] || { echo "usage: scripts/gpu-attention-ab.sh LABEL=FILE [LABEL=FILE ...]" >&2; exit 2; }
source scripts/gpu-env.sh
target=kernels/cuda/attention_tc.cu
cp "$target" "$logs/attention_tc_tree.cu"
labels=() files=()
for a in "$@"; do
  label=${a%%=*} file=${a#*=}
  [[ $label != "$a" && -n $label ]] || { echo "gpu-attention-ab: '$a' is not LABEL=FILE" >&2; exit 2; }
  [[ $file == tree ]] && file=$logs/attention_tc_tree.cu
  [[ -f $file ]] || { echo "gpu-attention-ab: $label: no file $file" >&2; exit 2; }
  labels+=("$label") files+=("$file")
done
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DDSV4_CUDA=ON \
  -DCMAKE_CUDA_ARCHITECTURES="${CUDA_ARCH:-90a-real}" -DDSV4_GUI=OFF -DDSV4_PYTHON=OFF \
  ${xx:+-DDSV4_XXHASH_INCLUDE=$xx} >"$logs/configure.log" 2>&1 || { tail -20 "$logs/configure.log"; exit 1; }
table=$logs/ab_table.txt
printf '%-12s %-6s %18s %10s\n' version round "sparse_attention ms" "layer ms" >"$table"
for ((round = 1; round <= ${ROUNDS:-2}; ++round)); do
  for i in "${!labels[@]}"; do
    l=${labels[$i]} log=$logs/ab_${labels[$i]}_$round.log
    cp "${files[$i]}" "$target"
    if ! ninja -C "$build" -j "$jobs" bench_gpu >"$logs/ab_build_$l.log" 2>&1; then
      echo "$l: build failed"; tail -20 "$logs/ab_build_$l.log"; rc=1; continue
    fi
    timeout 200 "$build/bench/bench_gpu" --fast-layer-only >"$log" 2>&1 || { echo "$l: bench_gpu failed"; tail -5 "$log"; rc=1; }
    printf '%-12s %-6s %18s %10s\n' "$l" "$round" "$(awk '$1 == "sparse_attention" {print $2; exit}' "$log")" \
      "$(awk '$1 == "total" {print $2; exit}' "$log")" >>"$table"
  done
done
cp "$logs/attention_tc_tree.cu" "$target"
echo "================ fast attention A/B on $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1) ================"
cat "$table"
exit $rc
