// The RL policy loss of a training step (docs/TRAINING.md "Loss"): GRPO/PPO-style clipped ratio on
// the response tokens, an optional truncated importance-sampling (TIS) correction against the rollout
// engine's log-probs, an optional k3 KL penalty against a reference model, a token-level mean.
//
// Per response token t of sample i, with logp the trainer's log-prob, old its old (behaviour) log-prob,
// A_i the sample's advantage:
//   r      = exp(logp - old)
//   pg     = -min(r * A, clip(r, 1 - eps_low, 1 + eps_high) * A)
//   tis    = min(exp(old - rollout), tis_cap)          (a constant; 1 when TIS is off)
//   kl     = exp(ref - logp) - (ref - logp) - 1        (k3; 0 when kl_coef == 0)
//   l_t    = tis * pg + kl_coef * kl
//   loss   = (sum over all samples and tokens of l_t) / N,   N = response tokens of the whole batch
// d loss / d logp_t = (tis * dpg + kl_coef * (1 - exp(ref - logp))) / N with dpg = -r * A where the
// unclipped term is the minimum (or the two are equal), else 0. All in fp64, then rounded to fp32
// once; the gradient of a token depends only on that token and N, never on the micro-batching.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace dsv4::train {

struct PolicyLossConfig {
  double eps_low = 0.2, eps_high = 0.28;
  bool tis = false;      // truncated importance sampling against the rollout log-probs
  double tis_cap = 2.0;  // C
  double kl_coef = 0.0;  // k3 KL penalty weight (needs reference log-probs)
};
// Throws InputError naming the field for negative eps, tis_cap <= 0, kl_coef < 0 or non-finite values.
void check(const PolicyLossConfig& c);

// One sample's response tokens (all arrays [n]); rollout / ref may be empty when not used.
struct SampleLogprobs {
  std::vector<float> logp, old, rollout, ref;
  double advantage = 0.0;
};

struct LossMetrics {
  double loss = 0;             // the token mean above
  double pg_loss = 0;          // mean of tis * pg
  double kl = 0;               // mean k3 KL vs the reference (0 when off)
  double clip_fraction = 0;    // fraction of tokens whose clipped term was taken (r outside the range
                               // on the side that matters for the sign of A)
  double ratio_mean = 0, ratio_min = 0, ratio_max = 0;
  double tis_mean = 0;         // mean TIS weight (1 when off)
  // Rollout-vs-train mismatch over tokens that have rollout log-probs: mean and max of
  // |logp - rollout|, and the k3 estimate of KL(rollout || train).
  double mismatch_mean_abs = 0, mismatch_max_abs = 0, mismatch_k3 = 0;
  int64_t tokens = 0, mismatch_tokens = 0;
};

// The loss over the whole batch: metrics, and per sample the gradient d loss / d logp_t [n]. Sums run
// over samples in order, tokens in order, in fp64. Throws InputError naming the sample for arrays of
// the wrong length, TIS without rollout log-probs or a KL coefficient without reference log-probs.
// normaliser > 0 replaces N (the response tokens of `samples`): a step computes each sample's
// gradient alone with the whole batch's N, which gives the same bits as the batch at once.
LossMetrics policy_loss(const PolicyLossConfig& c, const std::vector<SampleLogprobs>& samples,
                        std::vector<std::vector<float>>* dlogp, int64_t normaliser = 0);

// Group-relative advantages (GRPO): A_i = (r_i - mean of its group) / (std of its group + eps) when
// scale_by_std, else r_i - mean. Groups are the distinct `group` strings; std is the population std;
// sums in sample order, fp64. A group of one sample gets advantage 0.
std::vector<double> group_advantages(const std::vector<double>& rewards, const std::vector<std::string>& group,
                                     bool scale_by_std, double eps = 1e-6);

}  // namespace dsv4::train
