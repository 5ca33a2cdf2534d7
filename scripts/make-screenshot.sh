#!/usr/bin/env bash
# Regenerates docs/viewer.png: dsv4-view on the sample pair (traces/samples, scripts/make-samples.sh),
# routing agreement, the cell of layer 3 / token 73 (an indexer and a routing flip) selected.
# Renders offscreen when there is no display. Usage: scripts/make-screenshot.sh [path/to/dsv4-view]
set -euo pipefail
cd "$(dirname "$0")/.."
view=${1:-build/gui/dsv4-view}
samples=traces/samples
for f in "$samples/tiny-train.h5" "$samples/tiny-rollout.h5"; do
  [[ -f "$f" ]] || { echo "missing $f: run scripts/make-samples.sh first" >&2; exit 1; }
done
mkdir -p docs
"$view" --screenshot docs/viewer.png --size 1600x1000 --metric routing-agreement --select 3,73 \
  "$samples/tiny-train.h5" "$samples/tiny-rollout.h5"
echo "wrote docs/viewer.png"
