// The reports' text forms: the replay report as JSON.
#include <nlohmann/json.hpp>

#include "replay/replay.h"

namespace dsv4 {

std::string replay_to_json(const ReplayReport& r) {
  nlohmann::json j;
  j["trace"] = r.trace;
  j["model"] = r.model_source;
  j["identical"] = r.identical();
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
                      {"identical", s.identical},
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
    j["steps"].push_back(js);
  }
  return j.dump(2);
}

}  // namespace dsv4
