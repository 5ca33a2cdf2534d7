#!/usr/bin/env bash
# One call on the GPU machine for the whole-model PyTorch peer: builds dsv4 and bench_gpu (Hopper
# only), writes the mid checkpoint, runs `dsv4 forward --device cuda` on T random tokens in exact and
# in fast numerics, checks bench/torch_model.py against both (log-probs rel-L2, decision agreement;
# the peer attends to the reference's decisions with --force-decisions), times the peer, times dsv4's
# exact and fast forwards with `bench_gpu --model-only`, and prints a table of tokens/s. Logs under $OUT
# (or build-gpu/logs).
#
# Usage: scripts/gpu-torch-model-check.sh [--T N] [--reps N]
#   env: BUILD_DIR (default build-gpu), JOBS, CUDA_ARCH (default 90a-real), PYTHON (default the
#   machine's PyTorch venv, /opt/torch/.venv/bin/python, else python3)
set -uo pipefail
cd "$(dirname "$0")/.."
T=4096 reps=5
while [[ $# -gt 0 ]]; do
  case "$1" in
    --T) T=$2; shift ;;
    --reps) reps=$2; shift ;;
    *)
      echo "usage: scripts/gpu-torch-model-check.sh [--T N] [--reps N]" >&2
      exit 2
      ;;
  esac
  shift
done
source scripts/gpu-env.sh
py=${PYTHON:-/opt/torch/.venv/bin/python}
[[ -x $py ]] || py=python3
[[ $T == 4096 ]] || echo "note: bench_gpu --model-only times T = 4096; the peer runs T = $T" >&2

cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DDSV4_CUDA=ON \
  -DCMAKE_CUDA_ARCHITECTURES="${CUDA_ARCH:-90a-real}" -DDSV4_GUI=OFF -DDSV4_PYTHON=OFF \
  ${xx:+-DDSV4_XXHASH_INCLUDE=$xx} >"$logs/configure.log" 2>&1 &&
  ninja -C "$build" -j "$jobs" dsv4 bench_gpu >"$logs/build.log" 2>&1
if [[ $? -ne 0 ]]; then
  status build "FAILED (see build.log)"
  tail -30 "$logs/build.log"
  cat "$logs/summary.txt"
  exit 1
fi
status build ok
dsv4=$build/cli/dsv4
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$dsv4" model init --preset mid --seed 7 --out "$work/mid" >"$logs/init.log" 2>&1 || { cat "$logs/init.log"; exit 1; }

for n in exact fast; do
  if ! "$dsv4" forward --model "$work/mid" --device cuda --numerics "$n" --random "$T" \
      --out "$work/ref-$n.json" >"$logs/forward-$n.log" 2>&1; then
    status "dsv4 forward ($n)" "FAILED (see forward-$n.log)"
    rc=1
    continue
  fi
  status "dsv4 forward ($n)" "$(tail -1 "$logs/forward-$n.log" | cut -c1-60)"
  time_args=()
  [[ $n == exact ]] && time_args=(--time "$reps")
  "$py" bench/torch_model.py --model "$work/mid" --reference "$work/ref-$n.json" --device cuda \
    --force-decisions "${time_args[@]}" --json "$logs/peer-$n.json" >"$logs/peer-$n.log" 2>&1
  prc=$?
  cat "$logs/peer-$n.log"
  status "torch peer vs dsv4 $n" "$(grep -E '^log-probs rel-L2' "$logs/peer-$n.log" || echo "exit $prc")"
  [[ $prc -le 1 ]] || rc=1
done

"$build/bench/bench_gpu" --model-only >"$logs/bench_gpu.log" 2>&1 || { tail -20 "$logs/bench_gpu.log"; rc=1; }
cat "$logs/bench_gpu.log"
exact=$(awk '/^RESULT tokens_per_s cuda-exact/ {print $NF}' "$logs/bench_gpu.log")
fast=$(awk '/^RESULT tokens_per_s cuda-fast/ {print $NF}' "$logs/bench_gpu.log")
peer=$(awk '/^RESULT torch_model/ {print $(NF-1)}' "$logs/peer-exact.log" 2>/dev/null)

echo
echo "================ whole model, preset mid, tokens/s on $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1) ================"
cat "$logs/summary.txt"
printf '%-34s %14s %12s\n' "forward" "tokens/s" "x peer"
row() { [[ -n $2 ]] && printf '%-34s %14.1f %12s\n' "$1" "$2" "$(awk -v a="$2" -v b="$3" 'BEGIN { if (b > 0) printf "%.2f", a / b; else print "-" }')"; }
row "PyTorch peer (bf16, eager), T=$T" "$peer" "$peer"
row "dsv4 exact, T=4096" "$exact" "$peer"
row "dsv4 fast, T=4096" "$fast" "$peer"
exit "$rc"
