#!/usr/bin/env python3
"""Stored and logical bytes per token of every dataset kind in a dsv4 trace (h5py only).

Usage: scripts/trace-sizes.py TRACE.h5
Groups the datasets of all steps and sequences by their name (indexer_gaps, experts, value, ...)
and prints bytes per token, stored (after shuffle+deflate) and logical (in memory).
"""
import collections
import sys

import h5py

def main(path):
    f = h5py.File(path, "r")
    tokens = 0
    stored = collections.Counter()
    logical = collections.Counter()
    def visit(name, obj):
        if isinstance(obj, h5py.Dataset) and name.startswith("steps/"):
            key = name.split("/")[-1]
            if "/tensors/" in name:
                key = "tensors/" + name.split("/tensors/")[1].split("/")[0]
            stored[key] += obj.id.get_storage_size()
            logical[key] += obj.size * obj.dtype.itemsize
    f.visititems(visit)
    for step in f["steps"].values():
        tokens += int(sum(step["seq_lengths"][:]))
    print(f"{path}: {tokens} tokens")
    print(f"{'dataset':<24} {'stored B/token':>15} {'logical B/token':>16}")
    for key in sorted(stored, key=lambda k: -stored[k]):
        print(f"{key:<24} {stored[key] / tokens:>15.2f} {logical[key] / tokens:>16.2f}")
    print(f"{'total':<24} {sum(stored.values()) / tokens:>15.2f} {sum(logical.values()) / tokens:>16.2f}")

if __name__ == "__main__":
    main(sys.argv[1])
