// Precision bisect (docs/PROFILES.md "Bisect"): which precision choice makes two numerics profiles
// disagree. The forward runs on the same tokens under profile A, under A with every site where B
// differs taken from B (which is B's precision map), under A with each of those sites alone taken from
// B, and under A with the halves of the set taken from B (recursively, down to single sites). Every run
// is compared with A's run: log-prob mismatch (mean and max |Δ log-prob|, the k3 KL estimate) and
// decision flips (indexer and routing rows whose set changed; tie flips against confident ones, with
// the diff's relative tie rule). Each switched set reports the share of the whole mismatch it
// explains; singles are ranked by it.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "model/device.h"
#include "model/profile.h"
#include "model/weights.h"

namespace dsv4 {

struct BisectOptions {
  NumericsProfile a, b;
  Device device = Device::cpu;
  int threads = 0;
  // Called before each forward with what it runs ("A", "A + {kv.quant}", ...) and the run's number.
  std::function<void(const std::string& what, int run, int runs)> progress;
};

// A run against A's run.
struct BisectMetrics {
  int64_t tokens = 0;
  double mean_abs_dlogp = 0, max_abs_dlogp = 0;
  double kl_k3 = 0;  // mean((r - 1) - log r), r = p_X / p_A over the tokens (the diff's k3)
  int64_t indexer_rows = 0, indexer_flips = 0, indexer_tie_flips = 0;
  int64_t routing_rows = 0, routing_flips = 0, routing_tie_flips = 0;
  int64_t confident_flips() const {
    return (indexer_flips - indexer_tie_flips) + (routing_flips - routing_tie_flips);
  }
};

struct BisectEntry {
  std::vector<std::string> sites;  // the sites taken from B, in site order
  std::string kind;                // "site", "group" (a half of the halving) or "all"
  BisectMetrics m;
  double explained = 0;  // m.mean_abs_dlogp / the "all" run's (0 when that is 0)
};

struct BisectReport {
  std::string profile_a, profile_b, digest_a, digest_b;
  std::vector<ProfileSiteDiff> sites;  // where A and B differ
  int64_t seqs = 0, tokens = 0;
  BisectEntry all;                  // every differing site from B
  std::vector<BisectEntry> single;  // each site alone, ranked: explained, then flips, then site order
  std::vector<BisectEntry> groups;  // the halving: each half of the set, recursively (2 sites or more)
  double sum_single_explained = 0;  // far from 1: the sites interact
  int runs = 0;
  double seconds = 0;
};

// Throws InputError when A and B have the same precision map, or for the forward's input errors.
BisectReport bisect_profiles(const Weights& w, const std::vector<std::vector<int32_t>>& seqs,
                             const BisectOptions& opt);

std::string bisect_to_json(const BisectReport& r);  // {"format": "dsv4-bisect", "version": 1, ...}
// The report back from its JSON (the viewer's reader). Throws InputError naming `source` for text that
// is not a dsv4-bisect report, a newer version, or a missing or mistyped field.
BisectReport bisect_from_json(const std::string& text, const std::string& source);
std::string bisect_to_table(const BisectReport& r);  // the ranking, for a terminal

}  // namespace dsv4
