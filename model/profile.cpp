#include "model/profile.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <xxhash.h>

#include <algorithm>
#include <charconv>
#include <fstream>
#include <map>
#include <sstream>

#include "model/error.h"

namespace dsv4 {

// Generated from profiles/*.profile by model/CMakeLists.txt: {name, file text} in profile_names() order.
namespace detail {
const std::vector<std::pair<std::string, std::string>>& builtin_profile_files();
}

namespace {

// ---- value spellings ----------------------------------------------------------------------------
// The spellings of an enumerated site's values: one table gives both directions.

template <typename T>
struct Spelling {
  const char* text;
  T value;
};

template <typename T, size_t N>
std::string spelling_of(const Spelling<T> (&table)[N], T v) {
  for (const auto& e : table)
    if (e.value == v) return e.text;
  return "?";
}

// Sets `out` from the spelling `v`; nullptr, or `accepted` (the table's spellings, as the error says
// them) when v is none of them.
template <typename T, size_t N>
const char* read_spelling(const Spelling<T> (&table)[N], const std::string& v, T& out, const char* accepted) {
  for (const auto& e : table)
    if (v == e.text) {
      out = e.value;
      return nullptr;
    }
  return accepted;
}

constexpr Spelling<QuantSim> kKvQuant[] = {
    {"none", QuantSim::none}, {"fp8", QuantSim::fp8}, {"fp8_inplace_bf16_cast", QuantSim::fp8_inplace_bf16_cast}};
constexpr Spelling<QuantSim> kIndexerQuant[] = {
    {"none", QuantSim::none}, {"fp8", QuantSim::fp8}, {"fp4", QuantSim::fp4}};
constexpr Spelling<ScaleFmt> kScale[] = {{"ue8m0", ScaleFmt::ue8m0}, {"fp32", ScaleFmt::none}};
constexpr Spelling<Arith> kArith[] = {{"fp32", Arith::fp32}, {"bf16", Arith::bf16}};
constexpr Spelling<bool> kExpertOutput[] = {{"sum_fp32", false}, {"bf16_each", true}};
constexpr Spelling<bool> kOnOff[] = {{"off", false}, {"on", true}};

// A decimal integer in [lo, hi], the whole string.
bool parse_int(const std::string& s, int64_t lo, int64_t hi, int64_t& out) {
  if (s.empty()) return false;
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), out);
  return ec == std::errc() && end == s.data() + s.size() && out >= lo && out <= hi;
}

constexpr int64_t kMaxBlock = 65536;
constexpr const char* kTensorCore = "tensor_core";

// ---- the site table -----------------------------------------------------------------------------

// The sites fast numerics puts in the tensor_core order (with_numerics), and the only ones that take it.
constexpr ReduceOrder ReduceSites::*kTensorCoreSites[] = {&ReduceSites::gemm, &ReduceSites::indexer,
                                                         &ReduceSites::attention, &ReduceSites::moe};
template <ReduceOrder ReduceSites::*M>
constexpr bool takes_tensor_core() {
  for (auto m : kTensorCoreSites)
    if (m == M) return true;
  return false;
}

// A reduce.* site: the ReduceOrder member `m` of NumericsProfile::reduce. The table's entries are
// plain function pointers, so each member is bound through a template argument.
template <ReduceOrder ReduceSites::*M, bool TensorCore = takes_tensor_core<M>()>
ProfileSite reduce_site_of(const char* key, const char* choice) {
  return {key, choice,
          TensorCore ? "0 (one chain), a positive multiple of 8, or tensor_core (a GPU's bf16 tensor cores; "
                       "CUDA only; kernels/reduce.h)"
                     : "0 (one chain) or a positive multiple of 8 (kernels/reduce.h)",
          [](const NumericsProfile& p) {
            const ReduceOrder& o = p.reduce.*M;
            return o.tensor_core ? std::string(kTensorCore) : std::to_string(o.block);
          },
          [](NumericsProfile& p, const std::string& v) -> const char* {
            if (v == kTensorCore) {
              if (!TensorCore)
                return "the tensor_core order is for the GEMM, expert, indexer and attention sites only "
                       "(reduce.gemm, reduce.moe, reduce.indexer, reduce.attention)";
              p.reduce.*M = ReduceOrder{.block = 0, .tensor_core = true};
              return nullptr;
            }
            int64_t b = 0;
            if (!parse_int(v, 0, kMaxBlock, b))
              return TensorCore ? "expected an integer in 0..65536 or tensor_core" : "expected an integer in 0..65536";
            if (b % 8 != 0) return "the block must be 0 or a positive multiple of 8";
            p.reduce.*M = ReduceOrder{.block = int(b)};
            return nullptr;
          }};
}

const std::vector<ProfileSite> kSites = {
    reduce_site_of<&ReduceSites::gemm>("reduce.gemm", "blocking of the dense linears' dot products (k-tiles)"),
    reduce_site_of<&ReduceSites::norm>("reduce.norm", "blocking of the RMSNorms' sums of squares"),
    reduce_site_of<&ReduceSites::compressor>("reduce.compressor", "blocking of the compressor's pooled-row norm"),
    reduce_site_of<&ReduceSites::mhc>("reduce.mhc", "blocking of the mHC reductions (fn . x, row norms)"),
    reduce_site_of<&ReduceSites::indexer>("reduce.indexer", "blocking of the indexer's q.k dot products"),
    reduce_site_of<&ReduceSites::attention>("reduce.attention", "blocking of the sparse attention's q.kv dot products"),
    reduce_site_of<&ReduceSites::moe>("reduce.moe", "blocking of the experts' GEMMs"),
    {"attention.q_norm", "arithmetic of the per-head q RMSNorm", "fp32, bf16",
     [](const NumericsProfile& p) { return spelling_of(kArith, p.q_norm); },
     [](NumericsProfile& p, const std::string& v) {
       return read_spelling(kArith, v, p.q_norm, "accepted: fp32, bf16");
     }},
    {"attention.softmax", "softmax order of sparse attention (prefill and exact decode)",
     "two_pass, online:B (blocks of B slots, B in 1..65536)",
     [](const NumericsProfile& p) {
       return p.attention_online_block == 0 ? std::string("two_pass")
                                            : fmt::format("online:{}", p.attention_online_block);
     },
     [](NumericsProfile& p, const std::string& v) -> const char* {
       if (v == "two_pass") {
         p.attention_online_block = 0;
         return nullptr;
       }
       int64_t b = 0;
       if (v.rfind("online:", 0) != 0 || !parse_int(v.substr(7), 1, kMaxBlock, b))
         return "accepted: two_pass, online:B with B in 1..65536 (a block of 0 slots is impossible)";
       p.attention_online_block = int(b);
       return nullptr;
     }},
    {"attention.decode", "attention order of a one-token decode step after a cache",
     "exact, split:N (N in 1..65536)", [](const NumericsProfile& p) { return decode_attention_name(p); },
     [](NumericsProfile& p, const std::string& v) -> const char* {
       try {
         p.decode_attention_splits = parse_decode_attention(v);
       } catch (const InputError&) {
         return "accepted: exact, split:N with N in 1..65536";
       }
       return nullptr;
     }},
    {"kv.quant", "quantisation simulated on the window KV and main compressed KV (nope dims)",
     "none, fp8, fp8_inplace_bf16_cast", [](const NumericsProfile& p) { return spelling_of(kKvQuant, p.kv_quant); },
     [](NumericsProfile& p, const std::string& v) {
       return read_spelling(kKvQuant, v, p.kv_quant, "accepted: none, fp8, fp8_inplace_bf16_cast");
     }},
    {"kv.quant_block", "block of the KV quantisation (it must divide the nope dims)", "a positive integer (64)",
     [](const NumericsProfile& p) { return std::to_string(p.kv_quant_block); },
     [](NumericsProfile& p, const std::string& v) -> const char* {
       int64_t b = 0;
       if (!parse_int(v, 1, kMaxBlock, b)) return "expected an integer in 1..65536 (a block of 0 is impossible)";
       p.kv_quant_block = int(b);
       return nullptr;
     }},
    {"kv.quant_scale", "scale rule of the KV quantisation", "ue8m0 (powers of two), fp32 (amax / 448)",
     [](const NumericsProfile& p) { return spelling_of(kScale, p.kv_quant_scale); },
     [](NumericsProfile& p, const std::string& v) {
       return read_spelling(kScale, v, p.kv_quant_scale, "accepted: ue8m0, fp32");
     }},
    {"indexer.quant", "quantisation simulated on the indexer q and k (fp8: e4m3; fp4: e2m1)", "none, fp8, fp4",
     [](const NumericsProfile& p) { return spelling_of(kIndexerQuant, p.indexer_quant); },
     [](NumericsProfile& p, const std::string& v) {
       return read_spelling(kIndexerQuant, v, p.indexer_quant, "accepted: none, fp8, fp4");
     }},
    {"indexer.quant_block", "block of the indexer quantisation",
     "auto (fp8: min(Di, 128); fp4: 32), or a positive integer dividing Di",
     [](const NumericsProfile& p) {
       return p.indexer_quant_block_size == 0 ? std::string("auto") : std::to_string(p.indexer_quant_block_size);
     },
     [](NumericsProfile& p, const std::string& v) -> const char* {
       int64_t b = 0;
       if (v != "auto" && !parse_int(v, 1, kMaxBlock, b))
         return "accepted: auto, or an integer in 1..65536 (a block of 0 is impossible)";
       p.indexer_quant_block_size = int(b);
       return nullptr;
     }},
    {"indexer.quant_scale", "scale rule of the indexer quantisation",
     "ue8m0 (powers of two), fp32 (fp8 only: amax / 448)",
     [](const NumericsProfile& p) { return spelling_of(kScale, p.indexer_quant_scale); },
     [](NumericsProfile& p, const std::string& v) {
       return read_spelling(kScale, v, p.indexer_quant_scale, "accepted: ue8m0, fp32");
     }},
    {"indexer.score", "arithmetic of the indexer scores (q.k dots, ReLU times weight, head sum)",
     "fp32, bf16", [](const NumericsProfile& p) { return spelling_of(kArith, p.indexer_score); },
     [](NumericsProfile& p, const std::string& v) {
       return read_spelling(kArith, v, p.indexer_score, "accepted: fp32, bf16");
     }},
    {"moe.expert_output", "where the experts' w2 outputs are rounded to bf16",
     "sum_fp32 (once, after the fp32 sum), bf16_each (each expert's output, before the sum)",
     [](const NumericsProfile& p) { return spelling_of(kExpertOutput, p.expert_output_bf16); },
     [](NumericsProfile& p, const std::string& v) {
       return read_spelling(kExpertOutput, v, p.expert_output_bf16, "accepted: sum_fp32, bf16_each");
     }},
    {"moe.shared_clamp", "whether the shared expert's SwiGLU is clamped like the routed experts'", "off, on",
     [](const NumericsProfile& p) { return spelling_of(kOnOff, p.clamp_shared_expert); },
     [](NumericsProfile& p, const std::string& v) {
       return read_spelling(kOnOff, v, p.clamp_shared_expert, "accepted: off, on");
     }},
    {"topk.ties", "tie-break of every top-k (indexer and router)",
     "lower_index (equal scores: the smaller index wins; the only order implemented)",
     [](const NumericsProfile&) { return std::string("lower_index"); },
     [](NumericsProfile&, const std::string& v) -> const char* {
       return v == "lower_index" ? nullptr : "accepted: lower_index (the only tie-break implemented)";
     }},
};

bool valid_name(const std::string& s) {
  if (s.empty() || s.size() > 64) return false;
  return std::all_of(s.begin(), s.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-' ||
           c == '_' || c == '.';
  });
}

std::string trim(const std::string& s) {
  const auto b = s.find_first_not_of(" \t\r");
  if (b == std::string::npos) return "";
  const auto e = s.find_last_not_of(" \t\r");
  return s.substr(b, e - b + 1);
}

const std::map<std::string, NumericsProfile>& builtins() {
  static const std::map<std::string, NumericsProfile> m = [] {
    std::map<std::string, NumericsProfile> r;
    for (const auto& [name, text] : detail::builtin_profile_files()) {
      NumericsProfile p = parse_profile(text, fmt::format("built-in profile '{}'", name));
      if (p.name != name)
        throw Error(fmt::format("built-in profile file '{}.profile' names itself '{}'", name, p.name));
      r.emplace(name, std::move(p));
    }
    return r;
  }();
  return m;
}

}  // namespace

const std::vector<ProfileSite>& profile_sites() {
  return kSites;
}

const ProfileSite* find_profile_site(const std::string& key) {
  for (const auto& s : kSites)
    if (key == s.key) return &s;
  return nullptr;
}

NumericsProfile parse_profile(const std::string& text, const std::string& source) {
  struct Entry {
    std::string key, value;
    int line;
  };
  std::vector<Entry> sites;
  NumericsProfile p;
  bool have_version = false, have_name = false;
  std::string base;
  std::istringstream in(text);
  std::string raw;
  int line = 0;
  auto fail = [&](int at, const std::string& why) {
    throw InputError(fmt::format("{}:{}: {}", source, at, why));
  };
  while (std::getline(in, raw)) {
    ++line;
    const std::string s = trim(raw);
    if (s.empty() || s[0] == '#') continue;
    const auto eq = s.find('=');
    if (eq == std::string::npos) fail(line, fmt::format("expected 'key = value', got '{}'", s));
    const std::string key = trim(s.substr(0, eq)), value = trim(s.substr(eq + 1));
    if (!have_version) {
      if (key != "dsv4-profile")
        fail(line, "the first line must be 'dsv4-profile = 1' (the format version; docs/PROFILES.md)");
      int64_t v = 0;
      if (!parse_int(value, 1, 1000000, v))
        fail(line, fmt::format("format version '{}' is not a number", value));
      if (v > kProfileFormatVersion)
        fail(line, fmt::format("profile format version {} is newer than this build reads ({}): use a newer "
                               "dsv4-replay",
                               v, kProfileFormatVersion));
      have_version = true;
      continue;
    }
    if (key == "dsv4-profile") fail(line, "the format version is given twice");
    if (key == "name") {
      if (have_name) fail(line, "the name is given twice");
      if (!valid_name(value))
        fail(line, fmt::format("name '{}' must be 1-64 letters, digits, '-', '_' or '.'", value));
      p.name = value;
      have_name = true;
    } else if (key == "description") {
      p.description = value;
    } else if (key == "base") {
      if (!base.empty()) fail(line, "base is given twice");
      if (!is_builtin_profile(value))
        fail(line, fmt::format("base '{}' is not a built-in profile (known: {})", value,
                               fmt::join(profile_names(), ", ")));
      base = value;
    } else if (find_profile_site(key)) {
      for (const auto& e : sites)
        if (e.key == key) fail(line, fmt::format("site '{}' is given twice (first on line {})", key, e.line));
      sites.push_back({key, value, line});
    } else {
      std::vector<std::string> keys;
      for (const auto& k : kSites) keys.emplace_back(k.key);
      fail(line, fmt::format("unknown site '{}' (sites: {})", key, fmt::join(keys, ", ")));
    }
  }
  if (!have_version)
    throw InputError(fmt::format("{}: empty profile (the first line must be 'dsv4-profile = 1')", source));
  if (!have_name) throw InputError(fmt::format("{}: the profile has no 'name = ...' line", source));
  if (!base.empty()) {
    NumericsProfile b = profile_by_name(base);
    b.name = p.name;
    b.description = p.description;
    p = std::move(b);
  }
  for (const auto& e : sites)
    if (const char* why = find_profile_site(e.key)->set(p, e.value))
      fail(e.line, fmt::format("site '{}': impossible value '{}': {}", e.key, e.value, why));
  if (p.indexer_quant == QuantSim::fp4 && p.indexer_quant_scale != ScaleFmt::ue8m0) {
    int at = 0;
    for (const auto& e : sites)
      if (e.key == "indexer.quant_scale") at = e.line;
    fail(at, "site 'indexer.quant_scale': fp32 scales are an FP8 rule; FP4 (e2m1) scales are powers of two (ue8m0)");
  }
  if (base.empty()) {
    std::vector<std::string> missing;
    for (const auto& s : kSites)
      if (std::none_of(sites.begin(), sites.end(), [&](const Entry& e) { return e.key == s.key; }))
        missing.emplace_back(s.key);
    if (!missing.empty())
      throw InputError(
          fmt::format("{}: sites not set: {} (set them, or start from a built-in with 'base = NAME')", source,
                      fmt::join(missing, ", ")));
  }
  return p;
}

std::string profile_text(const NumericsProfile& p) {
  std::string o = fmt::format("dsv4-profile = {}\nname = {}\n", kProfileFormatVersion, p.name);
  if (!p.description.empty()) o += fmt::format("description = {}\n", p.description);
  for (const auto& s : kSites) o += fmt::format("{} = {}\n", s.key, s.get(p));
  return o;
}

std::string profile_text_digest(const std::string& text) {
  return fmt::format("{:016x}", uint64_t(XXH3_64bits(text.data(), text.size())));
}

std::string profile_digest(const NumericsProfile& p) {
  return profile_text_digest(profile_text(p));
}

std::vector<std::string> profile_names() {
  std::vector<std::string> n;
  for (const auto& f : detail::builtin_profile_files()) n.push_back(f.first);
  return n;
}

bool is_builtin_profile(const std::string& name) {
  const auto& f = detail::builtin_profile_files();
  return std::any_of(f.begin(), f.end(), [&](const auto& e) { return e.first == name; });
}

namespace {
// The error of a name that is no built-in's.
InputError unknown_profile(const std::string& name) {
  return InputError(fmt::format("unknown numerics profile '{}' (known: {})", name, fmt::join(profile_names(), ", ")));
}
}  // namespace

const std::string& builtin_profile_source(const std::string& name) {
  for (const auto& f : detail::builtin_profile_files())
    if (f.first == name) return f.second;
  throw unknown_profile(name);
}

NumericsProfile profile_by_name(const std::string& name) {
  const auto& m = builtins();
  const auto it = m.find(name);
  if (it == m.end()) throw unknown_profile(name);
  return it->second;
}

NumericsProfile load_profile(const std::string& name_or_file) {
  if (is_builtin_profile(name_or_file)) return profile_by_name(name_or_file);
  std::ifstream f(name_or_file, std::ios::binary);
  if (!f)
    throw InputError(
        fmt::format("--profile '{}' is neither a built-in profile ({}) nor a readable profile file",
                    name_or_file, fmt::join(profile_names(), ", ")));
  std::ostringstream s;
  s << f.rdbuf();
  NumericsProfile p = parse_profile(s.str(), name_or_file);
  // A built-in's name means its precision map wherever it is read (traces store names too).
  if (is_builtin_profile(p.name) && !profile_diff(p, profile_by_name(p.name)).empty())
    throw InputError(
        fmt::format("{}: name '{}' is a built-in profile's, but the file's sites differ from it: give "
                    "the file its own name",
                    name_or_file, p.name));
  return p;
}

NumericsProfile profile_train() {
  return profile_by_name("train");
}

NumericsProfile profile_rollout() {
  return profile_by_name("rollout");
}

const char* to_string(Numerics n) {
  return n == Numerics::fast ? "fast" : "exact";
}

Numerics parse_numerics(const std::string& s) {
  if (s == "exact") return Numerics::exact;
  if (s == "fast") return Numerics::fast;
  throw InputError(fmt::format("unknown numerics '{}' (accepted: exact, fast)", s));
}

namespace {
constexpr const char* kFastSuffix = ".fast";
bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}
}  // namespace

std::vector<std::string> tensor_core_sites(const NumericsProfile& p) {
  std::vector<std::string> sites;
  for (const auto& s : kSites)
    if (s.get(p) == kTensorCore) sites.emplace_back(s.key);
  return sites;
}

NumericsProfile with_numerics(const NumericsProfile& p, Numerics n) {
  if (n == Numerics::exact || numerics_of(p) == Numerics::fast) return p;
  NumericsProfile f = p;
  for (auto m : kTensorCoreSites) f.reduce.*m = ReduceOrder{.block = 0, .tensor_core = true};
  f.name = p.name + kFastSuffix;
  if (f.name.size() > 64) throw InputError(fmt::format("profile name '{}' is too long for its fast numerics' name", p.name));
  f.description = (p.description.empty() ? p.name : p.description) +
                  "; fast numerics: GEMMs, experts, indexer and attention on bf16 tensor cores (CUDA only)";
  return f;
}

std::string numerics_base_name(const NumericsProfile& p) {
  if (numerics_of(p) == Numerics::fast && ends_with(p.name, kFastSuffix))
    return p.name.substr(0, p.name.size() - std::string(kFastSuffix).size());
  return p.name;
}

NumericsProfile load_profile(const std::string& name_or_file, Numerics n) {
  return with_numerics(load_profile(name_or_file), n);
}

std::vector<ProfileSiteDiff> profile_diff(const NumericsProfile& a, const NumericsProfile& b) {
  std::vector<ProfileSiteDiff> d;
  for (const auto& s : kSites) {
    std::string va = s.get(a), vb = s.get(b);
    if (va != vb) d.push_back({s.key, std::move(va), std::move(vb)});
  }
  return d;
}

void copy_profile_site(NumericsProfile& p, const NumericsProfile& from, const std::string& key) {
  const ProfileSite* s = find_profile_site(key);
  if (!s) throw Error(fmt::format("copy_profile_site: unknown site '{}'", key));
  if (const char* why = s->set(p, s->get(from)))
    throw Error(fmt::format("copy_profile_site: site '{}': {}", key, why));
}

std::string decode_attention_name(const NumericsProfile& p) {
  return p.decode_attention_splits <= 0 ? "exact" : fmt::format("split:{}", p.decode_attention_splits);
}

int parse_decode_attention(const std::string& s) {
  constexpr int kMaxSplits = 65536;
  if (s == "exact") return 0;
  const std::string prefix = "split:";
  int64_t n = 0;
  if (s.compare(0, prefix.size(), prefix) == 0 && parse_int(s.substr(prefix.size()), 1, kMaxSplits, n))
    return int(n);
  throw InputError(
      fmt::format("unknown decode attention '{}' (accepted: exact, split:N with N in 1..{})", s, kMaxSplits));
}

}  // namespace dsv4
