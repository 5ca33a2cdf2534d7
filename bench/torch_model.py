#!/usr/bin/env python3
"""The whole DSV4 forward in PyTorch, written from MODEL.md §2-3: an independent peer of `dsv4 forward`.

It reads a checkpoint (config.json + model.safetensors, or a sharded model.safetensors.index.json, the
layout `dsv4 model init` writes), runs the prefill forward of one token sequence in the train profile's
precision map (MODEL.md §3.11: bf16 storage; bf16 tensor-core GEMMs with bf16 outputs for the dense
linears and the experts' w1/w3 and wo_a; fp32 GEMMs of bf16 values for the compressor, the router, the
experts' w2 and the head; fp32 norms, mHC, RoPE, indexer scores and softmax; no FP8), and

  (a) compares its per-token log-probs and decisions (indexer top-k sets, experts) with the JSON that
      `dsv4 forward --out FILE` wrote for the same tokens (--reference FILE): log-probs rel-L2 and
      max |diff|, and the number of rows whose decision set agrees. With --force-decisions it attends
      to the reference's indexer sets and runs the reference's experts, so the log-probs differ by
      rounding alone, and the check is tighter;
  (b) times the forward (--time N: median of N runs after a warm-up, CUDA events on a GPU) and prints
      tokens/s.

Nothing here is shared with the C++ code: the formulas come from the spec, the orders of the sums are
PyTorch's. Tie-breaking of every top-k: equal scores go to the smaller index (stable sort).

Usage:
  torch_model.py --model DIR --reference FORWARD.json [--force-decisions] [--device cpu|cuda]
                 [--bound X] [--time N] [--json OUT]
  torch_model.py --model DIR --random N [--token-seed S] --time N --device cuda

Exit status: 0; 1 when the log-probs' rel-L2 exceeds --bound; 2 for bad input (a missing or truncated
checkpoint file, a tensor of the wrong shape, tokens out of the vocabulary, a reference of other tokens).
"""
import argparse
import json
import math
import os
import struct
import sys
import time

import torch

BF16 = torch.bfloat16
F32 = torch.float32


class InputError(Exception):
    pass


# ---- checkpoint -------------------------------------------------------------------------------------

_ST_DTYPES = {"BF16": (BF16, 2), "F32": (F32, 4), "F16": (torch.float16, 2), "I32": (torch.int32, 4),
              "I64": (torch.int64, 8)}


def read_safetensors(path, out):
    """Adds every tensor of one safetensors file to `out` (name -> CPU tensor)."""
    try:
        with open(path, "rb") as f:
            raw = bytearray(f.read())
    except OSError as e:
        raise InputError(f"{path}: cannot read: {e.strerror}")
    if len(raw) < 8:
        raise InputError(f"{path}: truncated: {len(raw)} bytes, shorter than the 8-byte header length")
    (n,) = struct.unpack("<Q", raw[:8])
    if 8 + n > len(raw):
        raise InputError(f"{path}: truncated: the header claims {n} bytes, the file has {len(raw) - 8}")
    try:
        header = json.loads(raw[8:8 + n])
    except ValueError as e:
        raise InputError(f"{path}: the header is not valid JSON: {e}")
    body = memoryview(raw)[8 + n:]
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info.get("dtype") not in _ST_DTYPES:
            raise InputError(f"{path}: tensor '{name}': dtype {info.get('dtype')} is not read here")
        dt, size = _ST_DTYPES[info["dtype"]]
        a, b = info["data_offsets"]
        count = math.prod(info["shape"])
        if b > len(body) or b - a != count * size:
            raise InputError(f"{path}: tensor '{name}': bytes [{a}, {b}) do not fit the file "
                             f"({len(body)} data bytes) or its shape {info['shape']} x {size} bytes")
        t = torch.frombuffer(body[a:b], dtype=torch.uint8) if b > a else torch.empty(0, dtype=torch.uint8)
        out[name] = t.view(dt).reshape(info["shape"]).clone()


def read_json(path):
    try:
        with open(path) as f:
            return json.load(f)
    except OSError as e:
        raise InputError(f"{path}: cannot read: {e.strerror}")
    except ValueError as e:
        raise InputError(f"{path}: not valid JSON: {e}")


def load_checkpoint(d):
    cfg = read_json(os.path.join(d, "config.json"))
    tensors = {}
    index = os.path.join(d, "model.safetensors.index.json")
    if os.path.exists(index):
        files = sorted(set(read_json(index).get("weight_map", {}).values()))
        for name in files:
            read_safetensors(os.path.join(d, name), tensors)
    else:
        read_safetensors(os.path.join(d, "model.safetensors"), tensors)
    return cfg, tensors


class Weights:
    """The checkpoint's tensors on the device, looked up by name with a shape check."""

    def __init__(self, tensors, device, path):
        self.t, self.device, self.path = tensors, device, path
        self.cache = {}

    def __call__(self, name, shape=None, dtype=None):
        key = (name, dtype)
        if key in self.cache:
            return self.cache[key]
        if name not in self.t:
            raise InputError(f"{self.path}: tensor '{name}' is missing")
        x = self.t[name]
        if shape is not None and list(x.shape) != list(shape):
            raise InputError(f"{self.path}: tensor '{name}' has shape {list(x.shape)}, expected {list(shape)}")
        x = x.to(self.device)
        if dtype is not None:
            x = x.to(dtype)
        self.cache[key] = x
        return x


# ---- operators (MODEL.md §3) --------------------------------------------------------------------------

def bf16(x):
    return x.to(BF16)


def linear(x, w):
    """bf16 x bf16 -> bf16 (tensor cores on a GPU, fp32 accumulation)."""
    return x.to(BF16) @ w.t()


def linear_f32(x, w):
    """The same product in fp32 (exact products of the bf16 values, fp32 sums), fp32 out."""
    return x.float() @ w.float().t()


def rmsnorm(x, w, eps):
    x = x.float()
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    if w is not None:
        y = w.float() * y
    return bf16(y)


def rope_table(cfg, ratio, n, device):
    """cos and sin [n, rd/2] of positions 0..n-1 (MODEL.md §3.3): base 10000 without YaRN for C1
    layers, compress_rope_theta with YaRN (when configured) for C4 and C128 layers."""
    rd = cfg["qk_rope_head_dim"]
    compressed = ratio > 0
    base = float(cfg.get("compress_rope_theta", 160000.0) if compressed else cfg.get("rope_theta", 10000.0))
    i = torch.arange(rd // 2, dtype=torch.float64)
    freq = (1.0 / base ** (2.0 * i / rd)).float()
    rs = cfg.get("rope_scaling") or {}
    kind = rs.get("type", rs.get("rope_type", "none"))
    if compressed and kind == "yarn":
        L0 = rs.get("original_max_position_embeddings", 65536)

        def corr(k):
            return rd * math.log(L0 / (k * 2 * math.pi)) / (2 * math.log(base))

        low = max(math.floor(corr(rs.get("beta_fast", 32.0))), 0)
        high = min(math.ceil(corr(rs.get("beta_slow", 1.0))), rd - 1)
        if low == high:
            high += 0.001
        smooth = 1.0 - ((i - low) / (high - low)).clamp(0.0, 1.0)
        freq = (freq.double() / rs.get("factor", 1.0) * (1.0 - smooth) + freq.double() * smooth).float()
    angle = torch.arange(n, dtype=F32)[:, None] * freq[None, :]
    return torch.cos(angle).to(device), torch.sin(angle).to(device)


def rope(x, cos, sin, inverse=False):
    """Rotates the last rd dims of x (adjacent pairs, GPT-J style); cos/sin broadcast against
    x[..., rd/2]. fp32 math, bf16 out."""
    rd = cos.shape[-1] * 2
    y = x.float().clone()
    a, b = y[..., -rd::2].clone(), y[..., -rd + 1::2].clone()
    s = -sin if inverse else sin
    y[..., -rd::2] = a * cos - b * s
    y[..., -rd + 1::2] = a * s + b * cos
    return bf16(y)


_hadamards = {}


def hadamard(x):
    """Sylvester Hadamard over the last dim, scaled by n^-1/2; fp32 math, bf16 out."""
    n = x.shape[-1]
    key = (n, x.device)
    if key not in _hadamards:
        h = torch.ones(1, 1)
        while h.shape[0] < n:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        if h.shape[0] != n:
            raise InputError(f"index_head_dim {n} is not a power of two (the Hadamard rotation needs one)")
        _hadamards[key] = (h / math.sqrt(n)).to(x.device)
    return bf16(x.float() @ _hadamards[key])


def sinkhorn(c0, iters, eps):
    """c0 [T, hc, hc] (row j = source, column k = destination)."""
    c = torch.softmax(c0, -1) + eps
    c = c / (c.sum(1, keepdim=True) + eps)
    for _ in range(iters - 1):
        c = c / (c.sum(2, keepdim=True) + eps)
        c = c / (c.sum(1, keepdim=True) + eps)
    return c


def mix_logits(X, fn, eps):
    x = X.float().flatten(1)
    rho = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return rho * (x @ fn.t())


def hc_pre(X, fn, scale, base, cfg):
    hc, eps = cfg["hc_mult"], cfg["hc_eps"]
    mix = mix_logits(X, fn, cfg["rms_norm_eps"])
    s = torch.cat([scale[0].expand(hc), scale[1].expand(hc), scale[2].expand(hc * hc)])
    a = mix * s + base
    pre = torch.sigmoid(a[:, :hc]) + eps
    post = 2.0 * torch.sigmoid(a[:, hc:2 * hc])
    comb = sinkhorn(a[:, 2 * hc:].reshape(-1, hc, hc), cfg["hc_sinkhorn_iters"], eps)
    y = bf16((pre[:, :, None] * X.float()).sum(1))
    return y, post, comb


def hc_post(f, R, post, comb):
    out = post[:, :, None] * f.float()[:, None, :] + torch.einsum("tjk,tjd->tkd", comb, R.float())
    return bf16(out)


def hc_head(X, fn, scale, base, cfg):
    mix = mix_logits(X, fn, cfg["rms_norm_eps"])
    w = torch.sigmoid(mix * scale[0] + base) + cfg["hc_eps"]
    return bf16((w[:, :, None] * X.float()).sum(1))


def topk_lower_index(scores, k):
    """The k largest per row, equal scores to the smaller index; ids of -inf scores become -1."""
    v, i = torch.sort(scores, dim=-1, descending=True, stable=True)
    v, i = v[..., :k], i[..., :k]
    return torch.where(v == float("-inf"), torch.full_like(i, -1), i)


# ---- the model -----------------------------------------------------------------------------------------

class Model:
    def __init__(self, cfg, tensors, device, path, shared_clamp=False):
        self.cfg, self.dev, self.shared_clamp = cfg, device, shared_clamp
        self.w = Weights(tensors, device, path)
        self.ratios = list(cfg["compress_ratios"])[:cfg["num_hidden_layers"]]
        self.tables = {}

    def table(self, ratio, n):
        key = ratio > 0
        have = self.tables.get(key)
        if have is None or have[0].shape[0] < n:
            self.tables[key] = rope_table(self.cfg, ratio, max(n, 1), self.dev)
        c, s = self.tables[key]
        return c[:n], s[:n]

    # §3.5
    def compressor(self, x, prefix, d, r, rotate, T):
        c, D = self.cfg, self.cfg["hidden_size"]
        coff = 2 if r == 4 else 1
        wkv = self.w(prefix + "wkv.weight", [coff * d, D])
        wgate = self.w(prefix + "wgate.weight", [coff * d, D])
        ape = self.w(prefix + "ape", [r, coff * d], F32)
        G = T // r
        if G == 0:
            return torch.zeros(0, d, dtype=BF16, device=self.dev)
        kvp = linear_f32(x[:G * r], wkv).view(G, r, coff * d)
        sc = linear_f32(x[:G * r], wgate).view(G, r, coff * d) + ape
        if r == 4:
            KV = torch.zeros(G, 2 * r, d, device=self.dev)
            SC = torch.full((G, 2 * r, d), float("-inf"), device=self.dev)
            KV[:, r:], SC[:, r:] = kvp[:, :, d:], sc[:, :, d:]
            KV[1:, :r], SC[1:, :r] = kvp[:-1, :, :d], sc[:-1, :, :d]
        else:
            KV, SC = kvp, sc
        pooled = (torch.softmax(SC, 1) * KV).sum(1)
        out = rmsnorm(bf16(pooled), self.w(prefix + "norm.weight", [d]), c["rms_norm_eps"])
        cos, sin = self.table(r, G * r)
        out = rope(out, cos[::r], sin[::r])
        return hadamard(out) if rotate else out

    # §3.7
    def indexer(self, x, qr, layer, T):
        c = self.cfg
        Hi, Di, K = c["index_n_heads"], c["index_head_dim"], c["index_topk"]
        p = f"model.layers.{layer}.self_attn.indexer."
        G = T // 4
        k = min(K, G)
        if k == 0:
            return torch.zeros(T, 0, dtype=torch.long, device=self.dev)
        qi = linear(qr, self.w(p + "wq_b.weight", [Hi * Di, c["q_lora_rank"]])).view(T, Hi, Di)
        cos, sin = self.table(4, T)
        qi = hadamard(rope(qi, cos[:, None], sin[:, None]))
        ki = self.compressor(x, p + "compressor.", Di, 4, True, T).float()
        wt = (linear(x, self.w(p + "weights_proj.weight", [Hi, c["hidden_size"]])) *
              (Hi ** -0.5 * Di ** -0.5)).float()
        pos = torch.arange(T, device=self.dev)
        ids = []
        for t0 in range(0, T, 1024):
            t1 = min(T, t0 + 1024)
            dots = (qi[t0:t1].float().reshape(-1, Di) @ ki.t()).view(t1 - t0, Hi, G)
            score = (wt[t0:t1, :, None] * torch.relu(dots)).sum(1)
            visible = torch.arange(G, device=self.dev)[None, :] < ((pos[t0:t1] + 1) // 4)[:, None]
            score = score.masked_fill(~visible, float("-inf"))
            ids.append(topk_lower_index(score, k))
        return torch.cat(ids)

    def sets_to_ids(self, sets, k):
        ids = torch.full((len(sets), k), -1, dtype=torch.long)
        for t, s in enumerate(sets):
            if len(s) > k:
                raise InputError(f"the reference's indexer row {t} has {len(s)} entries, more than top-k {k}")
            ids[t, :len(s)] = torch.tensor(sorted(s), dtype=torch.long)
        return ids.to(self.dev)

    # §3.8
    @staticmethod
    def sparse_attention(q, kv, idx, sink, scale):
        T, H, Dh = q.shape
        out = torch.empty(T, H, Dh, dtype=BF16, device=q.device)
        for t0 in range(0, T, 512):
            ii = idx[t0:t0 + 512]
            valid = ii >= 0
            k = kv[ii.clamp_min(0)].float()                                   # [c, K, Dh]
            z = torch.einsum("thd,tkd->thk", q[t0:t0 + 512].float(), k) * scale
            z = z.masked_fill(~valid[:, None, :], float("-inf"))
            m = torch.maximum(z.amax(-1, keepdim=True), sink.view(1, H, 1))
            e = torch.exp(z - m)
            P = e / (e.sum(-1, keepdim=True) + torch.exp(sink.view(1, H, 1) - m))
            out[t0:t0 + 512] = bf16(torch.einsum("thk,tkd->thd", bf16(P).float(), k))
        return out

    # §3.4, §3.6, §3.8
    def attention(self, x, layer, T, forced_sets):
        c = self.cfg
        D, H, Dh, ql = c["hidden_size"], c["num_attention_heads"], c["head_dim"], c["q_lora_rank"]
        G, R, W, eps = c["o_groups"], c["o_lora_rank"], c["sliding_window"], c["rms_norm_eps"]
        r = self.ratios[layer]
        p = f"model.layers.{layer}.self_attn."
        cos, sin = self.table(r, T)
        qr = rmsnorm(linear(x, self.w(p + "wq_a.weight", [ql, D])), self.w(p + "q_norm.weight", [ql]), eps)
        q = rmsnorm(linear(qr, self.w(p + "wq_b.weight", [H * Dh, ql])).view(T, H, Dh), None, eps)
        q = rope(q, cos[:, None], sin[:, None])
        kv = rmsnorm(linear(x, self.w(p + "wkv.weight", [Dh, D])), self.w(p + "kv_norm.weight", [Dh]), eps)
        kv = rope(kv, cos, sin)

        pos = torch.arange(T, device=self.dev)
        m = torch.arange(min(T, W), device=self.dev)
        win = (pos - W + 1).clamp_min(0)[:, None] + m[None, :]
        parts, idx = [kv], [torch.where(win <= pos[:, None], win, torch.full_like(win, -1))]
        decided = None
        if r > 0:
            parts.append(self.compressor(x, p + "compressor.", Dh, r, False, T))
            if r == 4:
                decided = self.indexer(x, qr, layer, T)
                g = decided if forced_sets is None else self.sets_to_ids(forced_sets, decided.shape[1])
                ok = (g >= 0) & (g < ((pos + 1) // 4)[:, None])
            else:
                g = torch.arange(T // r, device=self.dev)[None, :].expand(T, -1)
                ok = g < ((pos + 1) // r)[:, None]
            idx.append(torch.where(ok, g + T, torch.full_like(g, -1)))
        KVcat, idx = torch.cat(parts), torch.cat(idx, 1)
        o = self.sparse_attention(q, KVcat, idx, self.w(p + "attn_sink", [H], F32), Dh ** -0.5)
        o = rope(o, cos[:, None], sin[:, None], inverse=True)
        wo_a = self.w(p + "wo_a.weight", [G * R, H * Dh // G]).view(G, R, H * Dh // G)
        u = torch.einsum("tgc,grc->tgr", o.view(T, G, H * Dh // G), wo_a)
        return linear(u.reshape(T, G * R), self.w(p + "wo_b.weight", [D, G * R])), decided

    def swiglu(self, x, prefix, I, weight=None, clamp=True):
        D, L = self.cfg["hidden_size"], self.cfg.get("swiglu_limit", 10.0)
        g = linear(x, self.w(prefix + "gate_proj.weight", [I, D])).float()
        u = linear(x, self.w(prefix + "up_proj.weight", [I, D])).float()
        if clamp:
            g, u = g.clamp(max=L), u.clamp(-L, L)
        a = torch.nn.functional.silu(g) * u
        if weight is not None:
            a = weight[:, None] * a
        return linear_f32(bf16(a), self.w(prefix + "down_proj.weight", [D, I]))

    # §3.9
    def moe(self, x, tokens, layer, T, forced_ids):
        c = self.cfg
        D, E, k, I = c["hidden_size"], c["n_routed_experts"], c["num_experts_per_tok"], c["moe_intermediate_size"]
        p = f"model.layers.{layer}.mlp."
        s = torch.sqrt(torch.nn.functional.softplus(linear_f32(x, self.w(p + "gate.weight", [E, D]))))
        if layer < c["num_hash_layers"]:
            chosen = self.w(p + "topk.tid2eid", [c["vocab_size"], k]).long()[tokens]
        else:
            chosen = topk_lower_index(s + self.w(p + "gate.e_score_correction_bias", [E], F32), k)
        ids = chosen if forced_ids is None else forced_ids
        w = s.gather(1, ids)
        if c.get("norm_topk_prob", True):
            w = w / w.sum(1, keepdim=True)
        w = w * c.get("routed_scaling_factor", 1.0)

        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=E).tolist()
        slot_tok = order // k
        y = torch.zeros(T * k, D, device=self.dev)
        start = 0
        for e, n in enumerate(counts):
            if n:
                sel = order[start:start + n]
                y[sel] = self.swiglu(x[slot_tok[start:start + n]], p + f"experts.{e}.", I, w.reshape(-1)[sel])
                start += n
        out = y.view(T, k, D).sum(1)
        if c.get("n_shared_experts", 1) > 0:
            out = out + self.swiglu(x, p + "shared_experts.", I * c.get("n_shared_experts", 1),
                                    clamp=self.shared_clamp)
        return bf16(out), chosen

    def forward(self, tokens, forced=None, temperature=1.0):
        """tokens: int64 [T] on the device. Returns (log-probs [T-1] fp32, decisions): the decisions are
        the peer's own choices, also where `forced` (the reference's) made the layer use others."""
        c = self.cfg
        T, D, hc, V, eps = tokens.shape[0], c["hidden_size"], c["hc_mult"], c["vocab_size"], c["rms_norm_eps"]
        mix = (2 + hc) * hc
        X = self.w("model.embed_tokens.weight", [V, D])[tokens][:, None, :].expand(T, hc, D).contiguous()
        decisions = {"indexer": {}, "experts": {}}
        for L in range(c["num_hidden_layers"]):
            p = f"model.layers.{L}."
            hc_w = {s: (self.w(p + f"hc_{s}_fn", [mix, hc * D], F32), self.w(p + f"hc_{s}_scale", [3], F32),
                        self.w(p + f"hc_{s}_base", [mix], F32)) for s in ("attn", "ffn")}
            a_in, post, comb = hc_pre(X, *hc_w["attn"], c)
            fs = forced["indexer"].get(L) if forced else None
            a, sets = self.attention(rmsnorm(a_in, self.w(p + "input_layernorm.weight", [D]), eps), L, T, fs)
            if sets is not None:
                decisions["indexer"][L] = sets
            X = hc_post(a, X, post, comb)
            f_in, post, comb = hc_pre(X, *hc_w["ffn"], c)
            fe = forced["experts"].get(L) if forced else None
            m, ids = self.moe(rmsnorm(f_in, self.w(p + "post_attention_layernorm.weight", [D]), eps), tokens, L, T, fe)
            decisions["experts"][L] = ids
            X = hc_post(m, X, post, comb)
        y = hc_head(X, self.w("model.hc_head_fn", [hc, hc * D], F32), self.w("model.hc_head_scale", [1], F32),
                    self.w("model.hc_head_base", [hc], F32), c)
        y = rmsnorm(y, self.w("model.norm.weight", [D]), eps)
        head = self.w("lm_head.weight", [V, D])
        lp = torch.empty(max(T - 1, 0), device=self.dev)
        for t0 in range(0, T - 1, 1024):
            t1 = min(T - 1, t0 + 1024)
            ls = torch.log_softmax(linear_f32(y[t0:t1], head) / temperature, -1)
            lp[t0:t1] = ls.gather(1, tokens[t0 + 1:t1 + 1, None])[:, 0]
        return lp, decisions


# ---- comparison with `dsv4 forward` ---------------------------------------------------------------------

def load_reference(path):
    ref = read_json(path)
    for key in ("tokens", "logprobs", "indexer_topk", "experts"):
        if key not in ref:
            raise InputError(f"{path}: field '{key}' is missing (write it with `dsv4 forward --out FILE`)")
    return ref


def forced_decisions(ref, dev):
    return {"indexer": {int(e["layer"]): e["sets"] for e in ref["indexer_topk"]},
            "experts": {int(e["layer"]): torch.tensor(e["ids"], dtype=torch.long, device=dev)
                        for e in ref["experts"]}}


def compare(ref, lp, decisions):
    a = torch.tensor(ref["logprobs"], dtype=torch.float64)
    b = lp.double().cpu()
    if a.shape != b.shape:
        raise InputError(f"the reference has {a.numel()} log-probs, the peer {b.numel()}")
    res = {"logprobs": {"count": a.numel(),
                        "rel_l2": float((a - b).norm() / a.norm().clamp_min(1e-300)) if a.numel() else 0.0,
                        "max_abs": float((a - b).abs().max()) if a.numel() else 0.0}}
    for kind, field, rows_of in (("indexer", "sets", lambda r: {g for g in r if g >= 0}),
                                 ("experts", "ids", set)):
        per_layer = {}
        for e in ref["indexer_topk" if kind == "indexer" else "experts"]:
            layer = int(e["layer"])
            mine = decisions[kind].get(layer)
            if mine is None:
                raise InputError(f"the reference has {kind} decisions in layer {layer}, the peer none")
            mine = mine.cpu().tolist()
            if len(mine) != len(e[field]):
                raise InputError(f"layer {layer}: the reference has {len(e[field])} {kind} rows, the peer {len(mine)}")
            per_layer[layer] = [sum(set(s) == rows_of(m) for s, m in zip(e[field], mine)), len(mine)]
        res[f"{kind}_rows_equal"] = [sum(v[0] for v in per_layer.values()), sum(v[1] for v in per_layer.values())]
        res[f"{kind}_rows_equal_per_layer"] = per_layer
    return res


def report(title, res):
    lpr = res["logprobs"]
    print(f"{title}:\n  log-probs rel-L2 {lpr['rel_l2']:.3e} (max |diff| {lpr['max_abs']:.3e}, {lpr['count']} tokens)")
    for kind in ("indexer", "experts"):
        a, b = res[f"{kind}_rows_equal"]
        print(f"  {kind} rows with the same set {a}/{b}; per layer " + ", ".join(
            f"{L}: {x}/{y}" for L, (x, y) in sorted(res[f"{kind}_rows_equal_per_layer"].items())))


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def time_forward(model, tokens, reps, dev):
    """Wall time of a forward whose log-probs reach the host, as `dsv4 forward` returns them; the
    median of `reps` after a warm-up (weight uploads, RoPE tables, the allocator's pool)."""
    model.forward(tokens)[0].cpu()
    ms = []
    for _ in range(reps):
        sync(dev)
        t0 = time.perf_counter()
        model.forward(tokens)[0].cpu()
        sync(dev)
        ms.append((time.perf_counter() - t0) * 1e3)
    return sorted(ms)[len(ms) // 2]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="checkpoint directory (config.json + model.safetensors)")
    ap.add_argument("--reference", help="`dsv4 forward --out` JSON: its tokens are run and compared")
    ap.add_argument("--random", type=int, help="N seeded random tokens instead of --reference's")
    ap.add_argument("--token-seed", type=int, default=1, help="seed of --random (default 1)")
    ap.add_argument("--force-decisions", action="store_true",
                    help="attend to the reference's indexer sets and run its experts (numerics alone)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--threads", type=int, default=0, help="CPU threads (0: PyTorch's default)")
    ap.add_argument("--bound", type=float, default=1e-2, help="largest log-probs rel-L2 that passes")
    ap.add_argument("--min-agree", type=float, default=0.0, metavar="F",
                    help="smallest fraction of indexer rows and of expert rows whose set equals the reference's "
                         "that passes (on the forced path with --force-decisions)")
    ap.add_argument("--shared-clamp", action="store_true", help="clamp the shared expert too (MODEL.md §3.9.3)")
    ap.add_argument("--time", type=int, default=0, metavar="N", help="time N forwards after a warm-up")
    ap.add_argument("--json", help="write the results here as JSON")
    args = ap.parse_args(argv)
    if (args.reference is None) == (args.random is None):
        ap.error("give exactly one of --reference and --random")
    if args.force_decisions and args.reference is None:
        ap.error("--force-decisions needs --reference")
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dev = torch.device(args.device)

    try:
        cfg, tensors = load_checkpoint(args.model)
        ref = load_reference(args.reference) if args.reference else None
        if ref is not None:
            tok = ref["tokens"]
        else:
            g = torch.Generator().manual_seed(args.token_seed)
            tok = torch.randint(0, cfg["vocab_size"], (args.random,), generator=g).tolist()
        bad = [t for t in tok if not 0 <= t < cfg["vocab_size"]]
        if bad:
            raise InputError(f"token {bad[0]} is outside the vocabulary [0, {cfg['vocab_size']})")
        tokens = torch.tensor(tok, dtype=torch.long, device=dev)
        model = Model(cfg, tensors, dev, args.model, args.shared_clamp)
        results = {"torch": torch.__version__, "device": str(dev), "T": len(tok)}
        if dev.type == "cuda":
            results["device_name"] = torch.cuda.get_device_name(dev)
        print(f"torch {torch.__version__} on {results.get('device_name', dev)}: "
              f"{cfg['num_hidden_layers']} layers, D {cfg['hidden_size']}, T {len(tok)}")
        failed = False
        with torch.inference_mode():
            if ref is not None:
                lp, dec = model.forward(tokens)
                checked = results["free"] = compare(ref, lp, dec)
                report("free decisions", checked)
                if args.force_decisions:
                    lp, dec = model.forward(tokens, forced_decisions(ref, dev))
                    checked = results["forced"] = compare(ref, lp, dec)
                    report("forced decisions (the peer's own choices on the forced path)", checked)
                e = checked["logprobs"]["rel_l2"]
                failed = not (e <= args.bound)
                print(f"log-probs rel-L2 {e:.3e} {'>' if failed else '<='} bound {args.bound:g}: "
                      f"{'FAIL' if failed else 'ok'}")
                for kind in ("indexer", "experts"):
                    a, b = checked[f"{kind}_rows_equal"]
                    if b and a < args.min_agree * b:
                        failed = True
                        print(f"{kind} rows with the same set {a}/{b} < {args.min_agree:g}: FAIL")
            if args.time > 0:
                ms = time_forward(model, tokens, args.time, dev)
                results["forward_ms"] = ms
                results["tokens_per_s"] = len(tok) / (ms * 1e-3)
                print(f"forward: {ms:.2f} ms (median of {args.time}), {results['tokens_per_s']:.1f} tokens/s")
                print(f"RESULT torch_model T={len(tok)} {ms:.4f} ms {results['tokens_per_s']:.1f} tokens/s")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
        return 1 if failed else 0
    except InputError as e:
        print(f"torch_model.py: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
