#!/usr/bin/env bash
# One command on a fresh Debian 12 machine: installs the missing packages, builds, runs the demo:
# a tiny seeded checkpoint, the forward pass in the train and rollout profiles, their per-token
# log-probs side by side and how many indexer/routing decisions differ.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ "${1:-}" != "--no-install" ]]; then scripts/install-deps.sh; fi
scripts/build.sh
out=$(mktemp -d)
./build/cli/dsv4 demo --preset tiny --seed 7 --length 64 --dir "$out/tiny"
