#include "adapters/r3.h"

#include <fmt/core.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <bit>
#include <cstring>
#include <exception>

#include "adapters/base64.h"
#include "capture/indexer_sets.h"
#include "model/error.h"

#include <omp.h>
#include "model/huge_pages.h"

namespace dsv4 {

static_assert(std::endian::native == std::endian::little,
              "the engine buffers are little-endian int32; a big-endian host would need a byte swap");

std::string R3Origin::describe() const {
  return id.empty() ? fmt::format("{}: request #{}", file, index)
                    : fmt::format("{}: request '{}' (#{})", file, id, index);
}

std::optional<std::string> r3_json_unescape(std::string_view text) {
  if (text.find('\\') == std::string_view::npos) return std::nullopt;
  try {
    std::string quoted;
    quoted.reserve(text.size() + 2);
    quoted.append(1, '"').append(text).append(1, '"');
    return nlohmann::json::parse(quoted).get<std::string>();
  } catch (const nlohmann::json::exception&) {
    return std::nullopt;
  }
}

void r3_check_bytes(size_t bytes, const R3Origin& o, const char* buffer_name) {
  if (bytes % 4 != 0)
    throw InputError(fmt::format("{}: {} holds {} bytes, not a whole number of int32 values (4 bytes each)",
                                 o.describe(), buffer_name, bytes));
}

std::vector<int32_t> r3_words(std::span<const uint8_t> bytes, const R3Origin& o, const char* buffer_name) {
  r3_check_bytes(bytes.size(), o, buffer_name);
  std::vector<int32_t> w(bytes.size() / 4);
  if (!w.empty()) std::memcpy(w.data(), bytes.data(), bytes.size());
  return w;
}

namespace {

constexpr const char* kCapturer =
    "the capturer was bound before it existed (the engine returned its initial buffer, not the decisions)";

// "layer 3 (C4 ordinal 1)": both numbers, since the engine's indexer buffer is indexed by the second.
std::string layer_name(const ModelConfig& c, int layer) {
  const int o = c.c4_ordinal(layer);
  std::string s = o >= 0 ? fmt::format("layer {} (C4 ordinal {})", layer, o) : fmt::format("layer {}", layer);
  if (c.is_hash_layer(layer)) s += " (hash layer)";
  return s;
}

std::string shape_str(const std::vector<int64_t>& s) {
  return fmt::format("[{}]", fmt::join(s, ", "));
}

bool all_equal(std::span<const int32_t> w, int32_t v) {
  return !w.empty() && std::all_of(w.begin(), w.end(), [v](int32_t x) { return x == v; });
}

// The row count of a buffer: T − 1 (the engine's layout) or T (with SGLang's extra stop-edge row).
bool rows_fit(int64_t rows, int64_t T) {
  return rows == T - 1 || rows == T;
}

// ---- routed_experts -------------------------------------------------------------------------------

int64_t routing_rows(const ModelConfig& c, const R3Request& q) {
  const std::string where = q.origin.describe() + ": routed_experts";
  const int64_t T = int64_t(q.tokens.size()), L = c.num_hidden_layers, k = c.num_experts_per_tok;
  const auto& b = q.routed_experts;
  int64_t rows = 0;
  if (!b.shape.empty()) {
    if (b.shape.size() != 3)
      throw InputError(fmt::format("{}: shape {} has {} dimensions, expected 3 [len(tokens) − 1, layers, k]",
                                   where, shape_str(b.shape), b.shape.size()));
    if (b.shape[1] != L)
      throw InputError(
          fmt::format("{}: shape {} holds {} layers, the config has {} (num_hidden_layers; hash layers "
                      "included)",
                      where, shape_str(b.shape), b.shape[1], L));
    if (b.shape[2] != k)
      throw InputError(
          fmt::format("{}: shape {} holds {} ids per row, the config routes to {} (num_experts_per_tok)",
                      where, shape_str(b.shape), b.shape[2], k));
    rows = b.shape[0];
  } else {
    const int64_t n = int64_t(b.size());
    // A buffer of T − 1 rows of k ids but another layer count: say that, not "wrong length".
    if (T > 1 && n % ((T - 1) * k) == 0 && n / ((T - 1) * k) != L)
      throw InputError(
          fmt::format("{}: {} bytes = {} rows (len(tokens) − 1) × {} layers × {} ids; the config has {} "
                      "layers (num_hidden_layers; hash layers included)",
                      where, n * 4, T - 1, n / ((T - 1) * k), k, L));
    if (n % (L * k) != 0)
      throw InputError(fmt::format(
          "{}: {} bytes are not a whole number of rows of {} layers × {} ids × 4 bytes", where, n * 4, L, k));
    rows = n / (L * k);
  }
  if (!rows_fit(rows, T))
    throw InputError(
        fmt::format("{}: {} rows for {} tokens; the layout has len(tokens) − 1 = {} rows (or {} with the "
                    "stop-edge row)",
                    where, rows, T, T - 1, T));
  return rows;
}

// The first problem of one routing layer's rows, or "" (rows r < keep of the buffer [rows, L, k]).
// `table`: the layer's tid2eid [vocab, k] when it is a hash layer and the weights are known.
std::string check_routing_layer(const ModelConfig& c, const R3Request& q, int layer, int64_t keep,
                                const int32_t* table) {
  const int L = c.num_hidden_layers, k = c.num_experts_per_tok, E = c.n_routed_experts;
  const int32_t* w = q.routed_experts.words.data();
  std::vector<int32_t> row(k), want(k);
  for (int64_t r = 0; r < keep; ++r) {
    const int32_t* ids = w + (r * L + layer) * k;
    for (int j = 0; j < k; ++j) {
      if (ids[j] < 0 || ids[j] >= E)
        return fmt::format("{} row {}: expert id {} (slot {}) is outside [0, {}) (n_routed_experts)",
                           layer_name(c, layer), r, ids[j], j, E);
    }
    row.assign(ids, ids + k);
    std::sort(row.begin(), row.end());
    if (auto d = std::adjacent_find(row.begin(), row.end()); d != row.end())
      return fmt::format("{} row {}: expert {} appears twice; a row must be a set of {} distinct experts",
                         layer_name(c, layer), r, *d, k);
    if (table) {
      const int32_t tok = q.tokens[size_t(r)];
      want.assign(table + int64_t(tok) * k, table + int64_t(tok) * k + k);
      std::sort(want.begin(), want.end());
      if (row != want)
        return fmt::format(
            "{} row {}: experts {} disagree with the model's tid2eid[{}] = {} (token {} at position {})",
            layer_name(c, layer), r, fmt::join(row, ","), tok, fmt::join(want, ","), tok, r);
    }
  }
  return "";
}

// ---- indexer_topk -----------------------------------------------------------------------------------

struct IndexerShape {
  int64_t rows = 0;
  int64_t width = 0;
};

IndexerShape indexer_shape(const ModelConfig& c, const R3Request& q, int64_t routing_rows_or_0) {
  const std::string where = q.origin.describe() + ": indexer_topk";
  const int64_t T = int64_t(q.tokens.size()), n = c.num_c4_layers();
  const auto& b = q.indexer_topk;
  auto layer_count_error = [&](int64_t got, const char* field) {
    return InputError(fmt::format(
        "{}: {} is {}, the config has {} C4 layers (the engine packs the indexer by C4 ordinal{})", where,
        field, got, n,
        got == c.num_hidden_layers ? "; this buffer looks indexed by global layer id (MODEL.md §6.6 item 1)"
                                   : ""));
  };
  IndexerShape s;
  if (!b.shape.empty()) {
    if (b.shape.size() != 3)
      throw InputError(
          fmt::format("{}: shape {} has {} dimensions, expected 3 [len(tokens) − 1, C4 layers, width]", where,
                      shape_str(b.shape), b.shape.size()));
    if (b.shape[1] != n) throw layer_count_error(b.shape[1], "its layer dimension");
    s = {b.shape[0], b.shape[2]};
    if (!rows_fit(s.rows, T))
      throw InputError(
          fmt::format("{}: {} rows for {} tokens; the layout has len(tokens) − 1 = {} rows (or {} with "
                      "the stop-edge row)",
                      where, s.rows, T, T - 1, T));
  } else {
    if (q.indexer_num_layers >= 0 && q.indexer_num_layers != n)
      throw layer_count_error(q.indexer_num_layers, "indexer_topk_num_layers");
    if (n == 0) throw InputError(fmt::format("{}: the config has no C4 layers, so no indexer", where));
    const int64_t words = int64_t(b.size());
    // The width is recovered from the length; the row count is T − 1, or T with the stop-edge row. When
    // both divide, the routing buffer's row count (or else T − 1) decides.
    std::vector<int64_t> candidates;
    if (routing_rows_or_0 > 0) candidates.push_back(routing_rows_or_0);
    for (int64_t r : {T - 1, T})
      if (r > 0 && std::find(candidates.begin(), candidates.end(), r) == candidates.end())
        candidates.push_back(r);
    bool found = false;
    for (int64_t r : candidates) {
      if (words % (r * n) == 0 && words / (r * n) > 0) {
        s = {r, words / (r * n)};
        found = true;
        break;
      }
    }
    if (!found)
      throw InputError(
          fmt::format("{}: {} bytes are not a whole number of rows of {} C4 layers × width × 4 bytes for "
                      "len(tokens) − 1 = {} rows (or {} with the stop-edge row)",
                      where, words * 4, n, T - 1, T));
  }
  const int64_t runtime = c.indexer_width(T);
  if (s.width != c.index_topk && s.width != runtime)
    throw InputError(
        fmt::format("{}: width {} is neither index_topk ({}, what the engine writes) nor the runtime "
                    "width min(index_topk, ⌊T/4⌋) = {} for T = {}",
                    where, s.width, c.index_topk, runtime, T));
  return s;
}

// Words [w0, w0 + n) of a buffer into `out`: copied, or decoded from its base64 text; false when that
// text holds a character outside the alphabet there.
bool read_words(const R3Buffer& b, size_t w0, size_t n, int32_t* out) {
  if (n == 0) return true;  // (out may be null: an empty vector's data())
  if (b.base64.empty()) {
    std::memcpy(out, b.words.data() + w0, n * 4);
    return true;
  }
  return base64_decode_range(b.base64, w0 * 4, n * 4, reinterpret_cast<uint8_t*>(out));
}

// A buffer still in base64 decoded whole (the routing buffer, small; or an indexer buffer whose text
// the row-at-a-time decoder refused, so that the full decoder names the character or accepts it).
void decode_whole(R3Buffer& b, const R3Origin& o, const char* name) {
  if (b.base64.empty()) return;
  std::string error;
  std::vector<int32_t> w;
  const std::optional<std::string> unescaped = r3_json_unescape(b.base64);
  const std::string_view text = unescaped ? std::string_view(*unescaped) : b.base64;
  const size_t bytes = base64_decoded_size(text, error);
  if (error.empty()) {
    r3_check_bytes(bytes, o, name);
    reserve_huge(w, bytes / 4 + 2);
    w.resize(bytes / 4 + 2);
    base64_decode_into(text, reinterpret_cast<uint8_t*>(w.data()), error);
  }
  if (!error.empty()) throw InputError(fmt::format("{}: {}: {}", o.describe(), name, error));
  w.resize(bytes / 4);
  b.words = std::move(w);
  b.base64 = {};
  b.base64_words = 0;
}

// What one C4 layer's pass found: its first problem ("" when none), whether every row read was −1
// throughout, whether its rows' base64 text held a character outside the alphabet.
struct LayerResult {
  std::string error;
  bool empty = false, bad_text = false;
};

// The message for a fault of the layer at `ordinal` (row t), or for the capturer's all-zero buffer.
std::string indexer_fault(const ModelConfig& c, const R3Request& q, int ordinal, const IndexerShape& s,
                          int64_t keep, int layer_id, int64_t t, const IndexerRowFault& f, bool& bad_text) {
  const int64_t n = c.num_c4_layers(), W = s.width, T = int64_t(q.tokens.size());
  const int runtime = c.indexer_width(T);
  const std::string layer = layer_name(c, layer_id);
  std::string message;
  switch (f.kind) {
    case IndexerRowFault::none:
      return "";
    case IndexerRowFault::negative:
      message =
          fmt::format("{} row {}: column {} holds {}; ids are compressed-group positions >= 0 or −1 (empty)",
                      layer, t, f.slot, f.id);
      break;
    case IndexerRowFault::beyond_width:
    case IndexerRowFault::too_many:  // only past the width, which beyond_width reports first
      message = fmt::format(
          "{} row {}: column {} holds {}; columns from the runtime width min(index_topk, ⌊T/4⌋) = {} on must "
          "be −1",
          layer, t, f.slot, f.id, runtime);
      break;
    case IndexerRowFault::future:
      message = fmt::format(
          "{} row {}: position {} is in the future: row {} sees compressed groups [0, {}) (⌊(t+1)/4⌋)", layer,
          t, f.id, t, (t + 1) / 4);
      break;
    case IndexerRowFault::duplicate:
      message = fmt::format("{} row {}: group {} appears twice; a row must be a set", layer, t, f.id);
      break;
  }
  // An all-zero layer is the capturer's initial buffer; say so whatever row fails first (row 0 does).
  std::vector<int32_t> row(static_cast<size_t>(W));
  for (int64_t r = 0; r < keep; ++r) {
    if (!read_words(q.indexer_topk, size_t((r * n + ordinal) * W), size_t(W), row.data())) {
      bad_text = true;
      return "";
    }
    if (!std::all_of(row.begin(), row.end(), [](int32_t v) { return v == 0; })) return message;
  }
  return fmt::format("{}: every row is all zero: {}", layer, kCapturer);
}

// The C4 layers [o0, o1) of the engine's [rows, n, width] buffer, read a row at a time (the layers'
// columns of a row are contiguous), checked and encoded at the runtime width by enc[o] (capture/
// indexer_sets.h, whose rules name the faults). A layer stops at its first fault; the others go on.
void check_indexer_layers(const ModelConfig& c, const R3Request& q, int o0, int o1, const IndexerShape& s,
                          int64_t keep, const std::vector<int>& layer_ids,
                          const std::vector<std::shared_ptr<IndexerSetEncoder>>& enc,
                          std::vector<LayerResult>& result) {
  const int64_t n = c.num_c4_layers(), W = s.width;
  const int64_t span = int64_t(o1 - o0) * W;
  std::vector<int32_t> rows(static_cast<size_t>(span));
  std::vector<char> stopped(static_cast<size_t>(o1 - o0), 0);
  for (int64_t t = 0; t < keep; ++t) {
    if (!read_words(q.indexer_topk, size_t((t * n + o0) * W), size_t(span), rows.data())) {
      for (int o = o0; o < o1; ++o) result[size_t(o)].bad_text = true;
      return;
    }
    for (int o = o0; o < o1; ++o) {
      if (stopped[size_t(o - o0)]) continue;
      const IndexerRowFault f = enc[size_t(o)]->add_row(rows.data() + (o - o0) * W, int(W));
      if (!f) continue;
      stopped[size_t(o - o0)] = 1;
      LayerResult& r = result[size_t(o)];
      r.error = indexer_fault(c, q, o, s, keep, layer_ids[size_t(o)], t, f, r.bad_text);
    }
  }
  for (int o = o0; o < o1; ++o) {
    if (stopped[size_t(o - o0)]) continue;
    IndexerSetEncoder& e = *enc[size_t(o)];
    e.finish();
    LayerResult& r = result[size_t(o)];
    r.empty = e.valid() == 0;
    // Row 3 is the first to see a compressed group, so a layer with rows from there on must pick some.
    if (r.empty && keep >= 4)
      r.error = fmt::format("{} row 3: every row is −1 although rows 3.. see compressed groups: {}",
                            layer_name(c, layer_ids[size_t(o)]), kCapturer);
  }
}

// The first non-empty message of a per-layer check run on several threads (lowest layer first, so the
// message does not depend on the thread count).
void throw_first(const std::string& prefix, const std::vector<std::string>& errors) {
  for (const auto& e : errors)
    if (!e.empty()) throw InputError(prefix + e);
}

}  // namespace

ExternalSequence r3_import(const ModelConfig& c, R3Request q, const Weights* weights,
                           std::vector<std::string>& notes, const IndexerEncoders& encoders) {
  const std::string who = q.origin.describe();
  const int64_t T = int64_t(q.tokens.size());
  if (T == 0) throw InputError(fmt::format("{}: no tokens", who));
  for (int64_t t = 0; t < T; ++t)
    if (q.tokens[size_t(t)] < 0 || q.tokens[size_t(t)] >= c.vocab_size)
      throw InputError(fmt::format("{}: token {} at position {} is outside the vocabulary [0, {})", who,
                                   q.tokens[size_t(t)], t, c.vocab_size));
  const int64_t keep = T - 1;

  ExternalSequence seq;
  seq.id = q.origin.id;
  seq.tokens = q.tokens;
  seq.prompt_length = q.prompt_length;
  seq.logprobs = std::move(q.logprobs);

  int64_t routed_rows = 0;
  if (q.routed_experts.present && q.routed_experts_start > 0)
    throw InputError(fmt::format(
        "{}: routed_experts starts at row {} (routed_experts_start_len): an incremental buffer, whose "
        "rows [0, {}) are an earlier turn's; import the conversation's turns together, in order",
        who, q.routed_experts_start, q.routed_experts_start));
  if (q.routed_experts.present) {
    decode_whole(q.routed_experts, q.origin, "routed_experts");  // small: read whole
    routed_rows = routing_rows(c, q);
    const int L = c.num_hidden_layers, k = c.num_experts_per_tok;
    const std::vector<int32_t>& words = q.routed_experts.words;
    if (all_equal(words, 0))
      throw InputError(
          fmt::format("{}: routed_experts: every layer, every row is expert 0: {}", who, kCapturer));
    if (all_equal(words, -1))
      throw InputError(fmt::format("{}: routed_experts: every layer, every row is −1: {}", who, kCapturer));
    // The tables are looked up here: a missing one throws, which must not happen inside the parallel loop.
    std::vector<const int32_t*> tables(size_t(L), nullptr);
    for (int l = 0; l < L && weights; ++l)
      if (c.is_hash_layer(l)) tables[size_t(l)] = weights->layer_i(l, "mlp.topk.tid2eid");
    std::vector<std::string> errors(static_cast<size_t>(L));
#pragma omp parallel for schedule(dynamic, 1)
    for (int l = 0; l < L; ++l) errors[size_t(l)] = check_routing_layer(c, q, l, keep, tables[size_t(l)]);
    throw_first(who + ": routed_experts ", errors);
    if (routed_rows == T)
      notes.push_back(fmt::format("{}: routed_experts: dropped the stop-edge row {}", who, T - 1));
    seq.routing.resize(size_t(L));
#pragma omp parallel for schedule(static)
    for (int l = 0; l < L; ++l) {
      ExternalRouting& r = seq.routing[size_t(l)];
      r.layer = l;
      r.rows = keep;
      r.k = k;
      r.ids.resize(size_t(keep * k));
      for (int64_t t = 0; t < keep; ++t)
        std::memcpy(&r.ids[size_t(t * k)], &words[size_t((t * L + l) * k)], size_t(k) * 4);
    }
  }

  if (q.indexer_topk.present) {
    // Text with JSON escapes has another length than its words: when the shape does not fit, it is
    // read through its escapes (if it has any) and the shape taken again.
    const IndexerShape s = [&] {
      try {
        return indexer_shape(c, q, routed_rows);
      } catch (const InputError&) {
        if (q.indexer_topk.base64.empty() || !r3_json_unescape(q.indexer_topk.base64)) throw;
      }
      decode_whole(q.indexer_topk, q.origin, "indexer_topk");
      return indexer_shape(c, q, routed_rows);
    }();
    std::vector<int> layers;
    for (int l = 0; l < c.num_hidden_layers; ++l)
      if (c.c4_ordinal(l) >= 0) layers.push_back(l);
    const int n = int(layers.size());
    // Each layer is read out of the engine's [rows, n, width] buffer a row at a time, checked and
    // encoded (the columns beyond the runtime width checked to be −1 in every row); never held whole.
    // The layers are split into one contiguous group per thread, each read row by row; a layer's rows
    // go through its encoder in order, so nothing depends on the thread count.
    std::vector<LayerResult> results;
    auto check_layers = [&] {
      std::vector<std::shared_ptr<IndexerSetEncoder>> enc;
      if (encoders) {
        enc = encoders(T, n);
        if (int(enc.size()) != n)
          throw Error("r3_import: the encoder factory made the wrong number of encoders");
      } else {
        for (int o = 0; o < n; ++o)
          enc.push_back(std::make_shared<IndexerSetEncoder>(T, c.indexer_width(T), true));
      }
      results.assign(size_t(n), LayerResult{});
      const int groups = std::max(1, std::min(n, omp_get_max_threads()));
      std::vector<std::exception_ptr> failed(static_cast<size_t>(groups));
#pragma omp parallel for schedule(static, 1) num_threads(groups)
      for (int g = 0; g < groups; ++g) {
        try {
          check_indexer_layers(c, q, n * g / groups, n * (g + 1) / groups, s, keep, layers, enc, results);
        } catch (...) {  // the file's errors (a disk full), raised after the loop
          failed[size_t(g)] = std::current_exception();
        }
      }
      for (const auto& f : failed)
        if (f) std::rethrow_exception(f);
      for (int o = 0; o < n; ++o) {
        ExternalIndexer& x = seq.indexer[size_t(o)];
        x = ExternalIndexer{};
        x.layer = layers[size_t(o)];
        x.rows = keep;
        x.width = c.indexer_width(T);
        x.encoded = enc[size_t(o)];
      }
      return std::none_of(results.begin(), results.end(), [](const LayerResult& r) { return r.bad_text; });
    };
    seq.indexer.resize(size_t(n));
    if (!check_layers()) {
      // A character outside the alphabet: the full decoder names it, or accepts what the row decoder
      // does not (EVP's leniency), and the layers are read again from the decoded words.
      decode_whole(q.indexer_topk, q.origin, "indexer_topk");
      check_layers();
    }
    // The rows past keep (the stop-edge row) are not imported, but their text must be base64 too, and
    // they count for "every row is −1".
    bool tail_empty = true;
    {
      const size_t from = size_t(keep * n * s.width), words = size_t(s.rows - keep) * size_t(n * s.width);
      std::vector<int32_t> tail(words);
      if (!read_words(q.indexer_topk, from, words, tail.data())) {
        decode_whole(q.indexer_topk, q.origin, "indexer_topk");
        read_words(q.indexer_topk, from, words, tail.data());
      }
      tail_empty = std::all_of(tail.begin(), tail.end(), [](int32_t v) { return v == -1; });
    }
    if (keep >= 4 && tail_empty &&
        std::all_of(results.begin(), results.end(), [](const LayerResult& r) { return r.empty; }))
      throw InputError(
          fmt::format("{}: indexer_topk: every layer, every row is −1 although rows 3.. see compressed "
                      "groups: {}",
                      who, kCapturer));
    for (const LayerResult& r : results)  // the lowest layer's first, whatever the threads did
      if (!r.error.empty()) throw InputError(who + ": indexer_topk " + r.error);
    if (s.rows == T)
      notes.push_back(fmt::format("{}: indexer_topk: dropped the stop-edge row {}", who, T - 1));
  }
  return seq;
}

// ---- incremental routing buffers ----------------------------------------------------------------------

void R3RoutingPrefixes::complete(const ModelConfig& c, R3Request& q, std::vector<std::string>& notes) const {
  const int64_t s = q.routed_experts_start;
  if (!q.routed_experts.present || s == 0) return;
  const std::string who = q.origin.describe();
  const int64_t T = int64_t(q.tokens.size()), L = c.num_hidden_layers, k = c.num_experts_per_tok;
  if (s < 0 || s > T - 1)
    throw InputError(fmt::format("{}: routed_experts_start_len {} is outside [0, {}] (len(tokens) − 1)", who,
                                 s, T - 1));
  decode_whole(q.routed_experts, q.origin, "routed_experts");
  R3Buffer& b = q.routed_experts;
  const int64_t n = int64_t(b.words.size());
  if (n % (L * k) != 0)
    throw InputError(fmt::format(
        "{}: routed_experts: {} bytes are not a whole number of rows of {} layers × {} ids × 4 bytes", who,
        n * 4, L, k));
  const int64_t rows = n / (L * k);
  if (rows != T - 1 - s && rows != T - s)
    throw InputError(fmt::format(
        "{}: routed_experts: {} rows from routed_experts_start_len {} for {} tokens; the buffer covers rows "
        "[{}, len(tokens) − 1) = {} rows (or {} with the stop-edge row)",
        who, rows, s, T, s, T - 1 - s, T - s));
  // The latest kept request holding rows [0, s) of the same first s tokens.
  const Kept* from = nullptr;
  for (auto it = kept_.rbegin(); it != kept_.rend() && !from; ++it)
    if (int64_t(it->tokens.size()) - 1 >= s && std::equal(q.tokens.begin(), q.tokens.begin() + s, it->tokens.begin()))
      from = &*it;
  if (!from)
    throw InputError(fmt::format(
        "{}: routed_experts starts at row {} (routed_experts_start_len), and no request imported before it "
        "holds rows [0, {}) for the same first {} tokens{}: import the conversation's earlier turns in the "
        "same command, before this one",
        who, s, s, s,
        dropped_ > 0 ? fmt::format(" ({} earlier requests were not kept: past the {} MiB kept for this; "
                                   "raise --prefix-memory)",
                                   dropped_, budget_ >> 20)
                     : std::string()));
  std::vector<int32_t> words;
  reserve_huge(words, size_t((s + rows) * L * k));
  words.assign(from->words.begin(), from->words.begin() + s * L * k);
  words.insert(words.end(), b.words.begin(), b.words.end());
  b.words = std::move(words);
  if (!b.shape.empty()) b.shape[0] += s;
  q.routed_experts_start = 0;
  notes.push_back(fmt::format("{}: routed_experts rows [0, {}) (routed_experts_start_len) from {}", who, s,
                              from->who));
}

void R3RoutingPrefixes::keep(const ModelConfig& c, const ExternalSequence& seq, std::string who) {
  if (seq.routing.empty() || seq.tokens.size() < 2) return;
  const int64_t rows = int64_t(seq.tokens.size()) - 1, L = c.num_hidden_layers, k = c.num_experts_per_tok;
  const int64_t size = (rows * L * k + int64_t(seq.tokens.size())) * 4;
  if (size > budget_) {
    ++dropped_;
    return;
  }
  Kept e{std::move(who), seq.tokens, std::vector<int32_t>(size_t(rows * L * k))};
  for (const ExternalRouting& r : seq.routing)
    for (int64_t t = 0; t < rows; ++t)
      std::memcpy(&e.words[size_t((t * L + r.layer) * k)], &r.ids[size_t(t * k)], size_t(k) * 4);
  kept_.push_back(std::move(e));
  bytes_ += size;
  size_t drop = 0;
  while (bytes_ > budget_) {
    const Kept& old = kept_[drop++];
    bytes_ -= (int64_t(old.words.size()) + int64_t(old.tokens.size())) * 4;
    ++dropped_;
  }
  kept_.erase(kept_.begin(), kept_.begin() + int64_t(drop));
}

int64_t r3_incremental_start(const std::vector<std::vector<int32_t>>& earlier, const std::vector<int32_t>& tokens,
                             int64_t prompt_length) {
  const int64_t T = int64_t(tokens.size());
  const int64_t cap = std::min(prompt_length < 0 ? T : prompt_length, T - 1);
  int64_t best = 0;
  for (const auto& e : earlier) {
    const int64_t most = std::min<int64_t>(cap, int64_t(e.size()) - 1);
    int64_t lcp = 0;
    while (lcp < most && e[size_t(lcp)] == tokens[size_t(lcp)]) ++lcp;
    best = std::max(best, lcp);
  }
  return best;
}

R3EngineBuffers r3_export(const ModelConfig& c, int64_t T, const RoutingSource& routing,
                          const IndexerSource& indexer, const std::string& what) {
  if (T < 1) throw InputError(fmt::format("{}: no tokens", what));
  R3EngineBuffers b;
  b.rows = T - 1;
  const int L = c.num_hidden_layers, k = c.num_experts_per_tok, K = c.index_topk;

  // Every layer or none: a partial buffer would shift the layers after a gap.
  auto require_all = [&](const char* buffer, int present_layer, int missing_layer) {
    throw InputError(
        fmt::format("{}: {} holds every layer or none, but {} has decisions and layer {} has none", what,
                    buffer, layer_name(c, present_layer), missing_layer));
  };

  int first_present = -1, first_missing = -1;
  for (int l = 0; l < L; ++l) {
    std::optional<RoutingRecord> r = routing(l);
    if (!r) {
      if (first_missing < 0) first_missing = l;
      if (first_present >= 0) require_all("routed_experts", first_present, l);
      continue;
    }
    if (first_missing >= 0) require_all("routed_experts", l, first_missing);
    if (first_present < 0) {
      first_present = l;
      b.num_layers = L;
      b.k = k;
      b.routed_experts.assign(size_t(b.rows * L * k), -1);
    }
    if (r->k != k || r->T < b.rows || int64_t(r->ids.size()) != r->T * r->k)
      throw InputError(
          fmt::format("{}: {}: routing of {} ids as {} rows × {}, expected at least {} rows × {}", what,
                      layer_name(c, l), r->ids.size(), r->T, r->k, b.rows, k));
    for (int64_t t = 0; t < b.rows; ++t) {
      int32_t* dst = &b.routed_experts[size_t((t * L + l) * k)];
      std::memcpy(dst, &r->ids[size_t(t * k)], size_t(k) * 4);
      std::sort(dst, dst + k);
    }
  }

  std::vector<int> c4;
  for (int l = 0; l < L; ++l)
    if (c.c4_ordinal(l) >= 0) c4.push_back(l);
  const int n = int(c4.size());
  first_present = first_missing = -1;
  for (int o = 0; o < n; ++o) {
    const int l = c4[size_t(o)];
    std::optional<IndexerRecord> x = indexer(l);
    if (!x) {
      if (first_missing < 0) first_missing = l;
      if (first_present >= 0) require_all("indexer_topk", first_present, l);
      continue;
    }
    if (first_missing >= 0) require_all("indexer_topk", l, first_missing);
    if (first_present < 0) {
      first_present = l;
      b.indexer_num_layers = n;
      b.width = K;
      b.indexer_topk.assign(size_t(b.rows * n * K), -1);
    }
    if (x->T < b.rows || x->k < 0 || int64_t(x->ids.size()) != x->T * x->k)
      throw InputError(fmt::format("{}: {}: indexer of {} ids as {} rows × {}, expected at least {} rows",
                                   what, layer_name(c, l), x->ids.size(), x->T, x->k, b.rows));
    for (int64_t t = 0; t < b.rows; ++t) {
      int32_t* dst = &b.indexer_topk[size_t((t * n + o) * K)];
      int m = 0;
      for (int j = 0; j < x->k; ++j) {
        const int32_t v = x->ids[size_t(t * x->k + j)];
        if (v < 0) continue;
        if (m == K)
          throw InputError(
              fmt::format("{}: {} row {}: more than index_topk = {} groups", what, layer_name(c, l), t, K));
        dst[m++] = v;
      }
      std::sort(dst, dst + m);
    }
  }
  return b;
}

}  // namespace dsv4
