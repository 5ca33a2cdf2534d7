#include "model/expert_parallel.h"

#include <fmt/format.h>

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

// Each expert's pair count, from the routing ids (host memory; ids outside [0, E) belong to none).
std::vector<int64_t> expert_counts(const MoeParams& p) {
  std::vector<int64_t> count(size_t(p.E), 0);
  for (int64_t q = 0; q < p.T * p.k; ++q)
    if (p.ids[q] >= 0 && p.ids[q] < p.E) ++count[size_t(p.ids[q])];
  return count;
}
}  // namespace

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

void moe_experts_dispatch(const MoeParams& p, Communicator& comm) {
  const int n = comm.size(), me = comm.rank();
  const int64_t D = p.D, out_row = dispatch_bytes_out(D) / int64_t(sizeof(float));
  // This rank's pairs by owner, each owner's in moe_pairs order.
  std::vector<std::vector<int64_t>> to(static_cast<size_t>(n));
  std::vector<int64_t> count(static_cast<size_t>(n), 0);
  for (int r = 0; r < n; ++r) {
    const ExpertRange e = expert_range(p.E, r, n);
    if (p.T > 0) to[size_t(r)] = moe_pairs(p, e.first, e.last);
    count[size_t(r)] = int64_t(to[size_t(r)].size());
  }
  // Every rank's pair counts for every owner: row r of `matrix` is rank r's.
  std::vector<int64_t> matrix(size_t(n) * size_t(n));
  comm.all_gather_v(count.data(), matrix.data(), std::vector<int64_t>(size_t(n), n * int64_t(sizeof(int64_t))));
  std::vector<int64_t> send_bytes, recv_bytes, recv_pairs;
  int64_t received = 0;
  for (int r = 0; r < n; ++r) {
    send_bytes.push_back(count[size_t(r)] * out_row * int64_t(sizeof(float)));
    recv_pairs.push_back(matrix[size_t(r) * size_t(n) + size_t(me)]);
    recv_bytes.push_back(recv_pairs.back() * out_row * int64_t(sizeof(float)));
    received += recv_pairs.back();
  }
  // Out: per pair [id as int32 bits, weight, row D].
  std::vector<float> out;
  out.reserve(size_t(p.T * p.k * out_row));
  for (const auto& v : to)
    for (const int64_t q : v) {
      int32_t id = p.ids[q];
      float id_bits;
      std::memcpy(&id_bits, &id, sizeof id);
      out.push_back(id_bits);
      out.push_back(p.weights[q]);
      out.insert(out.end(), p.x + (q / p.k) * D, p.x + (q / p.k + 1) * D);
    }
  std::vector<float> in(size_t(received * out_row));
  comm.all_to_all_v(out.data(), send_bytes, in.data(), recv_bytes);

  // The received pairs as a problem of one slot per row, computed with this rank's experts.
  std::vector<float> y_in(size_t(received * D));
  if (received > 0) {
    std::vector<float> xs(size_t(received * D)), wts(static_cast<size_t>(received));
    std::vector<int32_t> ids(static_cast<size_t>(received));
    for (int64_t j = 0; j < received; ++j) {
      const float* rec = in.data() + j * out_row;
      std::memcpy(&ids[size_t(j)], &rec[0], sizeof(int32_t));
      wts[size_t(j)] = rec[1];
      std::copy(rec + 2, rec + out_row, xs.begin() + j * D);
    }
    MoeParams q = p;
    q.T = received, q.k = 1, q.x = xs.data(), q.ids = ids.data(), q.weights = wts.data();
    q.n_shared = 0, q.shared = nullptr, q.out = nullptr;
    const ExpertRange mine = expert_range(p.E, me, n);
    const std::vector<int64_t> order = moe_pairs(q, mine.first, mine.last);
    if (int64_t(order.size()) != received)
      comm.abort(fmt::format("moe dispatch: {} of the {} pairs received belong to other ranks' experts",
                             received - int64_t(order.size()), received),
                 1);
    std::vector<float> y(size_t(received * D));
    moe_routed_outputs(q, mine.first, mine.last, y.data());
    for (size_t j = 0; j < order.size(); ++j)  // back to the order received
      std::copy(y.begin() + int64_t(j) * D, y.begin() + int64_t(j + 1) * D, y_in.begin() + order[j] * D);
  }
  // Back: each sender its pairs' outputs, in the order it sent them.
  std::vector<int64_t> back_send, back_recv;
  for (int r = 0; r < n; ++r) {
    back_send.push_back(recv_pairs[size_t(r)] * D * int64_t(sizeof(float)));
    back_recv.push_back(count[size_t(r)] * D * int64_t(sizeof(float)));
  }
  std::vector<float> back(size_t(p.T * p.k * D));
  comm.all_to_all_v(y_in.data(), back_send, back.data(), back_recv);
  if (p.T <= 0) return;
  std::vector<float> y_slot(size_t(p.T * p.k * D), 0.0f);
  const float* src = back.data();
  for (const auto& v : to)
    for (const int64_t q : v) {
      std::memcpy(y_slot.data() + q * D, src, size_t(D) * sizeof(float));
      src += D;
    }
  moe_combine(p, y_slot.data(), p.out);
}

void moe_experts_backward_parallel(const MoeBwdParams& p, Communicator& comm) {
  const MoeParams& f = p.fwd;
  if (f.T <= 0) return;
  const int n = comm.size(), me = comm.rank();
  const std::vector<int64_t> pairs = pairs_per_rank(expert_counts(f), n);
  std::vector<int64_t> dx_bytes, dw_bytes;
  int64_t total = 0;
  for (const int64_t v : pairs) {
    dx_bytes.push_back(p.dx ? v * f.D * int64_t(sizeof(float)) : 0);
    dw_bytes.push_back(v * int64_t(sizeof(float)));
    total += v;
  }
  const ExpertRange mine = expert_range(f.E, me, n);
  const size_t m = size_t(pairs[size_t(me)]);
  std::vector<float> dx_mine(p.dx ? m * size_t(f.D) : 0), dw_mine(m);
  moe_backward_routed(p, mine.first, mine.last, p.dx ? dx_mine.data() : nullptr, dw_mine.data());
  std::vector<float> dx_all(p.dx ? size_t(total * f.D) : 0), dw_all(static_cast<size_t>(total));
  if (p.dx) comm.all_gather_v(dx_mine.data(), dx_all.data(), dx_bytes);
  comm.all_gather_v(dw_mine.data(), dw_all.data(), dw_bytes);
  moe_backward_combine(p, p.dx ? dx_all.data() : nullptr, dw_all.data());
}

std::vector<float*> expert_grad_matrices(const MoeBwdParams& p, int e0, int e1) {
  std::vector<float*> out;
  if (!p.grads) return out;
  for (int e = e0; e < e1; ++e)
    for (float* g : {p.grads[e].dw1, p.grads[e].dw3, p.grads[e].dw2})
      if (g) out.push_back(g);
  return out;
}

std::vector<int64_t> pairs_per_rank(const std::vector<int64_t>& expert_counts, int ranks) {
  std::vector<int64_t> out(size_t(ranks), 0);
  for (int r = 0; r < ranks; ++r) {
    const ExpertRange e = expert_range(int(expert_counts.size()), r, ranks);
    for (int x = e.first; x < e.last; ++x) out[size_t(r)] += expert_counts[size_t(x)];
  }
  return out;
}

}  // namespace dsv4
