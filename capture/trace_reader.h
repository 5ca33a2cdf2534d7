// Reading traces (traces/FORMAT.md). Opens a closed file plainly read-only and a file marked open for
// SWMR writing in SWMR-read mode with bounded read attempts (capture/trace_open.h), so a trace that is
// being written (or whose writer was killed) can be read and a damaged one fails at once; refresh()
// re-reads the step list.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "capture/cupti.h"
#include "capture/env.h"
#include "capture/generation.h"
#include "capture/layout.h"  // kTraceFormatVersion
#include "capture/trace_open.h"
#include "capture/trace_seal.h"
#include "capture/training.h"
#include "model/collect.h"
#include "model/config.h"
#include "model/profile.h"

namespace dsv4 {

struct TraceStepInfo {
  int index = 0;
  std::string group;  // "/steps/000000"
  std::string kind, profile, capture;
  // The recorded profile's canonical text and digest (empty in traces written before profiles were
  // stored, and for external steps): recorded_profile() turns them into the profile.
  std::string profile_text, profile_digest;
  uint64_t seed = 0;
  int threads = 0;
  bool complete = false;
  // Why an incomplete step is not complete: empty for status 0 (its recorder stopped during the step),
  // else what could not be read (a damaged step group, attribute or status), naming the object.
  std::string damage;
  std::vector<int64_t> seq_lengths;
  // External steps (capture/external.h, format version 4): the engine that computed the step and where
  // its data came from; both empty for steps of our runtime.
  std::string engine, source;
  bool external() const { return !engine.empty(); }
  // "incomplete (status 0)" or "damaged: <what>" for a step that is not complete; "" otherwise.
  std::string why_not_complete() const;
};

// The numerics profile a step was recorded with: its stored text (checked against its digest), or for
// traces that store only a name, the built-in of that name. Throws TraceCorrupt (text and digest
// disagree, or the text does not parse) or InputError (a name this build does not know and no text),
// naming the trace and the step.
NumericsProfile recorded_profile(const TraceStepInfo& s, const std::string& trace_path);
// recorded_profile when this build knows the step's profile (a stored text, or a built-in's name);
// nullopt for an engine's name without a stored text.
std::optional<NumericsProfile> known_recorded_profile(const TraceStepInfo& s, const std::string& trace_path);
// The relative tie factor of a recorded step (model/decision_sets.h tie_factor): from the sites of its
// known recorded profile, else by its name.
double recorded_tie_factor(const TraceStepInfo& s, const std::string& trace_path);

struct TraceModelMeta {
  std::string config_json;
  std::string weights_path;
  std::string model_digest;  // 16 hex digits
  std::vector<std::string> tensor_names;
  std::vector<uint64_t> tensor_digests;
};

struct DigestRecord {
  std::string name;
  int layer = -1;
  int64_t rows = 0;
  int64_t first = 0;  // offset into DigestTable::values
};
struct DigestTable {
  std::vector<DigestRecord> records;  // execution order
  std::vector<uint64_t> values;
};

struct GroupSize {
  std::string group;          // e.g. "/steps/000000/seq_000/decisions"
  int64_t stored_bytes = 0;   // on disk (after filters)
  int64_t logical_bytes = 0;  // in memory
};

class TraceReader {
 public:
  // Throws NotATrace (not HDF5 or no format attribute), UnsupportedTraceVersion (newer), TraceError;
  // TraceCorrupt for a file that does not match its seal (capture/trace_seal.h), unless `seal` is
  // SealPolicy::report (validate and salvage, which report it themselves).
  static TraceReader open(const std::string& path, SealPolicy seal = SealPolicy::enforce);
  TraceReader(TraceReader&&) noexcept;
  TraceReader& operator=(TraceReader&&) noexcept;
  ~TraceReader();

  const std::string& path() const;
  const SealCheck& seal() const;  // the seal as checked at open (or at the last refresh)
  int format_version() const;
  std::string producer() const;
  std::string created() const;
  EnvFingerprint env() const;
  TraceModelMeta model() const;
  ModelConfig config() const;  // parsed from the recorded config.json text
  std::vector<std::string> tensor_names() const;
  // A joined trace's parts (capture/joined.h) in rank order, with their seals as checked at open; empty
  // for other traces.
  const std::vector<TracePart>& parts() const;

  std::vector<TraceStepInfo> steps() const;  // every step group, complete or not, in order
  void refresh();                            // re-read the step list (SWMR); drops what keep_reads kept

  // Keeps what tokens(), logprobs(), indexer(), routing(), mhc(), digests() and tensor() return, up to
  // `max_bytes` of decoded values, so that a second pass over the same step (the viewer's diff report
  // after its views) reads and decodes nothing twice; each later call returns a copy of what is kept.
  // Past the budget, reads are read as usual and not kept. 0 (the default) keeps nothing and drops what
  // is kept.
  void keep_reads(int64_t max_bytes);
  int64_t kept_bytes() const;

  // Per (step, sequence). Throws TraceError naming the dataset when something is missing or has the
  // wrong shape/dtype, TraceIncomplete for a step with status 0.
  std::vector<int32_t> tokens(int step, int seq) const;
  std::vector<float> logprobs(int step, int seq) const;
  std::vector<int> decision_layers(int step, int seq) const;
  // Decisions of one layer: ids [rows, width] (-1 padded) and [rows, k]. rows = T for steps of our
  // runtime; an external step's layer may hold T - 1 rows (the engines' layout) and no margins or
  // weights (empty vectors then).
  std::optional<IndexerRecord> indexer(int step, int seq, int layer) const;
  std::optional<RoutingRecord> routing(int step, int seq, int layer) const;
  // Rows [r0, r1) of the same, reading only those rows (and the indexer's row counts) from the file;
  // r1 is clamped to the rows stored. The record's T is the number of rows returned.
  std::optional<IndexerRecord> indexer_rows(int step, int seq, int layer, int64_t r0, int64_t r1) const;
  std::optional<RoutingRecord> routing_rows(int step, int seq, int layer, int64_t r0, int64_t r1) const;
  // The request id and prompt length an external step recorded for a sequence ("" and -1 otherwise).
  std::string sequence_id(int step, int seq) const;
  int64_t prompt_length(int step, int seq) const;
  // Whether the sequence holds log-probs (external steps may not).
  bool has_logprobs(int step, int seq) const;
  std::optional<MhcRecord> mhc(int step, int seq, int layer, Sublayer s) const;
  DigestTable digests(int step, int seq) const;
  // Full tensors kept by the capture policy: (name, layer) pairs, and one of them.
  std::vector<std::pair<std::string, int>> full_tensors(int step, int seq) const;
  std::optional<TensorCopy> tensor(int step, int seq, int layer, const std::string& name) const;
  // Rows [r0, r1) of a full tensor (shape[0] clamped), reading only those rows.
  std::optional<TensorCopy> tensor_rows(int step, int seq, int layer, const std::string& name, int64_t r0,
                                        int64_t r1) const;

  // The GPU kernel records of a complete step (/steps/NNNNNN/kernels). A trace written before kernel
  // records existed gives available = false, reason "not recorded in this trace".
  KernelRecords kernels(int step) const;
  // The generation record of a step of kind "generate" (capture/generation.h); nullopt for other steps.
  std::optional<GenerationRecord> generation(int step) const;
  // The training record of a step of kind "train-step" (capture/training.h); nullopt for other steps.
  // Throws TraceCorrupt naming the dataset when it is missing or malformed.
  std::optional<TrainingRecord> training(int step) const;

  std::vector<GroupSize> sizes() const;  // per step, per sequence group and its subgroups
  int64_t file_bytes() const;

  struct Impl;

 private:
  explicit TraceReader(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace dsv4
