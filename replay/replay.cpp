// Replay: re-execute recorded steps and verify them against the trace (replay/replay.h).
//
// Verification walks each sequence's recorded digest records in execution order while the model
// reports its named tensors: the n-th tensor the replay computes for a sequence must be the n-th
// record (same name, layer and row count) and every row's digest must equal the recorded one. The
// first differing (sequence, layer, tensor, row) in execution order is kept with the recomputed row
// and, where the trace holds the full tensor, the element-level difference.
#include "replay/replay.h"

#include "capture/layout.h"
#include "replay/generation.h"
#include "replay/training.h"

#include <fmt/format.h>
#include <omp.h>

#include <algorithm>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <set>

#include "capture/digest.h"
#include "capture/env.h"
#include "capture/errors.h"
#include "kernels/logits.h"
#include "kernels/reduce.h"
#include "model/collect.h"
#include "model/decision_sets.h"
#include "model/forward.h"

namespace dsv4 {

namespace {

// ---- element-level comparison ------------------------------------------------------------------

// Position of a value on a line where neighbouring representable values are one apart (sign-magnitude
// bit patterns mapped to a monotonic integer), so the ulp distance is a difference of two keys.
int64_t ordered_f32(float x) {
  const int32_t i = std::bit_cast<int32_t>(x);
  return i < 0 ? int64_t(INT32_MIN) - i : int64_t(i);
}
int64_t ordered_bf16(float x) {  // x is bf16-exact: its upper 16 bits are the bf16 pattern
  const int16_t i = int16_t(std::bit_cast<uint32_t>(x) >> 16);
  return i < 0 ? int64_t(INT16_MIN) - i : int64_t(i);
}

// Element diff of one row: first index whose stored bits differ, both values, the ulp distance in
// the storage dtype (bf16 tensors count bf16 ulps), and max abs/rel differences over the row.
void element_diff(const TensorCopy& rec, const TensorRecord& t, int64_t row, Divergence& d) {
  const int64_t per = t.row_elems();
  d.has_elements = true;
  const auto* rep_i = static_cast<const int32_t*>(t.data());
  const auto* rep_f = static_cast<const float*>(t.data());
  auto value_rec = [&](int64_t i) {
    return t.dtype == DType::i32 ? double(rec.i[size_t(row * per + i)])
                                 : double(rec.f[size_t(row * per + i)]);
  };
  auto value_rep = [&](int64_t i) {
    return t.dtype == DType::i32 ? double(rep_i[row * per + i]) : double(rep_f[row * per + i]);
  };
  auto same_bits = [&](int64_t i) {
    if (t.dtype == DType::i32) return rec.i[size_t(row * per + i)] == rep_i[row * per + i];
    const float a = rec.f[size_t(row * per + i)], b = rep_f[row * per + i];
    return std::bit_cast<uint32_t>(a) == std::bit_cast<uint32_t>(b);
  };
  for (int64_t i = 0; i < per; ++i) {
    if (same_bits(i)) continue;
    const double a = value_rec(i), b = value_rep(i);
    double abs = std::fabs(a - b);
    if (std::isnan(abs)) abs = std::numeric_limits<double>::infinity();  // NaN on one side only
    const double rel = a != 0 ? abs / std::fabs(a) : std::numeric_limits<double>::infinity();
    d.max_abs = std::max(d.max_abs, abs);
    d.max_rel = std::max(d.max_rel, rel);
    if (d.first_index >= 0) continue;
    d.first_index = i;
    d.recorded = a;
    d.replayed = b;
    if (t.dtype == DType::i32)
      d.ulp = int64_t(std::llabs(int64_t(a) - int64_t(b)));
    else if (t.dtype == DType::bf16)
      d.ulp = std::llabs(ordered_bf16(float(a)) - ordered_bf16(float(b)));
    else
      d.ulp = std::llabs(ordered_f32(float(a)) - ordered_f32(float(b)));
  }
}

// ---- the verifying observer ----------------------------------------------------------------------

// Compares every reported tensor with the recorded digests of its sequence and keeps the decisions
// the replay made (for the comparison with the recorded or the counterfactual ones afterwards).
class Verifier : public Observer {
 public:
  Verifier(const TraceReader& r, int step, std::vector<DigestTable> tables, StepReplay& out)
      : r_(r), step_(step), out_(out) {
    for (auto& t : tables) seqs_.push_back(SeqState{std::move(t)});
  }

  void on_tensor(const TensorRecord& t) override {
    if (t.seq < 0 || t.seq >= int(seqs_.size()))
      throw Error(
          fmt::format("internal: the replay reported sequence {} of a batch of {}", t.seq, seqs_.size()));
    SeqState& s = seqs_[size_t(t.seq)];
    if (s.lost) return;
    if (s.next >= s.table.records.size()) {
      lose(t, s,
           fmt::format(
               "extra record: the trace holds {} records for sequence {}, the replay computed {} layer {} "
               "after them",
               s.table.records.size(), t.seq, t.name, t.layer));
      return;
    }
    const DigestRecord& rec = s.table.records[s.next];
    if (rec.name != t.name || rec.layer != t.layer || rec.rows != t.rows()) {
      lose(t, s,
           fmt::format(
               "record order differs: record {} of sequence {} is {} layer {} ({} rows) in the trace, the "
               "replay computed {} layer {} ({} rows)",
               s.next, t.seq, rec.name, rec.layer, rec.rows, t.name, t.layer, t.rows()));
      return;
    }
    if (rec.first < 0 || rec.first + rec.rows > int64_t(s.table.values.size()))
      throw TraceError(
          fmt::format("{}: step {} sequence {}: digest record {} ({} layer {}) points past the {} "
                      "recorded values",
                      r_.path(), step_, t.seq, s.next, rec.name, rec.layer, s.table.values.size()));
    ++s.next;
    const std::vector<uint64_t> rows = digest_rows(t);
    ++out_.records_compared;
    out_.rows_compared += rec.rows;
    int64_t first_bad = -1, bad = 0;
    for (int64_t i = 0; i < rec.rows; ++i) {
      if (rows[size_t(i)] == s.table.values[size_t(rec.first + i)]) continue;
      ++bad;
      if (first_bad < 0) first_bad = i;
    }
    // Compared within tolerance: the values are judged, a digest difference is expected.
    if (judge_) judge_->record(t, bad == 0);
    if (bad == 0) return;
    ++out_.records_differing;
    out_.rows_differing += bad;
    if (!judge_ && !out_.first) out_.first = divergence(t, first_bad, "digest differs", true);
  }
  void on_indexer(const IndexerDecision& d) override { log.on_indexer(d); }
  void on_routing(const RoutingDecision& d) override { log.on_routing(d); }
  bool wants_tensors() const override { return true; }

  // A step compared within tolerance (replay/tolerance.h): every aligned record goes to `j`, and only
  // a record order that differs is a divergence.
  void judge_by_value(ToleranceJudge* j) { judge_ = j; }

  // After the forward: a sequence whose replay ended before its recorded records did is a divergence.
  void finish() {
    for (size_t q = 0; q < seqs_.size(); ++q) {
      SeqState& s = seqs_[q];
      if (s.lost || s.next == s.table.records.size()) continue;
      const DigestRecord& rec = s.table.records[s.next];
      ++out_.records_differing;
      if (out_.first) continue;
      Divergence d;
      d.step = step_;
      d.seq = int(q);
      d.layer = rec.layer;
      d.tensor = rec.name;
      d.reason = fmt::format(
          "missing record: the trace holds {} records for sequence {}, the replay computed only {}",
          s.table.records.size(), q, s.next);
      out_.first = std::move(d);
    }
  }

  DecisionLog log;

 private:
  struct SeqState {
    DigestTable table;
    size_t next = 0;
    bool lost = false;  // an order mismatch: later records cannot be aligned
  };

  void lose(const TensorRecord& t, SeqState& s, std::string why) {
    s.lost = true;
    ++out_.records_differing;
    if (!out_.first) out_.first = divergence(t, 0, std::move(why), false);
  }

  Divergence divergence(const TensorRecord& t, int64_t row, std::string reason, bool elements) const {
    Divergence d;
    d.step = step_;
    d.seq = t.seq;
    d.layer = t.layer;
    d.tensor = std::string(t.name);
    d.row = row;
    d.reason = std::move(reason);
    const int64_t per = t.row_elems();
    if (row < t.rows()) {
      const void* values = t.data();  // downloaded here when the replay ran on a device
      d.replayed_row.resize(size_t(per));
      for (int64_t i = 0; i < per; ++i)
        d.replayed_row[size_t(i)] = t.dtype == DType::i32
                                        ? float(static_cast<const int32_t*>(values)[row * per + i])
                                        : static_cast<const float*>(values)[row * per + i];
    }
    // NaN bit patterns (sign, payload) differ between x86 and CUDA arithmetic, and digests hash the
    // bits: say so where the replayed row holds NaN, since the recording may come from the other
    // device (docs/NUMERICS.md).
    if (std::any_of(d.replayed_row.begin(), d.replayed_row.end(), [](float v) { return v != v; }))
      d.reason +=
          " (the replayed row holds NaN: CPU and CUDA write different NaN bit patterns, so a row "
          "recorded on the other device differs here even where the numbers agree)";
    if (!elements) return d;
    // Only the first divergence reads the full tensor, so this costs one dataset read per step.
    const std::optional<TensorCopy> rec = r_.tensor(step_, t.seq, t.layer, std::string(t.name));
    if (!rec || rec->shape != t.shape || rec->dtype != t.dtype) return d;
    element_diff(*rec, t, row, d);
    if (d.first_index < 0)
      d.reason += " (the recorded full tensor equals the replayed row: the recorded digest itself is wrong)";
    return d;
  }

  const TraceReader& r_;
  int step_;
  StepReplay& out_;
  std::vector<SeqState> seqs_;
  ToleranceJudge* judge_ = nullptr;
};

// A generation step re-executed as one prefill of its sequences at temperature 1: the trace holds their
// raw logits, as the engine computes them, and their log-probs at each request's temperature τ
// (capture/generation.h). This computes the latter from the logits rows the way the recorder does
// (each row divided by τ, then log_softmax_gather) and reports them in place of the forward's
// temperature-1 log-probs.
class TemperatureLogprobs : public Observer {
 public:
  TemperatureLogprobs(Observer& inner, const std::vector<std::vector<int32_t>>& tokens,
                      const std::vector<float>& temperature)
      : inner_(inner), tokens_(tokens), temperature_(temperature), logprobs(tokens.size()) {}

  void on_tensor(const TensorRecord& t) override {
    const size_t q = size_t(t.seq);
    if (t.layer != -1 || q >= temperature_.size() || temperature_[q] == 1.0f) return inner_.on_tensor(t);
    if (t.name == "logits") {
      const int64_t T = t.rows(), V = t.row_elems();
      const auto* v = static_cast<const float*>(t.data());
      std::vector<float> row(static_cast<size_t>(V));
      logprobs[q].assign(size_t(std::max<int64_t>(T - 1, 0)), 0.0f);
      for (int64_t p = 0; p + 1 < T && p + 1 < int64_t(tokens_[q].size()); ++p) {
        for (int64_t j = 0; j < V; ++j) row[size_t(j)] = v[p * V + j] / temperature_[q];
        log_softmax_gather(row.data(), 1, V, &tokens_[q][size_t(p + 1)], &logprobs[q][size_t(p)]);
      }
    } else if (t.name == "logprobs") {
      TensorRecord u = t;
      u.host = logprobs[q].data();
      u.fetch = nullptr;
      u.row_digests = nullptr;
      return inner_.on_tensor(u);
    }
    inner_.on_tensor(t);
  }
  void on_indexer(const IndexerDecision& d) override { inner_.on_indexer(d); }
  void on_routing(const RoutingDecision& d) override { inner_.on_routing(d); }
  void on_mhc(const MhcDecision& d) override { inner_.on_mhc(d); }
  bool wants_tensors() const override { return inner_.wants_tensors(); }

 private:
  Observer& inner_;
  const std::vector<std::vector<int32_t>>& tokens_;
  const std::vector<float>& temperature_;

 public:
  std::vector<std::vector<float>> logprobs;  // per sequence at its temperature (empty at temperature 1)
};

// ---- decisions -------------------------------------------------------------------------------------

// Rows whose sets differ between two [T, k] tables; a shape mismatch counts every row.
void compare_ids(int seq, int layer, const char* kind, int64_t Ta, int ka, const std::vector<int32_t>& a,
                 int64_t Tb, int kb, const std::vector<int32_t>& b, std::vector<DecisionChange>& out) {
  DecisionChange c;
  c.seq = seq;
  c.layer = layer;
  c.kind = kind;
  // An external step's layer may stop one row short (the engines' layout): the rows both hold compare.
  if (std::abs(Ta - Tb) > 1 || ka != kb || int64_t(a.size()) != Ta * ka || int64_t(b.size()) != Tb * kb) {
    c.rows_changed = std::max(Ta, Tb);
    c.first_row = 0;
  } else {
    for (int64_t t = 0; t < std::min(Ta, Tb); ++t) {
      if (valid_ids(a, ka, t) == valid_ids(b, kb, t)) continue;  // decisions compare as sets
      ++c.rows_changed;
      if (c.first_row < 0) c.first_row = t;
    }
  }
  if (c.rows_changed > 0) out.push_back(std::move(c));
}

// The decisions one sequence of a trace's step holds, by layer.
struct SeqDecisions {
  std::map<int, IndexerRecord> indexer;
  std::map<int, RoutingRecord> routing;
};
SeqDecisions read_decisions(const TraceReader& r, int step, int seq) {
  SeqDecisions d;
  for (int layer : r.decision_layers(step, seq)) {
    if (auto x = r.indexer(step, seq, layer)) d.indexer[layer] = std::move(*x);
    if (auto x = r.routing(step, seq, layer)) d.routing[layer] = std::move(*x);
  }
  return d;
}

// Recomputed (the replay's log) vs expected decisions of every sequence; a layer present on one side
// only counts every row as changed.
std::vector<DecisionChange> compare_decisions_with(const DecisionLog& log,
                                                   const std::vector<SeqDecisions>& expected) {
  std::vector<DecisionChange> out;
  for (int seq = 0; seq < int(expected.size()); ++seq) {
    std::set<int> layers;
    for (const auto& [l, x] : expected[size_t(seq)].indexer) layers.insert(l);
    for (const auto& [l, x] : expected[size_t(seq)].routing) layers.insert(l);
    for (const auto& [key, x] : log.indexer)
      if (key.first == seq) layers.insert(key.second);
    for (const auto& [key, x] : log.routing)
      if (key.first == seq) layers.insert(key.second);
    for (int layer : layers) {
      static const IndexerRecord no_indexer;
      static const RoutingRecord no_routing;
      const auto ei = expected[size_t(seq)].indexer.find(layer);
      const auto ri = log.indexer.find({seq, layer});
      if (ei != expected[size_t(seq)].indexer.end() || ri != log.indexer.end()) {
        const IndexerRecord& a = ei != expected[size_t(seq)].indexer.end() ? ei->second : no_indexer;
        const IndexerRecord& b = ri != log.indexer.end() ? ri->second : no_indexer;
        compare_ids(seq, layer, "indexer", a.T, a.k, a.ids, b.T, b.k, b.ids, out);
      }
      const auto er = expected[size_t(seq)].routing.find(layer);
      const auto rr = log.routing.find({seq, layer});
      if (er != expected[size_t(seq)].routing.end() || rr != log.routing.end()) {
        const RoutingRecord& a = er != expected[size_t(seq)].routing.end() ? er->second : no_routing;
        const RoutingRecord& b = rr != log.routing.end() ? rr->second : no_routing;
        compare_ids(seq, layer, "routing", a.T, a.k, a.ids, b.T, b.k, b.ids, out);
      }
    }
  }
  return out;
}

// Overrides that force recorded decisions: indexer selections of C4 layers and/or the experts of
// learned layers (hash layers are never overridden; their ids follow from the tokens anyway).
// Why an external step is not re-executed, and what it is good for.
std::string external_step_note(const TraceStepInfo& s) {
  return fmt::format("engine '{}' computed it{}, so there is nothing to re-execute; `dsv4 diff` compares it with a "
                     "step of ours and `dsv4 replay OURS.h5 --take-decisions-from` forces its decisions",
                     s.engine, s.source.empty() ? "" : " (from " + s.source + ")");
}

// Forces the decisions `d` into a forward of `batch`; an external step's rows that stop before the
// last token are completed (model/decision_sets.h complete_decision_rows).
void add_overrides(const std::vector<SeqDecisions>& d, const std::vector<std::vector<int32_t>>& batch, bool indexer,
                   bool routing, Overrides& o) {
  for (int seq = 0; seq < int(d.size()); ++seq) {
    const int64_t T = int64_t(batch[size_t(seq)].size());
    if (indexer)
      for (const auto& [layer, x] : d[size_t(seq)].indexer)
        o.force_indexer(seq, layer, ForcedSelection{T, x.k, complete_decision_rows(x.ids, x.T, x.k, T)});
    if (routing)
      for (const auto& [layer, x] : d[size_t(seq)].routing)
        if (!x.hashed)
          o.force_experts(seq, layer, ForcedSelection{T, x.k, complete_decision_rows(x.ids, x.T, x.k, T)});
  }
}

// ---- environment --------------------------------------------------------------------------------

int env_rank(const std::string& key) {
  // Another instruction set first: exact mode is written to give the same bits on every ISA, so a
  // divergence across ISAs points at the one place where it does not (an intrinsic, a contraction).
  static const std::map<std::string, int> ranks = {
      {"isa", 0},
      {"machine", 0},
      {"compile_flags", 1},
      {"compiler", 2},
      {"cpu_flags", 3},
      {"build_id", 4},
      {"threads", 5},
      {"parallel", 5},
      {"gpu", 6},
      {"gpu_arch", 6},
      {"tensor_core_revision", 6},
      {"gpu_driver", 6},
      {"cuda", 6},
      {"cupti", 6},
      {"nccl", 6},
      {"hdf5", 7},
      {"deflate", 7},
      {"os", 7},
      {"cpu_model", 7},
      {"host", 9},
  };
  const auto it = ranks.find(key);
  return it == ranks.end() ? 8 : it->second;
}

double mean_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += std::fabs(double(a[i]) - double(b[i]));
  return a.empty() ? 0 : s / double(a.size());
}
double mean(const std::vector<float>& a) {
  double s = 0;
  for (float x : a) s += x;
  return a.empty() ? 0 : s / double(a.size());
}
double mean_diff(const std::vector<float>& a, const std::vector<float>& b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += double(a[i]) - double(b[i]);
  return a.empty() ? 0 : s / double(a.size());
}

// Model shape fields that decisions depend on: forcing decisions of a trace of another shape cannot work.
bool same_decision_shape(const ModelConfig& a, const ModelConfig& b) {
  return a.num_hidden_layers == b.num_hidden_layers && a.compress_ratios == b.compress_ratios &&
         a.index_topk == b.index_topk && a.n_routed_experts == b.n_routed_experts &&
         a.num_experts_per_tok == b.num_experts_per_tok && a.num_hash_layers == b.num_hash_layers &&
         a.vocab_size == b.vocab_size;
}

// Where a step in `p` would be replayed (device `d`) when that cannot reproduce its bits
// (fast_replay_obstacle); nullopt when it can be replayed bit for bit here, or is exact.
struct FastElsewhere {
  std::string sites;  // "reduce.gemm, reduce.moe"
  FastReplayObstacle obstacle;
};
std::optional<FastElsewhere> fast_elsewhere(const NumericsProfile& p, const TraceReader& r, Device d) {
  const std::vector<std::string> tc = tensor_core_sites(p);
  if (tc.empty()) return std::nullopt;
  std::optional<FastReplayObstacle> o =
      fast_replay_obstacle(r.env(), d, d == Device::cuda ? gpu_arch() : "none", kTensorCoreRevision);
  if (!o) return std::nullopt;
  return FastElsewhere{fmt::format("{}", fmt::join(tc, ", ")), std::move(*o)};
}

// Without --tolerance, a fast step that cannot be replayed bit for bit here (fast_elsewhere) is refused
// before it runs, with where it was recorded, where it would run and the two ways out.
[[noreturn]] void refuse_fast_step(const NumericsProfile& p, const TraceReader& r, int step, const FastElsewhere& f) {
  const FastReplayObstacle& o = f.obstacle;
  throw InputError(fmt::format(
      "{} step {}: recorded in fast numerics (profile '{}': {} = tensor_core) on {}; its bits are "
      "reproducible only by {}, and this replay would run on {}: {}, or give --tolerance to re-execute it in "
      "exact numerics with its recorded decisions and compare it within documented tolerances "
      "(docs/NUMERICS.md \"Fast numerics\")",
      r.path(), step, p.name, f.sites, o.recorded, o.only, o.here, o.remedy));
}

}  // namespace

// ---- public -----------------------------------------------------------------------------------------

std::optional<FastReplayObstacle> fast_replay_obstacle(const EnvFingerprint& recorded, Device device,
                                                       const std::string& here_arch, int here_revision) {
  const auto arch_it = recorded.find(kEnvGpuArch);
  const std::string arch = arch_it == recorded.end() ? "(not recorded)" : arch_it->second;
  const std::string on = "a GPU of architecture " + arch;
  if (device != Device::cuda || here_arch != arch)
    return FastReplayObstacle{on, "a GPU of that architecture",
                              device == Device::cuda ? "a GPU of architecture " + here_arch
                                                     : std::string("the ") + to_string(device),
                              fmt::format("replay it with --device cuda on a {} GPU", arch)};
  const auto rev_it = recorded.find(kEnvTensorCoreRevision);
  const std::string rev = rev_it == recorded.end() ? "1" : rev_it->second;
  if (rev == std::to_string(here_revision)) return std::nullopt;
  const auto build_it = recorded.find("build_id");
  return FastReplayObstacle{
      fmt::format("{} by tensor-core kernels of revision {}", on, rev),
      "tensor-core kernels of that revision",
      fmt::format("{} with this build's tensor-core kernels, revision {}", on, here_revision),
      fmt::format(
          "replay it with a build whose tensor-core kernels are revision {} (the recording's build_id: {})",
          rev, build_it == recorded.end() ? "(not recorded)" : build_it->second)};
}

bool ReplayReport::identical() const {
  if (!weight_mismatches.empty()) return false;
  for (const auto& s : steps)
    if (!s.identical) return false;
  return true;
}

bool ReplayReport::passed() const {
  if (!weight_mismatches.empty()) return false;
  for (const auto& s : steps)
    if (!s.passed()) return false;
  return true;
}

std::vector<EnvDifference> compare_env(const EnvFingerprint& recorded, const EnvFingerprint& here) {
  std::set<std::string> keys;
  for (const auto& [k, v] : recorded) keys.insert(k);
  for (const auto& [k, v] : here) keys.insert(k);
  std::vector<EnvDifference> out;
  for (const std::string& k : keys) {
    const auto a = recorded.find(k), b = here.find(k);
    const std::string va = a == recorded.end() ? "(absent)" : a->second;
    const std::string vb = b == here.end() ? "(absent)" : b->second;
    if (va != vb) out.push_back(EnvDifference{k, va, vb, env_rank(k)});
  }
  std::stable_sort(out.begin(), out.end(), [](const EnvDifference& x, const EnvDifference& y) {
    return x.rank != y.rank ? x.rank < y.rank : x.key < y.key;
  });
  return out;
}

namespace {

std::string launch_str(const KernelRecord& k) {
  return fmt::format("{} grid ({},{},{}) block ({},{},{}) shared {} B", k.name, k.grid[0], k.grid[1],
                     k.grid[2], k.block[0], k.block[1], k.block[2], k.shared_bytes);
}

}  // namespace

void compare_kernels(const KernelRecords& recorded, const KernelRecords& replayed, StepReplay& sr) {
  if (!replayed.available) {
    sr.kernels_note = "this replay could not record kernels (" + replayed.reason + ")";
    return;
  }
  const std::vector<KernelRecord> rec = model_launches(recorded), rep = model_launches(replayed);
  sr.kernels_recorded = int64_t(rec.size());
  sr.kernels_replayed = int64_t(rep.size());
  const size_t n = std::min(rec.size(), rep.size());
  for (size_t i = 0; i < n; ++i)
    if (!same_launch(rec[i], rep[i])) {
      sr.kernels_equal = false;
      sr.kernel_first_difference = int64_t(i);
      sr.kernels_note = fmt::format("kernel {}: recorded {}, replayed {}", i, launch_str(rec[i]), launch_str(rep[i]));
      return;
    }
  if (rec.size() != rep.size()) {
    sr.kernels_equal = false;
    sr.kernel_first_difference = int64_t(n);
    sr.kernels_note = rec.size() > n ? fmt::format("kernel {}: recorded {}, the replay launched no more kernels", n,
                                                   launch_str(rec[n]))
                                     : fmt::format("kernel {}: the trace records no more kernels, replayed {}", n,
                                                   launch_str(rep[n]));
    return;
  }
  sr.kernels_equal = true;
}

// The thread count of a step's replay: --threads, or the recorded count. The recorded count is a
// file's word, used for resources: it is bounded by this machine's processors (results never depend
// on it), and a negative value means "the OpenMP default".
static int replay_threads(const ReplayOptions& opt, const TraceStepInfo& info) {
  if (opt.threads > 0) return opt.threads;
  return std::clamp(info.threads, 0, omp_get_num_procs());
}

// What a step's replay compares against, per sequence: its tokens, digests and decisions.
struct RecordedStep {
  std::vector<std::vector<int32_t>> tokens;
  std::vector<DigestTable> tables;
  std::vector<SeqDecisions> decisions;
};
static RecordedStep read_recorded_step(const TraceReader& r, int index, int n_seqs) {
  RecordedStep out;
  for (int s = 0; s < n_seqs; ++s) {
    out.tokens.push_back(r.tokens(index, s));
    out.tables.push_back(r.digests(index, s));
    out.decisions.push_back(read_decisions(r, index, s));
  }
  return out;
}

// A generation step: the engine runs again with the recorded requests and settings; every request's
// reports, laid out as a prefill of its computed tokens (capture/generation.h), are verified against
// the recorded digests in execution order, then the sampled tokens, their log-probs and the generator
// counters are compared. A divergence names the request, the position and the decode step.
static StepReplay replay_generation_step(const TraceReader& r, int index, const TraceStepInfo& info,
                                         const Weights& w, const ReplayOptions& opt) {
  StepReplay sr;
  sr.step = index;
  sr.threads = replay_threads(opt, info);
  const GenerationRecord g = *r.generation(index);
  const int n = int(info.seq_lengths.size());
  RecordedStep rec = read_recorded_step(r, index, n);
  std::vector<std::vector<int32_t>>& toks = rec.tokens;
  std::vector<SeqDecisions>& recorded = rec.decisions;
  rollout::EngineOptions eo = recorded_engine_options(g, recorded_profile(info, r.path()));
  eo.device = opt.device;
  eo.threads = sr.threads;
  const auto t0 = std::chrono::steady_clock::now();
  CollectedGeneration c =
      run_collected(w, recorded_requests(g, toks), eo, [](std::string_view, int) { return true; });
  sr.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  Verifier v(r, index, std::move(rec.tables), sr);
  for (int s = 0; s < n; ++s)
    c.collector->report_request(s, int64_t(c.computed[size_t(s)].size()), s, c.gens[size_t(s)].logprobs, v);
  v.finish();
  sr.decision_changes = compare_decisions_with(v.log, recorded);
  // The sampling record: tokens, log-probs (bits) and generator counters, request by request.
  for (int s = 0; s < n && !sr.first; ++s) {
    const GenerationRequestRecord& want = g.requests[size_t(s)];
    const rollout::Generation& got = c.gens[size_t(s)];
    const size_t m = std::max(want.tokens.size(), got.tokens.size());
    for (size_t i = 0; i < m; ++i) {
      const bool tok = i >= want.tokens.size() || i >= got.tokens.size() || want.tokens[i] != got.tokens[i];
      const bool lp = !tok && std::memcmp(&want.logprobs[i], &got.logprobs[i], 4) != 0;
      const bool ctr = !tok && !lp && want.counters[i] != got.counters[i];
      if (!tok && !lp && !ctr) continue;
      Divergence d;
      d.step = index;
      d.seq = s;
      d.tensor = tok ? "generation:tokens" : lp ? "generation:logprobs" : "generation:counters";
      d.row = int64_t(i);
      d.reason = tok ? fmt::format("generated token {} of request '{}': {} recorded, {} replayed", i, want.id,
                                   i < want.tokens.size() ? std::to_string(want.tokens[i]) : "none",
                                   i < got.tokens.size() ? std::to_string(got.tokens[i]) : "none")
                 : lp
                     ? fmt::format("log-prob of generated token {} of request '{}': {} recorded, {} replayed",
                                   i, want.id, want.logprobs[i], got.logprobs[i])
                     : fmt::format("generator counter of token {} of request '{}' differs", i, want.id);
      sr.first = std::move(d);
      ++sr.records_differing;
      break;
    }
  }
  if (sr.first && sr.first->tensor.rfind("generation:", 0) != 0) {
    // Name the place in the engine's schedule: a row of a per-group tensor is the group's last position.
    Divergence& d = *sr.first;
    int64_t pos = d.row;
    if ((d.tensor == "attn.compressed_kv" || d.tensor == "indexer.k") && d.layer >= 0)
      pos = (d.row + 1) * r.config().ratio(d.layer) - 1;
    const std::string where = schedule_context(g, d.seq, pos);
    if (!where.empty()) d.reason += " — " + where;
  } else if (sr.first) {
    Divergence& d = *sr.first;
    const std::string where = schedule_context(g, d.seq, g.requests[size_t(d.seq)].prompt_length + d.row - 1);
    if (!where.empty()) d.reason += " — drawn from the logits of " + where;
  }
  sr.kernels_note = "generation steps hold no kernel records";
  sr.identical = !sr.first && sr.decision_changes.empty();
  return sr;
}

// A fast step that cannot be replayed bit for bit here, under --tolerance (replay/tolerance.h): re-executed
// in exact numerics with the recorded decisions forced (indexer selections, the experts of learned
// layers), so that the numerics alone differ, every record aligned with the trace as in a bitwise replay
// and judged by value where the trace holds the full tensor, the log-probs compared; then once more with
// the decisions free, for their agreement with the recorded ones. A generation step is re-executed as a
// prefill of its recorded tokens (prompt + response), which is how the trace lays it out: exact numerics
// give a decode row the bits of its prefill row, and the recorded tokens are fed instead of sampled; its
// log-probs are taken at each request's temperature from the logits rows (TemperatureLogprobs).
static StepReplay replay_step_within_tolerance(const TraceReader& r, int index, const TraceStepInfo& info,
                                               const Weights& w, const ReplayOptions& opt,
                                               const NumericsProfile& recorded_profile_, const FastElsewhere& where) {
  StepReplay sr;
  sr.step = index;
  sr.threads = replay_threads(opt, info);
  sr.numerics = to_string(Numerics::fast);
  const int n_seqs = int(info.seq_lengths.size());
  RecordedStep rec = read_recorded_step(r, index, n_seqs);
  ToleranceReplay& tol = sr.tolerance.emplace();
  tol.bounds = *opt.tolerance;
  tol.why_not_bitwise = fmt::format("recorded in fast numerics ({} = tensor_core) on {}, replayed on {}",
                                    where.sites, where.obstacle.recorded, where.obstacle.here);
  tol.recorded_profile = recorded_profile_.name;
  const ExactReplayProfile exact = exact_replay_profile(recorded_profile_);
  tol.replay_profile = exact.profile.name;
  tol.profile_note = exact.note;

  // Each sequence's log-prob temperature: 1 in a prefill step; a generation's request's (1 for greedy).
  std::vector<float> temperature(static_cast<size_t>(n_seqs), 1.0f);
  if (info.kind == trace_layout::kKindGenerate) {
    const GenerationRecord g = *r.generation(index);
    if (int(g.requests.size()) != n_seqs)
      throw TraceCorrupt(fmt::format("{}: step {} holds {} sequences and {} generation requests", r.path(), index,
                                     n_seqs, g.requests.size()));
    for (int s = 0; s < n_seqs; ++s) {
      const float tau = g.requests[size_t(s)].temperature;
      temperature[size_t(s)] = tau > 0 ? tau : 1.0f;
    }
    tol.notes.push_back(
        "a generation step: each request's recorded tokens (prompt + response) were fed as one prefill, the way the "
        "trace lays them out (in exact numerics a decode row has the bits of its prefill row); the sampling was not "
        "run again, so the generated tokens and the generator counters are the recorded ones, and the generated "
        "tokens' log-probs are compared among the log-probs");
    if (g.decode_attention != "exact" || recorded_profile_.decode_attention_splits > 0)
      tol.notes.push_back(fmt::format(
          "the recording decoded with split-KV attention ({}); the prefill re-execution uses the prefill order, so "
          "that difference is part of the comparison too",
          g.decode_attention != "exact" ? g.decode_attention : decode_attention_name(recorded_profile_)));
  }

  // The recorded decisions, keyed (sequence, layer), for the free run's agreement.
  std::map<std::pair<int, int>, IndexerRecord> rec_indexer;
  std::map<std::pair<int, int>, RoutingRecord> rec_routing;
  for (int s = 0; s < n_seqs; ++s) {
    for (const auto& [layer, x] : rec.decisions[size_t(s)].indexer) rec_indexer[{s, layer}] = x;
    for (const auto& [layer, x] : rec.decisions[size_t(s)].routing) rec_routing[{s, layer}] = x;
  }

  Verifier v(r, index, std::move(rec.tables), sr);
  ToleranceJudge judge(r, index, tol);
  v.judge_by_value(&judge);
  TemperatureLogprobs at_temperature(v, rec.tokens, temperature);
  Overrides forced;
  add_overrides(rec.decisions, rec.tokens, true, true, forced);
  RunOptions ro;
  ro.profile = exact.profile;
  ro.threads = sr.threads;
  ro.observer = &at_temperature;
  ro.overrides = forced.empty() ? nullptr : &forced;
  ro.device = opt.device;
  ro.experts = opt.experts;
  const auto t0 = std::chrono::steady_clock::now();
  const ForwardResult result = n_seqs == 0 ? ForwardResult{} : forward(w, rec.tokens, ro);
  std::vector<std::vector<float>> logprobs(static_cast<size_t>(n_seqs));
  for (int s = 0; s < n_seqs; ++s)
    logprobs[size_t(s)] = temperature[size_t(s)] == 1.0f ? result.seqs[size_t(s)].logprobs
                                                         : std::move(at_temperature.logprobs[size_t(s)]);
  sr.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  v.finish();
  sr.decision_changes = compare_decisions_with(v.log, rec.decisions);
  for (int s = 0; s < n_seqs; ++s) judge.logprobs(s, r.logprobs(index, s), logprobs[size_t(s)]);
  judge.finish();

  // The decisions left free.
  if (n_seqs > 0) {
    DecisionLog free(false);
    RunOptions ro;
    ro.profile = exact.profile;
    ro.threads = sr.threads;
    ro.observer = &free;
    ro.device = opt.device;
    ro.experts = opt.experts;
    forward(w, rec.tokens, ro);
    tol.free = free_decision_agreement(rec_indexer, rec_routing, free, tie_factor(recorded_profile_, exact.profile));
  }
  sr.kernels_note = "not compared: the step was re-executed in exact numerics, whose kernels are not the recorded ones";
  sr.identical = false;  // compared within tolerance, not bit for bit
  return sr;
}

// One step of replay_trace (the loop body): re-executes step `index` and appends its StepReplay.
static void replay_one_step(const TraceReader& r, int index, const TraceStepInfo& info, const Weights& w,
                            const ReplayOptions& opt, const std::optional<TraceReader>& source,
                            const std::vector<TraceStepInfo>& source_steps, ReplayReport& rep) {
  const std::string& trace = r.path();
  if (opt.experts && info.kind == trace_layout::kKindGenerate)
    throw InputError(fmt::format(
        "{}: step {} is of kind '{}'; an expert-parallel replay (--ep) re-executes prefill and training steps "
        "only: replay it in one process, or choose another step with --step",
        trace, index, info.kind));
  if (info.kind == trace_layout::kKindGenerate && (source || opt.force_indexer || opt.force_routing))
    throw InputError(
        fmt::format("{}: step {} is a generation; it replays as recorded (forced decisions and "
                    "counterfactuals apply to prefill steps)",
                    trace, index));
  // A fast step that cannot be replayed bit for bit here: refused, or under --tolerance compared within
  // tolerance. (A training step is never fast: its recording refuses fast numerics.)
  Numerics numerics = Numerics::exact;
  if (info.kind != trace_layout::kKindTrainStep) {
    const NumericsProfile p = recorded_profile(info, r.path());
    numerics = numerics_of(p);
    if (const std::optional<FastElsewhere> f = fast_elsewhere(p, r, opt.device)) {
      if (!opt.tolerance) refuse_fast_step(p, r, index, *f);
      if (source)
        throw InputError(fmt::format(
            "{}: step {} is in fast numerics and cannot be replayed bit for bit here; --tolerance re-executes it "
            "with its own recorded decisions, so it does not combine with --take-decisions-from",
            trace, index));
      rep.steps.push_back(replay_step_within_tolerance(r, index, info, w, opt, p, *f));
      return;
    }
  }
  if (info.kind == trace_layout::kKindGenerate) {
    rep.steps.push_back(replay_generation_step(r, index, info, w, opt));
    rep.steps.back().numerics = to_string(numerics);
    return;
  }
  StepReplay sr;
  sr.step = index;
  sr.numerics = to_string(numerics);
  sr.threads = replay_threads(opt, info);
  const int n_seqs = int(info.seq_lengths.size());
  RecordedStep rec = read_recorded_step(r, index, n_seqs);
  const std::vector<std::vector<int32_t>>& batch = rec.tokens;
  std::vector<DigestTable>& tables = rec.tables;
  const std::vector<SeqDecisions>& recorded = rec.decisions;

  if (info.kind == trace_layout::kKindTrainStep) {
    if (source || opt.force_indexer || opt.force_routing)
      throw InputError(fmt::format(
          "{}: step {} is a training step; it replays as recorded (with the decisions it was given)", trace,
          index));
    const TrainingReplayPlan plan = plan_training_replay(r, index);
    Overrides forced;
    add_overrides(recorded, batch, plan.force_indexer, plan.force_routing, forced);
    Verifier v(r, index, std::move(tables), sr);
    replay_training_step(r, plan, w, opt, forced, v, sr);
    v.finish();
    sr.decision_changes = compare_decisions_with(v.log, recorded);
    sr.kernels_note = "training steps hold no kernel records";
    sr.identical = !sr.first && sr.decision_changes.empty();
    rep.steps.push_back(std::move(sr));
    return;
  }

  Overrides ov;
  std::vector<SeqDecisions> forced_from;  // counterfactual: the other trace's decisions
  std::vector<std::vector<float>> source_logprobs;
  if (source) {
    const int k = opt.take_step >= 0 ? opt.take_step : index;
    if (k >= int(source_steps.size()))
      throw InputError(fmt::format("{}: no step {} to take decisions from (it has {} step{})",
                                   opt.take_decisions_from, k, source_steps.size(),
                                   source_steps.size() == 1 ? "" : "s"));
    const TraceStepInfo& src = source_steps[size_t(k)];
    if (!src.complete)
      throw TraceIncomplete(fmt::format("{}: step {} is incomplete; its decisions cannot be used",
                                        opt.take_decisions_from, k));
    sr.counterfactual_source = fmt::format("{} step {}{}", opt.take_decisions_from, k,
                                           src.external() ? ", engine " + src.engine : std::string());
    if (int(source_steps[size_t(k)].seq_lengths.size()) != n_seqs)
      throw InputError(fmt::format(
          "{} step {} holds {} sequences, {} step {} holds {}: a counterfactual needs the same "
          "tokens",
          opt.take_decisions_from, k, source_steps[size_t(k)].seq_lengths.size(), trace, index, n_seqs));
    for (int s = 0; s < n_seqs; ++s) {
      const std::vector<int32_t> toks = source->tokens(k, s);
      if (toks != batch[size_t(s)]) {
        size_t p = 0;
        while (p < toks.size() && p < batch[size_t(s)].size() && toks[p] == batch[size_t(s)][p]) ++p;
        throw InputError(fmt::format(
            "{} step {} sequence {} holds other tokens than {} step {} ({} vs {} tokens, first "
            "difference at position {}): a counterfactual needs the same tokens",
            opt.take_decisions_from, k, s, trace, index, toks.size(), batch[size_t(s)].size(), p));
      }
      forced_from.push_back(read_decisions(*source, k, s));
      if (source->has_logprobs(k, s)) source_logprobs.push_back(source->logprobs(k, s));
    }
    add_overrides(forced_from, batch, true, true, ov);
    bool completed = false;  // some layer stops one row short (the engines' layout)
    for (int s = 0; s < n_seqs; ++s) {
      const int64_t T = int64_t(batch[size_t(s)].size());
      for (const auto& [layer, x] : forced_from[size_t(s)].indexer) completed |= x.T < T;
      for (const auto& [layer, x] : forced_from[size_t(s)].routing) completed |= x.T < T;
    }
    if (completed)
      rep.notes.push_back(fmt::format(
          "{} holds no decisions for the last token of a sequence (the engines' layout); they were completed with "
          "ids 0, 1, ... (they change no log-prob), so the last row of the replay differs from the recorded one",
          opt.take_decisions_from));
  } else {
    add_overrides(recorded, batch, opt.force_indexer, opt.force_routing, ov);
  }

  Verifier v(r, index, std::move(tables), sr);
  RunOptions ro;
  ro.profile = recorded_profile(info, r.path());
  ro.threads = sr.threads;
  ro.observer = &v;
  ro.overrides = ov.empty() ? nullptr : &ov;
  ro.device = opt.device;
  ro.experts = opt.experts;
  const KernelRecords recorded_kernels = r.kernels(index);
  sr.kernels_recorded = int64_t(model_launches(recorded_kernels).size());
  KernelRecorder recorder;
  const bool record_kernels = recorded_kernels.available && opt.device == Device::cuda && recorder.start();
  const auto t0 = std::chrono::steady_clock::now();
  // A step of no sequence (a rank's own trace when the ranks split the sequences and it held none of
  // this step's): nothing to run, nothing to compare.
  const ForwardResult result = batch.empty() ? ForwardResult{} : forward(w, batch, ro);
  sr.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  v.finish();
  if (record_kernels)
    compare_kernels(recorded_kernels, recorder.stop(), sr);
  else if (!recorded_kernels.available)
    sr.kernels_note = "the trace holds no kernel records (" + recorded_kernels.reason + ")";
  else if (opt.device != Device::cuda)
    sr.kernels_note =
        "the replay ran on the " + std::string(to_string(opt.device)) + ", no kernels to compare";
  else
    sr.kernels_note = "this replay could not record kernels (" + recorder.reason() + ")";

  sr.decision_changes = compare_decisions_with(v.log, recorded);
  if (source) {
    sr.counterfactual_mismatches = compare_decisions_with(v.log, forced_from);
    sr.counterfactual_decisions_equal = sr.counterfactual_mismatches.empty();
    // A's log-probs take part only when every sequence of A holds them (an external step may not).
    const bool with_a = int(source_logprobs.size()) == n_seqs;
    std::vector<float> a, b_rec, b_rep;
    for (int s = 0; s < n_seqs; ++s) {
      const std::vector<float> rec = r.logprobs(index, s);
      const std::vector<float>& rep_lp = result.seqs[size_t(s)].logprobs;
      if ((with_a && source_logprobs[size_t(s)].size() != rec.size()) || rec.size() != rep_lp.size())
        throw TraceError(
            fmt::format("{} / {}: sequence {} holds {} and {} log-probs, the replay computed {}",
                        opt.take_decisions_from, trace, s, with_a ? source_logprobs[size_t(s)].size() : 0,
                        rec.size(), rep_lp.size()));
      if (with_a) a.insert(a.end(), source_logprobs[size_t(s)].begin(), source_logprobs[size_t(s)].end());
      b_rec.insert(b_rec.end(), rec.begin(), rec.end());
      b_rep.insert(b_rep.end(), rep_lp.begin(), rep_lp.end());
    }
    if (with_a) {
      sr.mean_abs_dlogprob_before = mean_abs_diff(a, b_rec);
      sr.mean_abs_dlogprob_after = mean_abs_diff(a, b_rep);
      sr.kl_before = mean_diff(a, b_rec);
      sr.kl_after = mean_diff(a, b_rep);
    }
    sr.mean_abs_dlogprob_forced = mean_abs_diff(b_rec, b_rep);
    sr.mean_logprob_recorded = mean(b_rec);
    sr.mean_logprob_forced = mean(b_rep);
  }
  sr.identical = !sr.first && sr.decision_changes.empty();
  rep.steps.push_back(std::move(sr));
 }

ReplayReport replay_trace(const std::string& trace, const ReplayOptions& opt) {
  TraceReader r = TraceReader::open(trace);
  ReplayReport rep;
  rep.trace = trace;
  const std::vector<TraceStepInfo> steps = r.steps();

  std::vector<int> selected;
  if (opt.step) {
    if (*opt.step < 0 || *opt.step >= int(steps.size()))
      throw InputError(fmt::format("{}: no step {} (the trace has {} step{}: 0..{})", trace, *opt.step,
                                   steps.size(), steps.size() == 1 ? "" : "s", int(steps.size()) - 1));
    const TraceStepInfo& st = steps[size_t(*opt.step)];
    if (!st.complete && !st.damage.empty())
      throw TraceCorrupt(fmt::format("{}: step {} is damaged ({}); `dsv4 trace validate` tells more and `dsv4 "
                                     "trace salvage` copies the intact steps",
                                     trace, *opt.step, st.damage));
    if (!st.complete)
      throw TraceIncomplete(
          fmt::format("{}: step {} is incomplete (its recorder stopped while writing it); `dsv4 "
                      "trace validate` lists the complete steps",
                      trace, *opt.step));
    if (st.external())
      throw InputError(fmt::format("{}: step {} is an external step: {}", trace, *opt.step, external_step_note(st)));
    selected.push_back(*opt.step);
  } else {
    for (const auto& s : steps) {
      if (s.complete && s.external()) {
        rep.notes.push_back(fmt::format("step {} not replayed: {}", s.index, external_step_note(s)));
      } else if (s.complete) {
        selected.push_back(s.index);
      } else {
        rep.skipped.push_back({s.index, s.why_not_complete()});
      }
    }
    if (selected.empty() && rep.skipped.empty() && !rep.notes.empty())
      throw InputError(fmt::format("{}: every step is an external step: {}", trace, external_step_note(steps.front())));
    if (selected.empty()) {
      std::string why;
      for (const auto& k : rep.skipped) why += fmt::format("; step {}: {}", k.step, k.reason);
      throw TraceIncomplete(fmt::format("{}: no complete step to replay (the trace has {} step{}, none complete{})",
                                        trace, steps.size(), steps.size() == 1 ? "" : "s", why));
    }
  }

  std::optional<TraceReader> source;
  std::vector<TraceStepInfo> source_steps;
  if (!opt.take_decisions_from.empty()) {
    source = TraceReader::open(opt.take_decisions_from);
    source_steps = source->steps();
    if (!same_decision_shape(source->config(), r.config()))
      throw InputError(
          fmt::format("{}: its model config differs from that of {} (layers, compress ratios, indexer or "
                      "experts): its decisions cannot be forced into this replay",
                      opt.take_decisions_from, trace));
    if (source->model().model_digest == trace_layout::kUnknownDigest)
      rep.notes.push_back(fmt::format("{} does not name the weights its engine ran: the models could not be checked "
                                      "to be the same",
                                      opt.take_decisions_from));
    else if (source->model().model_digest != r.model().model_digest)
      rep.notes.push_back(fmt::format("{} was recorded with other weights (model digest {} vs {})",
                                      opt.take_decisions_from, source->model().model_digest,
                                      r.model().model_digest));
  }

  // Expert-parallel: each rank loads its own experts, unless a training step is replayed (its update
  // runs on every weight on every rank).
  WeightFilter keep;
  if (opt.experts) {
    bool training = false;
    for (int index : selected) training |= steps[size_t(index)].kind == trace_layout::kKindTrainStep;
    if (!training) keep = rank_experts(r.config().n_routed_experts, opt.experts->rank(), opt.experts->size());
  }
  const Weights w = weights_for_trace(r, opt.model_dir, keep);
  rep.model_source = w.source();
  rep.weight_mismatches = weight_mismatches(r, w);

  // Replaying every step, a step whose recorded data cannot be read (a damaged dataset) is skipped and
  // named, and the others are still verified; with --step the error is the answer.
  for (int index : selected) {
    if (opt.step) {
      replay_one_step(r, index, steps[size_t(index)], w, opt, source, source_steps, rep);
      continue;
    }
    try {
      replay_one_step(r, index, steps[size_t(index)], w, opt, source, source_steps, rep);
    } catch (const TraceError& e) {
      rep.skipped.push_back({index, fmt::format("damaged: {}", e.what())});
    }
  }
  std::sort(rep.skipped.begin(), rep.skipped.end(),
            [](const ReplayReport::SkippedStep& a, const ReplayReport::SkippedStep& b) { return a.step < b.step; });
  // --tolerance applies where a bitwise replay is impossible: say which steps were replayed bit for bit.
  if (opt.tolerance) {
    std::vector<int> exact, fast;
    for (const StepReplay& s : rep.steps)
      if (!s.tolerance) (s.numerics == to_string(Numerics::fast) ? fast : exact).push_back(s.step);
    const auto steps_named = [](const std::vector<int>& v) {
      return fmt::format("step{} {}", v.size() == 1 ? "" : "s", fmt::join(v, ", "));
    };
    if (!exact.empty())
      rep.notes.push_back(fmt::format("--tolerance: {} in exact numerics, replayed bit for bit as usual (a tolerance "
                                      "applies only to a fast-numerics step that cannot be replayed bit for bit here)",
                                      steps_named(exact)));
    if (!fast.empty())
      rep.notes.push_back(
          fmt::format("--tolerance: {} in fast numerics, replayed bit for bit as usual on a GPU of the "
                      "architecture that recorded {} ({}) with tensor-core kernels of its revision ({})",
                      steps_named(fast), fast.size() == 1 ? "it" : "them", gpu_arch(), kTensorCoreRevision));
  }

  // The thread count this replay ran with
  // The thread count this replay ran with stands in for "threads" of this machine; it is listed when it
  // differs and ranked where it belongs: the thread count never changes results.
  EnvFingerprint here = environment_fingerprint();
  if (!rep.steps.empty())
    here["threads"] =
        std::to_string(rep.steps.front().threads > 0 ? rep.steps.front().threads : omp_get_max_threads());
  rep.env_differences = compare_env(r.env(), here);
  rep.recorded_on = machine_summary(r.env());
  rep.replayed_on = machine_summary(here);
  // Which layout recorded the trace and which replayed it, when either was parallel.
  const EnvFingerprint recorded_env = r.env();
  const std::string here_layout = opt.experts ? parallel_layout(*opt.experts) : "one process";
  if (recorded_env.count(kEnvParallel))
    rep.layout_note = fmt::format("recorded with {}, replayed with {}", recorded_layout(recorded_env), here_layout);
  else if (opt.experts)
    rep.layout_note = fmt::format("recorded in one process, replayed with {}", here_layout);
  return rep;
}

}  // namespace dsv4
