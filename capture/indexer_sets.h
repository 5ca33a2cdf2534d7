// Indexer rows as the trace stores them (traces/FORMAT.md: per row the count of valid ids and the gaps
// between consecutive ones), built a row at a time from rows in any slot order: each row is checked,
// made a set (ascending) and its gaps appended to a ChunkStream that compresses them as they come.
// ExternalTraceWriter runs every indexer row through it, and so does the importer (adapters/r3.cpp),
// which streams an engine's buffer layer by layer without holding its rows; the rules of what a row may
// hold are written here once, and each caller words the faults in its own terms.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "capture/h5.h"

namespace dsv4 {

// The first slot of a row (in slot order) that keeps it from being a set the trace can hold.
struct IndexerRowFault {
  enum Kind {
    none,
    negative,      // an id below −1 (−1 is an empty slot)
    beyond_width,  // a valid id in a slot at or past the width (strict_columns only)
    future,        // a group row t cannot see yet: id >= ⌊(t+1)/4⌋
    duplicate,     // the id is already in the row
    too_many,      // more valid ids than the width
  };
  Kind kind = none;
  int slot = -1;
  int32_t id = 0;
  explicit operator bool() const { return kind != none; }
};

class IndexerSetEncoder {
 public:
  // Rows of a sequence of T tokens stored at `width` ids (the runtime's min(index_topk, ⌊T/4⌋)).
  // strict_columns: valid ids only in the first `width` slots (the engines' layout pads the row's
  // end with −1); otherwise anywhere, as long as there are at most `width` of them.
  // `file`/`stream`: the gaps go into that stream of a ChunkFile as they are encoded (h5.h) instead of
  // being held; finish() then ends the stream.
  IndexerSetEncoder(int64_t T, int width, bool strict_columns, std::shared_ptr<h5::ChunkFile> file = nullptr,
                    int stream = 0);

  // Row rows() given as n slots; nothing is appended when it faults.
  IndexerRowFault add_row(const int32_t* slots, int n);

  int64_t rows() const { return int64_t(count_.size()); }
  int64_t T() const { return T_; }
  int width() const { return width_; }
  int64_t valid() const { return valid_; }  // ids appended, over all rows
  // The per-row counts ([rows] uint16) and the gaps, as the trace's datasets hold them.
  const std::vector<uint16_t>& count() const { return count_; }
  h5::Type gap_type() const { return gap_type_; }
  // No more rows (ends a ChunkFile stream; a no-op otherwise).
  void finish() { gaps_.finish(); }
  // The rows as sets: [rows, width], ascending, −1 after the valid ids (decoded back from the
  // encoding; for checks and small callers).
  std::vector<int32_t> sets() const;
  // Writes indexer_count and indexer_gaps under `parent`.
  void store(const h5::Object& parent) const;

 private:
  void append_gaps(const int32_t* ids, int m);
  int64_t T_;
  int width_;
  bool strict_;
  h5::Type gap_type_;
  int64_t valid_ = 0;
  std::vector<uint16_t> count_;
  h5::ChunkStream gaps_;
  std::vector<int32_t> ids_;       // the row's valid ids in slot order
  std::vector<uint64_t> seen_;     // bitmap of the row's groups, for rows not already ascending
  std::vector<uint8_t> row_gaps_;  // the row's gaps at the storage width
};

}  // namespace dsv4
