#!/usr/bin/env bash
# One command on a fresh Debian 12 machine: installs the missing packages, builds, runs every test.
# Usage: scripts/test.sh [--no-install]
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ "${1:-}" != "--no-install" ]]; then scripts/install-deps.sh; fi
scripts/build.sh
jobs=$(nproc 2>/dev/null || echo 2)
# GPU tests (label gpu) skip cleanly on machines without a GPU.
ctest --test-dir build --output-on-failure -j"$jobs"
