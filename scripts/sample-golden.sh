#!/usr/bin/env bash
# The golden text of a sample trace: every digest (summarised per record and as one hash over all
# rows), the indexer sets of layer 1 and the experts of layer 3. Machine-independent by design.
set -euo pipefail
dsv4=$1
trace=$2
"$dsv4" trace dump "$trace" --what digests
"$dsv4" trace dump "$trace" --what indexer --layer 1
"$dsv4" trace dump "$trace" --what experts --layer 3
