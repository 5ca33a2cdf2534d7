// Shared helpers of the training-step tests: seeded token sequences and samples.
#pragma once

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "train/samples.h"

namespace dsv4::test {

// n seeded token ids in [0, vocab).
inline std::vector<int32_t> seq_tokens(int n, int vocab, uint64_t seed) {
  std::mt19937_64 g(seed);
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (auto& x : t) x = int32_t(g() % uint64_t(vocab));
  return t;
}

// A sample of `prompt` + `response` seeded tokens with a given advantage.
inline train::TrainSample make_sample(const std::string& id, int prompt, int response, int vocab, uint64_t seed,
                                      double advantage) {
  const std::vector<int32_t> t = seq_tokens(prompt + response, vocab, seed);
  train::TrainSample s;
  s.id = id;
  s.prompt.assign(t.begin(), t.begin() + prompt);
  s.response.assign(t.begin() + prompt, t.end());
  s.advantage = advantage;
  return s;
}

}  // namespace dsv4::test
