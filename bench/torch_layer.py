#!/usr/bin/env python3
"""Independent PyTorch check and timing of the Flash-shaped attention layer dumped by bench_gpu.

Usage: torch_layer.py DUMP_DIR [--dsv4-log FILE] [--reps N] [--no-peak]

DUMP_DIR is what `bench_gpu --dump DUMP_DIR` writes: raw little-endian float32/int32 files and
manifest.json ({"attrs": {...}, "tensors": [{"name", "file", "dtype", "shape"}]}).

It prints
  (a) rel-L2 of each step of the query/kv path (rms norms, bf16-rounded GEMMs), each recomputed from
      the dumped input of that step;
  (b) rel-L2 of the sparse attention with sink (recomputed in fp32 from the dumped q, KVcat, idx,
      sink) against the dumped o, and of the output projection against attn_out;
  (c) a table of torch times (CUDA events, median of --reps runs after a warm-up) for the layer's
      GEMMs in bf16, the indexer's scores and top-k (bf16 einsum) and the gathered sparse attention in
      fp32, next to the dsv4 exact-mode times
      parsed from "RESULT op flash-attn <op> T=<T> <ms> ms" lines of --dsv4-log, when given;
  (d) the card's bf16 GEMM rate at 8192 x 8192 x 8192 (TFLOP/s).
Exit status: 0, or 1 when a rel-L2 exceeds its bound (1e-2; bf16 rounding alone gives ~1e-3).
"""
import argparse
import json
import os
import re
import sys

import numpy as np
import torch

BOUND = 1e-2


def load(d):
    with open(os.path.join(d, "manifest.json")) as f:
        man = json.load(f)
    dt = {"float32": np.float32, "int32": np.int32}
    ts = {}
    for t in man["tensors"]:
        a = np.fromfile(os.path.join(d, t["file"]), dtype=np.dtype(dt[t["dtype"]]).newbyteorder("<"))
        ts[t["name"]] = torch.from_numpy(a.reshape(t["shape"]).copy()).cuda()
    return man["attrs"], ts


def rel_l2(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def bf16(x):
    return x.to(torch.bfloat16).float()


def rms(x, w, eps):
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y * w if w is not None else y


def mm_f32(x, w):  # x [m, k] @ w[n, k]^T in fp32 (TF32 off)
    return x @ w.T


def sparse_attn(q, kv, idx, sink, scale, chunk=512):
    """o[t, h] = sum_j p_j kv[idx[t, j]] with p = softmax over [q.kv[idx[t, j]] * scale for idx >= 0,
    sink[h]]; the sink takes probability mass but adds no value. fp32 throughout."""
    T, H, Dh = q.shape
    out = torch.empty_like(q)
    for t0 in range(0, T, chunk):
        ii = idx[t0:t0 + chunk].long()
        valid = ii >= 0
        k = kv[ii.clamp_min(0)]                                   # [c, K, Dh]
        s = torch.einsum("thd,tkd->thk", q[t0:t0 + chunk], k) * scale
        s = s.masked_fill(~valid[:, None, :], float("-inf"))
        sk = sink.view(1, H, 1).expand(s.shape[0], H, 1)
        p = torch.softmax(torch.cat([s, sk], -1), -1)[..., :-1]
        out[t0:t0 + chunk] = torch.einsum("thk,tkd->thd", p, k)
    return out


def indexer_topk(qi, ki, wt, topk, ratio=4, chunk=1024):
    """The lightning indexer as a PyTorch engine runs it: bf16 einsum of the query heads with the
    compressed keys, ReLU, the head-weighted sum in fp32, the causal mask (group g is visible to row t
    when g < (t + 1) / ratio) and torch.topk. Returns the ids [T, min(topk, G)]."""
    T, G = qi.shape[0], ki.shape[0]
    pos = torch.arange(T, device=qi.device)
    g = torch.arange(G, device=qi.device)
    out = []
    for t0 in range(0, T, chunk):
        s = torch.einsum("thd,gd->thg", qi[t0:t0 + chunk], ki).float().relu_()
        s = (s * wt[t0:t0 + chunk, :, None]).sum(1)
        s = s.masked_fill(g[None, :] >= ((pos[t0:t0 + chunk] + 1) // ratio)[:, None], float("-inf"))
        out.append(s.topk(min(topk, G), -1).indices)
    return torch.cat(out)


def time_ms(fn, reps):
    fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ms = []
    for _ in range(reps):
        a.record()
        fn()
        b.record()
        b.synchronize()
        ms.append(a.elapsed_time(b))
    return sorted(ms)[len(ms) // 2]


def parse_log(path, T):
    res = {}
    if not path or not os.path.exists(path):
        return res
    pat = re.compile(r"^RESULT op flash-attn (.+) T=(\d+) ([0-9.eE+-]+) ms")
    with open(path) as f:
        for line in f:
            m = pat.match(line.strip())
            if m and int(m.group(2)) == T:
                res[m.group(1)] = float(m.group(3))
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("dump")
    ap.add_argument("--dsv4-log")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--no-peak", action="store_true")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    A, t = load(args.dump)
    T, D, ql, H, Dh = int(A["T"]), int(A["D"]), int(A["ql"]), int(A["H"]), int(A["Dh"])
    groups, R, eps, scale = int(A["groups"]), int(A["R"]), A["eps"], A["scale"]
    print(f"torch {torch.__version__}, device {torch.cuda.get_device_name()}, T={T}")
    failed = False

    def check(name, got, ref):
        nonlocal failed
        e = rel_l2(got, ref)
        bad = not (e <= BOUND)
        failed |= bad
        print(f"  {name:<34} rel-L2 {e:.3e}{'  FAIL' if bad else ''}")

    print("(a) query / kv path, each step from the dumped input of that step")
    check("x = rmsnorm(x_raw, attn_norm)", t["x"], rms(t["x_raw"], t["attn_norm"], eps))
    check("qa = bf16(x wq_a^T)", t["qa"], bf16(mm_f32(t["x"], t["wq_a"])))
    check("qr = rmsnorm(qa, q_norm)", t["qr"], rms(t["qa"], t["q_norm"], eps))
    check("qb = bf16(qr wq_b^T)", t["qb"], bf16(mm_f32(t["qr"], t["wq_b"])))
    check("q_heads = rmsnorm per head", t["q_heads"], rms(t["qb"].view(T, H, Dh), None, eps))
    check("kv_a = bf16(x wkv^T)", t["kv_a"], bf16(mm_f32(t["x"], t["wkv"])))
    check("kv = rmsnorm(kv_a, kv_norm)", t["kv"], rms(t["kv_a"], t["kv_norm"], eps))

    print("(b) sparse attention with sink, output projection")
    q, kv, idx, sink = t["attn_q"], t["KVcat"], t["idx"], t["sink"]
    o_ref = sparse_attn(q, kv, idx, sink, scale)
    check("o = sparse_attention(q, KVcat, idx, sink)", t["o"], o_ref)
    gw = (H // groups) * Dh
    o2 = t["o"].view(T, groups, gw)
    u_ref = torch.cat([bf16(mm_f32(o2[:, g], t["wo_a"][g])) for g in range(groups)], -1)
    check("wo_a_out = bf16(o_g wo_a[g]^T)", t["wo_a_out"], u_ref)
    check("attn_out = bf16(wo_a_out wo_b^T)", t["attn_out"], bf16(mm_f32(t["wo_a_out"], t["wo_b"])))
    del o_ref, u_ref

    print(f"(c) times, median of {args.reps} after a warm-up; dsv4 = exact mode from the bench log")
    Hi, Di, E = int(A["Hi"]), int(A["Di"]), int(A["E"])
    shapes = {  # bench op name -> (m, n, k, batch)
        "gemm wq_a": (T, ql, D, 1), "gemm wq_b": (T, H * Dh, ql, 1), "gemm wkv": (T, Dh, D, 1),
        "gemm indexer wq_b": (T, Hi * Di, ql, 1), "gemm indexer weights": (T, Hi, D, 1),
        "gemm wo_a (groups)": (T, R, gw, groups), "gemm wo_b": (T, D, groups * R, 1),
        "gemm router": (T, E, D, 1)}
    dsv4 = parse_log(args.dsv4_log, T)
    rows = []
    for op, (m, n, k, b) in shapes.items():
        x = torch.randn(b, m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(b, n, k, device="cuda", dtype=torch.bfloat16)
        rows.append((op + " [bf16]", time_ms(lambda: torch.matmul(x, w.transpose(1, 2)), args.reps), op))
        del x, w
    G = int(A["G"])
    topk = int(A.get("topk", int(A["K"]) - min(T, int(A["W"]))))
    qi = torch.randn(T, Hi, Di, device="cuda").to(torch.bfloat16)
    ki = torch.randn(G, Di, device="cuda").to(torch.bfloat16)
    wt = torch.randn(T, Hi, device="cuda") * 0.1
    rows.append(("indexer_topk [bf16 einsum]", time_ms(lambda: indexer_topk(qi, ki, wt, topk), args.reps),
                 "indexer_topk"))
    del qi, ki, wt
    rows.append(("sparse_attention [fp32 gather]",
                 time_ms(lambda: sparse_attn(q, kv, idx, sink, scale), args.reps), "sparse_attention"))
    print(f"  {'op':<36} {'torch ms':>10} {'dsv4 ms':>10}")
    for name, ms, op in rows:
        d = f"{dsv4[op]:10.3f}" if op in dsv4 else f"{'-':>10}"
        print(f"  {name:<36} {ms:10.3f} {d}")
        print(f"RESULT torch_op {op} T={T} {ms:.4f} ms")

    if not args.no_peak:
        del t, q, kv, idx, sink
        torch.cuda.empty_cache()
        n = 8192
        a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        ms = time_ms(lambda: torch.matmul(a, b), max(args.reps, 5))
        tf = 2.0 * n ** 3 / (ms * 1e-3) / 1e12
        print(f"(d) bf16 GEMM {n}x{n}x{n}: {ms:.3f} ms, {tf:.1f} TFLOP/s")
        print(f"RESULT torch_bf16_gemm_tflops {tf:.1f}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
