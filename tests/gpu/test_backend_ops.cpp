// Generic backend-vs-reference test of the CUDA kernels: a registry of op cases, each with seeded
// inputs (seeded from the case name), run through the CPU reference (kernels/cpu) and the CUDA op
// (kernels/cuda) on guarded device buffers. A case fails on a corrupted guard region, a NaN/Inf
// position mismatch, or any other value that differs in a single bit; it also asserts the output is
// not all zeros. BackendOps.Coverage lists every op of kernels/*.h with its number of cases.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <map>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "gpu_test_util.h"
#include "kernels/cuda/ops.h"
#include "model/communicator.h"  // expert_range (header only)
#include "test_util.h"

namespace dsv4 {
namespace {

using test::DeviceBuffers;
using test::same_floats;
using test::same_ints;

struct OpCase {
  std::string op;    // the op under test (a dsv4::cuda function)
  std::string name;  // the case, e.g. GEMM(m=37,n=70,k=300,block=64)
  std::function<void(const std::string& name)> run;
};

std::vector<OpCase>& registry() {
  static std::vector<OpCase> r;
  return r;
}
void add_case(std::string op, std::string name, std::function<void(const std::string&)> fn) {
  registry().push_back({std::move(op), std::move(name), std::move(fn)});
}

// Every op of kernels/*.h. `host` marks the ones that have no CUDA kernel by design (they run once
// on the host, e.g. the RoPE frequency table, or are internal helpers of another op).
struct OpInfo {
  const char* name;
  const char* header;
  bool host;
};
const std::vector<OpInfo>& all_ops() {
  static const std::vector<OpInfo> ops = {
      {"gemm", "linear.h", false},
      {"gemm_tiled", "cuda/ops.h (tiled GEMM kernel)", false},
      {"gemm_reference", "linear.h", true},
      {"rmsnorm", "norm.h", false},
      {"rope_freqs", "rope.h", true},
      {"rope_apply", "rope.h", false},
      {"sinkhorn", "mhc.h", true},
      {"hc_pre", "mhc.h", false},
      {"hc_post", "mhc.h", false},
      {"hc_head", "mhc.h", false},
      {"compressor", "compressor.h", false},
      {"hadamard", "compressor.h", false},
      {"topk_row", "indexer.h", true},
      {"indexer_topk", "indexer.h", false},
      {"indexer_topk_row_per_block", "cuda/ops.h (one block per query row)", false},
      {"indexer_score_ids", "indexer.h", false},
      {"build_index", "indexer.h", false},
      {"sparse_attention", "attention.h", false},
      {"router", "moe.h", false},
      {"moe_experts", "moe.h", false},
      {"logsumexp_row", "logits.h", true},
      {"log_softmax_gather", "logits.h", false},
      {"act_quant", "quant.h", false},
      {"fp8_sim", "quant.h", false},
      {"fp8_sim_inplace_bf16_cast", "quant.h", false},
      {"fp4_sim", "quant.h", false},
      {"bf16_round", "cuda/ops.h (graph step)", false},
      {"scale_bf16", "cuda/ops.h (graph step)", false},
      {"divide", "cuda/ops.h (graph step)", false},
      {"embed_streams", "cuda/ops.h (graph step)", false},
      {"copy_words", "cuda/ops.h (report snapshots)", false},
  };
  return ops;
}

std::string order_name(ReduceOrder o) {
  return o.block ? "block=" + std::to_string(o.block) : "chain";
}

// ---- GEMM ----------------------------------------------------------------------------------------
// Runs through cuda::gemm (op "gemm") and cuda::gemm_tiled (op "gemm_tiled"). `tiny` scales x
// rows from the third on by 1e-25 and w by 1e-22, so that most products underflow to +0 or -0 (and
// some to subnormals): the signs of zero lanes and sums must then match too.
void gemm_case(int64_t m, int64_t n, int64_t k, int64_t pad, ReduceOrder order, OutRound round,
               bool tiny = false) {
  for (const bool baseline : {false, true}) {
    const std::string name = std::string(baseline ? "GEMM_TILED" : "GEMM") + "(m=" + std::to_string(m) +
                             ",n=" + std::to_string(n) + ",k=" + std::to_string(k) +
                             ",pad=" + std::to_string(pad) + "," + order_name(order) +
                             (round == OutRound::bf16 ? ",bf16" : ",f32") + (tiny ? ",tiny" : "") + ")";
    add_case(baseline ? "gemm_tiled" : "gemm", name, [=](const std::string& nm) {
      auto g = test::rng_for(nm);
      const int64_t ldx = k + pad, ldw = k + pad, ldy = n + pad;
      auto x = test::randn_bf16(g, size_t(m * ldx));
      auto w = test::randn_bf16(g, size_t(n * ldw), 0.05f);
      if (tiny) {
        for (size_t i = size_t(2 * ldx); i < x.size(); ++i) x[i] *= 1e-25f;
        for (float& v : w) v *= 1e-22f;
      }
      std::vector<float> y(size_t(m * ldy), test::fill_value());
      GemmParams p;
      p.m = m, p.n = n, p.k = k, p.ldx = ldx, p.ldw = ldw, p.ldy = ldy, p.round = round, p.order = order;
      p.x = x.data(), p.w = w.data(), p.y = y.data();
      gemm(p);
      DeviceBuffers d;
      float* dy = d.upload(std::vector<float>(y.size(), test::fill_value()), "y");
      p.x = d.upload(x, "x"), p.w = d.upload(w, "w"), p.y = dy;
      if (baseline)
        cuda::gemm_tiled(p, nullptr);
      else
        cuda::gemm(p, nullptr);
      ASSERT_TRUE(d.guards_intact());
      const auto gy = d.download(dy, y.size());
      EXPECT_TRUE(same_floats(y, gy, "y"));
      if (k > 0) {
        EXPECT_FALSE(test::all_zero(gy));
      }
    });
  }
}

// ---- RMSNorm ------------------------------------------------------------------------------------
void rmsnorm_case(int64_t rows, int64_t dim, bool weight, bool in_place, ReduceOrder order, bool bf16 = false) {
  const std::string name = "RMSNORM(rows=" + std::to_string(rows) + ",dim=" + std::to_string(dim) +
                           (weight ? ",w" : ",no-w") + (in_place ? ",in-place," : ",") + order_name(order) +
                           (bf16 ? ",bf16-arith" : "") + ")";
  add_case("rmsnorm", name, [=](const std::string& nm) {
    auto g = test::rng_for(nm);
    const int64_t ld = dim + 3;
    const auto x = test::randn_bf16(g, size_t(rows * ld), 3.0f);
    const auto w = test::randn_bf16(g, size_t(dim), 1.0f);
    std::vector<float> y = in_place ? x : std::vector<float>(size_t(rows * ld), test::fill_value());
    RmsNormParams p;
    p.rows = rows, p.dim = dim, p.ldx = ld, p.ldy = ld, p.eps = 1e-6f, p.order = order, p.bf16_arith = bf16;
    p.x = in_place ? y.data() : x.data(), p.w = weight ? w.data() : nullptr, p.y = y.data();
    rmsnorm(p);
    DeviceBuffers d;
    float* dy = d.upload(in_place ? x : std::vector<float>(y.size(), test::fill_value()), "y");
    p.x = in_place ? dy : d.upload(x, "x");
    p.w = weight ? d.upload(w, "w") : nullptr;
    p.y = dy;
    cuda::rmsnorm(p, nullptr);
    ASSERT_TRUE(d.guards_intact());
    const auto gy = d.download(dy, y.size());
    EXPECT_TRUE(same_floats(y, gy, "y"));
    EXPECT_FALSE(test::all_zero(gy));
  });
}

// ---- RoPE ---------------------------------------------------------------------------------------
void rope_case(int64_t rows, int heads, int64_t head_dim, int rd, bool yarn, bool inverse, bool round) {
  const std::string name = "ROPE(rows=" + std::to_string(rows) + ",H=" + std::to_string(heads) +
                           ",hd=" + std::to_string(head_dim) + ",rd=" + std::to_string(rd) +
                           (yarn ? ",yarn" : "") + (inverse ? ",inverse" : "") + (round ? ",bf16" : ",f32") +
                           ")";
  add_case("rope_apply", name, [=](const std::string& nm) {
    auto g = test::rng_for(nm);
    RopeSpec spec;
    spec.rd = rd;
    spec.base = yarn ? 160000.0f : 10000.0f;
    spec.yarn = yarn;
    std::vector<float> freq(size_t(rd / 2));
    rope_freqs(spec, freq.data());
    std::vector<int64_t> pos(static_cast<size_t>(rows));
    std::uniform_int_distribution<int64_t> pd(0, 1 << 20);
    for (auto& v : pos) v = pd(g);
    if (rows > 0) pos[0] = 0;
    auto x = test::randn_bf16(g, size_t(rows * heads * head_dim));
    const auto x0 = x;
    RopeApplyParams p;
    p.rows = rows, p.heads = heads, p.ld = heads * head_dim, p.head_stride = head_dim,
    p.offset = head_dim - rd;
    p.rd = rd, p.inverse = inverse, p.round_bf16 = round;
    p.x = x.data(), p.pos = pos.data(), p.freq = freq.data();
    rope_apply(p);
    DeviceBuffers d;
    float* dx = d.upload(x0, "x");
    p.x = dx, p.pos = d.upload(pos, "pos"), p.freq = d.upload(freq, "freq");
    cuda::rope_apply(p, nullptr);
    ASSERT_TRUE(d.guards_intact());
    EXPECT_TRUE(same_floats(x, d.download(dx, x.size()), "x"));
  });
}

void register_dense_cases() {
  for (ReduceOrder o : {ReduceOrder{0}, ReduceOrder{64}}) {
    gemm_case(1, 1, 1, 0, o, OutRound::bf16);
    gemm_case(37, 70, 300, 0, o, OutRound::bf16);
    gemm_case(33, 65, 17, 5, o, OutRound::f32);
    gemm_case(5, 3, 0, 0, o, OutRound::bf16);
    gemm_case(64, 64, 1024, 0, o, OutRound::bf16);
    gemm_case(17, 24, 1024 + 8, 3, o, OutRound::f32);
    gemm_case(130, 97, 129, 1, o, OutRound::bf16);
  }
  gemm_case(3, 5, 200, 0, ReduceOrder{8}, OutRound::f32);
  // Shapes with at least ~100 output tiles of 64 x 64, where cuda::gemm takes the lane-split kernel:
  // full and partial tiles along m and n, k with a partial stage of 32 and a partial step of 8,
  // 16-byte aligned rows (ld % 4 == 0: float4 loads, also with k % 4 != 0) and unaligned ones.
  for (ReduceOrder o : {ReduceOrder{0}, ReduceOrder{64}, ReduceOrder{8}}) {
    for (OutRound r : {OutRound::bf16, OutRound::f32}) {
      gemm_case(768, 512, 1024, 0, o, r);  // full tiles only, aligned
      gemm_case(257, 1500, 517, 0, o, r);  // unaligned rows, k % 8 == 5
      gemm_case(600, 700, 1001, 3, o, r);  // aligned rows (ld = 1004), k % 4 == 1
    }
    gemm_case(130, 2100, 300, 1, o, OutRound::bf16);
    gemm_case(1000, 650, 75, 0, o, OutRound::f32);  // k in 3 stages, the last one partial
    gemm_case(700, 1000, 7, 1, o, OutRound::bf16);  // k < 8: one partial step
    gemm_case(640, 1030, 0, 0, o, OutRound::bf16);  // k == 0: every output is +0
    gemm_case(640, 1030, 64, 0, o, OutRound::f32);
    gemm_case(200, 4000, 136, 4, o, OutRound::bf16);
    // Underflowing products: -0 lanes must survive steps past k (k % 8 != 0) and chain ends.
    gemm_case(300, 2000, 12, 0, o, OutRound::f32, true);
    gemm_case(300, 2000, 75, 1, o, OutRound::bf16, true);
    gemm_case(33, 20, 75, 1, o, OutRound::f32, true);
  }
  for (ReduceOrder o : {ReduceOrder{0}, ReduceOrder{64}}) {
    rmsnorm_case(1, 7, true, false, o);
    rmsnorm_case(37, 256, true, false, o);
    rmsnorm_case(37, 256, true, true, o);
    rmsnorm_case(70, 192, false, true, o);
    rmsnorm_case(5, 1000, true, false, o);
    rmsnorm_case(70, 192, false, true, o, true);  // bf16 arithmetic (the attention.q_norm site)
    rmsnorm_case(37, 512, false, false, o, true);
  }
  // Rows of 1024 elements or more take the kernel that stages one row a block in shared memory
  // (kernels/cuda/norm.cu): model widths, lengths that are not multiples of 8 or 32, in place, bf16
  // arithmetic, one row and many; past its shared-memory limit (24576 floats) the 8-thread kernel.
  for (ReduceOrder o : {ReduceOrder{0}, ReduceOrder{64}}) {
    rmsnorm_case(1, 4096, true, false, o);
    rmsnorm_case(300, 4096, true, false, o);
    rmsnorm_case(300, 4096, true, true, o);
    rmsnorm_case(33, 1024, false, false, o);
    rmsnorm_case(70, 1031, true, true, o);
    rmsnorm_case(9, 7173, true, false, o);
    rmsnorm_case(41, 4096, false, true, o, true);
    rmsnorm_case(5, 1029, false, false, o, true);
    rmsnorm_case(3, 24580, true, false, o);
  }
  rmsnorm_case(20, 3000, true, false, ReduceOrder{8});
  rmsnorm_case(20, 3000, true, true, ReduceOrder{1024});
  rope_case(17, 5, 192, 64, false, false, true);
  rope_case(17, 5, 192, 64, true, true, true);
  rope_case(33, 1, 64, 64, true, false, false);
  rope_case(1, 3, 128, 16, false, true, false);
}

// ---- mHC ----------------------------------------------------------------------------------------
void hc_case(const std::string& op, int64_t T, int hc, int64_t D, ReduceOrder order) {
  const std::string name = "HC(" + op + ",T=" + std::to_string(T) + ",hc=" + std::to_string(hc) +
                           ",D=" + std::to_string(D) + "," + order_name(order) + ")";
  add_case(op, name, [=](const std::string& nm) {
    auto g = test::rng_for(nm);
    const int64_t hcD = hc * D;
    const auto X = test::randn_bf16(g, size_t(T * hcD));
    DeviceBuffers d;
    if (op == "hc_pre") {
      const int64_t rows = int64_t(2 + hc) * hc;
      const auto fn = test::randn_bf16(g, size_t(rows * hcD), 0.05f);
      const auto scale = test::randn_bf16(g, 3, 0.5f), base = test::randn_bf16(g, size_t(rows), 0.5f);
      const float fv = test::fill_value();
      std::vector<float> y(size_t(T * D), fv), pre(size_t(T * hc), fv), post(size_t(T * hc), fv),
          comb(size_t(T * hc * hc), fv);
      HcPreParams p;
      p.T = T, p.hc = hc, p.D = D, p.order = order;
      p.X = X.data(), p.fn = fn.data(), p.scale = scale.data(), p.base = base.data();
      p.y = y.data(), p.pre = pre.data(), p.post = post.data(), p.comb = comb.data();
      hc_pre(p);
      p.X = d.upload(X, "X"), p.fn = d.upload(fn, "fn"), p.scale = d.upload(scale, "scale");
      p.base = d.upload(base, "base");
      p.y = d.upload(std::vector<float>(y.size(), fv), "y");
      p.pre = d.upload(std::vector<float>(pre.size(), fv), "pre");
      p.post = d.upload(std::vector<float>(post.size(), fv), "post");
      p.comb = d.upload(std::vector<float>(comb.size(), fv), "comb");
      cuda::hc_pre(p, nullptr);
      ASSERT_TRUE(d.guards_intact());
      EXPECT_TRUE(same_floats(y, d.download(p.y, y.size()), "y"));
      EXPECT_TRUE(same_floats(pre, d.download(p.pre, pre.size()), "pre"));
      EXPECT_TRUE(same_floats(post, d.download(p.post, post.size()), "post"));
      EXPECT_TRUE(same_floats(comb, d.download(p.comb, comb.size()), "comb"));
      EXPECT_FALSE(test::all_zero(y));
    } else if (op == "hc_post") {
      const auto f = test::randn_bf16(g, size_t(T * D)), post = test::randn_bf16(g, size_t(T * hc));
      const auto comb = test::randn_bf16(g, size_t(T * hc * hc), 0.3f);
      std::vector<float> out(size_t(T * hcD), test::fill_value());
      HcPostParams p;
      p.T = T, p.hc = hc, p.D = D;
      p.f = f.data(), p.R = X.data(), p.post = post.data(), p.comb = comb.data(), p.out = out.data();
      hc_post(p);
      p.f = d.upload(f, "f"), p.R = d.upload(X, "R"), p.post = d.upload(post, "post");
      p.comb = d.upload(comb, "comb"),
      p.out = d.upload(std::vector<float>(out.size(), test::fill_value()), "out");
      cuda::hc_post(p, nullptr);
      ASSERT_TRUE(d.guards_intact());
      EXPECT_TRUE(same_floats(out, d.download(p.out, out.size()), "out"));
      EXPECT_FALSE(test::all_zero(out));
    } else {
      const auto fn = test::randn_bf16(g, size_t(hc * hcD), 0.05f);
      const auto scale = test::randn_bf16(g, 1, 0.5f), base = test::randn_bf16(g, size_t(hc), 0.5f);
      const float fv = test::fill_value();
      std::vector<float> y(size_t(T * D), fv), w(size_t(T * hc), fv);
      HcHeadParams p;
      p.T = T, p.hc = hc, p.D = D, p.order = order;
      p.X = X.data(), p.fn = fn.data(), p.scale = scale.data(), p.base = base.data(), p.y = y.data(),
      p.w = w.data();
      hc_head(p);
      p.X = d.upload(X, "X"), p.fn = d.upload(fn, "fn"), p.scale = d.upload(scale, "scale");
      p.base = d.upload(base, "base");
      p.y = d.upload(std::vector<float>(y.size(), fv), "y"),
      p.w = d.upload(std::vector<float>(w.size(), fv), "w");
      cuda::hc_head(p, nullptr);
      ASSERT_TRUE(d.guards_intact());
      EXPECT_TRUE(same_floats(y, d.download(p.y, y.size()), "y"));
      EXPECT_TRUE(same_floats(w, d.download(p.w, w.size()), "w"));
      EXPECT_FALSE(test::all_zero(y));
    }
  });
}

// ---- compressor and Hadamard --------------------------------------------------------------------
void compressor_case(int64_t T, int64_t D, int ratio, int64_t dd, int rd, bool had, ReduceOrder order) {
  const std::string name = "COMPRESSOR(T=" + std::to_string(T) + ",D=" + std::to_string(D) +
                           ",r=" + std::to_string(ratio) + ",d=" + std::to_string(dd) +
                           ",rd=" + std::to_string(rd) + (had ? ",hadamard," : ",") + order_name(order) + ")";
  add_case("compressor", name, [=](const std::string& nm) {
    auto g = test::rng_for(nm);
    const int64_t coff = ratio == 4 ? 2 : 1, cw = coff * dd, G = compressor_groups(T, ratio);
    const auto x = test::randn_bf16(g, size_t(T * D)), wkv = test::randn_bf16(g, size_t(cw * D), 0.1f),
               wgate = test::randn_bf16(g, size_t(cw * D), 0.1f),
               ape = test::randn_bf16(g, size_t(ratio * cw)), norm = test::randn_bf16(g, size_t(dd), 1.0f);
    RopeSpec spec{rd, 160000.0f, true};
    std::vector<float> freq(size_t(rd / 2));
    rope_freqs(spec, freq.data());
    std::vector<float> out(size_t(G * dd), test::fill_value());
    CompressorParams p;
    p.T = T, p.D = D, p.ratio = ratio, p.d = dd, p.rd = rd, p.hadamard = had, p.order = order;
    p.x = x.data(), p.wkv = wkv.data(), p.wgate = wgate.data(), p.ape = ape.data(), p.norm = norm.data();
    p.freq = freq.data(), p.out = out.data();
    compressor(p);
    DeviceBuffers d;
    p.x = d.upload(x, "x"), p.wkv = d.upload(wkv, "wkv"), p.wgate = d.upload(wgate, "wgate");
    p.ape = d.upload(ape, "ape"), p.norm = d.upload(norm, "norm"), p.freq = d.upload(freq, "freq");
    p.out = d.upload(std::vector<float>(out.size(), test::fill_value()), "out");
    cuda::compressor(p, nullptr);
    ASSERT_TRUE(d.guards_intact());
    const auto go = d.download(p.out, out.size());
    EXPECT_TRUE(same_floats(out, go, "out"));
    if (G > 0) {
      EXPECT_FALSE(test::all_zero(go));
    }
  });
}

void hadamard_case(int64_t rows, int64_t n, int64_t ld) {
  const std::string name =
      "HADAMARD(rows=" + std::to_string(rows) + ",n=" + std::to_string(n) + ",ld=" + std::to_string(ld) + ")";
  add_case("hadamard", name, [=](const std::string& nm) {
    auto g = test::rng_for(nm);
    auto x = test::randn_bf16(g, size_t(rows * ld));
    DeviceBuffers d;
    float* dx = d.upload(x, "x");
    hadamard(x.data(), rows, n, ld);
    cuda::hadamard(dx, rows, n, ld, nullptr);
    ASSERT_TRUE(d.guards_intact());
    EXPECT_TRUE(same_floats(x, d.download(dx, x.size()), "x"));
  });
}

// ---- indexer ------------------------------------------------------------------------------------
// Runs through cuda::indexer_topk (op "indexer_topk") and cuda::indexer_topk_row_per_block (op
// "indexer_topk_row_per_block"). G = T / ratio. Values: "randn" (distinct scores), "ties" (dyadic values:
// many equal scores, many exact zeros after relu), "nan" (randn with NaN in some keys, so whole score
// columns are NaN), "dup" (randn with planted equal scores: key g = 2 mod 5 copies key g - 1, key
// g = 3 mod 7 copies key g / 2, so every row that sees both has exactly equal scores there).
void indexer_case(int64_t T, int Hi, int64_t Di, int topk, const std::string& values, ReduceOrder order,
                  int ratio = 4, bool bf16 = false, int64_t pos0 = 0) {
  for (const bool baseline : {false, true}) {
    const std::string name =
        std::string(baseline ? "INDEXER_ROW_PER_BLOCK" : "INDEXER") + "(T=" + std::to_string(T) +
        ",Hi=" + std::to_string(Hi) + ",Di=" + std::to_string(Di) + ",topk=" + std::to_string(topk) + "," +
        values + "," + order_name(order) + (ratio != 4 ? ",ratio=" + std::to_string(ratio) : "") +
        (bf16 ? ",bf16-scores" : "") + (pos0 ? ",pos0=" + std::to_string(pos0) : "") + ")";
    add_case(baseline ? "indexer_topk_row_per_block" : "indexer_topk", name, [=](const std::string& nm) {
      auto g = test::rng_for(nm);
      const int64_t G = (pos0 + T) / ratio;  // the keys of every position up to the last row's
      const int k = int(std::min<int64_t>(topk, G));
      std::vector<float> qi, ki, wt;
      if (values == "ties") {
        qi = test::dyadic(g, size_t(T * Hi * Di)), ki = test::dyadic(g, size_t(G * Di));
        wt = test::dyadic(g, size_t(T * Hi));
        for (auto& v : ki) v = v * 0.25f;
        for (int64_t i = 0; i < G * Di; i += 3) ki[size_t(i)] = 0.0f;
      } else {
        qi = test::randn_bf16(g, size_t(T * Hi * Di)), ki = test::randn_bf16(g, size_t(G * Di));
        wt = test::randn_bf16(g, size_t(T * Hi), 0.1f);
      }
      if (values == "nan")
        for (int64_t grp = 1; grp < G; grp += 7)
          ki[size_t(grp * Di + 3 % Di)] = std::numeric_limits<float>::quiet_NaN();
      if (values == "dup")
        for (int64_t grp = 1; grp < G; ++grp) {
          const int64_t src = grp % 5 == 2 ? grp - 1 : grp % 7 == 3 ? grp / 2 : grp;
          std::copy_n(ki.begin() + src * Di, Di, ki.begin() + grp * Di);
        }
      const float fv = test::fill_value();
      std::vector<int32_t> ids(size_t(T * k), 12345);
      std::vector<float> margin(static_cast<size_t>(T), fv), score(size_t(T * k), fv);
      IndexerParams p;
      p.T = T, p.Hi = Hi, p.Di = Di, p.G = G, p.k = k, p.ratio = ratio, p.order = order, p.bf16_scores = bf16;
      p.pos0 = pos0;
      p.qi = qi.data(), p.ki = ki.data(), p.wt = wt.data();
      p.ids = ids.data(), p.margin = margin.data(), p.score = score.data();
      indexer_topk(p);
      DeviceBuffers d;
      p.qi = d.upload(qi, "qi"), p.ki = d.upload(ki, "ki"), p.wt = d.upload(wt, "wt");
      p.ids = d.upload(std::vector<int32_t>(ids.size(), 12345), "ids");
      p.margin = d.upload(std::vector<float>(margin.size(), fv), "margin");
      p.score = d.upload(std::vector<float>(score.size(), fv), "score");
      if (baseline)
        cuda::indexer_topk_row_per_block(p, nullptr);
      else
        cuda::indexer_topk(p, nullptr);
      ASSERT_TRUE(d.guards_intact());
      EXPECT_TRUE(same_ints(ids, d.download(p.ids, ids.size()), "ids"));
      EXPECT_TRUE(same_floats(margin, d.download(p.margin, margin.size()), "margin"));
      EXPECT_TRUE(same_floats(score, d.download(p.score, score.size()), "score"));
    });
  }
}

void indexer_score_ids_case(int64_t T, int Hi, int64_t Di, int k) {
  const std::string name = "INDEXER_SCORE_IDS(T=" + std::to_string(T) + ",Hi=" + std::to_string(Hi) +
                           ",Di=" + std::to_string(Di) + ",k=" + std::to_string(k) + ")";
  add_case("indexer_score_ids", name, [=](const std::string& nm) {
    auto g = test::rng_for(nm);
    const int64_t G = T / 4;
    const auto qi = test::randn_bf16(g, size_t(T * Hi * Di)), ki = test::randn_bf16(g, size_t(G * Di)),
               wt = test::randn_bf16(g, size_t(T * Hi), 0.1f);
    std::vector<int32_t> ids(size_t(T * k));
    std::uniform_int_distribution<int32_t> gd(-3, int32_t(G) + 2);
    for (auto& v : ids) v = gd(g);  // -1, other negatives and ids >= G give NaN
    std::vector<float> score(size_t(T * k), test::fill_value());
    IndexerParams p;
    p.T = T, p.Hi = Hi, p.Di = Di, p.G = G, p.k = k, p.ratio = 4;
    p.qi = qi.data(), p.ki = ki.data(), p.wt = wt.data();
    indexer_score_ids(p, ids.data(), score.data());
    DeviceBuffers d;
    p.qi = d.upload(qi, "qi"), p.ki = d.upload(ki, "ki"), p.wt = d.upload(wt, "wt");
    const int32_t* dids = d.upload(ids, "ids");
    float* dscore = d.upload(std::vector<float>(score.size(), test::fill_value()), "score");
    cuda::indexer_score_ids(p, dids, dscore, nullptr);
    ASSERT_TRUE(d.guards_intact());
    EXPECT_TRUE(same_floats(score, d.download(dscore, score.size()), "score"));
  });
}

void build_index_case(int64_t T, int W, CompressedKind kind, int ratio, int k) {
  const char* kn = kind == CompressedKind::none ? "none" : kind == CompressedKind::c128 ? "c128" : "c4";
  const std::string name = "BUILD_INDEX(T=" + std::to_string(T) + ",W=" + std::to_string(W) + "," + kn +
                           ",ratio=" + std::to_string(ratio) + ",k=" + std::to_string(k) + ")";
  add_case("build_index", name, [=](const std::string& nm) {
    auto g = test::rng_for(nm);
    std::vector<int32_t> sel(size_t(T * k), -1);
    for (int64_t t = 0; t < T; ++t) {
      const int64_t vis = (t + 1) / 4;
      for (int j = 0; j < k; ++j)
        if (vis > 0 && g() % 3 != 0) sel[size_t(t * k + j)] = int32_t(g() % uint64_t(vis));
    }
    IndexBuildParams p;
    p.T = T, p.W = W, p.kind = kind, p.ratio = ratio, p.k = k, p.sel = sel.data();
    const int64_t width = index_width(p);
    std::vector<int32_t> idx(size_t(T * width), 777);
    p.idx = idx.data();
    build_index(p);
    DeviceBuffers d;
    p.sel = d.upload(sel, "sel");
    p.idx = d.upload(std::vector<int32_t>(idx.size(), 777), "idx");
    cuda::build_index(p, nullptr);
    ASSERT_TRUE(d.guards_intact());
    EXPECT_TRUE(same_ints(idx, d.download(p.idx, idx.size()), "idx"));
  });
}

// ---- sparse attention ---------------------------------------------------------------------------
// splits > 0: the split-KV order (its own kernel). `few` > 0 also keeps rows 2, 3, ... at 1, 2, ...
// up to `few` valid slots (fewer valid slots than parts when few < splits).
void attention_case(int64_t T, int H, int64_t K, int64_t Dh, ReduceOrder order, int splits = 0, int few = 0,
                    int online = 0) {
  const std::string name = "ATTN(T=" + std::to_string(T) + ",H=" + std::to_string(H) +
                           ",K=" + std::to_string(K) + ",Dh=" + std::to_string(Dh) + "," + order_name(order) +
                           (splits ? ",splits=" + std::to_string(splits) : std::string()) +
                           (few ? ",few=" + std::to_string(few) : std::string()) +
                           (online ? ",online=" + std::to_string(online) : std::string()) + ")";
  add_case("sparse_attention", name, [=](const std::string& nm) {
    auto g = test::rng_for(nm);
    const int64_t N = T + T / 4;
    const auto q = test::randn_bf16(g, size_t(T * H * Dh)), kv = test::randn_bf16(g, size_t(N * Dh)),
               sink = test::randn_bf16(g, size_t(H));
    // Row 0: empty; row 1: one valid key at the last slot; others: random with ~1/3 masked.
    std::vector<int32_t> idx(size_t(T * K));
    for (int64_t t = 0; t < T; ++t)
      for (int64_t j = 0; j < K; ++j)
        idx[size_t(t * K + j)] =
            (t == 0 || (t == 1 && j != K - 1) || g() % 3 == 0) ? -1 : int32_t(g() % uint64_t(N));
    for (int64_t t = 2; t < T && t - 1 <= few; ++t) {  // row t: its first t - 1 valid slots only
      int64_t seen = 0;
      for (int64_t j = 0; j < K; ++j) {
        int32_t& v = idx[size_t(t * K + j)];
        if (v >= 0 && seen++ >= t - 1) v = -1;
      }
    }
    const float fv = test::fill_value();
    std::vector<float> o(size_t(T * H * Dh), fv), lse(size_t(T * H), fv);
    SparseAttnParams p;
    p.T = T, p.H = H, p.Dh = Dh, p.N = N, p.K = K, p.scale = 1.0f / std::sqrt(float(Dh)), p.order = order;
    p.q = q.data(), p.kv = kv.data(), p.idx = idx.data(), p.sink = sink.data(), p.o = o.data(),
    p.lse = lse.data();
    p.splits = splits;
    p.online_block = online;
    ASSERT_EQ(sparse_attention_check(p), nullptr);
    sparse_attention(p);
    DeviceBuffers d;
    p.q = d.upload(q, "q"), p.kv = d.upload(kv, "kv"), p.idx = d.upload(idx, "idx"),
    p.sink = d.upload(sink, "sink");
    p.o = d.upload(std::vector<float>(o.size(), fv), "o"),
    p.lse = d.upload(std::vector<float>(lse.size(), fv), "lse");
    cuda::sparse_attention(p, nullptr);
    ASSERT_TRUE(d.guards_intact());
    const auto go = d.download(p.o, o.size());
    EXPECT_TRUE(same_floats(o, go, "o"));
    EXPECT_TRUE(same_floats(lse, d.download(p.lse, lse.size()), "lse"));
    if (K > 0) {
      EXPECT_FALSE(test::all_zero(go));
    }
  });
}

// ---- router and experts -------------------------------------------------------------------------
void router_case(int64_t T, int E, int k, const std::string& mode, bool ties) {
  const std::string name = "ROUTER(T=" + std::to_string(T) + ",E=" + std::to_string(E) +
                           ",k=" + std::to_string(k) + "," + mode + (ties ? ",ties" : "") + ")";
  add_case("router", name, [=](const std::string& nm) {
    auto g = test::rng_for(nm);
    const int V = 50;
    auto logits = ties ? test::dyadic(g, size_t(T * E)) : test::randn_bf16(g, size_t(T * E), 2.0f);
    if (T > 3) logits[size_t(3 * E + 1)] = std::numeric_limits<float>::quiet_NaN();
    const auto bias = ties ? std::vector<float>(size_t(E), 0.0f) : test::randn_bf16(g, size_t(E), 0.1f);
    auto distinct_row = [&](int32_t* row) {
      std::vector<int32_t> all(static_cast<size_t>(E));
      for (int e = 0; e < E; ++e) all[size_t(e)] = e;
      std::shuffle(all.begin(), all.end(), g);
      std::copy(all.begin(), all.begin() + k, row);
    };
    std::vector<int32_t> tid2eid(size_t(V * k)), tokens(static_cast<size_t>(T)), forced(size_t(T * k));
    for (int v = 0; v < V; ++v) distinct_row(tid2eid.data() + v * k);
    for (auto& t : tokens) t = int32_t(g() % V);
    for (int64_t t = 0; t < T; ++t) distinct_row(forced.data() + t * k);
    const float fv = test::fill_value();
    std::vector<int32_t> ids(size_t(T * k), 999);
    std::vector<float> w(size_t(T * k), fv), margin(static_cast<size_t>(T), fv), scores(size_t(T * E), fv);
    RouterParams p;
    p.T = T, p.E = E, p.k = k, p.norm_topk_prob = mode != "learned-unnormalised",
    p.routed_scaling_factor = 1.5f;
    p.logits = logits.data();
    p.bias = mode == "hash" ? nullptr : bias.data();
    p.tid2eid = mode == "hash" ? tid2eid.data() : nullptr;
    p.tokens = tokens.data();
    p.forced = mode == "forced" ? forced.data() : nullptr;
    p.ids = ids.data(), p.weights = w.data(), p.margin = margin.data(), p.scores = scores.data();
    router(p);
    DeviceBuffers d;
    p.logits = d.upload(logits, "logits");
    p.bias = mode == "hash" ? nullptr : d.upload(bias, "bias");
    p.tid2eid = mode == "hash" ? d.upload(tid2eid, "tid2eid") : nullptr;
    p.tokens = d.upload(tokens, "tokens");
    p.forced = mode == "forced" ? d.upload(forced, "forced") : nullptr;
    p.ids = d.upload(std::vector<int32_t>(ids.size(), 999), "ids");
    p.weights = d.upload(std::vector<float>(w.size(), fv), "weights");
    p.margin = d.upload(std::vector<float>(margin.size(), fv), "margin");
    p.scores = d.upload(std::vector<float>(scores.size(), fv), "scores");
    cuda::router(p, nullptr);
    ASSERT_TRUE(d.guards_intact());
    EXPECT_TRUE(same_ints(ids, d.download(p.ids, ids.size()), "ids"));
    EXPECT_TRUE(same_floats(w, d.download(p.weights, w.size()), "weights"));
    EXPECT_TRUE(same_floats(margin, d.download(p.margin, margin.size()), "margin"));
    EXPECT_TRUE(same_floats(scores, d.download(p.scores, scores.size()), "scores"));
  });
}

// `used` experts receive all routed pairs (the others are empty groups).
void moe_case(int64_t T, int64_t D, int64_t I, int E, int k, int used, int n_shared, int64_t I_shared,
              float limit, bool clamp_shared, ReduceOrder order, bool round_each = false) {
  const std::string name = "MOE(T=" + std::to_string(T) + ",D=" + std::to_string(D) +
                           ",I=" + std::to_string(I) + ",E=" + std::to_string(E) + ",k=" + std::to_string(k) +
                           ",used=" + std::to_string(used) + ",shared=" + std::to_string(n_shared) + "x" +
                           std::to_string(I_shared) + ",L=" + std::to_string(int(limit * 100)) +
                           (clamp_shared ? ",clamp-shared," : ",") + order_name(order) +
                           (round_each ? ",round-each" : "") + ")";
  add_case("moe_experts", name, [=](const std::string& nm) {
    auto g = test::rng_for(nm);
    const int64_t Is = I_shared > 0 ? I_shared : I;
    const auto x = test::randn_bf16(g, size_t(T * D));
    std::vector<int32_t> ids(size_t(T * k));
    for (int64_t t = 0; t < T; ++t) {
      std::vector<int32_t> all(static_cast<size_t>(used));
      for (int e = 0; e < used; ++e) all[size_t(e)] = e * E / used;  // spread over [0, E)
      std::shuffle(all.begin(), all.end(), g);
      std::sort(all.begin(), all.begin() + k);
      std::copy(all.begin(), all.begin() + k, ids.begin() + t * k);
    }
    const auto weights = test::randn_bf16(g, size_t(T * k), 0.5f);
    std::vector<std::vector<float>> host_w;
    std::vector<ExpertWeights> ex(static_cast<size_t>(E)), sh(static_cast<size_t>(n_shared));
    for (int e = 0; e < E + n_shared; ++e) {
      const int64_t ii = e < E ? I : Is;
      host_w.push_back(test::randn_bf16(g, size_t(ii * D), 0.15f));
      host_w.push_back(test::randn_bf16(g, size_t(ii * D), 0.15f));
      host_w.push_back(test::randn_bf16(g, size_t(D * ii), 0.15f));
    }
    auto weights_of = [&](int e, const std::vector<const float*>& ptrs) {
      return ExpertWeights{ptrs[size_t(3 * e)], ptrs[size_t(3 * e + 1)], ptrs[size_t(3 * e + 2)]};
    };
    std::vector<const float*> hp, dp;
    DeviceBuffers d;
    for (size_t i = 0; i < host_w.size(); ++i) {
      hp.push_back(host_w[i].data());
      dp.push_back(d.upload(host_w[i], "expert weight " + std::to_string(i)));
    }
    for (int e = 0; e < E; ++e) ex[size_t(e)] = weights_of(e, hp);
    for (int s = 0; s < n_shared; ++s) sh[size_t(s)] = weights_of(E + s, hp);
    std::vector<float> out(size_t(T * D), test::fill_value());
    MoeParams p;
    p.T = T, p.D = D, p.I = I, p.I_shared = I_shared, p.E = E, p.k = k, p.n_shared = n_shared;
    p.swiglu_limit = limit, p.clamp_shared = clamp_shared, p.order = order, p.round_each = round_each;
    p.x = x.data(), p.ids = ids.data(), p.weights = weights.data(), p.experts = ex.data(),
    p.shared = sh.data();
    p.out = out.data();
    ASSERT_EQ(moe_check(p), nullptr);
    moe_experts(p);
    std::vector<ExpertWeights> ex_host = ex, sh_host = sh;
    MoeParams ph = p;  // host memory, for the parts below
    ph.experts = ex_host.data(), ph.shared = sh_host.data();
    for (int e = 0; e < E; ++e) ex[size_t(e)] = weights_of(e, dp);
    for (int s = 0; s < n_shared; ++s) sh[size_t(s)] = weights_of(E + s, dp);
    p.x = d.upload(x, "x"), p.ids = d.upload(ids, "ids"), p.weights = d.upload(weights, "weights");
    p.out = d.upload(std::vector<float>(out.size(), test::fill_value()), "out");
    cuda::moe_experts(p, nullptr);
    ASSERT_TRUE(d.guards_intact());
    const auto go = d.download(p.out, out.size());
    EXPECT_TRUE(same_floats(out, go, "out"));
    EXPECT_FALSE(test::all_zero(go));

    // The parts of expert parallelism: every expert's pair count, each rank's routed outputs equal to
    // the CPU's bit for bit, and their concatenation in rank order, put in slot order and summed, equal
    // to moe_experts, for 1, 2, 3 and E + 1 ranks (a rank with no expert among them).
    const std::vector<int64_t> count = cuda::moe_expert_counts(p, nullptr);
    ASSERT_EQ(count.size(), size_t(E));
    for (int e = 0; e < E; ++e) EXPECT_EQ(count[size_t(e)], int64_t(moe_pairs(ph, e, e + 1).size())) << "expert " << e;
    for (int ranks : {1, 2, 3, E + 1}) {
      std::vector<float> gathered;
      for (int r = 0; r < ranks; ++r) {
        const ExpertRange er = expert_range(E, r, ranks);
        std::vector<float> want(moe_pairs(ph, er.first, er.last).size() * size_t(D));
        moe_routed_outputs(ph, er.first, er.last, want.data());
        float* dy = d.upload(std::vector<float>(std::max<size_t>(want.size(), 1), test::fill_value()), "y");
        cuda::moe_routed_outputs(p, er.first, er.last, dy, nullptr);
        const auto got = d.download(dy, want.size());
        EXPECT_TRUE(same_floats(want, got, "routed outputs of rank " + std::to_string(r) + " of " + std::to_string(ranks)));
        gathered.insert(gathered.end(), got.begin(), got.end());
      }
      const float* dall = d.upload(gathered.empty() ? std::vector<float>(1) : gathered, "gathered");
      float* dslot = d.upload(std::vector<float>(size_t(T * k * D), test::fill_value()), "slots");
      cuda::moe_scatter_pairs(p, dall, dslot, nullptr);
      float* dout = d.upload(std::vector<float>(out.size(), test::fill_value()), "out of the parts");
      cuda::moe_combine(p, dslot, dout, nullptr);
      EXPECT_TRUE(same_floats(out, d.download(dout, out.size()), "out of " + std::to_string(ranks) + " ranks"));
    }
    ASSERT_TRUE(d.guards_intact());
  });
}

// ---- logits -------------------------------------------------------------------------------------
void log_softmax_case(int64_t rows, int64_t V) {
  const std::string name = "LOG_SOFTMAX(rows=" + std::to_string(rows) + ",V=" + std::to_string(V) + ")";
  add_case("log_softmax_gather", name, [=](const std::string& nm) {
    auto g = test::rng_for(nm);
    auto l = test::randn_bf16(g, size_t(rows * V), 3.0f);
    const float inf = std::numeric_limits<float>::infinity();
    // Special rows: a NaN, all -inf, a +inf, some -inf entries, all zeros (+0 and -0).
    if (rows > 5) {
      l[size_t(1 * V + V / 2)] = std::numeric_limits<float>::quiet_NaN();
      for (int64_t v = 0; v < V; ++v) l[size_t(2 * V + v)] = -inf;
      l[size_t(3 * V + 1)] = inf;
      for (int64_t v = 0; v < V; v += 5) l[size_t(4 * V + v)] = -inf;
      for (int64_t v = 0; v < V; ++v) l[size_t(5 * V + v)] = (v % 2) ? -0.0f : 0.0f;
    }
    std::vector<int32_t> target(static_cast<size_t>(rows));
    for (auto& t : target) t = int32_t(g() % uint64_t(V));
    if (rows > 7) target[6] = -1, target[7] = int32_t(V);  // no target: left unchanged
    std::vector<float> lp(static_cast<size_t>(rows), test::fill_value());
    log_softmax_gather(l.data(), rows, V, target.data(), lp.data());
    DeviceBuffers d;
    const float* dl = d.upload(l, "logits");
    const int32_t* dt = d.upload(target, "target");
    float* dlp = d.upload(std::vector<float>(lp.size(), test::fill_value()), "logprob");
    cuda::log_softmax_gather(dl, rows, V, dt, dlp, nullptr);
    ASSERT_TRUE(d.guards_intact());
    EXPECT_TRUE(same_floats(lp, d.download(dlp, lp.size()), "logprob"));
  });
}

// ---- FP8 / FP4 ----------------------------------------------------------------------------------
// x spans many binades (and includes zeros and huge values) so every scale and rounding path runs.
std::vector<float> wide_values(std::mt19937_64& g, size_t n) {
  std::vector<float> v = test::randn_bf16(g, n);
  std::uniform_int_distribution<int> e(-20, 12);
  for (size_t i = 0; i < n; ++i) v[i] = num::bf16_round(std::ldexp(v[i], e(g) / 4));
  for (size_t i = 0; i < n; i += 37) v[i] = 0.0f;
  if (n > 50) v[50] = 3.0e5f, v[49] = -7.0e4f;
  return v;
}

void quant_case(const std::string& op, int64_t rows, int64_t cols, int64_t ld, int block, ScaleFmt fmt) {
  const std::string name = "QUANT(" + op + ",rows=" + std::to_string(rows) + ",cols=" + std::to_string(cols) +
                           ",ld=" + std::to_string(ld) + ",block=" + std::to_string(block) +
                           (fmt == ScaleFmt::ue8m0 ? ",ue8m0" : ",f32-scale") + ")";
  add_case(op, name, [=](const std::string& nm) {
    auto g = test::rng_for(nm);
    DeviceBuffers d;
    if (op == "act_quant") {
      const auto x = wide_values(g, size_t(rows * cols));
      std::vector<uint8_t> q(size_t(rows * cols), 0x55);
      std::vector<float> scale(size_t(rows * (cols / block)), test::fill_value());
      ActQuantParams p;
      p.rows = rows, p.cols = cols, p.block = block, p.fmt = fmt;
      p.x = x.data(), p.q = q.data(), p.scale = scale.data();
      act_quant(p);
      p.x = d.upload(x, "x"), p.q = d.upload(std::vector<uint8_t>(q.size(), 0x55), "q");
      p.scale = d.upload(std::vector<float>(scale.size(), test::fill_value()), "scale");
      cuda::act_quant(p, nullptr);
      ASSERT_TRUE(d.guards_intact());
      EXPECT_TRUE(same_ints(q, d.download(p.q, q.size()), "q"));
      EXPECT_TRUE(same_floats(scale, d.download(p.scale, scale.size()), "scale"));
      return;
    }
    auto x = wide_values(g, size_t(rows * ld));
    float* dx = d.upload(x, "x");
    Fp8SimParams p;
    p.rows = rows, p.cols = cols, p.ld = ld, p.block = block, p.fmt = fmt, p.x = x.data();
    if (op == "fp8_sim") fp8_sim(p);
    if (op == "fp8_sim_inplace_bf16_cast") fp8_sim_inplace_bf16_cast(p);
    if (op == "fp4_sim") fp4_sim(p);
    p.x = dx;
    if (op == "fp8_sim") cuda::fp8_sim(p, nullptr);
    if (op == "fp8_sim_inplace_bf16_cast") cuda::fp8_sim_inplace_bf16_cast(p, nullptr);
    if (op == "fp4_sim") cuda::fp4_sim(p, nullptr);
    ASSERT_TRUE(d.guards_intact());
    EXPECT_TRUE(same_floats(x, d.download(dx, x.size()), "x"));
  });
}

// ---- element-wise graph steps -------------------------------------------------------------------
void elementwise_case(const std::string& op, int64_t n) {
  add_case(op, "ELEMENTWISE(" + op + ",n=" + std::to_string(n) + ")", [=](const std::string& nm) {
    auto g = test::rng_for(nm);
    std::normal_distribution<float> nd(0.0f, 3.0f);
    DeviceBuffers d;
    if (op == "embed_streams") {
      const int64_t V = 37, D = n, T = 19;
      const int hc = 4;
      const auto table = test::randn_bf16(g, size_t(V * D));
      std::vector<int32_t> tokens(static_cast<size_t>(T));
      for (auto& t : tokens) t = int32_t(g() % V);
      std::vector<float> H(size_t(T * hc * D));
      for (int64_t t = 0; t < T; ++t)
        for (int j = 0; j < hc; ++j)
          std::copy(table.begin() + tokens[size_t(t)] * D, table.begin() + (tokens[size_t(t)] + 1) * D,
                    H.begin() + (t * hc + j) * D);
      float* dH = d.upload(std::vector<float>(H.size(), test::fill_value()), "H");
      cuda::embed_streams(d.upload(table, "table"), D, d.upload(tokens, "tokens"), T, hc, dH, nullptr);
      ASSERT_TRUE(d.guards_intact());
      EXPECT_TRUE(same_floats(H, d.download(dH, H.size()), "H"));
      return;
    }
    std::vector<float> x(static_cast<size_t>(n));
    for (auto& v : x) v = nd(g);
    if (n > 4) x[0] = std::numeric_limits<float>::infinity(), x[1] = -0.0f, x[2] = 3.4e38f, x[3] = 1e-40f;
    float* dx = d.upload(x, "x");
    const float s = 0.0883883476f, temp = 0.7f;
    for (float& v : x) {
      if (op == "bf16_round") v = num::bf16_round(v);
      if (op == "scale_bf16") v = num::bf16_round(v * s);
      if (op == "divide") v = v / temp;
    }
    if (op == "bf16_round") cuda::bf16_round(dx, n, nullptr);
    if (op == "scale_bf16") cuda::scale_bf16(dx, n, s, nullptr);
    if (op == "divide") cuda::divide(dx, n, temp, nullptr);
    ASSERT_TRUE(d.guards_intact());
    EXPECT_TRUE(same_floats(x, d.download(dx, x.size()), "x"));
  });
}

// cuda::copy_words: `sizes.size()` copies in one launch (words of random bits, NaN patterns
// included), each into its own guarded buffer; every destination equals its source and nothing else
// is written.
void copy_words_case(std::vector<int64_t> sizes) {
  std::string name = "COPY_WORDS(";
  for (const int64_t n : sizes) name += std::to_string(n) + ",";
  name.back() = ')';
  add_case("copy_words", name, [=](const std::string& nm) {
    auto g = test::rng_for(nm);
    DeviceBuffers d;
    std::vector<std::vector<uint32_t>> src;
    std::vector<cuda::WordCopy> copies;
    for (size_t k = 0; k < sizes.size(); ++k) {
      std::vector<uint32_t> w(static_cast<size_t>(sizes[k]));
      for (auto& v : w) v = uint32_t(g());
      copies.push_back({d.upload(std::vector<uint32_t>(w.size(), 0xdeadbeefu), "dst" + std::to_string(k)),
                        d.upload(w, "src" + std::to_string(k)), sizes[k]});
      src.push_back(std::move(w));
    }
    cuda::copy_words(copies.data(), int(copies.size()), nullptr);
    ASSERT_TRUE(d.guards_intact());
    for (size_t k = 0; k < sizes.size(); ++k)
      EXPECT_EQ(d.download(copies[k].dst, src[k].size()), src[k]) << "copy " << k;
  });
}

void register_other_cases() {
  for (ReduceOrder o : {ReduceOrder{0}, ReduceOrder{64}}) {
    for (const char* op : {"hc_pre", "hc_head"}) {
      hc_case(op, 17, 4, 64, o);
      hc_case(op, 5, 4, 256, o);
      hc_case(op, 3, 3, 100, o);
    }
  }
  // The fused weights kernel (kernels/cuda/mhc.cu: 1, 2, 3, 4, 8, 15 or 24 fn rows) in its four
  // shapes: A = 1 token a thread in blocks of 32 threads below 8 tokens per multiprocessor, A = 1 in
  // blocks of 128 from there, A = 2 from 16, A = 4 from 60 (T = 1500, 2700 and 8010 on a 132-SM H200,
  // with part-filled last blocks, whose stage copies take the checked path); hc_pre's weights by hc
  // lanes a token for hc = 1 to 4 (3: two lanes of each group idle); hc * D a multiple of 64 or not (a
  // partial last stage and step), of 4 or not (16-byte or 4-byte stage copies), D a multiple of 4 or not (the
  // float4 mix or the scalar one); T = 1; blocked orders whose chains end inside a stage (8, 24) or
  // span stages (128). hc_pre with hc = 5 and hc_head with hc = 6 take the GEMM path.
  for (ReduceOrder o : {ReduceOrder{0}, ReduceOrder{64}}) {
    for (const char* op : {"hc_pre", "hc_head"}) {
      hc_case(op, 1, 4, 64, o);
      hc_case(op, 1, 1, 7, o);
      hc_case(op, 9, 2, 33, o);
      hc_case(op, 40, 3, 100, o);
      hc_case(op, 2700, 4, 260, o);
      hc_case(op, 2700, 3, 33, o);
      hc_case(op, 2650, 1, 1024, o);
      hc_case(op, 2641, 2, 500, o);
      hc_case(op, 1500, 4, 260, o);
      hc_case(op, 1123, 2, 33, o);
      hc_case(op, 11, 5, 48, o);
      hc_case(op, 8010, 4, 130, o);
      hc_case(op, 8010, 3, 64, o);
    }
    hc_case("hc_head", 70, 8, 40, o);
    hc_case("hc_head", 2700, 8, 36, o);
    hc_case("hc_head", 13, 6, 50, o);
  }
  for (ReduceOrder o : {ReduceOrder{8}, ReduceOrder{24}, ReduceOrder{128}}) {
    hc_case("hc_pre", 2700, 4, 130, o);
    hc_case("hc_pre", 1500, 4, 130, o);
    hc_case("hc_pre", 7, 4, 67, o);
    hc_case("hc_pre", 8010, 4, 130, o);
    hc_case("hc_head", 2700, 4, 130, o);
    hc_case("hc_head", 5, 3, 41, o);
  }
  // D a multiple of 512 (the models' widths, whose y rows take mix4_blocks_kernel) after the fused
  // weights kernel in all four of its shapes, with a part-filled last block.
  for (ReduceOrder o : {ReduceOrder{0}, ReduceOrder{64}}) {
    for (const char* op : {"hc_pre", "hc_head"}) {
      hc_case(op, 2700, 4, 512, o);
      hc_case(op, 7, 4, 1024, o);
    }
    hc_case("hc_pre", 1500, 4, 512, o);
    hc_case("hc_pre", 8010, 4, 512, o);
    hc_case("hc_pre", 1123, 2, 1024, o);
  }
  hc_case("hc_post", 17, 4, 100, ReduceOrder{});  // the float4 kernel (hc = 4, D % 4 == 0)
  hc_case("hc_post", 300, 4, 64, ReduceOrder{});
  hc_case("hc_post", 17, 4, 30, ReduceOrder{});  // D % 4 != 0: one thread per d
  hc_case("hc_post", 9, 2, 48, ReduceOrder{});
  hc_case("hc_post", 1, 3, 7, ReduceOrder{});
  for (ReduceOrder o : {ReduceOrder{0}, ReduceOrder{64}}) {
    compressor_case(129, 64, 4, 128, 64, false, o);
    compressor_case(129, 64, 4, 128, 64, true, o);
    compressor_case(300, 48, 128, 192, 64, false, o);
    compressor_case(3, 64, 4, 64, 64, false, o);
    compressor_case(4, 32, 4, 64, 16, true, o);
  }
  hadamard_case(7, 128, 128);
  hadamard_case(3, 512, 600);
  hadamard_case(2, 1, 1);
  // Each kernel shape: rows in registers of a warp (32 .. 1024), several short rows a block, one long
  // row a block; row counts that leave a block or a warp part-filled.
  hadamard_case(33, 32, 40);
  hadamard_case(9, 1024, 1024);
  hadamard_case(37, 16, 16);
  hadamard_case(3, 2048, 2048);
  for (ReduceOrder o : {ReduceOrder{0}, ReduceOrder{64}}) {
    indexer_case(300, 3, 64, 8, "randn", o);
    indexer_case(300, 3, 64, 8, "ties", o);
    indexer_case(300, 3, 64, 8, "nan", o);
  }
  indexer_case(5, 1, 128, 8, "randn", ReduceOrder{});
  indexer_case(3, 2, 32, 8, "randn", ReduceOrder{});
  indexer_case(1200, 5, 128, 64, "randn", ReduceOrder{64});
  indexer_case(1200, 4, 128, 64, "ties", ReduceOrder{});
  indexer_case(130, 2, 128, 32, "ties", ReduceOrder{});     // k == G at the end
  indexer_case(300, 20, 64, 16, "randn", ReduceOrder{64});  // head tiles of 16 with a remainder
  indexer_case(200, 37, 128, 512, "ties", ReduceOrder{});   // topk > G: k = G, rows choose all they see
  // cuda::indexer_topk cuts the rows into GEMM chunks of at most 256 rows and selection launches of
  // at most 2048 rows; the dot products run through the GEMM's lane-split kernel (n > 32 and at least
  // 96 output tiles of 64 x 64) or its tiled kernel.
  for (ReduceOrder o : {ReduceOrder{0}, ReduceOrder{64}}) {
    indexer_case(600, 64, 128, 32, "randn", o);   // Hi = 64: chunks 256, 256, 88; lane-split GEMM
    indexer_case(600, 64, 128, 32, "dup", o);     // planted equal scores
    indexer_case(2600, 1, 8, 16, "dup", o);       // Hi = 1, Di = 8: two selection launches (2048 + 552)
    indexer_case(1201, 3, 100, 64, "ties", o);    // Di % 8 == 4, aligned rows; 5 key tiles of 64
    indexer_case(700, 5, 75, 40, "dup", o);       // Di odd: unaligned rows, a partial last step
    indexer_case(300, 64, 200, 512, "randn", o);  // topk > G, Di in 4 blocks of 64 (last partial)
    indexer_case(333, 3, 13, 24, "nan", o);       // Di < 16 and not a multiple of 8
  }
  // Hi dividing 64 takes the GEMM with the head chain in its epilogue (detail::gemm_indexer_chain):
  // unaligned rows, several chunks and selection launches, tiles of 2 to 64 tokens, rows after a cache
  // (pos0 > 0: a decoding chunk's rows see the keys of earlier positions).
  for (ReduceOrder o : {ReduceOrder{0}, ReduceOrder{64}}) {
    indexer_case(700, 8, 75, 40, "dup", o);
    indexer_case(1500, 16, 128, 48, "nan", o);
    indexer_case(2600, 32, 32, 16, "ties", o);
    indexer_case(300, 64, 128, 32, "randn", o, 4, false, 913);
    indexer_case(45, 4, 128, 64, "dup", o, 4, false, 2001);
    indexer_case(45, 3, 128, 64, "dup", o, 4, false, 2001);  // Hi = 3 after a cache: GEMM, then the chain kernel
  }
  indexer_case(257, 2, 13, 8, "randn", ReduceOrder{}, 1);    // ratio 1: G = T, row t sees t + 1 keys
  indexer_case(257, 5, 64, 300, "dup", ReduceOrder{64}, 1);  // k > visible for most rows
  indexer_case(9, 64, 128, 4, "randn", ReduceOrder{64});     // rows with 0, 1 and 2 visible keys
  indexer_case(4, 3, 3, 1, "randn", ReduceOrder{});          // G = 1: only the last row sees a key
  // bf16 scores (the indexer.score site): every kernel path (fused, GEMM + chain, row per block)
  for (ReduceOrder o : {ReduceOrder{0}, ReduceOrder{64}}) {
    indexer_case(300, 3, 64, 8, "randn", o, 4, true);
    indexer_case(600, 64, 128, 32, "dup", o, 4, true);
    indexer_case(1201, 3, 100, 64, "ties", o, 4, true);
  }
  indexer_score_ids_case(300, 3, 64, 8);
  indexer_score_ids_case(17, 5, 128, 4);
  build_index_case(17, 8, CompressedKind::none, 0, 0);
  build_index_case(300, 128, CompressedKind::c128, 128, 0);
  build_index_case(300, 16, CompressedKind::c4, 4, 8);
  build_index_case(5, 16, CompressedKind::c4, 4, 1);
  for (ReduceOrder o : {ReduceOrder{0}, ReduceOrder{64}}) {
    attention_case(17, 5, 40, 192, o);
    attention_case(9, 1, 13, 256, o);
    attention_case(33, 12, 70, 64, o);
  }
  attention_case(4, 3, 0, 64, ReduceOrder{});
  attention_case(5, 43, 300, 40, ReduceOrder{64});
  attention_case(6, 61, 129, 64, ReduceOrder{});   // 61 heads: no head tile divides it
  attention_case(7, 16, 640, 512, ReduceOrder{});  // Flash-like: head dim 512, window + top-512
  // The 64-head kernel (cuda::sparse_attention_uses_head_tiles; 61 heads above take it too): Flash's
  // 64 heads in both orders, a second tile of 3 heads, chains that end inside a k stage (blocks of
  // 24), rows of 1 to 5 valid slots, 1 to 4 float4 columns a lane (Dh 64 to 512), and blocks that
  // walk several rows (T above the SM count).
  attention_case(9, 64, 640, 512, ReduceOrder{});
  attention_case(9, 64, 640, 512, ReduceOrder{64});
  attention_case(5, 67, 200, 256, ReduceOrder{64});
  attention_case(8, 40, 90, 96, ReduceOrder{24}, 0, 5);
  attention_case(4, 48, 150, 352, ReduceOrder{});  // 88 float4 columns: the last chunk of lanes is partial
  attention_case(300, 64, 130, 128, ReduceOrder{});
  // The split-KV (decode) order: parts of every size, rows with fewer valid slots than parts, empty
  // rows (row 0 of every case; all rows when K = 0), a head tile that does not divide H.
  for (int splits : {1, 2, 3, 7}) {
    attention_case(17, 5, 40, 192, ReduceOrder{}, splits, 8);
    attention_case(9, 12, 70, 64, ReduceOrder{64}, splits, 3);
  }
  attention_case(4, 3, 0, 64, ReduceOrder{}, 3);
  attention_case(6, 61, 129, 64, ReduceOrder{}, 7, 5);
  attention_case(3, 16, 640, 512, ReduceOrder{}, 4);   // Flash-like decode rows
  attention_case(2, 16, 640, 512, ReduceOrder{}, 64);  // many parts of 7 to 10 slots
  // The online order (the attention.softmax site): blocks of 1, of a few slots, larger than the row;
  // rows with fewer valid slots than a block; 61 heads; Flash-like rows.
  for (int online : {1, 5, 64, 1000}) {
    attention_case(17, 5, 40, 192, ReduceOrder{}, 0, 8, online);
    attention_case(9, 12, 70, 64, ReduceOrder{64}, 0, 3, online);
  }
  attention_case(4, 3, 0, 64, ReduceOrder{}, 0, 0, 64);
  attention_case(6, 61, 129, 64, ReduceOrder{}, 0, 5, 16);
  attention_case(7, 16, 640, 512, ReduceOrder{}, 0, 0, 64);
  for (const char* mode : {"learned", "learned-unnormalised", "hash", "forced"}) {
    router_case(17, 8, 2, mode, false);
    router_case(33, 6, 3, mode, true);
  }
  router_case(40, 384, 8, "learned", true);
  router_case(9, 4, 4, "learned", false);
  router_case(9, 4, 4, "forced", false);
  for (ReduceOrder o : {ReduceOrder{0}, ReduceOrder{64}}) {
    moe_case(17, 64, 32, 6, 2, 6, 1, 0, 10.0f, false, o);
    moe_case(17, 64, 32, 8, 3, 4, 1, 64, 0.5f, true, o);  // four empty experts, clamps active
  }
  moe_case(5, 96, 40, 16, 2, 3, 0, 0, 0.0f, false, ReduceOrder{});
  moe_case(33, 64, 24, 4, 1, 2, 2, 16, 1.0f, false, ReduceOrder{64});
  // Each expert's output rounded to bf16 (the moe.expert_output site), with the EP parts below.
  moe_case(17, 64, 32, 8, 3, 4, 1, 64, 0.5f, true, ReduceOrder{}, true);
  moe_case(33, 64, 24, 4, 1, 2, 2, 16, 1.0f, false, ReduceOrder{64}, true);
  // Expert GEMMs large enough for the lane-split kernel (150 to 270 gathered rows per used expert,
  // scattered back by pair), with 16-byte aligned rows and with unaligned ones.
  for (ReduceOrder o : {ReduceOrder{0}, ReduceOrder{64}}) {
    moe_case(300, 576, 640, 6, 2, 4, 1, 0, 10.0f, false, o);
    moe_case(400, 518, 650, 5, 2, 3, 1, 0, 10.0f, false, o);
  }
  log_softmax_case(17, 1000);
  log_softmax_case(3, 7);
  log_softmax_case(9, 4096);
  for (const char* op : {"fp8_sim", "fp8_sim_inplace_bf16_cast", "fp4_sim"}) {
    quant_case(op, 17, 192, 256, 64, ScaleFmt::ue8m0);
    quant_case(op, 9, 128, 128, op == std::string("fp4_sim") ? 32 : 128, ScaleFmt::none);
  }
  quant_case("act_quant", 17, 256, 256, 128, ScaleFmt::ue8m0);
  quant_case("act_quant", 5, 192, 192, 64, ScaleFmt::none);
  for (const char* op : {"bf16_round", "scale_bf16", "divide"}) elementwise_case(op, 1000);
  elementwise_case("embed_streams", 48);
  copy_words_case({1000});
  copy_words_case({0, 1, 7, 300001, 2});
  copy_words_case({5, 4096, 1, 0, 33, 65536, 3, 12});  // kMaxWordCopies
}

const std::vector<OpCase>& cases() {
  static const bool once = [] {
    register_dense_cases();
    register_other_cases();
    return true;
  }();
  (void)once;
  return registry();
}

std::vector<size_t> case_indices() {
  std::vector<size_t> v(cases().size());
  for (size_t i = 0; i < v.size(); ++i) v[i] = i;
  return v;
}

class BackendOps : public ::testing::TestWithParam<size_t> {};

TEST_P(BackendOps, MatchesCpuBitwise) {
  DSV4_REQUIRE_CUDA_DEVICE();
  const OpCase& c = cases()[GetParam()];
  SCOPED_TRACE(c.name);
  c.run(c.name);
}

std::string case_label(const ::testing::TestParamInfo<size_t>& info) {
  std::string s = cases()[info.param].name;
  for (char& ch : s)
    if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
  return std::to_string(info.param) + "_" + s;
}

INSTANTIATE_TEST_SUITE_P(Registry, BackendOps, ::testing::ValuesIn(case_indices()), case_label);

TEST(BackendOpsErrors, CopyWordsRejectsBadCopies) {
  std::vector<cuda::WordCopy> copies(size_t(cuda::kMaxWordCopies) + 1);
  EXPECT_THROW(cuda::copy_words(copies.data(), int(copies.size()), nullptr), Error);
  EXPECT_THROW(cuda::copy_words(copies.data(), -1, nullptr), Error);
  copies[0].words = 4;  // null pointers with words to copy
  EXPECT_THROW(cuda::copy_words(copies.data(), 1, nullptr), Error);
}

// Which exact calls the 64-head kernel takes (the cases above cover both kernels). Needs no device.
TEST(BackendOpsAttention, HeadTilesTakeTheTwoPassOrderOfManyHeads) {
  alignas(16) static float buf[64];
  SparseAttnParams p;
  p.T = 8, p.H = 64, p.Dh = 512, p.N = 100, p.K = 640, p.q = buf, p.kv = buf, p.o = buf;
  EXPECT_TRUE(cuda::sparse_attention_uses_head_tiles(p));  // Flash
  p.order = ReduceOrder{64};
  EXPECT_TRUE(cuda::sparse_attention_uses_head_tiles(p));
  auto with = [&](auto change) {
    SparseAttnParams c = p;
    change(c);
    return cuda::sparse_attention_uses_head_tiles(c);
  };
  EXPECT_TRUE(with([](SparseAttnParams& c) { c.H = 32; }));
  EXPECT_FALSE(with([](SparseAttnParams& c) { c.H = 31; }));      // few heads: 8-head tiles
  EXPECT_FALSE(with([](SparseAttnParams& c) { c.Dh = 40; }));     // not whole k stages
  EXPECT_FALSE(with([](SparseAttnParams& c) { c.Dh = 544; }));    // past the P.V registers
  EXPECT_FALSE(with([](SparseAttnParams& c) { c.K = 1152; }));    // the scores do not fit
  EXPECT_FALSE(with([](SparseAttnParams& c) { c.splits = 4; }));  // the split-KV order
  EXPECT_FALSE(with([](SparseAttnParams& c) { c.online_block = 64; }));
  EXPECT_FALSE(with([](SparseAttnParams& c) { c.order.tensor_core = true; }));
  EXPECT_FALSE(with([](SparseAttnParams& c) { c.kv = buf + 1; }));  // rows not 16-byte aligned
  EXPECT_FALSE(with([](SparseAttnParams& c) { c.q = buf + 2; }));
  EXPECT_FALSE(with([](SparseAttnParams& c) { c.o = buf + 3; }));
}

// Lists every op with its number of cases; a CUDA op without a case fails. Needs no device.
TEST(BackendOpsCoverage, EveryCudaOpHasCases) {
  std::map<std::string, int> count;
  for (const OpCase& c : cases()) ++count[c.op];
  std::printf("%-28s %-26s %s\n", "op", "header", "cases");
  std::vector<std::string> missing;
  for (const OpInfo& op : all_ops()) {
    const int n = count.count(op.name) ? count[op.name] : 0;
    std::printf("%-28s %-26s %s\n", op.name, op.header,
                op.host ? "(host-side or internal: no CUDA kernel)" : std::to_string(n).c_str());
    if (!op.host && n == 0) missing.push_back(op.name);
    count.erase(op.name);
  }
  for (const auto& [name, n] : count) ADD_FAILURE() << "cases for an op not in the op list: " << name;
  std::string m;
  for (const auto& s : missing) m += " " + s;
  std::printf("ops without a case:%s\n", missing.empty() ? " none" : m.c_str());
  EXPECT_TRUE(missing.empty()) << "CUDA ops without a case:" << m;
}

}  // namespace
}  // namespace dsv4
