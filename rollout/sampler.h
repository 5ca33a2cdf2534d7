// The counter-based token sampler of the rollout engine (docs/SAMPLING.md).
//
// A draw is a pure function of (seed, request id, position, the logits row): it does not depend on
// the batch a request runs in, on the order requests are sampled, on the thread count or on the
// device, so a recorded rollout can be re-sampled token for token anywhere. No state is kept
// between calls: the random word comes from Philox4x32-10 keyed by the seed and indexed by
// (position, request id).
//
// Rules, in order:
//  1. Every logit must be finite (NaN or +-inf throws InputError naming request and position).
//  2. temperature == 0: greedy. The token is the argmax of the raw logits, ties to the smaller id.
//     No random word is used.
//  3. Otherwise z_v = logits[v] / temperature (IEEE division, the same x / d as the model's
//     `divide` op); M = max z; e_v = exp_f(z_v - M); S = sum of e_v in index order (one fp32
//     accumulator); p_v = e_v / S.
//  4. Candidates are all ids sorted by p descending, ties by smaller id (a total order, so the
//     result does not depend on the sort algorithm).
//  5. top_k > 0 keeps the first top_k candidates (all of them when top_k >= V).
//  6. top_p keeps the shortest prefix of those whose running sum (in sorted order) is
//     >= top_p * (sum of the top-k candidates' p, same order). At least one candidate is kept.
//     Applied also for top_p == 1, where it only drops candidates whose p underflowed to 0.
//  7. u = uniform_open01(word 0 of Philox4x32-10(key, counter)) with
//       key     = (seed & 0xffffffff, seed >> 32)
//       counter = (position & 0xffffffff, position >> 32, request_id & 0xffffffff, request_id >> 32)
//     t = u * K, K the kept candidates' running sum; the token is the first kept candidate whose
//     running sum (same order) is > t (inverse CDF; if rounding leaves t >= every running sum,
//     the last kept candidate).
//  8. logprob = log_softmax(logits / temperature)[token] over the FULL vocabulary, before top-k and
//     top-p (temperature 1 for greedy): the value the trainer recomputes (MODEL.md §3.10). It is
//     computed by the model's own CPU kernel (log_softmax_gather of kernels/logits.h) on the row
//     divided as in rule 3, so it equals the forward pass's log-prob of the same token bit for bit.
//
// The uniform has 2^23 levels (kernels/numerics/philox.h), so candidates holding less than 2^-23 of
// the kept mass are drawn with a probability quantised to multiples of 2^-23.
#pragma once

#include <cstdint>
#include <string>

namespace dsv4::rollout {

struct SamplingParams {
  float temperature = 1.0f;  // 0 = greedy; otherwise logits are divided by it
  int top_k = 0;             // 0 = off
  float top_p = 1.0f;        // in (0, 1]; 1 = off
  uint64_t seed = 0;         // the Philox key
};

// Throws InputError naming the field and `where` (e.g. "prompts.jsonl line 3"): temperature < 0 or
// not finite, top_k < 0, top_p not in (0, 1] (NaN included).
void check_sampling(const SamplingParams& p, const std::string& where);

struct SampleResult {
  int32_t token = -1;
  float logprob = 0.0f;  // rule 8 above
  // The Philox counter of this (request, position), rule 7; filled for greedy too, though no
  // random word is drawn there.
  uint32_t counter[4] = {0, 0, 0, 0};
};

// Samples one token from a row of V logits by the rules above. `position` is the position of the
// token being generated (>= 0). Throws InputError (naming request and position) for V <= 0,
// position < 0, a non-finite logit, a temperature so small that some logits[v] / temperature
// overflows, and for bad parameters (check_sampling).
SampleResult sample_token(const float* logits, int64_t V, const SamplingParams& p, uint64_t request_id,
                          int64_t position);

// The pieces of rule 7, for reproducing a draw by hand (docs/SAMPLING.md).
void sampling_key(uint64_t seed, uint32_t key[2]);
void sampling_counter(uint64_t request_id, int64_t position, uint32_t counter[4]);
float sampling_uniform(uint64_t seed, uint64_t request_id, int64_t position);

}  // namespace dsv4::rollout
