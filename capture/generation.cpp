#include "capture/generation.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "capture/digest.h"
#include "capture/errors.h"
#include "capture/h5.h"
#include "capture/layout.h"
#include "kernels/compressor.h"
#include "kernels/logits.h"
#include "model/error.h"

namespace dsv4 {

using namespace trace_layout;  // the format's names

namespace {

const char* decision_key(Sublayer s) {
  return s == Sublayer::attn ? "mhc.attn" : "mhc.ffn";
}

template <typename T>
void grow(std::vector<T>& v, size_t n, T fill = T{}) {
  if (v.size() < n) v.resize(n, fill);
}

// A host tensor handed to an observer: the values are either all here or fetched per emission.
struct HostTensor {
  std::vector<float> values;
  std::vector<uint64_t> digests;
};

}  // namespace

GenerationCollector::GenerationCollector(const ModelConfig& c,
                                         std::function<bool(std::string_view, int)> keep)
    : c_(c), keep_(std::move(keep)) {}

void GenerationCollector::add_request(std::vector<int32_t> prompt, float temperature) {
  Request r;
  r.prompt = std::move(prompt);
  r.temperature = temperature > 0 ? temperature : 1.0f;
  const size_t n = r.prompt.empty() ? 0 : r.prompt.size() - 1;
  r.prompt_lp.assign(n, 0.0f);
  r.prompt_lp_have.assign(n, 0);
  // Earlier requests whose prompt starts this one's may lend it their prompt rows (prefix sharing).
  const int index = int(reqs_.size());
  for (Request& q : reqs_)
    if (q.prompt.size() <= r.prompt.size() && std::equal(q.prompt.begin(), q.prompt.end(), r.prompt.begin()))
      q.borrowers.push_back(index);
  reqs_.push_back(std::move(r));
}

void GenerationCollector::set_prefix(int request, int source, int64_t shared) {
  Request& r = req(request);
  if (source >= request || source < -1)
    throw Error(fmt::format("request {}: prefix source {} must be an earlier request", request, source));
  r.source = source;
  r.shared = shared;
}

GenerationCollector::Request& GenerationCollector::req(int seq) {
  if (seq < 0 || size_t(seq) >= reqs_.size())
    throw Error(fmt::format("generation: a report for request {} of {}", seq, reqs_.size()));
  return reqs_[size_t(seq)];
}

namespace {
// The indexer scores: rows as wide as the chunk's indexer width, widened to index_topk at emission.
bool is_indexer_scores(std::string_view name) {
  return name == "indexer.score";
}
// The model's logits, from which the prompt's log-probs are taken.
bool is_model_logits(std::string_view name, int layer) {
  return name == "logits" && layer == -1;
}
}  // namespace

bool GenerationCollector::wants_values(std::string_view name, int layer) const {
  return keep_(name, layer) || is_indexer_scores(name) || is_model_logits(name, layer);
}

void GenerationCollector::on_tensor(const TensorRecord& t) {
  Request& r = req(t.seq);
  const std::pair<int, std::string> key{t.layer, std::string(t.name)};
  auto [it, fresh] = r.tensors.try_emplace(key);
  Rows& rows = it->second;
  // Indexer score rows are as wide as the chunk's indexer width (the prefill width of the positions
  // seen so far): they are kept at the widest, index_topk, with empty slots (NaN) after the chunk's.
  const bool scores = is_indexer_scores(t.name);
  if (fresh) {
    r.order.push_back(key);
    rows.dtype = t.dtype;
    rows.elems = scores ? std::max<int64_t>(c_.index_topk, t.row_elems()) : t.row_elems();
  }
  if (!scores && t.row_elems() != rows.elems)
    throw Error(fmt::format("generation: request {} reported {} layer {} with rows of {} values, earlier {}",
                            t.seq, t.name, t.layer, t.row_elems(), rows.elems));
  const int64_t n = t.rows(), end = t.pos0 + n;
  const std::vector<uint64_t> d = digest_rows(t);
  grow(rows.digests, size_t(end));
  grow(rows.have, size_t(end), uint8_t(0));
  for (int64_t i = 0; i < n; ++i) {
    if (rows.have[size_t(t.pos0 + i)])
      throw Error(fmt::format("generation: request {} reported {} layer {} row {} twice", t.seq, t.name,
                              t.layer, t.pos0 + i));
    rows.digests[size_t(t.pos0 + i)] = d[size_t(i)];
    rows.have[size_t(t.pos0 + i)] = 1;
  }
  // The values a later emission needs (wants_values): what the caller keeps, the indexer scores
  // (widened then), and the logits of prompt rows (for the prompt's log-probs).
  if (!wants_values(t.name, t.layer)) return;
  const bool keep = keep_(t.name, t.layer) || scores;
  const bool logits = is_model_logits(t.name, t.layer);
  const auto* v = static_cast<const float*>(t.data());
  if (keep) {
    grow(rows.values, size_t(end * rows.elems), std::numeric_limits<float>::quiet_NaN());
    const int64_t w = t.row_elems();
    // Rows of zero elements (a tensor with no data, whose pointer may be null): nothing to copy, and
    // memcpy from a null pointer is undefined even for zero bytes.
    for (int64_t i = 0; w > 0 && i < n; ++i)
      std::memcpy(rows.values.data() + (t.pos0 + i) * rows.elems, v + i * w, size_t(w) * sizeof(float));
  }
  if (logits) {
    // The prompt's log-probs of this request and of the later ones that may fork its prompt (each at
    // its own temperature and with its own next token): the logits rows are not kept.
    const int64_t V = rows.elems;
    std::vector<float> row(static_cast<size_t>(V));
    const auto fill = [&](Request& q, int64_t i, int64_t p) {
      if (p + 1 >= int64_t(q.prompt.size()) || q.prompt_lp_have[size_t(p)]) return;
      for (int64_t j = 0; j < V; ++j) row[size_t(j)] = v[i * V + j] / q.temperature;
      log_softmax_gather(row.data(), 1, V, &q.prompt[size_t(p + 1)], &q.prompt_lp[size_t(p)]);
      q.prompt_lp_have[size_t(p)] = 1;
    };
    for (int64_t i = 0; i < n; ++i) {
      const int64_t p = t.pos0 + i;
      if (p >= int64_t(r.prompt.size())) continue;
      fill(r, i, p);
      for (int b : r.borrowers) fill(reqs_[size_t(b)], i, p);
    }
  }
}

void GenerationCollector::on_indexer(const IndexerDecision& d) {
  DecisionRows& dr = req(d.seq).decisions[{d.layer, "indexer"}];
  const size_t end = size_t(d.pos0 + d.T);
  grow(dr.ids, end);
  grow(dr.margin, end);
  grow(dr.have, end, uint8_t(0));
  for (int64_t t = 0; t < d.T; ++t) {
    std::vector<int32_t>& ids = dr.ids[size_t(d.pos0 + t)];
    ids.clear();
    for (int j = 0; j < d.k; ++j)
      if (d.ids[t * d.k + j] >= 0) ids.push_back(d.ids[t * d.k + j]);
    dr.margin[size_t(d.pos0 + t)] = d.margin[t];
    dr.have[size_t(d.pos0 + t)] = 1;
  }
}

void GenerationCollector::on_routing(const RoutingDecision& d) {
  DecisionRows& dr = req(d.seq).decisions[{d.layer, "routing"}];
  dr.k = d.k;
  dr.hashed = d.hashed;
  const size_t end = size_t(d.pos0 + d.T);
  grow(dr.ids, end);
  grow(dr.weights, end);
  grow(dr.margin, end);
  grow(dr.have, end, uint8_t(0));
  for (int64_t t = 0; t < d.T; ++t) {
    const size_t p = size_t(d.pos0 + t);
    dr.ids[p].assign(d.ids + t * d.k, d.ids + (t + 1) * d.k);
    dr.weights[p].assign(d.weights + t * d.k, d.weights + (t + 1) * d.k);
    dr.margin[p] = d.margin[t];
    dr.have[p] = 1;
  }
}

void GenerationCollector::on_mhc(const MhcDecision& d) {
  DecisionRows& dr = req(d.seq).decisions[{d.layer, decision_key(d.sublayer)}];
  dr.k = d.hc;
  const size_t end = size_t(d.pos0 + d.T);
  grow(dr.weights, end);  // pre
  grow(dr.extra, end);    // post, then comb
  grow(dr.have, end, uint8_t(0));
  const int hc = d.hc;
  for (int64_t t = 0; t < d.T; ++t) {
    const size_t p = size_t(d.pos0 + t);
    dr.weights[p].assign(d.pre + t * hc, d.pre + (t + 1) * hc);
    dr.extra[p].assign(d.post + t * hc, d.post + (t + 1) * hc);
    dr.extra[p].insert(dr.extra[p].end(), d.comb + t * hc * hc, d.comb + (t + 1) * hc * hc);
    dr.have[p] = 1;
  }
}

int GenerationCollector::holder(int r, const std::pair<int, std::string>& key, int64_t row,
                                bool decision) const {
  for (int q = r; q >= 0; q = reqs_[size_t(q)].source) {
    const Request& R = reqs_[size_t(q)];
    if (decision) {
      auto it = R.decisions.find(key);
      if (it != R.decisions.end() && row < int64_t(it->second.have.size()) && it->second.have[size_t(row)])
        return q;
    } else {
      auto it = R.tensors.find(key);
      if (it != R.tensors.end() && row < int64_t(it->second.have.size()) && it->second.have[size_t(row)])
        return q;
    }
  }
  return -1;
}

std::vector<float> GenerationCollector::prompt_logprobs(int request) const {
  const Request& r = reqs_.at(size_t(request));
  for (size_t p = 0; p < r.prompt_lp.size(); ++p)
    if (!r.prompt_lp_have[p])
      throw Error(fmt::format("generation: request {} has no logits row for prompt position {}", request, p));
  return r.prompt_lp;
}

std::vector<float> GenerationCollector::sequence_logprobs(int request, int64_t T,
                                                          const std::vector<float>& sampled_logprobs) const {
  std::vector<float> lp = prompt_logprobs(request);  // rows 0 .. P-2
  const size_t need = size_t(std::max<int64_t>(T - 1, 0));
  for (size_t i = 0; lp.size() < need && i < sampled_logprobs.size(); ++i) lp.push_back(sampled_logprobs[i]);
  if (lp.size() != need)
    throw Error(
        fmt::format("generation: request {} has {} log-probs for {} computed tokens", request, lp.size(), T));
  return lp;
}

void GenerationCollector::report_request(int request, int64_t T, int seq,
                                         const std::vector<float>& sampled_logprobs, Observer& out) const {
  if (request < 0 || size_t(request) >= reqs_.size())
    throw Error(fmt::format("generation: no request {} of {}", request, reqs_.size()));
  // The tensor order: this request's, or the one's whose prompt it forked when it ran no chunk itself.
  int order_from = request;
  while (reqs_[size_t(order_from)].order.empty() && reqs_[size_t(order_from)].source >= 0)
    order_from = reqs_[size_t(order_from)].source;
  const int k_full = c_.indexer_width(T);
  const float nan = std::numeric_limits<float>::quiet_NaN();

  for (const auto& key : reqs_[size_t(order_from)].order) {
    const auto& [layer, name] = key;
    if (name == "logprobs") continue;
    const Rows& proto = reqs_[size_t(order_from)].tensors.at(key);
    const bool per_group = name == "attn.compressed_kv" || name == "indexer.k";
    const int64_t R = per_group ? compressor_groups(T, c_.ratio(layer)) : T;
    const bool widened = is_indexer_scores(name);
    const int64_t elems = widened ? k_full : proto.elems;
    TensorRecord t;
    t.seq = seq;
    t.layer = layer;
    t.name = name;
    t.dtype = proto.dtype;
    t.shape = {R, elems};
    std::vector<uint64_t> digests(static_cast<size_t>(R));
    std::vector<float> values;
    bool all_values = true;
    for (int64_t row = 0; row < R; ++row) {
      const int q = holder(request, key, row, false);
      if (q < 0)
        throw Error(
            fmt::format("generation: request {} has no row {} of {} layer {}", request, row, name, layer));
      const Rows& src = reqs_[size_t(q)].tensors.at(key);
      digests[size_t(row)] = src.digests[size_t(row)];
      if (src.values.size() < size_t((row + 1) * src.elems)) {
        all_values = false;
        continue;
      }
      if (values.empty()) values.assign(size_t(R * elems), nan);
      std::memcpy(values.data() + row * elems, src.values.data() + row * src.elems,
                  size_t(std::min(src.elems, elems)) * sizeof(float));
    }
    if (widened) {  // the widened rows' digests are those of the widened values
      TensorRecord h = t;
      h.host = values.data();
      digests = digest_rows(h);
    }
    t.row_digests = digests.data();
    if (all_values && R > 0) t.host = values.data();
    out.on_tensor(t);
  }

  // logprobs [T-1]: the prompt's (rows 0 .. P-2), then the sampled tokens' from row P-1 on; the last
  // computed row predicts the last generated token, so all generated log-probs but none beyond are used.
  std::vector<float> lp = sequence_logprobs(request, T, sampled_logprobs);
  TensorRecord t;
  t.seq = seq;
  t.layer = -1;
  t.name = "logprobs";
  t.dtype = DType::f32;
  t.shape = {int64_t(lp.size())};
  t.host = lp.data();
  out.on_tensor(t);

  // Decisions, per layer.
  for (int L = 0; L < c_.num_hidden_layers; ++L) {
    for (Sublayer s : {Sublayer::attn, Sublayer::ffn}) {
      const std::pair<int, std::string> key{L, decision_key(s)};
      const int hc = c_.hc_mult;
      std::vector<float> pre(size_t(T * hc)), post(size_t(T * hc)), comb(size_t(T * hc * hc));
      for (int64_t p = 0; p < T; ++p) {
        const int q = holder(request, key, p, true);
        if (q < 0)
          throw Error(fmt::format("generation: request {} has no mHC row {} of layer {}", request, p, L));
        const DecisionRows& dr = reqs_[size_t(q)].decisions.at(key);
        std::copy(dr.weights[size_t(p)].begin(), dr.weights[size_t(p)].end(), pre.begin() + p * hc);
        std::copy(dr.extra[size_t(p)].begin(), dr.extra[size_t(p)].begin() + hc, post.begin() + p * hc);
        std::copy(dr.extra[size_t(p)].begin() + hc, dr.extra[size_t(p)].end(), comb.begin() + p * hc * hc);
      }
      MhcDecision d;
      d.seq = seq;
      d.layer = L;
      d.sublayer = s;
      d.T = T;
      d.hc = hc;
      d.pre = pre.data();
      d.post = post.data();
      d.comb = comb.data();
      out.on_mhc(d);
    }
    if (c_.ratio(L) == 4) {
      const std::pair<int, std::string> key{L, "indexer"};
      std::vector<int32_t> ids(size_t(T * k_full), -1);
      std::vector<float> margin(static_cast<size_t>(T));
      for (int64_t p = 0; p < T; ++p) {
        const int q = holder(request, key, p, true);
        if (q < 0)
          throw Error(fmt::format("generation: request {} has no indexer row {} of layer {}", request, p, L));
        const DecisionRows& dr = reqs_[size_t(q)].decisions.at(key);
        std::copy(dr.ids[size_t(p)].begin(), dr.ids[size_t(p)].end(), ids.begin() + p * k_full);
        margin[size_t(p)] = dr.margin[size_t(p)];
      }
      IndexerDecision d;
      d.seq = seq;
      d.layer = L;
      d.T = T;
      d.k = k_full;
      d.ids = ids.data();
      d.margin = margin.data();
      out.on_indexer(d);
    }
    {
      const std::pair<int, std::string> key{L, "routing"};
      const int k = c_.num_experts_per_tok;
      std::vector<int32_t> ids(static_cast<size_t>(T * k));
      std::vector<float> w(static_cast<size_t>(T * k)), margin(static_cast<size_t>(T));
      bool hashed = false;
      for (int64_t p = 0; p < T; ++p) {
        const int q = holder(request, key, p, true);
        if (q < 0)
          throw Error(fmt::format("generation: request {} has no routing row {} of layer {}", request, p, L));
        const DecisionRows& dr = reqs_[size_t(q)].decisions.at(key);
        std::copy(dr.ids[size_t(p)].begin(), dr.ids[size_t(p)].end(), ids.begin() + p * k);
        std::copy(dr.weights[size_t(p)].begin(), dr.weights[size_t(p)].end(), w.begin() + p * k);
        margin[size_t(p)] = dr.margin[size_t(p)];
        hashed = dr.hashed;
      }
      RoutingDecision d;
      d.seq = seq;
      d.layer = L;
      d.T = T;
      d.k = k;
      d.hashed = hashed;
      d.ids = ids.data();
      d.weights = w.data();
      d.margin = margin.data();
      out.on_routing(d);
    }
  }
}

// ---- HDF5 ----------------------------------------------------------------------------------------

void write_generation(const h5::Object& step, const std::vector<std::string>& seq_groups,
                      const GenerationRecord& g) {
  using h5::Type;
  const auto dims = [](int64_t n) { return std::vector<hsize_t>{hsize_t(n)}; };
  h5::Object gg = h5::create_group(step, kGeneration);
  h5::write_attr(gg, kGenMaxBatch, int32_t(g.max_batch));
  h5::write_attr(gg, kGenPageSize, int32_t(g.page_size));
  h5::write_attr(gg, kGenPrefillChunk, int32_t(g.prefill_chunk));
  h5::write_attr(gg, kGenTokenBudget, int64_t(g.token_budget));
  h5::write_attr(gg, kGenPrefixSharing, uint8_t(g.prefix_sharing ? 1 : 0));
  h5::write_attr(gg, kGenDecodeAttention, g.decode_attention);
  const int64_t C = int64_t(g.schedule.size());
  std::vector<int32_t> st, rq;
  std::vector<int64_t> p0, len;
  std::vector<uint8_t> sm;
  for (const auto& c : g.schedule) {
    st.push_back(c.step);
    rq.push_back(c.request);
    p0.push_back(c.pos0);
    len.push_back(c.length);
    sm.push_back(c.sampled);
  }
  const auto put = [&](const h5::Object& parent, const char* name, Type t, std::vector<hsize_t> shape,
                       const auto& v) {
    h5::Object d = h5::create_dataset(parent, name, t, shape);
    if (!v.empty()) h5::write(d, v);
  };
  put(gg, kGenScheduleStep, Type::i32, dims(C), st);
  put(gg, kGenScheduleRequest, Type::i32, dims(C), rq);
  put(gg, kGenSchedulePos0, Type::i64, dims(C), p0);
  put(gg, kGenScheduleLength, Type::i64, dims(C), len);
  put(gg, kGenScheduleSampled, Type::u8, dims(C), sm);
  if (seq_groups.size() != g.requests.size())
    throw Error(
        fmt::format("generation record: {} requests for {} sequences", g.requests.size(), seq_groups.size()));
  for (size_t i = 0; i < g.requests.size(); ++i) {
    const GenerationRequestRecord& r = g.requests[i];
    h5::Object sq = h5::open(step, seq_groups[i]);
    h5::Object q = h5::create_group(sq, kGeneration);
    h5::write_attr(q, kGenId, r.id);
    h5::write_attr(q, kGenRequestKey, r.request_key);
    h5::write_attr(q, kGenPromptLength, int64_t(r.prompt_length));
    h5::write_attr(q, kGenMaxNewTokens, int32_t(r.max_new_tokens));
    h5::write_attr(q, kGenTemperature, r.temperature);
    h5::write_attr(q, kGenTopK, int32_t(r.top_k));
    h5::write_attr(q, kGenTopP, r.top_p);
    h5::write_attr(q, kGenSamplingSeed, r.sampling_seed);
    h5::write_attr(q, kGenFinishReason, r.finish_reason);
    h5::write_attr(q, kGenPrefixSource, int32_t(r.prefix_source));
    h5::write_attr(q, kGenSharedPrefix, int64_t(r.shared_prefix));
    const int64_t N = int64_t(r.tokens.size());
    std::vector<uint32_t> ctr;
    for (const auto& c : r.counters) ctr.insert(ctr.end(), c.begin(), c.end());
    put(q, kTokens, Type::i32, dims(N), r.tokens);
    put(q, kLogprobs, Type::f32, dims(N), r.logprobs);
    put(q, kGenCounters, Type::u32, std::vector<hsize_t>{hsize_t(N), 4}, ctr);
    put(q, kGenStopIds, Type::i32, dims(int64_t(r.stop_ids.size())), r.stop_ids);
  }
}

GenerationRecord read_generation(const h5::Object& step, const std::vector<std::string>& seq_groups,
                                 const std::string& where) {
  if (!h5::exists(step, kGeneration))
    throw TraceError(fmt::format("{}: a generation step without its '{}' group", where, kGeneration));
  GenerationRecord g;
  h5::Object gg = h5::open(step, kGeneration);
  g.max_batch = int(h5::read_attr_int(gg, kGenMaxBatch));
  g.page_size = int(h5::read_attr_int(gg, kGenPageSize));
  g.prefill_chunk = int(h5::read_attr_int(gg, kGenPrefillChunk));
  g.token_budget = h5::read_attr_int(gg, kGenTokenBudget);
  g.prefix_sharing = h5::read_attr_int(gg, kGenPrefixSharing) != 0;
  g.decode_attention = h5::read_attr_string(gg, kGenDecodeAttention);
  const auto st = h5::read<int32_t>(h5::open(gg, kGenScheduleStep));
  const auto rq = h5::read<int32_t>(h5::open(gg, kGenScheduleRequest));
  const auto p0 = h5::read<int64_t>(h5::open(gg, kGenSchedulePos0));
  const auto len = h5::read<int64_t>(h5::open(gg, kGenScheduleLength));
  const auto sm = h5::read<uint8_t>(h5::open(gg, kGenScheduleSampled));
  if (rq.size() != st.size() || p0.size() != st.size() || len.size() != st.size() || sm.size() != st.size())
    throw TraceError(fmt::format("{}: the schedule datasets of '{}' differ in length", where, kGeneration));
  for (size_t i = 0; i < st.size(); ++i) g.schedule.push_back({st[i], rq[i], p0[i], len[i], sm[i]});
  for (size_t i = 0; i < seq_groups.size(); ++i) {
    h5::Object sq = h5::open(step, seq_groups[i]);
    if (!h5::exists(sq, kGeneration))
      throw TraceError(fmt::format("{}: {} has no '{}' group", where, seq_groups[i], kGeneration));
    h5::Object q = h5::open(sq, kGeneration);
    GenerationRequestRecord r;
    r.id = h5::read_attr_string(q, kGenId);
    r.request_key = h5::read_attr_u64(q, kGenRequestKey);
    r.prompt_length = h5::read_attr_int(q, kGenPromptLength);
    r.max_new_tokens = int(h5::read_attr_int(q, kGenMaxNewTokens));
    r.temperature = h5::read_attr_f32(q, kGenTemperature);
    r.top_k = int(h5::read_attr_int(q, kGenTopK));
    r.top_p = h5::read_attr_f32(q, kGenTopP);
    r.sampling_seed = h5::read_attr_u64(q, kGenSamplingSeed);
    r.finish_reason = h5::read_attr_string(q, kGenFinishReason);
    r.prefix_source = int(h5::read_attr_int(q, kGenPrefixSource));
    r.shared_prefix = h5::read_attr_int(q, kGenSharedPrefix);
    r.tokens = h5::read<int32_t>(h5::open(q, kTokens));
    r.logprobs = h5::read<float>(h5::open(q, kLogprobs));
    const auto ctr = h5::read<uint32_t>(h5::open(q, kGenCounters));
    r.stop_ids = h5::read<int32_t>(h5::open(q, kGenStopIds));
    if (r.logprobs.size() != r.tokens.size() || ctr.size() != 4 * r.tokens.size())
      throw TraceError(fmt::format("{}: {}/{}: {} tokens, {} log-probs, {} counter words", where,
                                   seq_groups[i], kGeneration, r.tokens.size(), r.logprobs.size(),
                                   ctr.size()));
    for (size_t j = 0; j < r.tokens.size(); ++j)
      r.counters.push_back({ctr[4 * j], ctr[4 * j + 1], ctr[4 * j + 2], ctr[4 * j + 3]});
    g.requests.push_back(std::move(r));
  }
  return g;
}

}  // namespace dsv4
