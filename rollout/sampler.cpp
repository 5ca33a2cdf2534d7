// The counter-based token sampler; the rules are in rollout/sampler.h and docs/SAMPLING.md.
#include "rollout/sampler.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "kernels/logits.h"
#include "kernels/numerics/numerics.h"
#include "kernels/numerics/philox.h"
#include "model/error.h"

namespace dsv4::rollout {

void check_sampling(const SamplingParams& p, const std::string& where) {
  if (!std::isfinite(p.temperature) || p.temperature < 0.0f)
    throw InputError(
        fmt::format("{}: temperature must be finite and >= 0 (0 = greedy), found {}", where, p.temperature));
  if (p.top_k < 0)
    throw InputError(fmt::format("{}: top_k must be >= 0 (0 = off), found {}", where, p.top_k));
  // Written so that NaN fails too.
  if (!(p.top_p > 0.0f && p.top_p <= 1.0f))
    throw InputError(fmt::format("{}: top_p must be in (0, 1], found {}", where, p.top_p));
}

void sampling_key(uint64_t seed, uint32_t key[2]) {
  key[0] = uint32_t(seed);
  key[1] = uint32_t(seed >> 32);
}

void sampling_counter(uint64_t request_id, int64_t position, uint32_t counter[4]) {
  const uint64_t pos = uint64_t(position);
  counter[0] = uint32_t(pos);
  counter[1] = uint32_t(pos >> 32);
  counter[2] = uint32_t(request_id);
  counter[3] = uint32_t(request_id >> 32);
}

float sampling_uniform(uint64_t seed, uint64_t request_id, int64_t position) {
  uint32_t key[2], counter[4];
  sampling_key(seed, key);
  sampling_counter(request_id, position, counter);
  return num::uniform_open01(num::philox4x32_10(key, counter).w[0]);
}

namespace {

// log_softmax(row)[token] by the model's CPU kernel, so the value matches the forward pass's bits.
float row_logprob(const float* row, int64_t V, int32_t token) {
  float lp = 0.0f;
  log_softmax_gather(row, 1, V, &token, &lp);
  return lp;
}

}  // namespace

SampleResult sample_token(const float* logits, int64_t V, const SamplingParams& p, uint64_t request_id,
                          int64_t position) {
  const auto where = [&] {
    return fmt::format("sample_token: request {} position {}", request_id, position);
  };
  check_sampling(p, where());
  if (V <= 0)
    throw InputError(fmt::format("{}: the vocabulary size V must be positive, found {}", where(), V));
  if (position < 0) throw InputError(fmt::format("{}: the position must be >= 0", where()));
  for (int64_t v = 0; v < V; ++v)
    if (!std::isfinite(logits[v]))
      throw InputError(
          fmt::format("{}: logits[{}] is {} (every logit must be finite)", where(), v, logits[v]));

  SampleResult r;
  sampling_counter(request_id, position, r.counter);

  if (p.temperature == 0.0f) {
    // Greedy: strict > keeps the first (smaller) id among equal maxima.
    int64_t best = 0;
    for (int64_t v = 1; v < V; ++v)
      if (logits[v] > logits[best]) best = v;
    r.token = int32_t(best);
    r.logprob = row_logprob(logits, V, r.token);
    return r;
  }

  // Rule 3: the divided row (also the input of the log-prob), its maximum and the probabilities.
  std::vector<float> z(static_cast<size_t>(V), 0.0f);
  float M = -INFINITY;
  for (int64_t v = 0; v < V; ++v) {
    z[v] = logits[v] / p.temperature;
    if (!std::isfinite(z[v]))
      throw InputError(fmt::format("{}: temperature {} is too small: logits[{}] / temperature = {} overflows",
                                   where(), p.temperature, v, logits[v]));
    M = std::max(M, z[v]);
  }
  std::vector<float> prob(static_cast<size_t>(V));
  float S = 0.0f;
  for (int64_t v = 0; v < V; ++v) {
    prob[v] = num::exp_f(z[v] - M);
    S += prob[v];
  }
  // S >= 1 (the maximum contributes exp_f(0) = 1), so the division is safe.
  for (int64_t v = 0; v < V; ++v) prob[v] = prob[v] / S;

  // Rule 4-5: candidates by p descending, then smaller id; only the first n need to be in order.
  const int64_t n = (p.top_k > 0 && p.top_k < V) ? int64_t(p.top_k) : V;
  std::vector<int32_t> ids(static_cast<size_t>(V));
  std::iota(ids.begin(), ids.end(), 0);
  const auto before = [&](int32_t a, int32_t b) {
    return prob[a] > prob[b] || (prob[a] == prob[b] && a < b);
  };
  std::partial_sort(ids.begin(), ids.begin() + n, ids.end(), before);

  // Rule 6: the shortest prefix reaching top_p of the top-k mass. The loop ends by i = n - 1 at the
  // latest: the running sum there is the top-k mass itself (same order), and top_p <= 1.
  float topk_mass = 0.0f;
  for (int64_t i = 0; i < n; ++i) topk_mass += prob[ids[i]];
  const float need = p.top_p * topk_mass;
  int64_t kept = 0;
  float kept_mass = 0.0f;
  while (kept < n) {
    kept_mass += prob[ids[kept]];
    ++kept;
    if (kept_mass >= need) break;
  }

  // Rule 7: inverse CDF over the kept candidates in sorted order.
  const float t = sampling_uniform(p.seed, request_id, position) * kept_mass;
  int32_t token = ids[kept - 1];
  float run = 0.0f;
  for (int64_t i = 0; i < kept; ++i) {
    run += prob[ids[i]];
    if (run > t) {
      token = ids[i];
      break;
    }
  }
  r.token = token;
  r.logprob = row_logprob(z.data(), V, r.token);
  return r;
}

}  // namespace dsv4::rollout
