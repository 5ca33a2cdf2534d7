// Decisions as sets: the valid ids of a row, how two rows agree, and when a differing row is a tie
// flip. Decisions compare as sets (DESIGN.md §4); the diff engine, replay verification, the viewer and
// `dsv4 trace dump` all read rows, overlaps and tie thresholds from here, so they never disagree
// about what a flip is.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>
#include <vector>

#include "model/profile.h"

namespace dsv4 {

// The valid ids of one row of k ids (−1 padding dropped), ascending.
std::vector<int32_t> valid_ids(const int32_t* row, int64_t k);
// Row t of a [T, k] id table as above; empty when k <= 0 or the table has no row t.
std::vector<int32_t> valid_ids(const std::vector<int32_t>& table, int64_t k, int64_t t);

// |A ∩ B| of two ascending id lists (merge).
int64_t sorted_intersection_size(const std::vector<int32_t>& a, const std::vector<int32_t>& b);
// Indexer overlap (recall of A's selection): |A ∩ B| / max(|A|, 1); 1 when both sets are empty.
double set_overlap(const std::vector<int32_t>& a, const std::vector<int32_t>& b);
// Routing agreement: |A ∩ B| / |A ∪ B|; 1 when both sets are empty.
double set_jaccard(const std::vector<int32_t>& a, const std::vector<int32_t>& b);

// The relative tie factor f of a profile, read from its sites (so a new profile needs no edit here):
// 2^-3 when it simulates FP4 on the indexer inputs (close to the ~11% relative error FP4 puts on them,
// MODEL.md §12.1 item 4), else 2^-4 (the relative rounding step of FP8 e4m3) when it simulates FP8
// anywhere, else 2^-7 (the relative precision of bf16).
double tie_factor(const NumericsProfile& p);
// By name: a built-in's factor; 2^-4 for a name this build does not know (a newer producer).
double tie_factor(const std::string& profile);
// Of two steps compared: the coarser of their factors.
double tie_factor(const std::string& profile_a, const std::string& profile_b);
double tie_factor(const NumericsProfile& a, const NumericsProfile& b);

// The relative tie threshold: f × the median of the finite |margin| of every list given, the median
// being the element of rank ⌊n/2⌋ (a recorded margin, never an average of two). nullopt when no
// margin is finite (every row chose everything it could see).
std::optional<double> relative_tie_threshold(std::initializer_list<const std::vector<float>*> margins,
                                             double factor);

// A differing row is a tie flip when either side's margin is below the threshold (a NaN threshold
// or margin is never below).
inline bool is_tie_flip(float margin_a, float margin_b, double threshold) {
  return margin_a < threshold || margin_b < threshold;
}

// The engines report no decision for a sequence's last token (it was never fed: MODEL.md §6.2), so an
// external step's layer may hold T − 1 rows. Forcing such decisions into a forward of T tokens needs
// the last row; it changes no log-prob (the last position's output predicts no token of the sequence),
// so it is completed the way the trainers fill rows without a decision (MODEL.md §6.4): ids 0, 1, …,
// k − 1. `ids` is [rows, k]; returns [T, k] (ids itself when rows = T).
std::vector<int32_t> complete_decision_rows(const std::vector<int32_t>& ids, int64_t rows, int k, int64_t T);

}  // namespace dsv4
