#include "model/late_reports.h"

#include <fmt/format.h>

#include <stdexcept>
#include <string>

namespace dsv4 {

namespace {

using Part = backend::Backend::AsyncPart;

Part bytes_of(const void* src, int64_t n, size_t elem) {
  Part p;
  p.src = src;
  p.bytes = size_t(std::max<int64_t>(n, 0)) * elem;
  return p;
}

// data() of a late tensor whose values were not asked for.
class NotDownloaded final : public TensorFetch {
 public:
  NotDownloaded(std::string_view name, int layer) : name_(name), layer_(layer) {}
  const void* fetch() override {
    throw std::logic_error(
        fmt::format("data() of {} (layer {}): its values were not downloaded (the observer's wants_values() "
                    "said no when it was reported)",
                    name_, layer_));
  }

 private:
  std::string_view name_;
  int layer_;
};

template <typename T>
const T* part(const backend::Backend::AsyncDownload& c, size_t i) {
  return static_cast<const T*>(c.part(i));
}

}  // namespace

LateReports::LateReports(Download download, Observer& observer, size_t max_bytes)
    : download_(std::move(download)), observer_(observer), max_bytes_(max_bytes) {}

LateReports::~LateReports() = default;

void LateReports::tensor(const TensorRecord& r, const void* data, backend::Buffer<uint64_t> sums) {
  Pending p;
  TensorRecord t = r;
  t.host = nullptr;
  t.fetch = nullptr;
  t.row_digests = nullptr;
  Part digests;
  digests.src = data;
  digests.digests = true;
  digests.dt = t.dtype;
  digests.rows = std::max<int64_t>(t.rows(), 0);
  digests.row_elems = t.row_elems();
  digests.sums = sums.data();
  p.sums = std::move(sums);
  std::vector<Part> parts{digests};
  p.values = observer_.wants_values(t.name, t.layer);
  if (p.values) parts.push_back(bytes_of(data, digests.rows * digests.row_elems, 4));  // f32/bf16/i32: 4 bytes
  p.what = std::move(t);
  push(std::move(p), parts);
}

void LateReports::indexer(const IndexerDecision& d) {
  Pending p;
  p.what = d;
  push(std::move(p), {bytes_of(d.ids, d.T * d.k, 4), bytes_of(d.margin, d.T, 4)});
}

void LateReports::routing(const RoutingDecision& d) {
  Pending p;
  p.what = d;
  push(std::move(p), {bytes_of(d.ids, d.T * d.k, 4), bytes_of(d.weights, d.T * d.k, 4), bytes_of(d.margin, d.T, 4)});
}

void LateReports::mhc(const MhcDecision& d) {
  Pending p;
  p.what = d;
  push(std::move(p), {bytes_of(d.pre, d.T * d.hc, 4), bytes_of(d.post, d.T * d.hc, 4),
                      bytes_of(d.comb, d.T * d.hc * d.hc, 4)});
}

void LateReports::push(Pending p, const std::vector<Part>& parts) {
  p.copies = download_(parts);
  if (!p.copies) throw std::logic_error("LateReports: the backend has no asynchronous downloads");
  in_flight_ += p.copies->bytes();
  pending_.push_back(std::move(p));
  // Hand on what has landed, in order; then wait while too much is in flight.
  while (!pending_.empty() && (pending_.front().copies->ready() || in_flight_ > max_bytes_)) hand_on_first();
}

void LateReports::finish() {
  while (!pending_.empty()) hand_on_first();
}

void LateReports::hand_on_first() {
  Pending& first = pending_.front();
  first.copies->wait();
  hand_on(first);
  in_flight_ -= first.copies->bytes();
  pending_.pop_front();
}

void LateReports::hand_on(Pending& p) {
  const backend::Backend::AsyncDownload& c = *p.copies;
  if (auto* t = std::get_if<TensorRecord>(&p.what)) {
    TensorRecord r = *t;
    r.row_digests = part<uint64_t>(c, 0);
    NotDownloaded missing(r.name, r.layer);
    if (p.values)
      r.host = c.part(1);
    else
      r.fetch = &missing;
    observer_.on_tensor(r);
  } else if (auto* d = std::get_if<IndexerDecision>(&p.what)) {
    IndexerDecision x = *d;
    x.ids = part<int32_t>(c, 0);
    x.margin = part<float>(c, 1);
    observer_.on_indexer(x);
  } else if (auto* d = std::get_if<RoutingDecision>(&p.what)) {
    RoutingDecision x = *d;
    x.ids = part<int32_t>(c, 0);
    x.weights = part<float>(c, 1);
    x.margin = part<float>(c, 2);
    observer_.on_routing(x);
  } else if (auto* d = std::get_if<MhcDecision>(&p.what)) {
    MhcDecision x = *d;
    x.pre = part<float>(c, 0);
    x.post = part<float>(c, 1);
    x.comb = part<float>(c, 2);
    observer_.on_mhc(x);
  }
}

}  // namespace dsv4
