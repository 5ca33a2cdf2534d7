#include "capture/indexer_sets.h"

#include <bit>
#include <cstring>
#include <stdexcept>

#include "capture/layout.h"
#include "capture/step_layout.h"

namespace dsv4 {

IndexerSetEncoder::IndexerSetEncoder(int64_t T, int width, bool strict_columns,
                                     std::shared_ptr<h5::ChunkFile> file, int stream)
    : T_(T),
      width_(width),
      strict_(strict_columns),
      gap_type_(unsigned_for(uint64_t(T / 4))),
      gaps_(gap_type_, std::move(file), stream),
      ids_(size_t(width)),
      seen_(size_t(T / 4 / 64 + 1), 0),
      row_gaps_(size_t(width) * h5::type_size(gap_type_)) {
  if (width < 0 || width > 0xffff)
    throw std::logic_error("IndexerSetEncoder: width outside the uint16 counts");
}

IndexerRowFault IndexerSetEncoder::add_row(const int32_t* slots, int n) {
  const int64_t t = rows();
  const int32_t visible = int32_t((t + 1) / 4);  // groups complete once token t is fed
  int m = 0;
  int32_t prev = -1;
  // Rows whose valid ids ascend (an engine's sorted top-k, an export's rows) need no more than a
  // comparison per id; the first id that does not ascend moves the row to the bitmap of its groups,
  // which finds a duplicate at the slot it stands in and yields the set in order.
  bool ascending = true;
  for (int j = 0; j < n; ++j) {
    const int32_t g = slots[j];
    if (g == -1) continue;
    if (g < -1) return {IndexerRowFault::negative, j, g};
    if (strict_ && j >= width_) return {IndexerRowFault::beyond_width, j, g};
    if (g >= visible) return {IndexerRowFault::future, j, g};
    if (ascending && g <= prev) {
      ascending = false;
      for (int i = 0; i < m; ++i)
        seen_[size_t(ids_[size_t(i)]) >> 6] |= uint64_t(1) << (ids_[size_t(i)] & 63);
    }
    if (!ascending) {
      uint64_t& w = seen_[size_t(g) >> 6];
      const uint64_t bit = uint64_t(1) << (g & 63);
      if (w & bit) {
        std::fill(seen_.begin(), seen_.begin() + (visible >> 6) + 1, 0);
        return {IndexerRowFault::duplicate, j, g};
      }
      w |= bit;
    }
    if (m == width_) {
      if (!ascending) std::fill(seen_.begin(), seen_.begin() + (visible >> 6) + 1, 0);
      return {IndexerRowFault::too_many, j, g};
    }
    ids_[size_t(m++)] = g;
    prev = g;
  }
  if (!ascending) {  // the set, in order, out of the bitmap (cleared on the way)
    int k = 0;
    for (size_t wi = 0; wi <= size_t(visible >> 6); ++wi) {
      uint64_t w = seen_[wi];
      seen_[wi] = 0;
      while (w) {
        ids_[size_t(k++)] = int32_t(wi * 64 + size_t(std::countr_zero(w)));
        w &= w - 1;
      }
    }
  }
  count_.push_back(uint16_t(m));
  valid_ += m;
  append_gaps(ids_.data(), m);
  return {};
}

void IndexerSetEncoder::append_gaps(const int32_t* ids, int m) {
  if (m == 0) return;
  auto fill = [&](auto* out) {
    using U = std::remove_pointer_t<decltype(out)>;
    int32_t prev = -1;
    for (int i = 0; i < m; ++i) {
      out[i] = U(ids[i] - prev - 1);
      prev = ids[i];
    }
  };
  switch (gap_type_) {
    case h5::Type::u8:
      fill(row_gaps_.data());
      break;
    case h5::Type::u16:
      fill(reinterpret_cast<uint16_t*>(row_gaps_.data()));
      break;
    default:
      fill(reinterpret_cast<uint32_t*>(row_gaps_.data()));
      break;
  }
  gaps_.append(row_gaps_.data(), size_t(m));
}

std::vector<int32_t> IndexerSetEncoder::sets() const {
  const std::vector<uint8_t> raw = gaps_.values();
  auto gap = [&](size_t i) -> int64_t {
    switch (gap_type_) {
      case h5::Type::u8:
        return raw[i];
      case h5::Type::u16: {
        uint16_t v;
        std::memcpy(&v, raw.data() + 2 * i, 2);
        return v;
      }
      default: {
        uint32_t v;
        std::memcpy(&v, raw.data() + 4 * i, 4);
        return v;
      }
    }
  };
  std::vector<int32_t> out(size_t(rows()) * size_t(width_), -1);
  size_t at = 0;
  for (size_t r = 0; r < count_.size(); ++r) {
    int64_t id = -1;
    for (int j = 0; j < count_[r]; ++j, ++at) {
      id += gap(at) + 1;
      out[r * size_t(width_) + size_t(j)] = int32_t(id);
    }
  }
  return out;
}

void IndexerSetEncoder::store(const h5::Object& parent) const {
  using namespace trace_layout;
  h5::write(h5::create_dataset(parent, kIndexerCount, h5::Type::u16, {hsize_t(count_.size())}), count_);
  gaps_.store(parent, kIndexerGaps);
}

}  // namespace dsv4
