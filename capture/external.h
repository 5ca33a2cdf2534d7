// Steps that another engine computed: the decisions (MoE routing, indexer top-k), log-probs and tensors
// that an SGLang, miles or PyTorch run reported, written in the trace format as *external steps*
// (format version 4, traces/FORMAT.md "External steps"). Our runtime computed none of it, so there is
// nothing to re-execute: such a step has no digests; `dsv4 diff` compares it with a step of ours (or
// another external one), `dsv4 replay OURS --take-decisions-from EXTERNAL` forces its decisions into our
// model, and the viewer shows it.
//
// One writer serves the importers (`dsv4 import sglang|miles`, adapters/) and the Python package's
// TraceWriter (python/). It checks everything against the model config before a byte is written and
// throws InputError naming the sequence (its request id), the layer and the row; the file keeps its
// NAME.h5.incomplete name until close(), and a step its writer did not end stays at status 0, as for
// the runtime's writer.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "model/config.h"
#include "model/observer.h"

namespace dsv4 {

class IndexerSetEncoder;

// Indexer top-k of one C4 layer: ids [rows, width], row-major. A row holds compressed-group positions
// of the sequence (0-based, in any order) and −1 for empty slots (anywhere in the row), at most the
// runtime's min(index_topk, ⌊T/4⌋) valid ones. rows is T (a row per token) or T − 1 (the engines'
// layout: the last token was never fed, so it has no row). Or, instead of ids, the rows already
// checked and encoded (capture/indexer_sets.h; an importer streaming a large buffer): `encoded` holds
// `rows` rows of a sequence of T tokens at the runtime width, and `ids` is empty.
struct ExternalIndexer {
  int layer = 0;
  int64_t rows = 0;
  int width = 0;
  std::vector<int32_t> ids;
  std::shared_ptr<IndexerSetEncoder> encoded;
};

// MoE routing of one layer: ids [rows, k] (k = num_experts_per_tok; any order within a row), weights
// [rows, k] in the order of the ids or empty when the engine did not report them. rows as above.
struct ExternalRouting {
  int layer = 0;
  int64_t rows = 0;
  int k = 0;
  std::vector<int32_t> ids;
  std::vector<float> weights;
};

// A tensor the engine computed (e.g. from a forward hook), stored under tensors/<name>/layer_LLL (or
// /model for layer −1). f32 and bf16 values are in `f` (bf16 values must be bf16-exact: they are stored
// as their upper 16 bits), i32 values in `i`. shape[0] is the token axis.
struct ExternalTensor {
  std::string name;
  int layer = -1;
  DType dtype = DType::f32;
  std::vector<int64_t> shape;
  std::vector<float> f;
  std::vector<int32_t> i;
};

// One sequence (request, sample) of an external step.
struct ExternalSequence {
  std::string id;                        // the engine's request id ("" when it has none); named in errors
  std::vector<int32_t> tokens;           // prompt + response, as fed
  int64_t prompt_length = -1;            // −1: unknown
  std::vector<float> logprobs;           // empty (not reported) or T − 1: logprobs[t] = log p(tokens[t+1])
  std::vector<ExternalIndexer> indexer;  // any subset of the C4 layers
  std::vector<ExternalRouting> routing;  // any subset of the layers (hash layers included)
  std::vector<ExternalTensor> tensors;
};

struct ExternalStepSpec {
  std::string kind = "rollout";     // "rollout" (an inference engine) | "train" (a trainer's forward)
  std::string engine;               // who computed it: "sglang", "miles", "python", ...; required
  std::string profile = "unknown";  // the engine's numerics, when a profile of ours describes them
  std::string source;               // where the data came from (a file name), for the reader
};

// The model the engine ran: the config.json text (required) and, when known, the weights (a path the
// runtime can load, and their digest as TraceHeader holds it). Without weights the trace records
// model_digest "unknown" and diff/replay say that the weights could not be checked.
struct ExternalModel {
  std::string config_json;
  std::string weights_path;  // "" when unknown
  std::string model_digest;  // 16 hex digits, or "" (unknown)
  std::vector<std::string> tensor_names;
  std::vector<uint64_t> tensor_digests;
};

class ExternalTraceWriter {
 public:
  // New trace at `path` (must end in .h5; written as path + ".incomplete" until close()); refuses to
  // overwrite an existing file. Throws InputError for a config_json that does not parse.
  static std::unique_ptr<ExternalTraceWriter> create(const std::string& path, const ExternalModel& m);
  ~ExternalTraceWriter();

  const ModelConfig& config() const;

  void begin_step(const ExternalStepSpec& s);
  // Checks and writes one sequence of the open step (memory: this sequence only). Rows of an indexer
  // layer are stored as sets (ascending, −1 dropped); a routing row is sorted ascending with its
  // weights. Throws InputError, writing nothing of the sequence, for: no tokens, token ids outside the
  // vocabulary, log-probs of another length than T − 1, a layer out of range or given twice, an indexer
  // layer that is not C4, rows other than T or T − 1, a width below the runtime's or wider with valid
  // ids in the extra slots, an id below −1, a duplicate id in a row, a group that position t cannot
  // see yet (≥ ⌊(t+1)/4⌋), more valid ids than the width; routing of k ≠ num_experts_per_tok, ids
  // outside [0, n_routed_experts) (−1 included), duplicates, weights of the wrong size or not finite;
  // tensors whose values do not match their shape or a bf16 value that is not bf16-exact.
  void add_sequence(const ExternalSequence& s);
  // Encoders for `n` indexer layers of the next sequence of T tokens, at the runtime width (rows checked
  // with the engines' column rule when strict_columns; capture/indexer_sets.h), that write their gaps
  // into the open step's file as they encode them (from any threads; the file's bytes do not depend on
  // them). Hand each back in ExternalIndexer::encoded, finished, to add_sequence, which links them into
  // the sequence; whatever is not handed back is deleted from the file with the encoders. For an
  // importer streaming an engine's buffer: no layer's rows are ever held, encoded or not.
  std::vector<std::shared_ptr<IndexerSetEncoder>> stream_indexer_layers(int64_t T, int n,
                                                                        bool strict_columns);
  // Marks the open step complete (status 1). A step with no sequence is an InputError.
  void end_step();
  // Seals the file and renames NAME.h5.incomplete to NAME.h5. Idempotent.
  void close();

  const std::string& final_path() const;
  int steps_written() const;

  struct Impl;

 private:
  explicit ExternalTraceWriter(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace dsv4
