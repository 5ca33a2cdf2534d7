// The DSV4 forward pass (MODEL.md §2-3), prefill over whole sequences, on the CPU or a CUDA device.
//
// Sequences of a batch are computed one after another with identical code paths, so a sequence's
// results never depend on the others (batch invariance); inside a sequence the kernels parallelise
// over independent outputs only, so results do not depend on the thread count. The CUDA backend
// computes every tensor with the CPU's operation order: both devices give the same bits.
//
// Named tensors reported to the Observer, per layer L (shape[0] is the row axis):
//   attn.hc_pre [T,D]  attn.norm [T,D]  attn.qr [T,q_lora]  attn.q [T,H*Dh]  attn.kv [T,Dh]
//   attn.compressed_kv [G,Dh] (C4/C128)  indexer.q [T,Hi*Di]  indexer.k [G4,Di]  indexer.weights [T,Hi] f32
//   indexer.score [T,k] f32 (score of each chosen group, NaN for empty slots)  attn.o [T,H*Dh]
//   attn.u [T,G*R]  attn.out [T,D]  attn.hc_post [T,hc*D]
//   ffn.hc_pre [T,D]  ffn.norm [T,D]  moe.router_logits [T,E] f32  moe.out [T,D]  ffn.hc_post [T,hc*D]
// and model-level (layer -1): embed [T,D], head.hc [T,D], head.norm [T,D], logits [T,V] f32,
// logprobs [T-1] f32. All others are bf16.
#pragma once

#include <cstdint>
#include <vector>

#include "model/communicator.h"
#include "model/device.h"
#include "model/observer.h"
#include "model/overrides.h"
#include "model/profile.h"
#include "model/sequence_cache.h"
#include "model/weights.h"

namespace dsv4 {

struct RunOptions {
  NumericsProfile profile = profile_train();
  int threads = 0;  // 0: OpenMP default
  Observer* observer = nullptr;
  const Overrides* overrides = nullptr;
  float temperature = 1.0f;  // logits / temperature before log_softmax (MODEL.md §3.10)
  // cuda: weights are uploaded once per Weights object and activations stay on the device; only what
  // the Observer is given (tensors when it wants them, decisions always) and the log-probabilities
  // come back. Throws InputError when this dsv4 was built without CUDA or no device is usable.
  Device device = Device::cpu;
  // Expert parallelism (model/expert_parallel.h): the routed experts shared out among this
  // communicator's ranks, every rank running the same sequences (one rank too); nullptr: all local.
  // The result is the same bits for every rank count. The communicator moves the backend's memory:
  // MPI for the CPU, NCCL for CUDA (parallel/).
  Communicator* experts = nullptr;
  // With `experts`: the ranks split the sequences (data parallel; model/communicator.h
  // sequence_range): each rank calls forward() with its own sequences (none allowed), and at every MoE
  // layer the tokens' pairs travel to their experts' owners and back (moe_experts_dispatch). A rank
  // with fewer sequences than another serves its experts for the other's remaining ones, so every
  // sequence gets the bits of a single-device forward. CPU only.
  bool split_sequences = false;
  // A deferrable observer (Observer::deferrable) on a device: the most host memory its reports may
  // hold while their downloads are in flight (model/late_reports.h); past it the model waits.
  size_t late_report_bytes = size_t(256) << 20;
};

struct SequenceResult {
  std::vector<int32_t> tokens;
  std::vector<float> logprobs;     // [T-1]: logprobs[t] = log_softmax(logits[t])[tokens[t+1]]
  std::vector<float> last_logits;  // forward_chunk only: the logits [V] of the chunk's last token
};

struct ForwardResult {
  std::vector<SequenceResult> seqs;
};

// With opt.split_sequences the batch is this rank's sequences (it may be empty) and the results are
// theirs; every rank of opt.experts must call forward() at the same point.
// Throws InputError for empty sequences or token ids outside [0, vocab_size) (naming sequence and
// position) and OverrideError for invalid forced decisions (naming sequence, layer and token).
ForwardResult forward(const Weights& w, const std::vector<std::vector<int32_t>>& batch,
                      const RunOptions& opt);

// Checks that every forced decision names a sequence of `batch`, an existing layer, a ratio-4 layer
// (indexer) or a learned-routing layer (experts); throws OverrideError naming them. The rows
// themselves are checked when the layer runs.
void check_overrides(const Overrides& o, const ModelConfig& c, const std::vector<std::vector<int32_t>>& batch);

// One chunk of sequence `seq` on backend `be` (which must have been made for `w` and own the cache's
// memory): `tokens` at positions cache.length() .. + T - 1, attending to what the cache holds of the
// earlier tokens and leaving this chunk's state in it (MODEL.md §7). A decode step is a chunk of one
// token. Every named tensor and decision is reported for the chunk's rows (TensorRecord::pos0 says
// where they start) with the same bits a whole-sequence forward gives those rows, for any split of
// a sequence into chunks: the graph is the same code, the cache only supplies the earlier rows. The
// result holds the last token's raw logits (temperature 1; `logprobs` is not reported: the next
// token is the caller's to choose). opt.device and opt.threads are not used (the backend and the
// caller decide); overrides are not supported. Throws InputError for token ids outside the
// vocabulary and positions beyond max_position_embeddings.
SequenceResult forward_chunk(backend::Backend& be, const Weights& w, int seq,
                             const std::vector<int32_t>& tokens, SequenceCache& cache, const RunOptions& opt);

}  // namespace dsv4
