#!/usr/bin/env bash
# Expert parallelism on this machine's CPUs (docs/PARALLEL.md): the forward of one sequence with
# --ep 1, 2 and 4 under mpirun (oversubscribed where there are fewer cores), each result compared
# byte for byte with the single-process one, and a table of time and bytes gathered per token.
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
exit $rc
