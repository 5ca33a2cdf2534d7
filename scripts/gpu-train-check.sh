#!/usr/bin/env bash
# One call on the GPU machine for the training step: the whole GPU check without the sanitizer and the
# kernel benchmark (scripts/gpu-check.sh --no-sanitizer --no-bench: build, ctest -L gpu including the
# backward ops on CUDA against the CPU), then one training step run on the GPU and on the CPU (the
# written checkpoints and optimizer states must be byte-identical), the GPU step's trace replayed on
# the CPU, and bench_train's CUDA cases (step vs forward time, digest overhead). Logs under $OUT (or
# build-gpu/logs); a short table at the end. Usage: scripts/gpu-train-check.sh [--train-only]
set -uo pipefail
cd "$(dirname "$0")/.."
export PATH=/opt/torch/.venv/bin:/usr/local/cuda/bin:$PATH
logs=${OUT:-build-gpu/logs}
mkdir -p "$logs"
# --train-only: instead of the whole GPU check, build just what the training step needs and run its
# GPU tests (the backward ops and the whole step against the CPU).
if [[ "${1:-}" == "--train-only" ]]; then
  rc=0
  xxh=()
  [[ -f .carry/xxhash/xxhash.h ]] && xxh=(-DDSV4_XXHASH_INCLUDE="$PWD/.carry/xxhash")
  gen=()
  command -v ninja >/dev/null 2>&1 && gen=(-G Ninja)
  if ! { cmake -S . -B build-gpu "${gen[@]}" -DCMAKE_BUILD_TYPE=Release -DDSV4_CUDA=ON -DDSV4_GUI=OFF \
           -DDSV4_BUILD_TESTS=ON -DDSV4_BUILD_BENCH=ON -DCMAKE_CUDA_ARCHITECTURES=90 "${xxh[@]}" &&
         cmake --build build-gpu -j"${JOBS:-16}" --target dsv4 bench_train test_grad_linear_gpu \
           test_grad_attention_gpu test_grad_mhc_gpu test_grad_indexer_gpu test_gpu_train; } >"$logs/build.log" 2>&1; then
    tail -30 "$logs/build.log"
    echo "build failed"
    exit 1
  fi
  for t in test_grad_linear_gpu test_grad_attention_gpu test_grad_mhc_gpu test_grad_indexer_gpu test_gpu_train; do
    b=$(find build-gpu -name $t -type f -perm -u+x | head -1)
    if "$b" >"$logs/$t.log" 2>&1; then
      echo "$t: $(grep -E '^\[  PASSED' "$logs/$t.log")" | tee -a "$logs/gpu-check.log"
    else
      echo "$t: FAILED" | tee -a "$logs/gpu-check.log"
      grep -E "Failure|FAILED|Expected|Which is" "$logs/$t.log" | head -20
      rc=1
    fi
  done
else
  scripts/gpu-check.sh --no-sanitizer --no-bench
  rc=$?
fi
bin=build-gpu/cli/dsv4
train_status="not run"
if [[ -x $bin ]]; then
  w=$logs/train
  rm -rf "$w" && mkdir -p "$w"
  {
    printf '{"id":"a","prompt":[%s],"response":[%s],"reward":1,"group":"g"}\n' "$(seq -s, 1 40)" "$(seq -s, 50 120)"
    printf '{"id":"b","prompt":[%s],"response":[%s],"reward":0,"group":"g"}\n' "$(seq -s, 1 40)" "$(seq -s, 200 230)"
    printf '{"id":"c","prompt":[%s],"response":[%s],"reward":0.5,"group":"h"}\n' "$(seq -s, 3 90)" "$(seq -s, 300 500)"
  } >"$w/samples.jsonl"
  if "$bin" train-step --preset tiny --seed 7 --data "$w/samples.jsonl" --lr 1e-3 --indexer-kl 0.5 --device cuda \
      --out-model "$w/gpu" --record "$w/step-gpu.h5" >"$w/train.log" 2>&1 &&
    "$bin" train-step --preset tiny --seed 7 --data "$w/samples.jsonl" --lr 1e-3 --indexer-kl 0.5 --device cpu \
      --out-model "$w/cpu" >>"$w/train.log" 2>&1 &&
    cmp "$w/gpu/model.safetensors" "$w/cpu/model.safetensors" >>"$w/train.log" 2>&1 &&
    cmp "$w/gpu/optimizer.safetensors" "$w/cpu/optimizer.safetensors" >>"$w/train.log" 2>&1 &&
    "$bin" replay "$w/step-gpu.h5" --device cpu >>"$w/train.log" 2>&1; then
    train_status="GPU step = CPU step (checkpoint and optimizer state bytes), replay on CPU exit 0"
  else
    train_status="FAILED (see train/train.log)"
    rc=1
  fi
  rm -rf "$w/gpu" "$w/cpu" "$w/step-gpu.h5"
fi
tb=$(find build-gpu -name bench_train -type f -perm -u+x | head -1)
if [[ -n "$tb" ]]; then
  timeout 150 "$tb" --benchmark_filter=Cuda >"$logs/bench_train.log" 2>&1 || echo "bench_train failed or timed out" >>"$logs/bench_train.log"
fi
{
  echo "train step on GPU vs CPU, replay on CPU:  $train_status"
  grep -E "^BM_" "$logs/bench_train.log" 2>/dev/null | sed -E 's/ +/ /g'
} | tee -a "$logs/gpu-check.log"
exit $rc
