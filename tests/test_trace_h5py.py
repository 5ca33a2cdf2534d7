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


def check_external_seq(path, seq, T, cfg, n_layers):
    """FORMAT.md 'External steps': tokens, optional log-probs, the reported layers' decisions at T or
    T - 1 rows (sets at the runtime's width, no margins, weights optional), no digests."""
    vocab, topk = cfg["vocab_size"], cfg["index_topk"]
    n_exp, k_e = cfg["n_routed_experts"], cfg["num_experts_per_tok"]
    ratios = cfg["compress_ratios"][:n_layers]
    check(isinstance(seq.attrs["request_id"], str), path, "request_id")
    P = int(seq.attrs["prompt_length"])
    check(-1 <= P <= T, path, f"prompt_length {P}")
    tokens = seq["tokens"][:]
    check(tokens.dtype == np.int32 and tokens.shape == (T,), f"{path}/tokens", f"{tokens.dtype} {tokens.shape}")
    check(((tokens >= 0) & (tokens < vocab)).all(), f"{path}/tokens", "ids outside [0, vocab)")
    if "logprobs" in seq:
        lp = seq["logprobs"][:]
        check(lp.shape == (T - 1,) and np.isfinite(lp).all(), f"{path}/logprobs", f"{lp.shape}")
    check("digests" not in seq, path, "an external step holds no digests")
    rows_seen = set()
    for name, d in seq.get("decisions", {}).items():
        where = f"{path}/decisions/{name}"
        L = int(name[len("layer_"):])
        check(0 <= L < n_layers, where, "layer out of range")
        check(int(d.attrs["hashed"]) == (1 if L < cfg.get("num_hash_layers", 0) else 0), where, "hashed")
        check(not any(k.startswith("mhc_") or k.endswith("_margin") for k in d.keys()), where, "margins or mHC")
        if "experts" in d:
            ex = d["experts"][:].astype(np.int64)
            R = ex.shape[0]
            rows_seen.add(R)
            check(R in (T, T - 1) and ex.shape[1:] == (k_e,), where + "/experts", str(ex.shape))
            check(((ex >= 0) & (ex < n_exp)).all(), where + "/experts", "ids out of range")
            check((np.diff(ex, axis=1) > 0).all() if k_e > 1 else True, where + "/experts", "not ascending")
            if "expert_weights" in d:
                check(d["expert_weights"].shape == ex.shape, where + "/expert_weights", "shape")
        if "indexer_count" in d:
            check(ratios[L] == 4, where, "indexer on a layer that is not C4")
            width = int(d.attrs["indexer_width"])
            check(width == min(topk, T // 4), where, f"indexer_width {width}")
            count = d["indexer_count"][:]
            R = count.shape[0]
            rows_seen.add(R)
            check(R in (T, T - 1), where + "/indexer_count", f"{R} rows")
            for t, ids in enumerate(decode_indexer(count, d["indexer_gaps"][:])):
                check(len(ids) <= width and (ids < (t + 1) // 4).all(), where, f"row {t}: {ids}")
    check(len(rows_seen) <= 1, path, f"decision rows differ between layers: {rows_seen}")
    n_full = 0
    for name, g in seq.get("tensors", {}).items():
        for ln, ds in g.items():
            dt = as_str(ds.attrs["dtype"])
            check(dt in ("bfloat16", "float32", "int32"), f"{path}/tensors/{name}/{ln}", dt)
            check(ds.shape[0] == T, f"{path}/tensors/{name}/{ln}", f"shape {ds.shape}")
            n_full += 1
    return n_full


def ragged(g, name, n, where):
    """FORMAT.md 'Training steps', ragged lists: X concatenated, X_count per entry."""
    data, count = g[name][:], g[name + "_count"][:]
    check(count.dtype == np.int64 and count.shape == (n,), f"{where}/{name}_count", f"{count.dtype} {count.shape}")
    check((count >= 0).all() and int(count.sum()) == len(data), f"{where}/{name}",
          f"{len(data)} values, counts {count.tolist()[:8]}")
    return np.split(data, np.cumsum(count)[:-1]) if n else []


def check_training(where, t, lengths, weight_names):
    """FORMAT.md 'Training steps (version 3)'."""
    a = t.attrs
    check(isinstance(a["settings_json"], str), where, "settings_json")
    json.loads(a["settings_json"])
    check(a["optimizer_step_before"].dtype == np.int64, where, "optimizer_step_before dtype")
    check(isinstance(a["optimizer_state_path"], str), where, "optimizer_state_path")
    check(a["optimizer_state_digest"].dtype == np.uint64, where, "optimizer_state_digest dtype")
    names = list(t["metric_names"].asstr()[:])
    values = t["metric_values"][:]
    check(names == sorted(set(names)), where + "/metric_names", f"{names}: not sorted and unique")
    check(values.dtype == np.float64 and values.shape == (len(names),), where + "/metric_values", str(values))

    S = len(lengths)
    s, sw = t["samples"], where + "/samples"
    check(len(s["id"]) == S and len(s["group"]) == S, sw, "id/group: not one per sequence")
    P = s["prompt_length"][:]
    check(P.dtype == np.int64 and P.shape == (S,), sw + "/prompt_length", str(P))
    check(((P >= 0) & (P <= lengths)).all(), sw + "/prompt_length", f"{P} outside [0, {lengths}]")
    for name in ("advantage", "reward"):
        check(s[name].dtype == np.float64 and s[name].shape == (S,), f"{sw}/{name}", "dtype/shape")
    hr = s["has_reward"][:]
    check(hr.dtype == np.uint8 and set(hr.tolist()) <= {0, 1}, sw + "/has_reward", str(hr))
    for name in ("rollout_logprobs", "old_logprobs", "ref_logprobs"):
        check(s[name].dtype == np.float32, f"{sw}/{name}", f"dtype {s[name].dtype}")
        for i, v in enumerate(ragged(s, name, S, sw)):
            check(len(v) in (0, lengths[i] - P[i]), f"{sw}/{name}", f"sample {i}: {len(v)} values")

    p, pw = t["params"], where + "/params"
    pn = list(p["name"].asstr()[:])
    W = len(pn)
    check(pn == sorted(set(pn)) and set(pn) <= set(weight_names), pw + "/name", "not sorted, unique weight names")
    rows, elems = p["rows"][:], p["row_elems"][:]
    check(rows.dtype == np.int64 and elems.dtype == np.int64 and rows.shape == elems.shape == (W,), pw,
          "rows/row_elems dtype/shape")
    shape = {n: (int(r), int(e)) for n, r, e in zip(pn, rows, elems)}
    for name in ("grad", "weight", "master", "m", "v"):
        check(p[name].dtype == np.uint64, f"{pw}/{name}", f"dtype {p[name].dtype}")
        for i, v in enumerate(ragged(p, name, W, pw)):
            check(len(v) in (0, rows[i]), f"{pw}/{name}", f"{pn[i]}: {len(v)} digests for {rows[i]} rows")

    g, gw = t["act_grads"], where + "/act_grads"
    A = len(g["name"])
    for name, dt in (("seq", np.int32), ("layer", np.int32), ("rows", np.int64), ("cols", np.int64)):
        check(g[name].dtype == dt and g[name].shape == (A,), f"{gw}/{name}", f"{g[name].dtype} {g[name].shape}")
    check(((g["seq"][:] >= 0) & (g["seq"][:] < S)).all() and (g["layer"][:] >= -1).all(), gw, "seq/layer range")
    check(g["digests"].dtype == np.uint64 and len(g["digests"]) == int(g["rows"][:].sum()), gw + "/digests",
          "not the rows' digests")

    n_full = 0
    for group in ("full_grads", "full_weights"):
        for name, ds in t[group].items():
            check(name in shape and ds.dtype == np.float32 and ds.shape == shape.get(name), f"{where}/{group}/{name}",
                  f"{ds.dtype} {ds.shape}, parameter {shape.get(name)}")
            n_full += 1
    return n_full


def main(path):
    f = h5py.File(path, "r", swmr=True)
    check(as_str(f.attrs["format"]) == "dsv4-trace", "/", "format")
    kinds = [as_str(g.attrs["kind"]) for g in f["steps"].values()]
    external = any("engine" in g.attrs for g in f["steps"].values())
    check(int(f.attrs["format_version"]) == (4 if external else 3 if "train-step" in kinds else 1), "/",
          "format_version")
    check(as_str(f.attrs["producer"]).startswith("dsv4 "), "/", "producer")
    check(re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", as_str(f.attrs["created"])) is not None, "/", "created")
    env = f["meta/env"].attrs
    for k in ENV_KEYS:
        check(k in env and isinstance(env[k], str), "/meta/env", f"attribute {k}")
    model = f["meta/model"]
    cfg = json.loads(model.attrs["config_json"])
    digest = as_str(model.attrs["model_digest"])
    check(re.fullmatch(r"[0-9a-f]{16}", digest) is not None or (external and digest == "unknown"), "/meta/model",
          "model_digest")
    wn = [as_str(x) for x in model["tensor_names"][:]]
    check(wn == sorted(wn) and (len(wn) > 0 or digest == "unknown"), "/meta/model/tensor_names",
          "not sorted / empty")
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
        if "engine" in g.attrs:
            check(as_str(g.attrs["kind"]) in ("train", "rollout"), where, "kind")
            check(as_str(g.attrs["capture"]) == "external" and as_str(g.attrs["engine"]) != "", where,
                  "capture / engine")
            lengths = g["seq_lengths"][:]
            check(len(lengths) == int(g.attrs["n_seqs"]), where + "/seq_lengths", str(lengths))
            for i, T in enumerate(lengths):
                n_full += check_external_seq(f"{where}/seq_{i:03d}", g[f"seq_{i:03d}"], int(T), cfg, n_layers)
            continue
        check(as_str(g.attrs["kind"]) in ("train", "rollout", "train-step"), where, "kind")
        check(as_str(g.attrs["profile"]) in ("train", "rollout"), where, "profile")
        check(g.attrs["seed"].dtype == np.uint64, where, "seed dtype")
        check(g.attrs["threads"].dtype == np.int32, where, "threads dtype")
        check(isinstance(g.attrs["capture"], str), where, "capture")
        lengths = g["seq_lengths"][:]
        check(lengths.dtype == np.int32 and len(lengths) == int(g.attrs["n_seqs"]), where + "/seq_lengths",
              str(lengths))
        for i, T in enumerate(lengths):
            n_full += check_seq(f"{where}/seq_{i:03d}", g[f"seq_{i:03d}"], int(T), cfg, names, n_layers)
        if as_str(g.attrs["kind"]) == "train-step":
            n_full += check_training(where + "/training", g["training"], lengths.astype(np.int64), wn)
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
