#include "adapters/r3.h"

#include <fmt/core.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <bit>
#include <cstring>

#include "model/error.h"
#include "model/huge_pages.h"

namespace dsv4 {

static_assert(std::endian::native == std::endian::little,
              "the engine buffers are little-endian int32; a big-endian host would need a byte swap");

std::string R3Origin::describe() const {
  return id.empty() ? fmt::format("{}: request #{}", file, index)
                    : fmt::format("{}: request '{}' (#{})", file, id, index);
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
    const int64_t n = int64_t(b.words.size());
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
    const int64_t words = int64_t(b.words.size());
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

// Checks one C4 layer's rows (r < keep) and copies them into `out` at the runtime width; returns the
// first problem, or "". `seen` is scratch of ⌊T/4⌋ + 1 entries (a row's stamp per group, so it needs no
// clearing between rows). One pass over the rows: this is most of an import's work.
std::string check_indexer_layer(const ModelConfig& c, const R3Request& q, int ordinal, const IndexerShape& s,
                                int64_t keep, std::vector<int64_t>& seen, ExternalIndexer& out) {
  const int64_t n = c.num_c4_layers(), W = s.width, runtime = c.indexer_width(int64_t(q.tokens.size()));
  const int64_t width = std::min(W, runtime);
  const int32_t* w = q.indexer_topk.words.data();
  auto row_of = [&](int64_t t) { return w + (t * n + ordinal) * W; };
  const std::string layer = layer_name(c, out.layer);
  // An all-zero layer is the capturer's initial buffer; say so whatever row fails first (row 0 does).
  auto problem = [&](std::string message) {
    for (int64_t t = 0; t < keep; ++t)
      if (!std::all_of(row_of(t), row_of(t) + W, [](int32_t v) { return v == 0; })) return message;
    return fmt::format("{}: every row is all zero: {}", layer, kCapturer);
  };
  out.ids.clear();
  reserve_huge(out.ids, size_t(keep * width));
  int64_t valid = 0;
  for (int64_t t = 0; t < keep; ++t) {
    const int32_t* row = row_of(t);
    const int64_t visible = (t + 1) / 4;  // groups complete once token t is fed
    for (int64_t j = 0; j < W; ++j) {
      const int32_t v = row[j];
      if (v == -1) continue;
      if (v < -1)
        return problem(
            fmt::format("{} row {}: column {} holds {}; ids are compressed-group positions >= 0 or −1 "
                        "(empty)",
                        layer, t, j, v));
      if (j >= runtime)
        return problem(
            fmt::format("{} row {}: column {} holds {}; columns from the runtime width min(index_topk, "
                        "⌊T/4⌋) = {} on must be −1",
                        layer, t, j, v, runtime));
      if (v >= visible)
        return problem(
            fmt::format("{} row {}: position {} is in the future: row {} sees compressed groups [0, {}) "
                        "(⌊(t+1)/4⌋)",
                        layer, t, v, t, visible));
      if (seen[size_t(v)] == t + 1)
        return problem(fmt::format("{} row {}: group {} appears twice; a row must be a set", layer, t, v));
      seen[size_t(v)] = t + 1;
      ++valid;
    }
    out.ids.insert(out.ids.end(), row, row + width);
  }
  // Row 3 is the first to see a compressed group, so a layer with rows from there on must pick some.
  if (valid == 0 && keep >= 4)
    return fmt::format("{} row 3: every row is −1 although rows 3.. see compressed groups: {}", layer,
                       kCapturer);
  out.rows = keep;
  out.width = int(width);
  return "";
}

// The first non-empty message of a per-layer check run on several threads (lowest layer first, so the
// message does not depend on the thread count).
void throw_first(const std::string& prefix, const std::vector<std::string>& errors) {
  for (const auto& e : errors)
    if (!e.empty()) throw InputError(prefix + e);
}

}  // namespace

ExternalSequence r3_import(const ModelConfig& c, R3Request q, const Weights* weights,
                           std::vector<std::string>& notes) {
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
  if (q.routed_experts.present) {
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
    const IndexerShape s = indexer_shape(c, q, routed_rows);
    const std::vector<int32_t>& words = q.indexer_topk.words;
    if (all_equal(words, -1) && keep >= 4)
      throw InputError(
          fmt::format("{}: indexer_topk: every layer, every row is −1 although rows 3.. see compressed "
                      "groups: {}",
                      who, kCapturer));
    std::vector<int> layers;
    for (int l = 0; l < c.num_hidden_layers; ++l)
      if (c.c4_ordinal(l) >= 0) layers.push_back(l);
    const int n = int(layers.size());
    // Checked and copied at the runtime's width (the columns beyond it are checked to be −1 in every row).
    seq.indexer.resize(size_t(n));
    std::vector<std::string> errors(static_cast<size_t>(n));
#pragma omp parallel
    {
      std::vector<int64_t> seen(size_t(T / 4 + 1), 0);
#pragma omp for schedule(dynamic, 1)
      for (int o = 0; o < n; ++o) {
        std::fill(seen.begin(), seen.end(), 0);
        seq.indexer[size_t(o)].layer = layers[size_t(o)];
        errors[size_t(o)] = check_indexer_layer(c, q, o, s, keep, seen, seq.indexer[size_t(o)]);
      }
    }
    throw_first(who + ": indexer_topk ", errors);
    if (s.rows == T)
      notes.push_back(fmt::format("{}: indexer_topk: dropped the stop-edge row {}", who, T - 1));
  }
  return seq;
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
    if (r->k != k || r->T < b.rows)
      throw InputError(fmt::format("{}: {}: routing of {} rows × {} ids, expected at least {} rows × {}",
                                   what, layer_name(c, l), r->T, r->k, b.rows, k));
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
    if (x->T < b.rows)
      throw InputError(fmt::format("{}: {}: indexer rows {} < {}", what, layer_name(c, l), x->T, b.rows));
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
