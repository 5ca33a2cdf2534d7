// Expert parallelism (docs/PARALLEL.md): the MoE of a forward whose routed experts are shared out
// among the ranks of a Communicator (model/communicator.h expert_range). Every rank runs the same
// sequences (the rest of the layer is replicated); at each MoE layer a rank computes the outputs of
// the (token, slot) pairs routed to its own experts, the ranks gather them (all_gather_v), and each
// rank sums every token's slots in slot order and adds the shared experts (kernels/moe.h
// moe_combine). Each pair's output and each token's sum are formed exactly as the single-device
// moe_experts forms them, so the result is bit-identical to it for every rank count.
#pragma once

#include "kernels/grad.h"
#include "kernels/moe.h"
#include "model/communicator.h"

namespace dsv4 {

// p.out = moe_experts(p) computed with `comm`'s ranks sharing the experts (host memory: the CPU
// backend). p.experts must hold valid weights for this rank's experts; the others are not read.
void moe_experts_parallel(const MoeParams& p, Communicator& comm);

// Data parallel over sequences (docs/PARALLEL.md): each rank passes its own tokens (p.T may be 0, p
// then serves its experts only). The rank sends each of its (token, slot) pairs — the token's row, the
// expert id, the routing weight — to the rank owning the expert (all_to_all_v), every rank computes the
// pairs it received with its experts (moe_routed_outputs, whose rows do not depend on which other rows
// share the expert), sends the outputs back, and each rank sums its tokens' slots in slot order and
// adds the shared experts (moe_combine): moe_experts' bits for its tokens, whatever the other ranks
// run. Every rank calls it once per MoE layer, in the same order.
void moe_experts_dispatch(const MoeParams& p, Communicator& comm);

// The bytes moe_experts_dispatch sends per pair out (the row, id and weight) and back (the output).
inline int64_t dispatch_bytes_out(int64_t D) { return (D + 2) * int64_t(sizeof(float)); }
inline int64_t dispatch_bytes_back(int64_t D) { return D * int64_t(sizeof(float)); }

// moe_experts_backward(p) computed with `comm`'s ranks sharing the experts (host memory): each rank the
// backward of its experts' pairs (kernels/grad.h moe_backward_routed), the pairs' input and
// routing-weight gradients gathered in rank order and summed by every rank as the single device sums
// them (moe_backward_combine). dx, dweights and the shared experts' gradients are then the
// single-device bits on every rank; each routed expert's weight gradients are complete on its owner
// only (Backend::moe_experts_backward_parallel then gathers them: expert_grad_matrices).
void moe_experts_backward_parallel(const MoeBwdParams& p, Communicator& comm);

// The routed experts' weight gradients as they travel to the ranks that do not own them: experts
// [e0, e1) in order, each its w1, w3, w2 gradient matrix (I * D floats), frozen (null) ones left out
// (the same on every rank).
std::vector<float*> expert_grad_matrices(const MoeBwdParams& p, int e0, int e1);

// The (token, slot) pairs each of `ranks` ranks owns, from each expert's pair count.
std::vector<int64_t> pairs_per_rank(const std::vector<int64_t>& expert_counts, int ranks);

}  // namespace dsv4
