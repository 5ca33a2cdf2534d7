// AdamW, the global gradient norm and the optimizer state file (train/optimizer.h).
#include "train/optimizer.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <nlohmann/json.hpp>

#include "model/error.h"
#include "model/safetensors.h"

namespace dsv4::train {

namespace {

using nlohmann::json;

// The format version of the optimizer state file. Bump it when the tensors or the metadata change
// meaning; load() refuses newer versions.
constexpr int kStateVersion = 1;
constexpr const char* kStateFormat = "dsv4-optimizer";

// Elementwise loops run in parallel above this many elements (each element is independent).
constexpr int64_t kParallelMin = int64_t(1) << 15;

// beta^n in fp64 by binary exponentiation (square-and-multiply from the low bit): IEEE operations
// only, so the bias corrections are the same on every machine (libm's pow is not).
double pow_int(double beta, int64_t n) {
  double result = 1.0, base = beta;
  while (n > 0) {
    if (n & 1) result = result * base;
    base = base * base;
    n >>= 1;
  }
  return result;
}

void check_field(bool ok, const char* field, const char* expected, double v) {
  if (!ok) throw InputError(fmt::format("AdamW config: field '{}' must be {}, found {}", field, expected, v));
}

}  // namespace

void check(const AdamWConfig& c) {
  check_field(std::isfinite(c.lr) && c.lr >= 0, "lr", "a finite number >= 0", c.lr);
  check_field(std::isfinite(c.beta1) && c.beta1 >= 0 && c.beta1 < 1, "beta1", "in [0, 1)", c.beta1);
  check_field(std::isfinite(c.beta2) && c.beta2 >= 0 && c.beta2 < 1, "beta2", "in [0, 1)", c.beta2);
  check_field(std::isfinite(c.eps) && c.eps > 0, "eps", "a finite number > 0", c.eps);
  check_field(std::isfinite(c.weight_decay) && c.weight_decay >= 0, "weight_decay", "a finite number >= 0",
              c.weight_decay);
  check_field(std::isfinite(c.clip_grad) && c.clip_grad >= 0, "clip_grad", "a finite number >= 0 (0: off)",
              c.clip_grad);
}

double global_norm(const TensorSet& grads) {
  double sum = 0;
  for (const auto& [name, g] : grads)
    for (float x : g) {
      const double d = x;
      sum += d * d;
    }
  return std::sqrt(sum);
}

// ---- the state file --------------------------------------------------------------------------
// Tensors are stored flat ([numel]); the number of dims of each is the metadata "ndim", a JSON object
// {"<name>": n}.

void OptimizerState::save(const std::string& path) const {
  auto bad = [&](const std::string& name, const std::string& what) {
    return Error(fmt::format("{}: cannot save the optimizer state: tensor '{}': {}", path, name, what));
  };
  json nd = json::object();
  SafetensorsWriter w;
  for (const auto& [name, p] : master) {
    const auto mi = m.find(name), vi = v.find(name);
    const auto di = ndim.find(name);
    if (mi == m.end()) throw bad(name, "no first moment ('m')");
    if (vi == v.end()) throw bad(name, "no second moment ('v')");
    if (di == ndim.end()) throw bad(name, "no number of dims ('ndim')");
    if (mi->second.size() != p.size() || vi->second.size() != p.size())
      throw bad(name, fmt::format("master has {} values, m {}, v {}", p.size(), mi->second.size(),
                                  vi->second.size()));
    if (di->second < 0) throw bad(name, fmt::format("negative number of dims {}", di->second));
    const std::vector<int64_t> shape{int64_t(p.size())};
    w.add_f32("master." + name, shape, p);
    w.add_f32("m." + name, shape, mi->second);
    w.add_f32("v." + name, shape, vi->second);
    nd[name] = di->second;
  }
  for (const auto* set : {&m, &v})
    for (const auto& [name, x] : *set)
      if (!master.count(name)) throw bad(name, "has moments but no master weights");
  for (const auto& [name, n] : ndim)
    if (!master.count(name)) throw bad(name, "has a number of dims but no master weights");
  if (step < 0) throw Error(fmt::format("{}: cannot save the optimizer state: negative step {}", path, step));
  w.set_metadata("format", kStateFormat);
  w.set_metadata("version", std::to_string(kStateVersion));
  w.set_metadata("step", std::to_string(step));
  w.set_metadata("ndim", nd.dump());
  w.write(path);
}

OptimizerState OptimizerState::load(const std::string& path) {
  const SafetensorsReader r = SafetensorsReader::open(path);  // structural errors name the file
  const auto meta = r.metadata();
  auto fail = [&](const std::string& what) {
    return InputError(fmt::format("{}: optimizer state: {}", path, what));
  };
  auto get = [&](const char* key) -> const std::string& {
    const auto it = meta.find(key);
    if (it == meta.end())
      throw fail(fmt::format("metadata '{}' is missing (not an optimizer state file?)", key));
    return it->second;
  };
  // A non-negative decimal integer, or nullopt-like -1.
  auto parse_count = [](const std::string& s) -> int64_t {
    if (s.empty() || s.size() > 18) return -1;
    int64_t x = 0;
    for (char ch : s) {
      if (ch < '0' || ch > '9') return -1;
      x = x * 10 + (ch - '0');
    }
    return x;
  };

  const std::string& format = get("format");
  if (format != kStateFormat)
    throw fail(fmt::format("metadata 'format' is '{}', expected '{}'", format, kStateFormat));
  const std::string& version = get("version");
  const int64_t ver = parse_count(version);
  if (ver < 1) throw fail(fmt::format("metadata 'version' must be a positive integer, found '{}'", version));
  if (ver > kStateVersion)
    throw fail(
        fmt::format("the file has format version {}, newer than this build reads (version {}); use "
                    "a newer dsv4 to read it",
                    ver, kStateVersion));
  OptimizerState s;
  const std::string& step = get("step");
  s.step = parse_count(step);
  if (s.step < 0) throw fail(fmt::format("metadata 'step' must be an integer >= 0, found '{}'", step));

  json nd;
  try {
    nd = json::parse(get("ndim"));
  } catch (const json::parse_error& e) {
    throw fail(fmt::format("metadata 'ndim' is not valid JSON (error at byte {})", e.byte));
  }
  if (!nd.is_object())
    throw fail(fmt::format("metadata 'ndim' must be a JSON object, found {}", nd.type_name()));
  for (const auto& [name, n] : nd.items()) {
    if (!n.is_number_unsigned() || n.get<uint64_t>() > 64)
      throw fail(
          fmt::format("metadata 'ndim': tensor '{}' must have an integer number of dims in [0, 64], "
                      "found {}",
                      name, n.dump()));
    s.ndim[name] = int(n.get<uint64_t>());
  }

  // Every stored tensor belongs to a name of 'ndim'; every name has its three tensors.
  for (const std::string& t : r.names()) {
    const size_t dot = t.find('.');
    const std::string kind = dot == std::string::npos ? "" : t.substr(0, dot);
    if (kind != "master" && kind != "m" && kind != "v")
      throw fail(fmt::format("unexpected tensor '{}' (expected master.<name>, m.<name> or v.<name>)", t));
    if (!s.ndim.count(t.substr(dot + 1)))
      throw fail(
          fmt::format("unexpected tensor '{}': '{}' is not listed in metadata 'ndim'", t, t.substr(dot + 1)));
  }
  for (const auto& [name, n] : s.ndim) {
    int64_t numel = -1;
    for (const char* kind : {"master", "m", "v"}) {
      const std::string t = std::string(kind) + "." + name;
      if (!r.contains(t)) throw fail(fmt::format("tensor '{}' is missing", t));
      const StTensorInfo& info = r.info(t);
      if (info.dtype != StDType::F32)
        throw fail(fmt::format("tensor '{}' has dtype {}, expected F32", t, to_string(info.dtype)));
      if (info.shape.size() != 1)
        throw fail(fmt::format("tensor '{}' has {} dims, expected 1 (stored flat)", t, info.shape.size()));
      if (numel < 0) numel = info.shape[0];
      if (info.shape[0] != numel)
        throw fail(
            fmt::format("tensor '{}' has {} values but master.{} has {}", t, info.shape[0], name, numel));
    }
    s.master[name] = r.read_f32("master." + name);
    s.m[name] = r.read_f32("m." + name);
    s.v[name] = r.read_f32("v." + name);
  }
  return s;
}

// ---- the step ----------------------------------------------------------------------------------

StepStats adamw_step(const AdamWConfig& c, const TensorSet& grads, OptimizerState& state) {
  check(c);
  // Everything is checked before anything changes, so a failed step leaves the state as it was.
  for (const auto& entry : grads) {
    // Named references, not a structured binding: the lambda below captures the name, which
    // clang 14 does not allow for a structured binding (a C++20 feature it lacks).
    const std::string& name = entry.first;
    const auto& g = entry.second;
    auto bad = [&](const std::string& what) {
      return InputError(fmt::format("AdamW step: tensor '{}': {}", name, what));
    };
    const auto pi = state.master.find(name);
    if (pi == state.master.end()) throw bad("not in the optimizer state (no master weights)");
    if (pi->second.size() != g.size())
      throw bad(
          fmt::format("the gradient has {} values but the master weights {}", g.size(), pi->second.size()));
    const auto mi = state.m.find(name), vi = state.v.find(name);
    if (mi == state.m.end() || mi->second.size() != g.size())
      throw bad(fmt::format("the first moment 'm' is missing or does not have {} values", g.size()));
    if (vi == state.v.end() || vi->second.size() != g.size())
      throw bad(fmt::format("the second moment 'v' is missing or does not have {} values", g.size()));
    if (!state.ndim.count(name)) throw bad("the optimizer state has no number of dims ('ndim') for it");
  }

  StepStats st;
  st.grad_norm = global_norm(grads);
  if (!std::isfinite(st.grad_norm)) {
    for (const auto& [name, g] : grads)
      for (size_t i = 0; i < g.size(); ++i)
        if (!std::isfinite(g[i]))
          throw Error(
              fmt::format("AdamW step: tensor '{}': the gradient is {} at index {}; the step is not "
                          "taken",
                          name, g[i], i));
    throw Error(fmt::format("AdamW step: the global gradient norm overflows ({}); the step is not taken",
                            st.grad_norm));
  }
  const double clip = c.clip_grad > 0 ? std::min(1.0, c.clip_grad / (st.grad_norm + 1e-6)) : 1.0;
  const float cc = float(clip);
  st.clip_coef = cc;

  state.step += 1;
  const int64_t t = state.step;
  // Per-step constants: each formed in fp64 and rounded to fp32 once.
  const float b1 = float(c.beta1), omb1 = float(1.0 - c.beta1);
  const float b2 = float(c.beta2), omb2 = float(1.0 - c.beta2);
  const float bc1 = float(1.0 - pow_int(c.beta1, t)), bc2 = float(1.0 - pow_int(c.beta2, t));
  const float lr = float(c.lr), lr_wd = float(c.lr * c.weight_decay), eps = float(c.eps);

  double upd = 0;
  std::vector<float> np;
  for (const auto& [name, gv] : grads) {
    std::vector<float>& pv = state.master.at(name);
    std::vector<float>& mv = state.m.at(name);
    std::vector<float>& vv = state.v.at(name);
    const bool decay = state.ndim.at(name) >= 2;
    const int64_t n = int64_t(gv.size());
    np.resize(size_t(n));
    const float* gp = gv.data();
    const float* pp = pv.data();
    float* mp = mv.data();
    float* vp = vv.data();
    float* out = np.data();
#pragma omp parallel for schedule(static) if (n >= kParallelMin)
    for (int64_t i = 0; i < n; ++i) {
      const float g = gp[i] * cc;
      const float m = b1 * mp[i] + omb1 * g;
      const float v = b2 * vp[i] + omb2 * g * g;
      const float mhat = m / bc1;
      const float vhat = v / bc2;
      float p = pp[i];
      if (decay) p = p - lr_wd * p;
      p = p - lr * mhat / (std::sqrt(vhat) + eps);
      mp[i] = m;
      vp[i] = v;
      out[i] = p;
    }
    for (int64_t i = 0; i < n; ++i) {
      const double d = double(out[i]) - double(pp[i]);
      upd += d * d;
    }
    std::copy(np.begin(), np.end(), pv.begin());
  }
  st.update_norm = std::sqrt(upd);
  return st;
}

}  // namespace dsv4::train
