#!/usr/bin/env bash
# Regenerates traces/samples/: two small traces of the tiny preset over the same tokens, one per
# numerics profile, and the golden text dumps the tests compare against.
# Usage: scripts/make-samples.sh [path/to/dsv4]
set -euo pipefail
cd "$(dirname "$0")/.."
dsv4=${1:-build/cli/dsv4}
out=traces/samples
mkdir -p "$out"
rm -f "$out"/tiny-*.h5 "$out"/tiny-*.txt
for profile in train rollout; do
  "$dsv4" record --preset tiny --seed 7 --random 96 --token-seed 3 --profile "$profile" \
    --capture 'attn.kv@1,moe.out@3' --threads 1 --out "$out/tiny-$profile.h5"
  scripts/sample-golden.sh "$dsv4" "$out/tiny-$profile.h5" >"$out/tiny-$profile.golden.txt"
done
ls -l "$out"
