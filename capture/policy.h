// Capture policy: which full tensors a trace keeps besides decisions, digests and outputs.
//   "decisions"          decisions + digests + outputs (the default)
//   "full"               also every named tensor
//   "attn.*@3-5,moe.out" also the listed tensors: comma-separated items `pattern[@layers]`, where
//                        pattern is a tensor name with `*` wildcards and layers is `L`, `A-B` or
//                        absent (every layer, and model-level tensors too).
#pragma once

#include <climits>
#include <string>
#include <string_view>
#include <vector>

namespace dsv4 {

struct ModelConfig;

class CapturePolicy {
 public:
  static CapturePolicy parse(const std::string& text);        // throws InputError naming the bad item
  bool wants_tensor(std::string_view name, int layer) const;  // layer -1: model-level
  // Throws InputError naming the item when an item selects no tensor of a model of config `c` (a
  // layer range beyond its layers, a name on layers that do not report it): a recording must not keep
  // nothing silently. The trace writer calls it for every trace it creates or appends to.
  void check_matches(const ModelConfig& c) const;
  const std::string& text() const { return text_; }
  bool full() const { return full_; }

 private:
  struct Item {
    std::string pattern;
    bool all_layers = true;
    int first = 0, last = 0;
    std::string text;  // as written
    bool wants(std::string_view name, int layer) const;
  };
  std::string text_ = "decisions";
  bool full_ = false;
  std::vector<Item> items_;
};

}  // namespace dsv4
