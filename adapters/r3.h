// The R3 layouts of the rollout engines (MODEL.md §6.2), written once: SGLang's meta_info buffers and
// miles' per-sample arrays hold the same two int32 tensors of one request,
//
//   routed_experts  [rows, num_hidden_layers, num_experts_per_tok]   every decoder layer, hash layers
//                                                                    included (their tid2eid ids)
//   indexer_topk    [rows, n_C4_layers, width]                       slot = the layer's C4 ordinal
//                                                                    (ModelConfig::c4_ordinal), values
//                                                                    0-based compressed-group positions
//                                                                    of the request, −1 for empty slots
//
// with rows = len(tokens) − 1 (the last token was never fed) and width = index_topk as the engine
// writes it. r3_import turns them into an ExternalSequence for ExternalTraceWriter after checking the
// pitfalls of MODEL.md §6.6; r3_export turns a trace's decisions back into the same bytes.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "capture/external.h"
#include "capture/indexer_sets.h"
#include "model/collect.h"
#include "model/config.h"
#include "model/weights.h"

namespace dsv4 {

// Where a request came from, for messages: "FILE: request 'ID' (#N)" or "FILE: request #N".
struct R3Origin {
  std::string file;
  std::string id;     // the engine's request id, "" when it has none
  int64_t index = 0;  // position of the request in its file (0-based)
  std::string describe() const;
};

// One engine buffer: flat int32 words, and the shape when the container states one (a .npy array);
// an empty shape means "recover it from the length" (SGLang's base64 strings). The words are either
// decoded (`words`) or still the base64 text they came in (`base64`, a view into the response's text,
// valid while that text is; `base64_words` of them): r3_import then decodes them a row at a time, so
// that a 1.4 GB buffer is never held decoded.
struct R3Buffer {
  bool present = false;  // the engine reported this buffer
  std::vector<int32_t> words;
  std::vector<int64_t> shape;
  std::string_view base64;
  size_t base64_words = 0;
  size_t size() const { return base64.empty() ? words.size() : base64_words; }
};

// A request as the engine reported it. indexer_num_layers is SGLang's indexer_topk_num_layers (−1 when
// the container gives a shape instead).
struct R3Request {
  R3Origin origin;
  std::vector<int32_t> tokens;  // prompt + response, as fed
  int64_t prompt_length = -1;   // −1: unknown
  std::vector<float> logprobs;  // empty or T − 1 (ExternalSequence's rule)
  R3Buffer routed_experts;
  // SGLang's routed_experts_start_len: routed_experts holds rows [start, len(tokens) − 1) only (an
  // incremental buffer; R3RoutingPrefixes::complete adds rows [0, start)). 0: the whole buffer.
  int64_t routed_experts_start = 0;
  R3Buffer indexer_topk;
  int indexer_num_layers = -1;
};

// A buffer's base64 text as it stood inside a JSON string (a lifted SGLang field, read without parsing
// its string): when it holds escapes ("\/" is legal JSON for '/'), the text they stand for; nullopt
// when it holds none (or does not unescape).
std::optional<std::string> r3_json_unescape(std::string_view text);

// The engine buffers are little-endian int32: base64-decoded bytes become words here, and a length that
// is not a multiple of 4 bytes is an InputError naming the origin and the buffer.
std::vector<int32_t> r3_words(std::span<const uint8_t> bytes, const R3Origin& o, const char* buffer_name);
// The same rule for a length alone (for callers that decode into int32 storage directly).
void r3_check_bytes(size_t bytes, const R3Origin& o, const char* buffer_name);

// Checks a request against the config and returns its ExternalSequence (routing of every layer when
// routed_experts is present, indexer top-k of every C4 layer, mapped from C4 ordinals to layer ids, at
// the runtime's width min(index_topk, ⌊T/4⌋), T − 1 rows). `weights` (optional) supplies the hash
// layers' tid2eid tables. Throws InputError naming the origin, the buffer, the layer (global id and C4
// ordinal) and the row for: a byte length that does not fit the layout, rows other than T − 1 (or T:
// the stop-edge row, which is dropped with a note), a layer count or width that does not match the
// config, an all-zero or all −1 buffer, ids out of range, duplicate ids in a row, indexer positions the
// row cannot see yet (≥ ⌊(t+1)/4⌋), valid ids in the columns beyond the runtime width, hash-layer ids
// that disagree with tid2eid. Things worth telling the user that are not errors are appended to notes.
//
// The indexer layers are read out of the engine's buffer a row at a time and handed over encoded
// (ExternalIndexer::encoded). `encoders` makes the encoders of the n C4 layers of a sequence of T tokens:
// ExternalTraceWriter::stream_indexer_layers, so that the rows go into the trace as they are checked;
// without it they are held encoded in memory.
using IndexerEncoders = std::function<std::vector<std::shared_ptr<IndexerSetEncoder>>(int64_t T, int n)>;
ExternalSequence r3_import(const ModelConfig& c, R3Request req, const Weights* weights,
                           std::vector<std::string>& notes, const IndexerEncoders& encoders = nullptr);

// Incremental routing buffers (SGLang's routed_experts_start_len, docs/ADAPTERS.md): a turn of a
// conversation sent with routed_experts_start_len = s gets rows [s, len(tokens) − 1) only; rows [0, s)
// are an earlier turn's, since row t depends on tokens [0, t] alone. The prefixes object keeps the
// routing of the requests imported so far (oldest dropped first past a byte budget) and completes an
// incremental buffer from the latest kept request whose first s tokens are the request's.
class R3RoutingPrefixes {
 public:
  static constexpr int64_t kDefaultBudgetBytes = int64_t(1) << 30;
  explicit R3RoutingPrefixes(int64_t budget_bytes = kDefaultBudgetBytes) : budget_(budget_bytes) {}

  // When q.routed_experts_start > 0: prepends rows [0, start) and sets the start to 0, with a note
  // naming the request they came from. InputError naming the request when the buffer's rows do not fit
  // the start (len(tokens) − 1 − start, or one more with the stop-edge row) or no kept request has the
  // rows.
  void complete(const ModelConfig& c, R3Request& q, std::vector<std::string>& notes) const;
  // Keeps an imported sequence's routing (nothing when it has none). `who`: R3Origin::describe().
  void keep(const ModelConfig& c, const ExternalSequence& seq, std::string who);

  int64_t bytes() const { return bytes_; }
  int64_t dropped() const { return dropped_; }

 private:
  struct Kept {
    std::string who;
    std::vector<int32_t> tokens;
    std::vector<int32_t> words;  // [len(tokens) − 1, num_hidden_layers, k], the engine's layout
  };
  std::vector<Kept> kept_;  // oldest first
  int64_t budget_;
  int64_t bytes_ = 0;
  int64_t dropped_ = 0;  // requests dropped for the budget
};

// The routed_experts_start_len an incremental export gives sequence `tokens` (prompt of
// `prompt_length` tokens, −1: unknown) after `earlier` sequences: the most rows [0, s) any earlier
// sequence holds for the same first s tokens (s ≤ its len − 1), at most the prompt length (SGLang
// refuses a start past the prompt) and len(tokens) − 1.
int64_t r3_incremental_start(const std::vector<std::vector<int32_t>>& earlier, const std::vector<int32_t>& tokens,
                             int64_t prompt_length);

// The engine buffers of one sequence, built from decisions (for export).
struct R3EngineBuffers {
  int64_t rows = 0;                       // T − 1
  int num_layers = 0, k = 0;              // routed_experts [rows, num_layers, k]
  std::vector<int32_t> routed_experts;    // empty when the trace holds no routing
  int indexer_num_layers = 0, width = 0;  // indexer_topk [rows, indexer_num_layers, width]
  std::vector<int32_t> indexer_topk;      // empty when the trace holds no indexer decisions
};

// Reads one layer's decisions (nullopt: the trace has none for that layer).
using RoutingSource = std::function<std::optional<RoutingRecord>(int layer)>;
using IndexerSource = std::function<std::optional<IndexerRecord>(int layer)>;

// The engine layout of a sequence of T tokens: T − 1 rows, ids ascending inside a row, indexer rows −1
// padded to index_topk columns. Routing must be there for every layer or none, the indexer for every
// C4 layer or none (the engine reports whole buffers); `what` names the sequence in errors.
R3EngineBuffers r3_export(const ModelConfig& c, int64_t T, const RoutingSource& routing,
                          const IndexerSource& indexer, const std::string& what);

}  // namespace dsv4
