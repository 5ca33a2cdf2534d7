#include "capture/policy.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cctype>
#include <charconv>

#include "model/config.h"
#include "model/error.h"
#include "model/manifest.h"

namespace dsv4 {
namespace {

// `*` matches any run of characters (dots included); everything else matches itself.
bool glob_match(std::string_view pattern, std::string_view name) {
  size_t p = 0, n = 0, star = std::string_view::npos, resume = 0;
  while (n < name.size()) {
    if (p < pattern.size() && pattern[p] == '*') {
      star = p++;
      resume = n;
    } else if (p < pattern.size() && pattern[p] == name[n]) {
      ++p;
      ++n;
    } else if (star != std::string_view::npos) {
      p = star + 1;
      n = ++resume;
    } else {
      return false;
    }
  }
  while (p < pattern.size() && pattern[p] == '*') ++p;
  return p == pattern.size();
}

std::string_view trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
  return s;
}

// A layer number: decimal digits only (no sign, no spaces), fits in an int.
bool parse_layer(std::string_view s, int& out) {
  if (s.empty()) return false;
  for (char c : s)
    if (c < '0' || c > '9') return false;
  auto [ptr, ec] = std::from_chars(s.data(), s.data() + s.size(), out);
  return ec == std::errc() && ptr == s.data() + s.size();
}

// Every tensor name the forward can report. The names do not depend on the config beyond which layer
// kinds exist, and the tiny preset has every kind (dense, ratio-4 and ratio-128 layers).
const std::vector<std::string>& known_names() {
  static const std::vector<std::string> names = tensor_names(preset("tiny"));
  return names;
}

}  // namespace

CapturePolicy CapturePolicy::parse(const std::string& text) {
  CapturePolicy p;
  p.text_ = text;
  auto fail = [&](const std::string& why) {
    throw InputError(fmt::format("capture policy '{}': {}", text, why));
  };
  std::string_view rest = text;
  while (true) {
    const size_t comma = rest.find(',');
    const std::string_view raw = rest.substr(0, comma);
    const std::string_view item = trim(raw);
    if (item == "decisions") {
      // Decisions, digests and outputs are always kept; the keyword adds nothing.
    } else if (item == "full") {
      p.full_ = true;
    } else {
      if (item.empty()) fail("unknown item ''");
      Item it;
      it.text = std::string(item);
      const size_t at = item.find('@');
      it.pattern = std::string(trim(item.substr(0, at)));
      if (it.pattern.empty()) fail(fmt::format("item '{}' has no tensor name", item));
      for (char c : it.pattern)
        if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '*'))
          fail(fmt::format("unknown item '{}' (a tensor name may hold letters, digits, '.', '_' and '*')",
                           item));
      const auto& names = known_names();
      if (std::none_of(names.begin(), names.end(),
                       [&](const std::string& n) { return glob_match(it.pattern, n); }))
        fail(fmt::format("unknown item '{}': '{}' matches no tensor (known: {})", item, it.pattern,
                         fmt::join(names, ", ")));
      if (at != std::string_view::npos) {
        const std::string_view range = trim(item.substr(at + 1));
        const size_t dash = range.find('-');
        it.all_layers = false;
        if (dash == std::string_view::npos) {
          if (!parse_layer(range, it.first))
            fail(fmt::format("layer range '{}' is not a layer number or A-B", range));
          it.last = it.first;
        } else {
          if (!parse_layer(range.substr(0, dash), it.first) || !parse_layer(range.substr(dash + 1), it.last))
            fail(fmt::format("layer range '{}' is not a layer number or A-B", range));
          if (it.first > it.last) fail(fmt::format("layer range {}-{} is empty", it.first, it.last));
        }
      }
      p.items_.push_back(std::move(it));
    }
    if (comma == std::string_view::npos) break;
    rest.remove_prefix(comma + 1);
  }
  return p;
}

bool CapturePolicy::Item::wants(std::string_view name, int layer) const {
  // A layer range selects decoder layers only; model-level tensors (layer -1) need an item without one.
  if (!all_layers && (layer < first || layer > last)) return false;
  return glob_match(pattern, name);
}

bool CapturePolicy::wants_tensor(std::string_view name, int layer) const {
  if (full_) return true;
  return std::any_of(items_.begin(), items_.end(), [&](const Item& it) { return it.wants(name, layer); });
}

void CapturePolicy::check_matches(const ModelConfig& c) const {
  if (items_.empty()) return;
  // Which (name, layer) pairs exist depends on the layer kinds only; a length of the largest
  // compression ratio gives every tensor at least one row.
  int64_t T = 1;
  for (int r : c.compress_ratios) T = std::max<int64_t>(T, r);
  const std::vector<TensorSpecT> manifest = tensor_manifest(c, T);
  for (const Item& it : items_)
    if (std::none_of(manifest.begin(), manifest.end(),
                     [&](const TensorSpecT& m) { return it.wants(m.name, m.layer); }))
      throw InputError(fmt::format(
          "capture policy '{}': item '{}' selects no tensor of this model ({} layers: 0..{}), so it would "
          "record nothing",
          text_, it.text, c.num_hidden_layers, c.num_hidden_layers - 1));
}

}  // namespace dsv4
