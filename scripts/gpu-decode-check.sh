#!/usr/bin/env bash
# One call on the GPU machine for the decoding path: the whole GPU check without the sanitizer and the
# kernel benchmark (scripts/gpu-check.sh --no-sanitizer --no-bench: build, ctest -L gpu including the
# engine on CUDA against the CPU, record on GPU -> replay on CPU), then a generation recorded on the GPU
# and replayed on the CPU, then bench_decode's CUDA cases. Logs under $OUT (or build-gpu/logs).
set -uo pipefail
cd "$(dirname "$0")/.."
export PATH=/opt/torch/.venv/bin:/usr/local/cuda/bin:$PATH
logs=${OUT:-build-gpu/logs}
mkdir -p "$logs"
scripts/gpu-check.sh --no-sanitizer --no-bench
rc=$?
bin=build-gpu/cli/dsv4
gen_status="not run"
if [[ -x $bin ]]; then
  printf '{"id":"a","prompt":[%s]}\n{"id":"b","prompt":[%s],"temperature":0}\n{"id":"c","prompt":[%s],"top_p":0.9}\n' \
    "$(seq -s, 1 40)" "$(seq -s, 3 90)" "$(seq -s, 1 40)" >"$logs/prompts.jsonl"
  t=$logs/gen-gpu.h5
  rm -f "$t" "$t.incomplete"
  if "$bin" generate --preset tiny --seed 7 --prompts "$logs/prompts.jsonl" --max-new-tokens 48 --device cuda \
      --prefill-chunk 16 --page-size 16 --record "$t" --out "$logs/samples-gpu.jsonl" >"$logs/gen.log" 2>&1 &&
    "$bin" generate --preset tiny --seed 7 --prompts "$logs/prompts.jsonl" --max-new-tokens 48 --device cpu \
      --out "$logs/samples-cpu.jsonl" >>"$logs/gen.log" 2>&1 &&
    cmp "$logs/samples-gpu.jsonl" "$logs/samples-cpu.jsonl" >>"$logs/gen.log" 2>&1 &&
    "$bin" replay "$t" --device cpu >>"$logs/gen.log" 2>&1; then
    gen_status="samples equal, replay on CPU exit 0"
  else
    gen_status="FAILED (see gen.log)"
    rc=1
  fi
  rm -f "$t"
fi
dec=$(find build-gpu -name bench_decode -type f -perm -u+x | head -1)
if [[ -n "$dec" ]]; then
  timeout 300 "$dec" --benchmark_filter=Cuda >"$logs/bench_decode.log" 2>&1 || echo "bench_decode failed or timed out" >>"$logs/bench_decode.log"
fi
{
  echo "generate on GPU -> replay on CPU:  $gen_status"
  grep -E "^BM_Decode" "$logs/bench_decode.log" 2>/dev/null | sed -E 's/ +/ /g'
} | tee -a "$logs/gpu-check.log"
exit $rc
