#include "replay/attribution.h"

#include <fmt/format.h>

#include <cmath>

#include "capture/layout.h"
#include "capture/trace_reader.h"
#include "model/collect.h"
#include "model/decision_sets.h"
#include "model/error.h"
#include "model/forward.h"
#include "replay/replay.h"

namespace dsv4 {

namespace {

// One side of a stage: per sequence its log-probs and decisions.
struct Side {
  std::string name;
  std::vector<std::vector<float>> logprobs;
  std::map<std::pair<int, int>, IndexerRecord> indexer;
  std::map<std::pair<int, int>, RoutingRecord> routing;
};

Side from_trace(const TraceReader& r, int step, int n, const std::string& name) {
  Side s;
  s.name = name;
  for (int q = 0; q < n; ++q) {
    s.logprobs.push_back(r.logprobs(step, q));
    for (int L : r.decision_layers(step, q)) {
      if (auto x = r.indexer(step, q, L)) s.indexer[{q, L}] = *x;
      if (auto x = r.routing(step, q, L)) s.routing[{q, L}] = *x;
    }
  }
  return s;
}

Side from_forward(const Weights& w, const std::vector<std::vector<int32_t>>& seqs,
                  const std::vector<float>& temperature, const NumericsProfile& p, const std::string& name) {
  Side s;
  s.name = name;
  for (size_t q = 0; q < seqs.size(); ++q) {  // one call per sequence: each has its own temperature
    DecisionLog log;
    RunOptions o;
    o.profile = p;
    o.temperature = temperature[q];
    o.observer = &log;
    s.logprobs.push_back(forward(w, {seqs[q]}, o).seqs[0].logprobs);
    for (auto& [key, rec] : log.indexer) s.indexer[{int(q), key.second}] = rec;
    for (auto& [key, rec] : log.routing) s.routing[{int(q), key.second}] = rec;
  }
  return s;
}

AttributionStage compare(const std::string& name, const Side& a, const Side& b) {
  AttributionStage st;
  st.name = name;
  st.from = a.name;
  st.to = b.name;
  double sum = 0, abs_sum = 0;
  for (size_t q = 0; q < a.logprobs.size(); ++q) {
    const auto& x = a.logprobs[q];
    const auto& y = b.logprobs[q];
    if (x.size() != y.size())
      throw Error(fmt::format("attribution: sequence {} has {} and {} log-probs", q, x.size(), y.size()));
    for (size_t t = 0; t < x.size(); ++t) {
      const double d = double(y[t]) - double(x[t]);
      sum += d;
      abs_sum += std::fabs(d);
      st.logprob_abs_max = std::max(st.logprob_abs_max, std::fabs(d));
      ++st.tokens;
    }
  }
  if (st.tokens > 0) {
    st.logprob_mean = sum / double(st.tokens);
    st.logprob_abs_mean = abs_sum / double(st.tokens);
  }
  for (const auto& [key, ra] : a.indexer) {
    auto it = b.indexer.find(key);
    if (it == b.indexer.end()) continue;
    const IndexerRecord& rb = it->second;
    for (int64_t t = 0; t < std::min(ra.T, rb.T); ++t) {
      ++st.indexer_rows;
      if (valid_ids(ra.ids, ra.k, t) != valid_ids(rb.ids, rb.k, t)) ++st.indexer_rows_differing;
    }
  }
  for (const auto& [key, ra] : a.routing) {
    auto it = b.routing.find(key);
    if (it == b.routing.end() || ra.hashed) continue;
    const RoutingRecord& rb = it->second;
    for (int64_t t = 0; t < std::min(ra.T, rb.T); ++t) {
      ++st.routing_rows;
      if (valid_ids(ra.ids, ra.k, t) != valid_ids(rb.ids, rb.k, t)) ++st.routing_rows_differing;
    }
  }
  return st;
}

}  // namespace

Attribution attribute_mismatch(const std::string& rollout, int rs, const std::string& train, int ts,
                               const std::string& model_dir) {
  const TraceReader R = TraceReader::open(rollout), Tr = TraceReader::open(train);
  const auto rsteps = R.steps(), tsteps = Tr.steps();
  if (rs < 0 || rs >= int(rsteps.size()) || ts < 0 || ts >= int(tsteps.size()))
    throw InputError(
        fmt::format("attribution: step {} of {} or step {} of {} does not exist", rs, rollout, ts, train));
  const TraceStepInfo& ri = rsteps[size_t(rs)];
  const TraceStepInfo& ti = tsteps[size_t(ts)];
  if (ri.kind != trace_layout::kKindGenerate)
    throw InputError(
        fmt::format("{} step {} is a {} step: --attribute needs the rollout as a generation step "
                    "(dsv4 generate --record) as trace B",
                    rollout, rs, ri.kind));
  const int n = int(ri.seq_lengths.size());
  if (int(ti.seq_lengths.size()) != n)
    throw InputError(
        fmt::format("{} and {} hold {} and {} sequences", rollout, train, n, ti.seq_lengths.size()));
  const auto gen = R.generation(rs);
  std::vector<std::vector<int32_t>> seqs;
  std::vector<float> temps;
  for (int q = 0; q < n; ++q) {
    seqs.push_back(R.tokens(rs, q));
    if (seqs.back() != Tr.tokens(ts, q))
      throw InputError(fmt::format("{} and {}: sequence {} holds other tokens", rollout, train, q));
    const float tau = gen->requests[size_t(q)].temperature;
    temps.push_back(tau > 0 ? tau : 1.0f);
  }
  for (float tau : temps)
    if (tau != 1.0f)
      throw InputError(
          "attribution: a request sampled at a temperature other than 1; the training step's log-probs are "
          "at "
          "temperature 1, so the stages would not add up");
  const Weights w = weights_for_trace(R, model_dir);
  const NumericsProfile P = recorded_profile(ri, R.path());
  NumericsProfile noFp8 = P;
  noFp8.name = P.name + " without FP8 caches";
  if (P.fp8_kv_cache()) noFp8.kv_quant = QuantSim::none;
  if (P.fp8_indexer_cache()) noFp8.indexer_quant = QuantSim::none;

  const Side g = from_trace(R, rs, n, "generation (" + ri.profile + ")");
  const Side pre = from_forward(w, seqs, temps, P, "prefill (" + ri.profile + ")");
  const Side nof = from_forward(w, seqs, temps, noFp8, "prefill (" + noFp8.name + ")");
  const Side t = from_trace(Tr, ts, n, "training step (" + ti.profile + ")");
  Attribution a;
  a.stages.push_back(compare("decode vs prefill", g, pre));
  a.stages.push_back(compare("FP8 cache", pre, nof));
  a.stages.push_back(compare("rest of the profile", nof, t));
  a.stages.push_back(compare("total", g, t));
  return a;
}

std::string attribution_to_table(const Attribution& a) {
  std::string s =
      fmt::format("\n{:<22} {:>12} {:>12} {:>12} {:>18} {:>18}   compared\n", "mismatch from", "dlogp mean",
                  "|dlogp| mean", "|dlogp| max", "indexer rows diff", "routing rows diff");
  for (const auto& st : a.stages)
    s += fmt::format("{:<22} {:>12.3e} {:>12.3e} {:>12.3e} {:>11}/{:<6} {:>11}/{:<6}   {} -> {}\n", st.name,
                     st.logprob_mean, st.logprob_abs_mean, st.logprob_abs_max, st.indexer_rows_differing,
                     st.indexer_rows, st.routing_rows_differing, st.routing_rows, st.from, st.to);
  s += "(signed means add up along the chain; decision rows are (position, layer) sets, hash layers left "
       "out)\n";
  return s;
}

}  // namespace dsv4
