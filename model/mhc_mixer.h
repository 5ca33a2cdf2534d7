// The Params fields that the mHC mixers' ops (hc_pre, hc_head and their backward ops) take from the
// config and the mixer's weights, set in one place for the forward and the backward.
#pragma once

#include <cstdint>
#include <string>

#include "kernels/reduce.h"
#include "model/config.h"
#include "model/device.h"
#include "model/weights.h"

namespace dsv4 {

// Sets the fields that HcPreParams, HcHeadParams, HcPreBwdParams and HcHeadBwdParams share: the streams
// X [T, hc, D], the weights of the mixer under `prefix` (mhc_prefix or kHeadMhcPrefix, model/weights.h),
// the config's epsilons (and Sinkhorn iterations where the op has a Sinkhorn) and the reduction order.
template <class P>
void set_mhc_mixer(P& p, backend::Backend& be, const ModelConfig& c, const std::string& prefix, int64_t T,
                   const float* X, ReduceOrder order) {
  p.T = T;
  p.hc = c.hc_mult;
  p.D = c.hidden_size;
  p.X = X;
  p.fn = be.weight(prefix + "fn");
  p.scale = be.weight(prefix + "scale");
  p.base = be.weight(prefix + "base");
  p.rms_eps = c.rms_norm_eps;
  p.hc_eps = c.hc_eps;
  if constexpr (requires { p.sinkhorn_iters; }) p.sinkhorn_iters = c.hc_sinkhorn_iters;
  p.order = order;
}

}  // namespace dsv4
