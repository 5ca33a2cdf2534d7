#include "model/forward_json.h"

#include <nlohmann/json.hpp>

namespace dsv4 {

std::string forward_to_json(const SequenceResult& r, const DecisionLog& log, const std::string& profile) {
  nlohmann::json j;
  j["profile"] = profile;
  j["tokens"] = r.tokens;
  j["logprobs"] = r.logprobs;
  j["indexer_topk"] = nlohmann::json::array();
  for (const auto& [key, rec] : log.indexer) {
    nlohmann::json sets = nlohmann::json::array();
    for (int64_t t = 0; t < rec.T; ++t) {
      std::vector<int32_t> s;
      for (int i = 0; i < rec.k; ++i)
        if (rec.ids[t * rec.k + i] != -1) s.push_back(rec.ids[t * rec.k + i]);
      sets.push_back(s);
    }
    j["indexer_topk"].push_back({{"layer", key.second}, {"sets", sets}});
  }
  j["experts"] = nlohmann::json::array();
  for (const auto& [key, rec] : log.routing) {
    nlohmann::json ids = nlohmann::json::array();
    for (int64_t t = 0; t < rec.T; ++t)
      ids.push_back(std::vector<int32_t>(rec.ids.begin() + t * rec.k, rec.ids.begin() + (t + 1) * rec.k));
    j["experts"].push_back({{"layer", key.second}, {"hashed", rec.hashed}, {"ids", ids}});
  }
  return j.dump();
}

}  // namespace dsv4
