#!/usr/bin/env bash
# Expert parallelism on this machine's CPUs (docs/PARALLEL.md): the forward of one sequence with
# --ep 1, 2 and 4 under mpirun (oversubscribed where there are fewer cores), each result compared
# byte for byte with the single-process one, and a table of time and bytes gathered per token; then a
# training step (4 samples of tokens/4 tokens each) at --ep 1, 2 and 4, its checkpoint and optimizer
# state compared byte for byte, and its time; then a batch of 8 sequences recorded with every rank
# running every sequence and with the sequences split among the ranks (--dp), each trace compared with
# the one-process recording (dsv4 diff: every digest), with its time, the bytes rank 0 received per
# token and the weights it holds (each rank loads its own experts).
# Usage: scripts/ep-check.sh [--preset tiny] [--tokens 2000] [--dsv4 build/cli/dsv4]
set -euo pipefail
preset=tiny tokens=2000 bin=build/cli/dsv4
while (($#)); do
  case "$1" in
    --preset) preset=$2; shift 2 ;;
    --tokens) tokens=$2; shift 2 ;;
    --dsv4) bin=$2; shift 2 ;;
    *) echo "usage: $0 [--preset NAME] [--tokens N] [--dsv4 PATH]" >&2; exit 2 ;;
  esac
done
command -v mpirun >/dev/null || { echo "mpirun not found: install openmpi-bin (scripts/install-deps.sh)" >&2; exit 2; }
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1 \
  OMPI_MCA_btl_vader_single_copy_mechanism=none
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
rc=0
printf '%-4s %-10s %-12s %-16s %s\n' ep seconds tokens/s bytes/token result
for n in 1 2 4; do
  log=$work/ep$n.log
  mpirun -np "$n" "$bin" forward --preset "$preset" --seed 7 --random "$tokens" --threads 1 --ep "$n" \
    --out "$work/ep$n.json" 2>"$log"
  secs=$(sed -nE 's/.* ([0-9.]+) s \(([0-9]+) tokens\/s\).*/\1/p' "$log")
  tps=$(sed -nE 's/.* \(([0-9]+) tokens\/s\).*/\1/p' "$log")
  bpt=$(sed -nE 's/.* ([0-9]+) bytes per token.*/\1/p' "$log")
  if cmp -s "$work/ep1.json" "$work/ep$n.json"; then res="byte-identical to --ep 1"; else res="DIFFERS"; rc=1; fi
  printf '%-4s %-10s %-12s %-16s %s\n' "$n" "$secs" "$tps" "${bpt:-0}" "$res"
done

"$bin" model init --preset "$preset" --seed 7 --out "$work/m0" >/dev/null
len=$((tokens / 4))
for s in 0 1 2 3; do
  prompt=$(seq -s, $((s * 7 + 1)) $((s * 7 + 8)))
  response=$(seq -s, $((s * 3 + 20)) $((s * 3 + 19 + len - 8)))
  printf '{"id": "s%d", "prompt": [%s], "response": [%s], "reward": %d, "group": "g"}\n' "$s" "$prompt" "$response" \
    $((s % 2))
done >"$work/samples.jsonl"
printf '\n%-4s %-10s %s\n' ep "train-step s" result
for n in 1 2 4; do
  t0=$EPOCHREALTIME
  mpirun -np "$n" "$bin" train-step --model "$work/m0" --data "$work/samples.jsonl" --lr 1e-3 --threads 1 --quiet \
    --ep "$n" --out-model "$work/t$n" 2>"$work/t$n.log"
  secs=$(awk -v a="$t0" -v b="$EPOCHREALTIME" 'BEGIN { print b - a }')
  if cmp -s "$work/t1/model.safetensors" "$work/t$n/model.safetensors" &&
    cmp -s "$work/t1/optimizer.safetensors" "$work/t$n/optimizer.safetensors"; then
    res="checkpoint and optimizer state byte-identical to --ep 1"
  else
    res="DIFFERS"
    rc=1
  fi
  printf '%-4s %-10.2f %s\n' "$n" "$secs" "$res"
done

for s in 0 1 2 3 4 5 6 7; do
  echo "[$(seq -s, $((s * 5 + 1)) $((s * 5 + tokens / 8)) | awk -F, -v OFS=, '{ for (i = 1; i <= NF; i++) $i = $i % 500 } 1')]"
done >"$work/batch.jsonl"
"$bin" record --preset "$preset" --seed 7 --batch "$work/batch.jsonl" --threads 1 --out "$work/r1.h5" 2>"$work/r1.log"
printf '\n%-4s %-22s %-10s %-12s %-12s %s\n' ep layout "record s" bytes/token "weights MB" result
printf '%-4s %-22s %-10s %-12s %-12s %s\n' 1 "one process" \
  "$(sed -nE 's/^record: step .* in ([0-9.]+) s;.*/\1/p' "$work/r1.log")" 0 \
  "$("$bin" forward --preset "$preset" --seed 7 --random 2 --out /dev/null 2>&1 | sed -nE 's/.*, ([0-9.]+) MB of weights.*/\1/p')" -
for n in 2 4; do
  for dp in "" --dp; do
    out=$work/r$n${dp:+dp}.h5
    mpirun -np "$n" "$bin" record --preset "$preset" --seed 7 --batch "$work/batch.jsonl" --threads 1 --ep "$n" $dp \
      --out "$out" 2>"$out.log"
    secs=$(sed -nE 's/^record: step .* in ([0-9.]+) s;.*/\1/p' "$out.log")
    bpt=$(sed -nE 's/.*\(([0-9]+) bytes per token\).*/\1/p' "$out.log")
    mb=$(sed -nE 's/.*holds ([0-9.]+) MB of weights.*/\1/p' "$out.log")
    if "$bin" diff "$work/r1.h5" "$out" | grep -q "first divergence: none (every digest agrees)"; then
      res="every digest equal to one process"
    else
      res="DIFFERS"
      rc=1
    fi
    layout="every rank every seq"
    [[ -n $dp ]] && layout="sequences split (--dp)"
    printf '%-4s %-22s %-10s %-12s %-12s %s\n' "$n" "$layout" "$secs" "$bpt" "$mb" "$res"
  done
done
exit $rc
