#include "model/decision_sets.h"

#include <algorithm>
#include <cmath>

#include "model/error.h"
#include "model/profile.h"

namespace dsv4 {

std::vector<int32_t> valid_ids(const int32_t* row, int64_t k) {
  std::vector<int32_t> s;
  s.reserve(size_t(std::max<int64_t>(k, 0)));
  for (int64_t j = 0; j < k; ++j)
    if (row[j] >= 0) s.push_back(row[j]);
  std::sort(s.begin(), s.end());
  return s;
}

std::vector<int32_t> valid_ids(const std::vector<int32_t>& table, int64_t k, int64_t t) {
  if (k <= 0 || t < 0 || (t + 1) * k > int64_t(table.size())) return {};
  return valid_ids(table.data() + t * k, k);
}

int64_t sorted_intersection_size(const std::vector<int32_t>& a, const std::vector<int32_t>& b) {
  int64_t n = 0;
  size_t i = 0, j = 0;
  while (i < a.size() && j < b.size()) {
    if (a[i] < b[j]) {
      ++i;
    } else if (b[j] < a[i]) {
      ++j;
    } else {
      ++n, ++i, ++j;
    }
  }
  return n;
}

double set_overlap(const std::vector<int32_t>& a, const std::vector<int32_t>& b) {
  if (a.empty() && b.empty()) return 1.0;
  return double(sorted_intersection_size(a, b)) / double(std::max<size_t>(a.size(), 1));
}

double set_jaccard(const std::vector<int32_t>& a, const std::vector<int32_t>& b) {
  const int64_t inter = sorted_intersection_size(a, b);
  const int64_t uni = int64_t(a.size() + b.size()) - inter;
  return uni == 0 ? 1.0 : double(inter) / double(uni);
}

double tie_factor(const NumericsProfile& p) {
  if (p.indexer_quant == QuantSim::fp4) return 0.125;  // 2^-3
  const bool fp8 = p.kv_quant == QuantSim::fp8 || p.indexer_quant == QuantSim::fp8;
  return fp8 ? 0.0625 : 0.0078125;  // 2^-4 : 2^-7
}

double tie_factor(const std::string& profile) {
  if (!is_builtin_profile(profile)) return 0.0625;
  return tie_factor(profile_by_name(profile));
}

double tie_factor(const std::string& profile_a, const std::string& profile_b) {
  return std::max(tie_factor(profile_a), tie_factor(profile_b));
}

double tie_factor(const NumericsProfile& a, const NumericsProfile& b) {
  return std::max(tie_factor(a), tie_factor(b));
}

std::optional<double> relative_tie_threshold(std::initializer_list<const std::vector<float>*> margins,
                                             double factor) {
  std::vector<double> m;
  for (const auto* v : margins)
    for (float x : *v)
      if (std::isfinite(x)) m.push_back(std::fabs(double(x)));
  if (m.empty()) return std::nullopt;
  std::nth_element(m.begin(), m.begin() + m.size() / 2, m.end());
  return factor * m[m.size() / 2];
}

std::vector<int32_t> complete_decision_rows(const std::vector<int32_t>& ids, int64_t rows, int k, int64_t T) {
  std::vector<int32_t> out(ids);
  if (rows >= T || k <= 0) return out;
  out.reserve(size_t(T * k));
  for (int64_t t = rows; t < T; ++t)
    for (int j = 0; j < k; ++j) out.push_back(j);
  return out;
}

}  // namespace dsv4
