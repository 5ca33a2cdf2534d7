// Replay of a fast-numerics step within tolerances (replay/tolerance.h).
#include "replay/tolerance.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <type_traits>

#include "capture/errors.h"
#include "capture/trace_reader.h"
#include "model/decision_sets.h"
#include "model/error.h"
#include "model/observer.h"
#include "replay/rel_l2.h"

namespace dsv4 {

namespace {

// A bound's value: a finite number >= 0, else an InputError naming the option and its default.
double parse_bound(const char* option, const char* what, const std::string& value, double fallback) {
  errno = 0;
  char* end = nullptr;
  const double x = std::strtod(value.c_str(), &end);
  if (end != value.c_str() + value.size() || value.empty() || errno == ERANGE || !std::isfinite(x) || x < 0)
    throw InputError(
        fmt::format("{}: '{}' is not a finite number >= 0 (the {} bound; default {:g})", option, value, what, fallback));
  return x;
}

}  // namespace

ToleranceBounds parse_tolerance(const std::string& value, const std::string& logprobs) {
  ToleranceBounds b;
  if (!value.empty()) b.tensor_rel_l2 = parse_bound("--tolerance", "per-tensor rel-L2", value, kDefaultTensorRelL2);
  if (!logprobs.empty())
    b.logprob_rel_l2 = parse_bound("--tolerance-logprobs", "log-probs' rel-L2", logprobs, kDefaultLogprobRelL2);
  return b;
}

// ---- rel-L2 -------------------------------------------------------------------------------------------

void RelL2::add(double a, double b) {
  ++n_;
  if (!std::isfinite(a) || !std::isfinite(b)) {
    // A non-finite element must be the same on both sides: the same infinity, or NaN against NaN.
    if (!(a == b || (std::isnan(a) && std::isnan(b)))) ++nonfinite_mismatches_;
    return;
  }
  const double d = b - a;
  num_ += d * d;
  den_ += a * a;
  max_abs_ = std::max(max_abs_, std::fabs(d));
}

void RelL2::add(const float* a, const float* b, int64_t n) {
  for (int64_t i = 0; i < n; ++i) add(double(a[i]), double(b[i]));
}

double RelL2::rel_l2() const {
  if (nonfinite_mismatches_ > 0) return std::numeric_limits<double>::infinity();
  return rel_l2_of(num_, den_);
}

// ---- the exact profile ---------------------------------------------------------------------------------

ExactReplayProfile exact_replay_profile(const NumericsProfile& fast) {
  const std::vector<std::string> sites = tensor_core_sites(fast);
  if (sites.empty()) throw Error(fmt::format("exact_replay_profile: profile '{}' is exact already", fast.name));
  const std::string base = numerics_base_name(fast);
  const std::string site_list = fmt::format("{}", fmt::join(sites, ", "));
  ExactReplayProfile out;
  if (base != fast.name && is_builtin_profile(base)) {
    // Made by with_numerics from a built-in: the built-in's order goes back on the tensor_core sites.
    const NumericsProfile builtin = profile_by_name(base);
    NumericsProfile e = fast;
    for (const std::string& s : sites) copy_profile_site(e, builtin, s);
    if (profile_diff(e, builtin).empty()) {
      out.profile = builtin;
      out.note = fmt::format("the built-in profile '{}' that '{}' was made from ({} back to its exact order)", base,
                             fast.name, site_list);
      return out;
    }
    // Other sites differ from the built-in's too: not the built-in (its name means its sites).
    out.profile = e;
    out.profile.name = fast.name + " with exact " + site_list;
    out.note = fmt::format("'{}' with {} back to the order of the built-in '{}' (its other sites differ from the "
                           "built-in's, so it is not the built-in)",
                           fast.name, site_list, base);
    return out;
  }
  // A profile file made fast ("my-engine.fast"), or one that set tensor_core itself: the exact order it
  // had on those sites is not in the trace. The default exact order (one chain) stands in.
  NumericsProfile e = fast;
  for (const std::string& s : sites) {
    const ProfileSite* site = find_profile_site(s);
    if (const char* why = site ? site->set(e, "0") : "unknown site")
      throw Error(fmt::format("exact_replay_profile: site '{}': {}", s, why));
  }
  e.name = fast.name + " with exact " + site_list;
  out.profile = e;
  out.note = fmt::format(
      "'{}' with {} = 0 (the default exact order, one chain of kernels/reduce.h): {} is not built in, so the exact "
      "order of its own on those sites is not known",
      fast.name, site_list, base != fast.name ? "the profile '" + base + "' it was made from" : "a profile that sets "
                                                                                                   "tensor_core itself");
  return out;
}

// ---- free decisions -----------------------------------------------------------------------------------

namespace {

// Rows of one kind at one layer over every sequence: recorded against free, margins of both sides.
template <typename Rec>
void agree_layer(const std::vector<std::pair<const Rec*, const Rec*>>& pairs, double factor, FreeDecisionKind& k) {
  std::vector<float> ma, mb;
  for (const auto& [a, b] : pairs) {
    ma.insert(ma.end(), a->margin.begin(), a->margin.end());
    mb.insert(mb.end(), b->margin.begin(), b->margin.end());
  }
  const double thr = relative_tie_threshold({&ma, &mb}, factor).value_or(0);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (const auto& [a, b] : pairs) {
    for (int64_t t = 0; t < std::min(a->T, b->T); ++t) {
      ++k.rows;
      if (valid_ids(a->ids, a->k, t) == valid_ids(b->ids, b->k, t)) {
        ++k.same;
        continue;
      }
      const float m_a = size_t(t) < a->margin.size() ? a->margin[size_t(t)] : nan;
      const float m_b = size_t(t) < b->margin.size() ? b->margin[size_t(t)] : nan;
      if (is_tie_flip(m_a, m_b, thr))
        ++k.tie_flips;
      else
        ++k.confident_flips;
      if (std::isfinite(m_a)) k.largest_flip_margin = std::max(k.largest_flip_margin, double(std::fabs(m_a)));
    }
  }
}

template <typename Rec>
void agree(const std::map<std::pair<int, int>, Rec>& rec, const std::map<std::pair<int, int>, Rec>& free, double factor,
           FreeDecisionKind& k) {
  std::map<int, std::vector<std::pair<const Rec*, const Rec*>>> by_layer;
  for (const auto& [key, a] : rec) {
    const auto it = free.find(key);
    if (it == free.end()) continue;
    if constexpr (std::is_same_v<Rec, RoutingRecord>)
      if (a.hashed) continue;  // the ids follow from the tokens
    by_layer[key.second].push_back({&a, &it->second});
  }
  for (const auto& [layer, pairs] : by_layer) agree_layer(pairs, factor, k);
}

}  // namespace

FreeDecisionAgreement free_decision_agreement(const std::map<std::pair<int, int>, IndexerRecord>& rec_indexer,
                                              const std::map<std::pair<int, int>, RoutingRecord>& rec_routing,
                                              const DecisionLog& free, double tie_factor) {
  FreeDecisionAgreement a;
  a.tie_factor = tie_factor;
  agree(rec_indexer, free.indexer, tie_factor, a.indexer);
  agree(rec_routing, free.routing, tie_factor, a.routing);
  return a;
}

// ---- the judge -----------------------------------------------------------------------------------------

void ToleranceJudge::record(const TensorRecord& t, bool bitwise_equal) {
  out_.records_bitwise_equal += bitwise_equal;
  const std::optional<TensorCopy> rec = r_.tensor(step_, t.seq, t.layer, std::string(t.name));
  if (!rec) {
    ++out_.digest_only;
    out_.digest_only_equal += bitwise_equal;
    return;
  }
  if (rec->shape != t.shape || rec->dtype != t.dtype)
    throw TraceCorrupt(fmt::format(
        "{}: step {} sequence {}: the full tensor {} layer {} is stored as {} [{}], its digest record and the "
        "replay have {} [{}]",
        r_.path(), step_, t.seq, t.name, t.layer, to_string(rec->dtype), fmt::join(rec->shape, ", "),
        to_string(t.dtype), fmt::join(t.shape, ", ")));
  RelL2 e;
  const void* values = t.data();  // downloaded here when the replay ran on a device
  const int64_t n = t.rows() * t.row_elems();
  if (t.dtype == DType::i32) {
    const auto* b = static_cast<const int32_t*>(values);
    for (int64_t i = 0; i < n; ++i) e.add(double(rec->i[size_t(i)]), double(b[i]));
  } else {
    e.add(rec->f.data(), static_cast<const float*>(values), n);
  }
  ToleranceTensor x{t.seq, t.layer, std::string(t.name), e.rel_l2(), e.max_abs(), e.nonfinite_mismatches()};
  ++out_.tensors_compared;
  // The worst: the largest rel-L2 (+inf for non-finite mismatches); the first one kept among equals.
  if (!out_.worst || x.rel_l2 > out_.worst->rel_l2) out_.worst = x;
  if (!within_bound(x.rel_l2, out_.bounds.tensor_rel_l2)) {
    ++out_.tensors_over;
    if (!out_.first_over) out_.first_over = x;
  }
}

void ToleranceJudge::logprobs(int seq, const std::vector<float>& recorded, const std::vector<float>& replayed) {
  if (recorded.size() != replayed.size())
    throw TraceCorrupt(fmt::format("{}: step {} sequence {} holds {} log-probs, the replay computed {}", r_.path(),
                                   step_, seq, recorded.size(), replayed.size()));
  logprobs_.add(recorded.data(), replayed.data(), int64_t(recorded.size()));
}

void ToleranceJudge::finish() {
  out_.logprobs = logprobs_.elements();
  out_.logprob_rel_l2 = logprobs_.rel_l2();
  out_.logprob_max_abs = logprobs_.max_abs();
  out_.logprob_nonfinite_mismatches = logprobs_.nonfinite_mismatches();
}

}  // namespace dsv4
