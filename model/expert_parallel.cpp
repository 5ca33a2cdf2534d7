#include "model/expert_parallel.h"

#include <cstring>

namespace dsv4 {

namespace {
// The pairs of every rank, in rank order (the order the gathered outputs arrive in).
std::vector<std::vector<int64_t>> pairs_by_rank(const MoeParams& p, int ranks) {
  std::vector<std::vector<int64_t>> out;
  for (int r = 0; r < ranks; ++r) {
    const ExpertRange e = expert_range(p.E, r, ranks);
    out.push_back(moe_pairs(p, e.first, e.last));
  }
  return out;
}
}  // namespace

std::vector<int64_t> moe_parallel_bytes(const MoeParams& p, int ranks) {
  std::vector<int64_t> bytes;
  for (const auto& pairs : pairs_by_rank(p, ranks)) bytes.push_back(int64_t(pairs.size()) * p.D * int64_t(sizeof(float)));
  return bytes;
}

void moe_experts_parallel(const MoeParams& p, Communicator& comm) {
  if (p.T <= 0) return;
  const int n = comm.size(), me = comm.rank();
  const std::vector<std::vector<int64_t>> pairs = pairs_by_rank(p, n);
  std::vector<int64_t> bytes;
  int64_t total = 0;
  for (const auto& v : pairs) {
    bytes.push_back(int64_t(v.size()) * p.D * int64_t(sizeof(float)));
    total += int64_t(v.size());
  }
  const ExpertRange mine = expert_range(p.E, me, n);
  std::vector<float> y(pairs[size_t(me)].size() * size_t(p.D));
  moe_routed_outputs(p, mine.first, mine.last, y.data());
  std::vector<float> all(size_t(total * p.D));
  comm.all_gather_v(y.data(), all.data(), bytes);
  // Every pair's output into its slot: ranks in order, each rank's pairs in its order.
  std::vector<float> y_slot(size_t(p.T * p.k * p.D), 0.0f);
  const float* src = all.data();
  for (const auto& v : pairs)
    for (int64_t q : v) {
      std::memcpy(y_slot.data() + q * p.D, src, size_t(p.D) * sizeof(float));
      src += p.D;
    }
  moe_combine(p, y_slot.data(), p.out);
}

}  // namespace dsv4
