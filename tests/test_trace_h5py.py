#!/usr/bin/env python3
"""Reads a dsv4 trace with h5py using only what traces/FORMAT.md says, and checks it.

usage: test_trace_h5py.py TRACE.h5

Exits 0 when every check passes, 1 with a list of failures otherwise. Independent of the C++ reader on
purpose: it is the evidence that the format document is enough to read a trace.
"""
import json
import re
import sys

import h5py
import numpy as np

ENV_KEYS = ["host", "os", "cpu_model", "cpu_flags", "compiler", "compile_flags", "build_id", "gpu",
            "gpu_driver", "cuda", "cupti", "nccl", "hdf5"]

failures = []


def check(cond, where, what):
    if not cond:
        failures.append(f"{where}: {what}")
    return cond


def as_str(v):
    return v.decode() if isinstance(v, bytes) else str(v)


def decode_indexer(count, gaps):
    """FORMAT.md 'Compact encoding of indexer selections'."""
    rows = np.split(gaps.astype(np.int64), np.cumsum(count.astype(np.int64))[:-1]) if len(count) else []
    return [np.cumsum(g + 1) - 1 for g in rows]


def check_seq(path, seq, T, cfg, names, n_layers):
    vocab, topk = cfg["vocab_size"], cfg["index_topk"]
    n_exp, k_e, hc = cfg["n_routed_experts"], cfg["num_experts_per_tok"], cfg.get("hc_mult", 4)
    ratios = cfg["compress_ratios"][:n_layers]

    tokens = seq["tokens"][:]
    check(tokens.dtype == np.int32 and tokens.shape == (T,), f"{path}/tokens", f"{tokens.dtype} {tokens.shape}")
    check(((tokens >= 0) & (tokens < vocab)).all(), f"{path}/tokens", "ids outside [0, vocab)")
    lp = seq["logprobs"][:]
    check(lp.dtype == np.float32 and lp.shape == (T - 1,), f"{path}/logprobs", f"{lp.dtype} {lp.shape}")
    check(np.isfinite(lp).all() and (lp <= 0).all(), f"{path}/logprobs", "not finite and <= 0")

    dec = seq["decisions"]
    check(sorted(dec.keys()) == [f"layer_{L:03d}" for L in range(n_layers)], f"{path}/decisions",
          f"layers {sorted(dec.keys())}")
    for L in range(n_layers):
        where = f"{path}/decisions/layer_{L:03d}"
        d = dec[f"layer_{L:03d}"]
        if ratios[L] == 4:
            width = int(d.attrs["indexer_width"])
            check(width == min(topk, T // 4), where, f"indexer_width {width}")
            count, gaps = d["indexer_count"][:], d["indexer_gaps"][:]
            check(count.dtype == np.uint16 and count.shape == (T,), where + "/indexer_count", str(count.shape))
            check(gaps.dtype.kind == "u", where + "/indexer_gaps", f"dtype {gaps.dtype}")
            check(int(count.sum()) == len(gaps), where, "sum(indexer_count) != len(indexer_gaps)")
            for p, ids in enumerate(decode_indexer(count, gaps)):
                visible = (p + 1) // 4
                ok = len(ids) == min(width, visible) and (np.diff(ids) > 0).all() and (ids < visible).all()
                if not check(ok, where, f"token {p}: ids {ids.tolist()} (width {width}, {visible} visible)"):
                    break
            m = d["indexer_margin"][:]
            check(m.dtype == np.float32 and m.shape == (T,), where + "/indexer_margin", str(m.shape))
        else:
            check("indexer_count" not in d, where, "indexer datasets on a non-C4 layer")
        ex, w, rm = d["experts"][:], d["expert_weights"][:], d["router_margin"][:]
        check(ex.dtype.kind == "u" and ex.shape == (T, k_e), where + "/experts", f"{ex.dtype} {ex.shape}")
        check((ex < n_exp).all(), where + "/experts", f"ids >= n_routed_experts ({n_exp})")
        check((np.diff(ex.astype(np.int64), axis=1) > 0).all(), where + "/experts", "not ascending per row")
        check(w.dtype == np.float32 and w.shape == (T, k_e), where + "/expert_weights", str(w.shape))
        check(np.isfinite(w).all(), where + "/expert_weights", "not finite")
        check(rm.dtype == np.float32 and rm.shape == (T,), where + "/router_margin", str(rm.shape))
        hashed = int(d.attrs["hashed"])
        check(hashed == int(L < cfg["num_hash_layers"]), where, f"hashed = {hashed}")
        if hashed:
            check(np.isposinf(rm).all(), where + "/router_margin", "hash layers have +inf margins")
        for sub in ("attn", "ffn"):
            for part, shape in (("pre", (T, hc)), ("post", (T, hc)), ("comb", (T, hc, hc))):
                a = d[f"mhc_{sub}_{part}"]
                check(a.dtype == np.float32 and a.shape == shape, f"{where}/mhc_{sub}_{part}", str(a.shape))

    dg = seq["digests"]
    value, tensor, layer, rows = dg["value"][:], dg["tensor"][:], dg["layer"][:], dg["rows"][:]
    check(value.dtype == np.uint64, f"{path}/digests/value", str(value.dtype))
    check(tensor.shape == layer.shape == rows.shape, f"{path}/digests", "record arrays differ in length")
    check(int(rows.sum()) == len(value), f"{path}/digests", f"sum(rows) {rows.sum()} != len(value) {len(value)}")
    check(((tensor >= 0) & (tensor < len(names))).all(), f"{path}/digests/tensor", "index outside tensor_names")
    records = {(names[t], int(l)): int(r) for t, l, r in zip(tensor, layer, rows)}
    check(len(records) == len(tensor), f"{path}/digests", "a (tensor, layer) pair appears twice")

    n_full = 0
    if "tensors" in seq:
        for name, grp in seq["tensors"].items():
            check(name in names, f"{path}/tensors/{name}", "not in /meta/tensor_names")
            for lname, ds in grp.items():
                where = f"{path}/tensors/{name}/{lname}"
                L = -1 if lname == "model" else int(re.fullmatch(r"layer_(\d{3})", lname).group(1))
                dtype = as_str(ds.attrs["dtype"])
                raw = ds[()]
                if dtype == "bfloat16":
                    check(raw.dtype == np.uint16, where, f"bfloat16 stored as {raw.dtype}")
                    vals = (raw.astype(np.uint32) << 16).view(np.float32)
                elif dtype == "float32":
                    check(raw.dtype == np.float32, where, f"float32 stored as {raw.dtype}")
                    vals = raw
                else:
                    check(dtype == "int32" and raw.dtype == np.int32, where, f"dtype {dtype} stored as {raw.dtype}")
                    vals = raw
                if name != "indexer.score":  # NaN marks its empty slots
                    check(np.isfinite(vals).all(), where, "non-finite values")
                check((name, L) in records, where, "no digest record for this tensor")
                if (name, L) in records:
                    check(raw.shape[0] == records[(name, L)], where, "rows differ from its digest record")
                n_full += 1
    return n_full


def main(path):
    f = h5py.File(path, "r", swmr=True)
    check(as_str(f.attrs["format"]) == "dsv4-trace", "/", "format")
    check(int(f.attrs["format_version"]) == 1, "/", "format_version")
    check(as_str(f.attrs["producer"]).startswith("dsv4 "), "/", "producer")
    check(re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", as_str(f.attrs["created"])) is not None, "/", "created")
    env = f["meta/env"].attrs
    for k in ENV_KEYS:
        check(k in env and isinstance(env[k], str), "/meta/env", f"attribute {k}")
    model = f["meta/model"]
    cfg = json.loads(model.attrs["config_json"])
    check(re.fullmatch(r"[0-9a-f]{16}", as_str(model.attrs["model_digest"])) is not None, "/meta/model",
          "model_digest")
    wn = [as_str(x) for x in model["tensor_names"][:]]
    check(wn == sorted(wn) and len(wn) > 0, "/meta/model/tensor_names", "not sorted / empty")
    check(model["tensor_digests"].dtype == np.uint64 and model["tensor_digests"].shape == (len(wn),),
          "/meta/model/tensor_digests", "shape/dtype")
    names = [as_str(x) for x in f["meta/tensor_names"].asstr()[:]]
    n_layers = cfg["num_hidden_layers"]

    steps = sorted(f["steps"].keys())
    check(steps == [f"{i:06d}" for i in range(len(steps))], "/steps", f"step names {steps}")
    complete, n_full = 0, 0
    for s in steps:
        g = f["steps"][s]
        where = f"/steps/{s}"
        status = g["status"][:]
        check(status.dtype == np.uint8 and status.shape == (1,), where + "/status", str(status))
        if status[0] != 1:
            continue
        complete += 1
        check(as_str(g.attrs["kind"]) in ("train", "rollout"), where, "kind")
        check(as_str(g.attrs["profile"]) in ("train", "rollout"), where, "profile")
        check(g.attrs["seed"].dtype == np.uint64, where, "seed dtype")
        check(g.attrs["threads"].dtype == np.int32, where, "threads dtype")
        check(isinstance(g.attrs["capture"], str), where, "capture")
        lengths = g["seq_lengths"][:]
        check(lengths.dtype == np.int32 and len(lengths) == int(g.attrs["n_seqs"]), where + "/seq_lengths",
              str(lengths))
        for i, T in enumerate(lengths):
            n_full += check_seq(f"{where}/seq_{i:03d}", g[f"seq_{i:03d}"], int(T), cfg, names, n_layers)
    check(complete > 0, "/steps", "no complete step")
    if failures:
        print(f"{path}: {len(failures)} problems:")
        for x in failures[:50]:
            print("  " + x)
        return 1
    print(f"{path}: OK ({complete} complete steps, {n_full} full tensors)")
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print(__doc__)
        sys.exit(2)
    sys.exit(main(sys.argv[1]))
