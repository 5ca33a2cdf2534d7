// The reports' text forms: the replay report as JSON.
#include <nlohmann/json.hpp>

#include <cmath>

#include "replay/replay.h"

namespace dsv4 {

namespace {

// A number that may be +-inf or NaN (a rel-L2 of non-finite values at other places): JSON has no such
// numbers; they are written as null, as nlohmann writes them in `dsv4 diff --json` (docs/DIFF_JSON.md).
nlohmann::json number(double x) {
  if (!std::isfinite(x)) return nullptr;
  return x;
}

nlohmann::json tensor_json(const std::optional<ToleranceTensor>& t) {
  if (!t) return nullptr;
  return {{"seq", t->seq},
          {"layer", t->layer},
          {"tensor", t->tensor},
          {"rel_l2", number(t->rel_l2)},
          {"max_abs", number(t->max_abs)},
          {"nonfinite_mismatches", t->nonfinite_mismatches}};
}

nlohmann::json free_kind_json(const FreeDecisionKind& k) {
  return {{"rows", k.rows},
          {"same", k.same},
          {"tie_flips", k.tie_flips},
          {"confident_flips", k.confident_flips},
          {"largest_flip_margin", k.largest_flip_margin}};
}

// A step compared within tolerance (replay/tolerance.h ToleranceReplay).
nlohmann::json tolerance_json(const ToleranceReplay& t) {
  nlohmann::json j{{"compared", "within tolerance, not bitwise"},
                   {"within", t.within()},
                   {"why_not_bitwise", t.why_not_bitwise},
                   {"recorded_profile", t.recorded_profile},
                   {"replay_profile", t.replay_profile},
                   {"profile_note", t.profile_note},
                   {"decisions_forced", true},
                   {"bounds", {{"tensor_rel_l2", t.bounds.tensor_rel_l2}, {"logprob_rel_l2", t.bounds.logprob_rel_l2}}},
                   {"tensors",
                    {{"compared", t.tensors_compared},
                     {"over_bound", t.tensors_over},
                     {"within", t.tensors_within()},
                     {"worst", tensor_json(t.worst)},
                     {"first_over", tensor_json(t.first_over)}}},
                   {"digest_only", {{"records", t.digest_only}, {"bitwise_equal", t.digest_only_equal}}},
                   {"records_bitwise_equal", t.records_bitwise_equal},
                   {"logprobs",
                    {{"count", t.logprobs},
                     {"rel_l2", number(t.logprob_rel_l2)},
                     {"max_abs", number(t.logprob_max_abs)},
                     {"nonfinite_mismatches", t.logprob_nonfinite_mismatches},
                     {"within", t.logprobs_within()}}},
                   {"notes", t.notes}};
  if (t.free)
    j["free_decisions"] = {{"indexer", free_kind_json(t.free->indexer)},
                           {"routing", free_kind_json(t.free->routing)},
                           {"tie_factor", t.free->tie_factor}};
  else
    j["free_decisions"] = nullptr;
  return j;
}

}  // namespace

std::string replay_to_json(const ReplayReport& r) {
  nlohmann::json j;
  j["trace"] = r.trace;
  j["model"] = r.model_source;
  j["identical"] = r.identical();
  j["passed"] = r.passed();
  j["verified_all"] = r.verified_all();
  j["skipped"] = nlohmann::json::array();
  for (const auto& k : r.skipped) j["skipped"].push_back({{"step", k.step}, {"reason", k.reason}});
  j["notes"] = r.notes;
  j["weight_mismatches"] = r.weight_mismatches;
  j["recorded_on"] = r.recorded_on;
  j["replayed_on"] = r.replayed_on;
  for (const auto& e : r.env_differences)
    j["env_differences"].push_back(
        {{"key", e.key}, {"recorded", e.recorded}, {"here", e.here}, {"rank", e.rank}});
  for (const auto& s : r.steps) {
    nlohmann::json js{{"step", s.step},
                      {"numerics", s.numerics},
                      {"identical", s.identical},
                      {"passed", s.passed()},
                      {"records_compared", s.records_compared},
                      {"rows_compared", s.rows_compared},
                      {"seconds", s.seconds}};
    if (s.first) {
      const Divergence& d = *s.first;
      js["first_divergence"] = {
          {"seq", d.seq}, {"layer", d.layer}, {"tensor", d.tensor}, {"row", d.row}, {"reason", d.reason}};
      if (d.has_elements)
        js["first_divergence"]["elements"] = {{"index", d.first_index}, {"recorded", d.recorded},
                                              {"replayed", d.replayed}, {"ulp", d.ulp},
                                              {"max_abs", d.max_abs},   {"max_rel", d.max_rel}};
    }
    for (const auto& c : s.decision_changes)
      js["decision_changes"].push_back({{"layer", c.layer},
                                        {"kind", c.kind},
                                        {"rows_changed", c.rows_changed},
                                        {"first_row", c.first_row}});
    js["kernels"] = {{"compared", s.kernels_equal.has_value()},
                     {"equal", s.kernels_equal.value_or(false)},
                     {"recorded", s.kernels_recorded},
                     {"replayed", s.kernels_replayed},
                     {"first_difference", s.kernel_first_difference},
                     {"note", s.kernels_note}};
    if (s.mean_abs_dlogprob_forced) {
      // null where the other trace holds no log-probs (an external step may not).
      const auto num = [](const std::optional<double>& x) { return x ? nlohmann::json(*x) : nlohmann::json(); };
      js["counterfactual"] = {{"source", s.counterfactual_source},
                              {"mean_abs_dlogprob_before", num(s.mean_abs_dlogprob_before)},
                              {"mean_abs_dlogprob_after", num(s.mean_abs_dlogprob_after)},
                              {"kl_before", num(s.kl_before)},
                              {"kl_after", num(s.kl_after)},
                              {"mean_abs_dlogprob_forced", *s.mean_abs_dlogprob_forced},
                              {"mean_logprob_recorded", num(s.mean_logprob_recorded)},
                              {"mean_logprob_forced", num(s.mean_logprob_forced)},
                              {"decisions_equal", s.counterfactual_decisions_equal.value_or(false)}};
    }
    if (s.tolerance) js["tolerance"] = tolerance_json(*s.tolerance);
    j["steps"].push_back(js);
  }
  return j.dump(2);
}

}  // namespace dsv4
