// The inverse of an index table on the CPU: for each target row, the flat slots that point to it, in
// increasing slot order (CSR form). The backward ops that scatter gradients back to the rows an index
// table read (the attention's dkv, the indexer's dki) sum each row over this list, one sequential sum
// per row: no atomics, and the order depends on nothing but the table.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace dsv4::cpu {

struct InverseMap {
  std::vector<int64_t> begin;  // [rows + 1]: the slots of row r are slots[begin[r] .. begin[r + 1])
  std::vector<int64_t> slots;
};

// Slots whose value lies outside [0, rows) (-1 holes) belong to no row.
inline InverseMap inverse_map(const int32_t* table, int64_t n, int64_t rows) {
  InverseMap m;
  m.begin.assign(size_t(rows + 1), 0);
  for (int64_t s = 0; s < n; ++s)
    if (table[s] >= 0 && table[s] < rows) ++m.begin[size_t(table[s]) + 1];
  for (int64_t r = 0; r < rows; ++r) m.begin[size_t(r + 1)] += m.begin[size_t(r)];
  m.slots.resize(size_t(m.begin[size_t(rows)]));
  std::vector<int64_t> fill(m.begin.begin(), m.begin.end() - 1);
  for (int64_t s = 0; s < n; ++s)
    if (table[s] >= 0 && table[s] < rows) m.slots[size_t(fill[size_t(table[s])]++)] = s;
  return m;
}

}  // namespace dsv4::cpu
