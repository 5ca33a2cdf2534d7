// The Observer seam: the model reports every named tensor and every decision through it. Capture,
// tests and replay verification are all Observers. Names are stable (`attn.q`, `moe.out`, ...) and,
// with the layer, the key that aligns two traces.
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

namespace dsv4 {

enum class DType { f32, bf16, i32 };
const char* to_string(DType t);

// Fetches the host copy of a tensor that lives in device memory (downloaded on the first call, kept
// for the rest of the report).
class TensorFetch {
 public:
  virtual ~TensorFetch() = default;
  virtual const void* fetch() = 0;
};

// A tensor as the model computed it. Row-major; shape[0] is the token (or compressed-group) axis, so
// a row is what a per-token digest covers. bf16 tensors hold bf16-exact values in fp32 storage.
//
// On the CPU the values are in host memory already. With a device backend the values stay on the
// device until an observer asks for them with data(), and `row_digests` carries the per-row XXH3-64
// digests the backend computed in place (the same values capture/digest.h computes on the host), so
// observers that only need digests move 8 bytes per row across the bus.
struct TensorRecord {
  int seq = 0;     // sequence index within the batch
  int layer = -1;  // -1: model-level (embedding, head)
  // Index of row 0 within the sequence: 0 for a whole-sequence forward; a decoding engine's chunk
  // reports its rows from its first position (token tensors) or first new group (attn.compressed_kv,
  // indexer.k) on.
  int64_t pos0 = 0;
  std::string_view name;
  DType dtype = DType::f32;
  std::vector<int64_t> shape;
  const void* host = nullptr;             // host values, or null while they are on a device (see fetch)
  TensorFetch* fetch = nullptr;           // downloads the values when host is null
  const uint64_t* row_digests = nullptr;  // rows() digests computed by the backend, or null

  // The host values (float* for f32/bf16, int32_t* for i32), downloaded on first use if needed.
  const void* data() const { return host ? host : fetch ? fetch->fetch() : nullptr; }
  int64_t rows() const { return shape.empty() ? 1 : shape[0]; }
  int64_t row_elems() const {
    int64_t n = 1;
    for (size_t i = 1; i < shape.size(); ++i) n *= shape[i];
    return n;
  }
};

// Lightning-indexer top-k of one C4 layer: ids [T, k] ascending with -1 for empty slots, margin [T]
// = score(k-th chosen) - score(best unchosen) (+inf when nothing was left out).
struct IndexerDecision {
  int seq = 0, layer = 0;
  int64_t pos0 = 0;  // position of row 0 (see TensorRecord::pos0)
  int64_t T = 0;
  int k = 0;
  bool forced = false;
  const int32_t* ids = nullptr;
  const float* margin = nullptr;
};

// MoE routing of one layer: ids [T, k] ascending, weights [T, k] (after normalisation and scaling),
// margin [T] on the biased selection score (+inf for hash layers).
struct RoutingDecision {
  int seq = 0, layer = 0;
  int64_t pos0 = 0;
  int64_t T = 0;
  int k = 0;
  bool hashed = false;
  bool forced = false;
  const int32_t* ids = nullptr;
  const float* weights = nullptr;
  const float* margin = nullptr;
};

enum class Sublayer { attn, ffn };
const char* to_string(Sublayer s);

// mHC mixing of one sublayer: pre [T, hc], post [T, hc], comb [T, hc, hc] (comb[j][k], j source).
struct MhcDecision {
  int seq = 0, layer = 0;
  int64_t pos0 = 0;
  Sublayer sublayer = Sublayer::attn;
  int64_t T = 0;
  int hc = 0;
  const float* pre = nullptr;
  const float* post = nullptr;
  const float* comb = nullptr;
};

class Observer {
 public:
  virtual ~Observer() = default;
  // Called in execution order. The record and its data are only valid during the call; call
  // TensorRecord::data() only when the values are needed (it may download them).
  virtual void on_tensor(const TensorRecord&) {}
  virtual void on_indexer(const IndexerDecision&) {}
  virtual void on_routing(const RoutingDecision&) {}
  virtual void on_mhc(const MhcDecision&) {}
  // Lets the model skip building a tensor's record when nobody wants it (digests still want all).
  virtual bool wants_tensors() const { return true; }
  // Whether reports may reach this observer late: still in execution order and all of them before the
  // forward returns, but after the model has gone on. A device backend then downloads them without
  // waiting (model/device.h download_async), so recording costs the compute stream nothing but the
  // snapshot copies: the digest kernels run on a stream of their own. A late TensorRecord carries its row
  // digests, and its values only when wants_values() said so when it was made (data() of any other throws
  // std::logic_error).
  virtual bool deferrable() const { return false; }
  virtual bool wants_values(std::string_view name, int layer) const {
    (void)name, (void)layer;
    return true;
  }
};

}  // namespace dsv4
