// Replay: re-execute recorded steps and compare every recomputed digest with the recorded one, in
// execution order (DESIGN.md §6). Exit semantics for the CLI: 0 bit-identical (or, under --tolerance,
// within tolerance), 1 divergence (or outside tolerance), 2 bad input.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "capture/cupti.h"
#include "capture/env.h"
#include "capture/trace_reader.h"
#include "model/communicator.h"
#include "model/device.h"
#include "model/weights.h"
#include "replay/tolerance.h"

namespace dsv4 {

struct ReplayOptions {
  std::optional<int> step;     // nullopt: every complete step
  std::string model_dir;       // empty: the recorded weights path ("init:seed=N" re-creates preset weights)
  int threads = 0;             // 0: as recorded (the recorded thread count does not change results)
  bool force_indexer = false;  // indexer replay: feed the recorded indexer selections via Overrides
  bool force_routing = false;  // routing replay: feed the recorded expert ids (learned layers)
  std::string take_decisions_from;  // counterfactual: force the decisions of this other trace
  int take_step = -1;               // step of that trace (-1: same index as the replayed step)
  // Where the replay runs. With cuda, and kernel records in the trace, the replay records its own
  // kernels (capture/cupti.h) and compares the two launch sequences (StepReplay::kernels_*).
  Device device = Device::cpu;
  // Training steps: the optimizer state the step started from, when it is no longer where the trace
  // says ("" = the recorded path; a fresh state needs none).
  std::string optimizer_state;
  // Expert parallelism of the replay (model/communicator.h; nullptr: one process). Prefill steps
  // only: a generation or training step under it is an InputError naming the step.
  Communicator* experts = nullptr;
  // `--tolerance`: a step in fast numerics that cannot be replayed bit for bit here (another GPU
  // architecture, the CPU) is re-executed in exact numerics with its recorded decisions forced and
  // compared within these bounds (replay/tolerance.h; StepReplay::tolerance). nullopt: such a step is
  // refused (InputError naming where it was recorded). Every other step is replayed bit for bit as usual.
  std::optional<ToleranceBounds> tolerance;
};

// Where two computations first differ.
struct Divergence {
  int step = 0, seq = 0, layer = -1;
  std::string tensor;  // named tensor, or "decision:indexer" / "decision:routing" / "weights"
  int64_t row = 0;     // token row (or compressed-group row)
  // Element level, when both values are available (recorded full tensor, or a recorded decision):
  bool has_elements = false;
  int64_t first_index = -1;  // within the row
  double recorded = 0, replayed = 0;
  int64_t ulp = 0;
  double max_abs = 0, max_rel = 0;  // over the row
  std::vector<float> replayed_row;  // the recomputed row (always available: replay computes it fully)
  // Why this is a divergence: "digest differs", or "record order differs: ..." / "extra record ..." /
  // "missing record ..." when the replay's sequence of named tensors does not follow the recorded one
  // (the comparison of that sequence stops there: alignment is lost).
  std::string reason;
};

struct DecisionChange {
  int seq = 0;
  int layer = 0;
  std::string kind;  // "indexer" | "routing"
  int64_t rows_changed = 0;
  int64_t first_row = -1;
};

struct EnvDifference {
  std::string key, recorded, here;
  int rank = 0;  // 0 = most likely culprit (isa, compile flags, compiler, cpu flags ...), larger = less likely
};

struct StepReplay {
  int step = 0;
  int threads = 0;  // OpenMP threads the replay ran with (0: the OpenMP default)
  std::string numerics = "exact";  // of the recorded profile: "exact" or "fast" (model/profile.h Numerics)
  // Replayed bit for bit: no digest differs and no recomputed decision differs from the recorded one.
  // false for a step compared within tolerance (below), whatever its values.
  bool identical = true;
  int64_t records_compared = 0, rows_compared = 0;
  int64_t records_differing = 0, rows_differing = 0;
  std::optional<Divergence> first;
  // Recomputed vs recorded decisions of this trace, per (sequence, layer, kind), only those that
  // differ. Under a counterfactual these are the places where the other trace decided differently.
  std::vector<DecisionChange> decision_changes;
  double seconds = 0;
  // Counterfactual (take_decisions_from): log-prob mismatch between the two traces before and after
  // forcing A's decisions into B. k1 = mean(logp_A - logp_B) over every predicted token.
  // Needs the other trace's log-probs: an external step may hold none (nullopt then).
  std::optional<double> mean_abs_dlogprob_before, mean_abs_dlogprob_after, kl_before, kl_after;
  // Counterfactual, always: what forcing A's decisions did to this trace's log-probs (B recorded vs B
  // replayed with A's decisions): mean |Δ| and the mean log-prob of each.
  std::optional<double> mean_abs_dlogprob_forced, mean_logprob_recorded, mean_logprob_forced;
  std::string counterfactual_source;  // A's step as "TRACE step K" (+ ", engine E" for an external one)
  // Counterfactual: whether the forced run's decisions equal A's recorded ones (as sets, every layer
  // including hash layers), and where they do not.
  std::optional<bool> counterfactual_decisions_equal;
  std::vector<DecisionChange> counterfactual_mismatches;
  // GPU kernel sequence, compared when the trace holds kernel records (available = 1) and this replay
  // recorded its own (device cuda, CUPTI available): names, grid, block and shared memory, in launch
  // order, of the model's launches (capture/cupti.h model_launches: the report kernels depend on the
  // observer and are left out of the counts and indices). nullopt: not compared, kernels_note says
  // why. A kernel difference does not change `identical` (which is about the computed bits); it tells
  // where the launch plan changed.
  std::optional<bool> kernels_equal;
  int64_t kernels_recorded = 0;          // the model's launches in the trace (0 when it holds none)
  int64_t kernels_replayed = 0;          // by this replay (0 when it recorded none)
  int64_t kernel_first_difference = -1;  // launch index of the first difference (-1: none)
  std::string kernels_note;              // the first difference, or why nothing was compared
  // A fast step compared within tolerance, not bit for bit (ReplayOptions::tolerance): the bounds, the
  // worst tensor, the log-probs, the digest-only records. `first` then holds only a structural
  // divergence (the replay's records do not follow the recorded ones), and decision_changes the forced
  // decisions that did not take. nullopt for a step replayed bit for bit.
  std::optional<ToleranceReplay> tolerance;
  // Bit-identical, or compared within tolerance with every value within its bound and nothing else
  // differing.
  bool passed() const {
    return tolerance ? tolerance->within() && !first && decision_changes.empty() : identical;
  }
};

struct ReplayReport {
  std::string trace;
  std::string model_source;
  std::vector<StepReplay> steps;
  std::vector<EnvDifference> env_differences;  // sorted by rank
  std::vector<std::string> weight_mismatches;  // tensor names whose digest differs from the recorded
  // Steps of the trace that were not verified (replaying every step): incomplete ones (status 0),
  // damaged ones (a step group, attribute or dataset that cannot be read), in step order.
  struct SkippedStep {
    int step = 0;
    std::string reason;  // "incomplete (status 0): ..." or the read error naming the object
  };
  std::vector<SkippedStep> skipped;
  std::vector<std::string> notes;  // remarks for the reader (model mismatch, ...)
  std::string layout_note;         // how a parallel recording was laid out ("" for one process)
  // Where the trace was recorded and where it was replayed (machine_summary, capture/env.h).
  std::string recorded_on, replayed_on;
  // Every replayed step bit-identical and the weights equal to the recorded ones.
  bool identical() const;
  // Every replayed step passed (bit-identical, or within tolerance under --tolerance) and the weights
  // equal to the recorded ones; identical() when no step was compared within tolerance.
  bool passed() const;
  // passed() and no step skipped: every step of the trace (or the one asked for) was verified.
  bool verified_all() const { return passed() && skipped.empty(); }
};

// Throws InputError for bad input (unreadable trace, missing weights, step out of range, a
// counterfactual trace of other tokens). A weights digest mismatch is reported, not thrown.
ReplayReport replay_trace(const std::string& trace, const ReplayOptions& opt);
// The report as JSON (`dsv4 replay --json`), indented by 2.
std::string replay_to_json(const ReplayReport& r);
// Weights for a recorded trace: --model dir, or the recorded path, or "init:seed=N".
// A relative recorded path is looked up beside the trace first, then in the working directory (a
// bundle records "model", see bundle_trace). Throws InputError when no weights can be found, or when
// the checkpoint's config differs from the recorded one (naming the field).
// With `keep`, only the tensors it accepts are loaded (Weights::load).
Weights weights_for_trace(const TraceReader& r, const std::string& model_dir, const WeightFilter& keep = {});
// The seed of a weights source "init:seed=N" (preset weights re-created from the seed); nullopt for
// a path.
std::optional<uint64_t> init_seed(const std::string& source);
// Names of the weight tensors whose digest differs from the recorded one (or that exist on one side
// only), sorted.
std::vector<std::string> weight_mismatches(const TraceReader& r, const Weights& w);
// Every key whose value differs (absent on one side reads "(absent)"), sorted by rank then key:
// isa/machine 0, compile_flags 1, compiler 2, cpu_flags 3, build_id 4, threads/parallel 5 (never change
// results), gpu/gpu_arch/tensor_core_revision/gpu_driver/cuda/cupti/nccl 6, hdf5/deflate/os/cpu_model 7,
// other keys 8, host 9 (expected to differ).
std::vector<EnvDifference> compare_env(const EnvFingerprint& recorded, const EnvFingerprint& here);

// ---- fast numerics (docs/NUMERICS.md "Fast numerics") -------------------------------------------
// Why this build cannot replay bit for bit a step in fast numerics recorded with env `recorded`: the
// tensor_core order's bits are those of one GPU architecture (gpu_arch) and of one revision of the
// kernels (tensor_core_revision, kernels/reduce.h kTensorCoreRevision; a trace without the key is taken
// at revision 1). `device` is where the replay would run, `here_arch` its GPU's architecture ("none"
// without one), `here_revision` this build's. nullopt when the replay is bitwise. The architecture is
// checked first. The fields complete the sentences of the refusal and of the tolerance report.
struct FastReplayObstacle {
  std::string recorded;  // "a GPU of architecture sm_90" (+ " by tensor-core kernels of revision 1")
  std::string only;      // what alone reproduces the bits: "a GPU of that architecture", ...
  std::string here;      // where this replay would run: "the cpu", "a GPU of architecture sm_80", ...
  std::string remedy;    // "replay it with --device cuda on a sm_90 GPU", ...
};
std::optional<FastReplayObstacle> fast_replay_obstacle(const EnvFingerprint& recorded, Device device,
                                                       const std::string& here_arch, int here_revision);

// `dsv4 trace bundle`: copies the trace and its weights directory into `out_dir` with a manifest
// (MANIFEST.json: file names, sizes and XXH3 digests; the model digest) so both move together.
// Layout: out_dir/<trace file name>, out_dir/model/{config.json, *.safetensors, index}, and
// out_dir/MANIFEST.json. The copied trace records weights_path "model" (the original is kept in the
// attribute weights_path_recorded), so `dsv4 replay out_dir/TRACE` finds the weights by itself and
// `--model out_dir/model` works too. An empty model_dir takes the recorded weights; "init:seed=N"
// weights are written out as a checkpoint. Throws InputError when out_dir exists and is not empty,
// or when the weights do not match the trace's recorded digests.
void bundle_trace(const std::string& trace, const std::string& model_dir, const std::string& out_dir);

// Recorded vs replayed kernel launches of one step, in launch order (name, grid, block, shared
// memory: capture/cupti.h same_launch) of the model, report kernels (is_report_kernel) left out on both
// sides: sets sr.kernels_equal, the counts, the first differing launch index and a note naming both
// launches; a replay that could not record leaves kernels_equal unset.
void compare_kernels(const KernelRecords& recorded, const KernelRecords& replayed, StepReplay& sr);

}  // namespace dsv4
