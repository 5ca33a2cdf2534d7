#include "model/manifest.h"

#include <algorithm>

#include "kernels/compressor.h"

namespace dsv4 {

int64_t TensorSpecT::row_elems() const {
  int64_t n = 1;
  for (size_t i = 1; i < shape.size(); ++i) n *= shape[i];
  return n;
}

std::vector<TensorSpecT> tensor_manifest(const ModelConfig& c, int64_t T) {
  std::vector<TensorSpecT> m;
  auto add = [&](int layer, const char* name, DType dt, std::vector<int64_t> shape) {
    m.push_back(TensorSpecT{layer, name, dt, std::move(shape)});
  };
  const int64_t D = c.hidden_size, H = c.num_attention_heads, Dh = c.head_dim, hc = c.hc_mult;
  add(-1, "embed", DType::bf16, {T, D});
  for (int L = 0; L < c.num_hidden_layers; ++L) {
    const int r = c.ratio(L);
    add(L, "attn.hc_pre", DType::bf16, {T, D});
    add(L, "attn.norm", DType::bf16, {T, D});
    add(L, "attn.qr", DType::bf16, {T, c.q_lora_rank});
    add(L, "attn.q", DType::bf16, {T, H * Dh});
    add(L, "attn.kv", DType::bf16, {T, Dh});
    if (r > 0) add(L, "attn.compressed_kv", DType::bf16, {compressor_groups(T, r), Dh});
    if (r == 4) {
      const int64_t k = c.indexer_width(T);
      add(L, "indexer.q", DType::bf16, {T, int64_t(c.index_n_heads) * c.index_head_dim});
      add(L, "indexer.k", DType::bf16, {compressor_groups(T, 4), c.index_head_dim});
      add(L, "indexer.weights", DType::f32, {T, c.index_n_heads});
      add(L, "indexer.score", DType::f32, {T, k});
    }
    add(L, "attn.o", DType::bf16, {T, H * Dh});
    add(L, "attn.u", DType::bf16, {T, int64_t(c.o_groups) * c.o_lora_rank});
    add(L, "attn.out", DType::bf16, {T, D});
    add(L, "attn.hc_post", DType::bf16, {T, hc * D});
    add(L, "ffn.hc_pre", DType::bf16, {T, D});
    add(L, "ffn.norm", DType::bf16, {T, D});
    add(L, "moe.router_logits", DType::f32, {T, c.n_routed_experts});
    add(L, "moe.out", DType::bf16, {T, D});
    add(L, "ffn.hc_post", DType::bf16, {T, hc * D});
  }
  add(-1, "head.hc", DType::bf16, {T, D});
  add(-1, "head.norm", DType::bf16, {T, D});
  add(-1, "logits", DType::f32, {T, c.vocab_size});
  add(-1, "logprobs", DType::f32, {T - 1});
  return m;
}

std::vector<std::string> tensor_names(const ModelConfig& c) {
  // A sequence long enough for every layer type to report everything.
  std::vector<std::string> names;
  for (const auto& s : tensor_manifest(c, 8))
    if (std::find(names.begin(), names.end(), s.name) == names.end()) names.push_back(s.name);
  return names;
}

}  // namespace dsv4
