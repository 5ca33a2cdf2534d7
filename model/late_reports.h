// Reports on their way from a device backend to a deferrable observer (Observer::deferrable). Each
// report's row digests, wanted values or decision arrays are downloaded without waiting
// (Backend::download_async) and the report reaches the observer once they have landed, in the order
// the reports were made: the ones that have landed are handed on at every new report, and finish()
// waits for the rest. At most `max_bytes` of host memory are in flight; past that the oldest report
// is waited for (back-pressure: the model pauses, memory stays bounded).
#pragma once

#include <cstddef>
#include <deque>
#include <functional>
#include <memory>
#include <variant>

#include "model/device.h"
#include "model/observer.h"

namespace dsv4 {

class LateReports {
 public:
  // How a report's parts go down: Backend::download_async of the model's backend.
  using Download = std::function<std::unique_ptr<backend::Backend::AsyncDownload>(
      const std::vector<backend::Backend::AsyncPart>&)>;
  LateReports(Download download, Observer& observer, size_t max_bytes);
  ~LateReports();  // drops the reports not handed on (the forward failed)
  LateReports(const LateReports&) = delete;
  LateReports& operator=(const LateReports&) = delete;

  // The record's data is `data` in backend memory (host, fetch and row_digests of `r` are ignored).
  // With `sums` (the rows' block sums, formed by the op that wrote them: kernels/row_sums.h) the
  // digests come from those; the buffer is kept until the report is handed on.
  void tensor(const TensorRecord& r, const void* data, backend::Buffer<uint64_t> sums = {});
  // The decisions' arrays are backend memory.
  void indexer(const IndexerDecision& d);
  void routing(const RoutingDecision& d);
  void mhc(const MhcDecision& d);
  // Waits for every report still on its way and hands it on.
  void finish();

 private:
  struct Pending {
    std::variant<TensorRecord, IndexerDecision, RoutingDecision, MhcDecision> what;
    bool values = false;  // a tensor whose values were downloaded too
    backend::Buffer<uint64_t> sums;  // read by the download's digests: freed after it (declared first)
    std::unique_ptr<backend::Backend::AsyncDownload> copies;
  };
  void push(Pending p, const std::vector<backend::Backend::AsyncPart>& parts);
  void hand_on_first();  // waits for the oldest report and hands it on
  void hand_on(Pending& p);

  Download download_;
  Observer& observer_;
  size_t max_bytes_;
  size_t in_flight_ = 0;
  std::deque<Pending> pending_;
};

}  // namespace dsv4
