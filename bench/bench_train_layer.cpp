// One training forward + backward of a seeded model (default: the tiny preset, seed 7) on one
// sequence of random tokens with random log-prob gradients, dumping what an independent autograd
// re-implementation of ONE compressed-attention (C4) layer's attention sublayer needs, and our
// gradients of it: bench/torch_train_layer.py reads the dump (scripts/torch-train-check.sh runs both on
// the GPU machine).
//
// Usage: bench_train_layer --dump DIR [--preset NAME] [--seed S] [--layer L] [--T N]
//                          [--device cpu|cuda] [--threads N]
//   --layer  a ratio-4 layer of the preset (default: the first one)
//   --T      tokens (default 300); --device: default cuda when available, else cpu
//
// DIR gets raw little-endian float32 / int32 files (row-major, no header) and manifest.json, the
// format of bench_gpu's --dump: {"attrs": {<name>: <number>}, "tensors": [{"name", "file", "dtype",
// "shape"}]}. Tensors (layer L's attention sublayer, profile "train", so no FP8 simulation):
//   x          [T, D]      the sublayer input (attn_norm output, tape)
//   idx        [T, K]      the attention's index rows into KVcat (window part, then the indexer's
//                          compressed entries + T; -1 = empty)
//   freq       [rd/2]      the layer's RoPE frequencies (compressed layers' table)
//   w.<name>   the weights the sublayer differentiates, <name> without "model.layers.L.self_attn."
//   fwd.qa, fwd.qr [T, ql], fwd.q_lin, fwd.q [T, H*Dh], fwd.kv_lin [T, Dh], fwd.kvp, fwd.sc [T, 2*Dh],
//   fwd.kvcat [N, Dh], fwd.o_attn, fwd.o [T, H*Dh], fwd.u [T, G*R], fwd.out [T, D]
//              our forward's activations (the tape's; the torch forward is compared to them, and its
//              "pinned" mode takes their values)
//   dout       [T, D]      d loss / d(sublayer output): the GradRecord grad.attn.out
//   g.dx       [T, D]      our d loss / d x: grad.attn.norm
//   g.u, g.o, g.q [T, H*Dh], g.kvcat [N, Dh]   our intermediate activation gradients
//   g.w.<name> our parameter gradient of each dumped weight (the sample's GradSet)
// attrs: T D H Dh ql rd R groups ratio W N K G layer eps scale.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "kernels/rope.h"
#include "bench/dump.h"
#include "model/backward.h"
#include "model/device.h"
#include "model/forward.h"
#include "model/tape.h"
#include "model/tokens.h"
#include "model/weights.h"

namespace {

using namespace dsv4;
using bench::Dumper;



// Seeded uniform values in [-a, a) (deterministic on every machine).
std::vector<float> uniform(int64_t n, float a, uint64_t seed) {
  std::vector<float> v(size_t(std::max<int64_t>(n, 0)));
  uint64_t s = seed * 0x9e3779b97f4a7c15ull + 1;
  for (float& x : v) {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    x = a * (float(int((s >> 40) & 0xffffff) - (1 << 23)) / float(1 << 23));
  }
  return v;
}

int usage() {
  std::fprintf(stderr,
               "usage: bench_train_layer --dump DIR [--preset NAME] [--seed S] [--layer L] [--T N] "
               "[--device cpu|cuda] [--threads N]\n");
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  std::string dump_dir, preset_name = "tiny", device_name;
  uint64_t seed = 7;
  int layer = -1, threads = 0;
  int64_t T = 300;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const bool has = i + 1 < argc;
    if (a == "--dump" && has)
      dump_dir = argv[++i];
    else if (a == "--preset" && has)
      preset_name = argv[++i];
    else if (a == "--seed" && has)
      seed = std::strtoull(argv[++i], nullptr, 10);
    else if (a == "--layer" && has)
      layer = std::atoi(argv[++i]);
    else if (a == "--T" && has)
      T = std::atoll(argv[++i]);
    else if (a == "--device" && has)
      device_name = argv[++i];
    else if (a == "--threads" && has)
      threads = std::atoi(argv[++i]);
    else
      return usage();
  }
  if (dump_dir.empty() || T < 8) return usage();
  try {
    const Weights w = Weights::init(preset(preset_name), seed);
    const ModelConfig& c = w.config();
    if (layer < 0)
      for (int L = 0; L < c.num_hidden_layers && layer < 0; ++L)
        if (c.ratio(L) == 4) layer = L;
    if (layer < 0 || layer >= c.num_hidden_layers || c.ratio(layer) != 4) {
      std::fprintf(stderr, "layer %d of preset %s is not a ratio-4 (C4) layer\n", layer, preset_name.c_str());
      return 2;
    }
    const Device dev = device_name.empty() ? (cuda_device_available() ? Device::cuda : Device::cpu)
                                           : parse_device(device_name);
    RunOptions opt;  // profile "train": bf16 storage, fp32 accumulation, no FP8 simulation
    opt.device = dev;
    opt.threads = threads;
    auto be = backend::make_backend(dev, w);

    const std::vector<int32_t> tokens = random_tokens(T, c.vocab_size, seed + 1);
    Tape tape;
    forward_with_tape(*be, w, 0, tokens, opt, tape);
    // d loss / d logprobs: random, of the size of a token-mean loss's gradient.
    const std::vector<float> dlogprobs = uniform(T - 1, 1.0f / float(T), seed + 2);

    std::map<std::string, std::vector<float>> acts;  // the layer's activation gradients by name
    BackwardOptions bo;
    bo.trainable = [](const std::string&) { return true; };
    bo.on_grad = [&](const GradRecord& r) {
      if (r.layer != layer) return;
      static const char* const keep[] = {"grad.attn.out", "grad.attn.norm", "grad.attn.u", "grad.attn.o",
                                         "grad.attn.q", "grad.attn.kvcat"};
      if (std::find_if(std::begin(keep), std::end(keep), [&](const char* k) { return r.name == k; }) ==
          std::end(keep))
        return;
      const float* v = r.values();
      if (!v) throw std::runtime_error("no values for " + r.name);
      acts[r.name].assign(v, v + r.rows * r.cols);
    };
    const GradSet grads = backward(*be, w, tape, 0, dlogprobs, opt, bo);

    const AttentionTape& t = tape.attn[size_t(layer)];
    const int64_t D = c.hidden_size, Dh = c.head_dim, ql = c.q_lora_rank, R = c.o_lora_rank;
    const int H = c.num_attention_heads, Gr = c.o_groups, rd = c.qk_rope_head_dim;
    Dumper du(dump_dir);
    du.attr("T", double(T));
    du.attr("D", double(D));
    du.attr("H", H);
    du.attr("Dh", double(Dh));
    du.attr("ql", double(ql));
    du.attr("rd", rd);
    du.attr("R", double(R));
    du.attr("groups", Gr);
    du.attr("ratio", c.ratio(layer));
    du.attr("W", c.sliding_window);
    du.attr("N", double(t.N));
    du.attr("K", double(t.K));
    du.attr("G", double(t.G));
    du.attr("layer", layer);
    du.attr("eps", c.rms_norm_eps);
    du.attr("scale", 1.0 / std::sqrt(double(Dh)));

    du.put("x", be->download(t.x.data(), T * D), {T, D});
    du.put("idx", be->download(t.idx.data(), T * t.K), {T, t.K});
    // The compressed layers' table, as backend::rope_tables makes it.
    const RopeSpec comp{rd,
                        c.compress_rope_theta,
                        c.rope_scaling.type == "yarn",
                        c.rope_scaling.factor,
                        c.rope_scaling.original_max_position_embeddings,
                        c.rope_scaling.beta_fast,
                        c.rope_scaling.beta_slow};
    std::vector<float> freq(size_t(rd / 2));
    rope_freqs(comp, freq.data());
    du.put("freq", freq, {int64_t(freq.size())});

    const std::string a = layer_prefix(layer) + "self_attn.";
    const char* const wnames[] = {"wq_a.weight",           "q_norm.weight",          "wq_b.weight",
                                  "wkv.weight",            "kv_norm.weight",         "compressor.wkv.weight",
                                  "compressor.wgate.weight", "compressor.ape",       "compressor.norm.weight",
                                  "attn_sink",             "wo_a.weight",            "wo_b.weight"};
    for (const char* n : wnames) {
      const WeightTensor& wt = w.get(a + n);
      du.put(std::string("w.") + n, wt.f, wt.shape);
      const auto it = grads.find(a + n);
      if (it == grads.end()) throw std::runtime_error("no gradient of " + a + n);
      du.put(std::string("g.w.") + n, it->second, wt.shape);
    }
    const int64_t cw = 2 * Dh;  // ratio 4: the overlapping compressor's projection width
    du.put("fwd.qa", be->download(t.qa.data(), T * ql), {T, ql});
    du.put("fwd.qr", be->download(t.qr.data(), T * ql), {T, ql});
    du.put("fwd.q_lin", be->download(t.q_lin.data(), T * H * Dh), {T, H * Dh});
    du.put("fwd.kv_lin", be->download(t.kv_lin.data(), T * Dh), {T, Dh});
    du.put("fwd.kvp", be->download(t.kvp.data(), T * cw), {T, cw});
    du.put("fwd.sc", be->download(t.sc.data(), T * cw), {T, cw});
    du.put("fwd.o_attn", be->download(t.o_attn.data(), T * H * Dh), {T, H * Dh});
    du.put("fwd.q", be->download(t.q.data(), T * H * Dh), {T, H * Dh});
    du.put("fwd.kvcat", be->download(t.kvcat.data(), t.N * Dh), {t.N, Dh});
    du.put("fwd.o", be->download(t.o.data(), T * H * Dh), {T, H * Dh});
    du.put("fwd.u", be->download(t.u.data(), T * Gr * R), {T, Gr * R});
    du.put("fwd.out", be->download(t.out.data(), T * D), {T, D});
    const std::pair<const char*, std::vector<int64_t>> gnames[] = {
        {"grad.attn.out", {T, D}},      {"grad.attn.norm", {T, D}},      {"grad.attn.u", {T, Gr * R}},
        {"grad.attn.o", {T, H * Dh}},   {"grad.attn.q", {T, H * Dh}},    {"grad.attn.kvcat", {t.N, Dh}}};
    for (const auto& [n, shape] : gnames) {
      const auto it = acts.find(n);
      if (it == acts.end()) throw std::runtime_error(std::string("the backward reported no ") + n);
      const std::string s(n);
      const std::string out = s == "grad.attn.out" ? "dout" : s == "grad.attn.norm" ? "g.dx" : "g." + s.substr(10);
      du.put(out, it->second, shape);
    }
    du.finish();
    std::printf("dumped layer %d (C4) of %s seed %llu, T=%lld, N=%lld, K=%lld, G=%lld, device %s, to %s\n", layer,
                preset_name.c_str(), static_cast<unsigned long long>(seed), static_cast<long long>(T),
                static_cast<long long>(t.N), static_cast<long long>(t.K), static_cast<long long>(t.G),
                to_string(dev), dump_dir.c_str());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_train_layer: %s\n", e.what());
    return 1;
  }
  return 0;
}
