// The JSON of one sequence's forward: what `dsv4 forward` prints and what the Python package's
// dsv4.forward returns, built in this one place so the two cannot drift apart.
#pragma once

#include <string>

#include "model/collect.h"
#include "model/forward.h"

namespace dsv4 {

// {"profile", "tokens", "logprobs", "indexer_topk": [{"layer", "sets": [[ids of row t, -1 dropped]]}],
//  "experts": [{"layer", "hashed", "ids": [[k ids of row t]]}]}, compact (no indentation), for the
// sequence `r` whose decisions `log` recorded as sequence 0.
std::string forward_to_json(const SequenceResult& r, const DecisionLog& log, const std::string& profile);

}  // namespace dsv4
