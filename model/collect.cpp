#include "model/collect.h"

#include <cstring>

namespace dsv4 {

const char* to_string(DType t) {
  switch (t) {
    case DType::f32:
      return "f32";
    case DType::bf16:
      return "bf16";
    case DType::i32:
      return "i32";
  }
  return "?";
}

const char* to_string(Sublayer s) {
  return s == Sublayer::attn ? "attn" : "ffn";
}

void DecisionLog::on_tensor(const TensorRecord& t) {
  if (!keep_tensors_) return;
  TensorCopy c;
  c.dtype = t.dtype;
  c.shape = t.shape;
  const int64_t n = t.rows() * t.row_elems();
  if (t.dtype == DType::i32) {
    const auto* p = static_cast<const int32_t*>(t.data());
    c.i.assign(p, p + n);
  } else {
    const auto* p = static_cast<const float*>(t.data());
    c.f.assign(p, p + n);
  }
  Key key{t.seq, t.layer};
  tensor_order.emplace_back(key, std::string(t.name));
  tensors[{key, std::string(t.name)}] = std::move(c);
}

void DecisionLog::on_indexer(const IndexerDecision& d) {
  IndexerRecord& r = indexer[{d.seq, d.layer}];
  r.T = d.T;
  r.k = d.k;
  r.ids.assign(d.ids, d.ids + d.T * d.k);
  r.margin.assign(d.margin, d.margin + d.T);
}

void DecisionLog::on_routing(const RoutingDecision& d) {
  RoutingRecord& r = routing[{d.seq, d.layer}];
  r.T = d.T;
  r.k = d.k;
  r.hashed = d.hashed;
  r.ids.assign(d.ids, d.ids + d.T * d.k);
  r.weights.assign(d.weights, d.weights + d.T * d.k);
  r.margin.assign(d.margin, d.margin + d.T);
}

void DecisionLog::on_mhc(const MhcDecision& d) {
  MhcRecord& r = mhc[{{d.seq, d.layer}, d.sublayer}];
  r.T = d.T;
  r.hc = d.hc;
  r.pre.assign(d.pre, d.pre + d.T * d.hc);
  r.post.assign(d.post, d.post + d.T * d.hc);
  r.comb.assign(d.comb, d.comb + d.T * d.hc * d.hc);
}

Overrides DecisionLog::to_overrides() const {
  Overrides o;
  for (const auto& [key, r] : indexer)
    o.force_indexer(key.first, key.second, ForcedSelection{r.T, r.k, r.ids});
  for (const auto& [key, r] : routing)
    if (!r.hashed) o.force_experts(key.first, key.second, ForcedSelection{r.T, r.k, r.ids});
  return o;
}

}  // namespace dsv4
