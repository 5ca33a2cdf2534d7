#include "capture/validate.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <hdf5.h>

#include <algorithm>
#include <cmath>
#include <ctime>
#include <filesystem>
#include <optional>
#include <set>

#include "capture/digest.h"
#include "capture/env.h"
#include "capture/errors.h"
#include "capture/h5.h"
#include "capture/layout.h"
#include "capture/policy.h"
#include "capture/trace_open.h"
#include "capture/trace_reader.h"
#include "capture/training.h"
#include "model/config.h"
#include "model/manifest.h"
#include "model/profile.h"
#include "model/weights.h"

namespace dsv4 {
namespace {

using namespace trace_layout;  // the format's names

// A dataset with many bad rows reports the first few and then how many more there were.
constexpr int kFindingsPerDataset = 5;

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

class Validator {
 public:
  explicit Validator(ValidateReport& rep) : rep_(rep) {}

  void run(const std::string& path) {
    path_ = path;
    std::error_code ec;
    if (!std::filesystem::exists(path, ec)) {
      unreadable(fmt::format("{}: no such file", path));
      return;
    }
    // The seal first, with plain reads: its finding stands even when HDF5 cannot open the file.
    try {
      rep_.seal = check_seal(path);
    } catch (const TraceError& e) {
      unreadable(e.what());
      return;
    }
    if (!rep_.seal.ok()) problem("seal", seal_problem(rep_.seal));
    try {
      classify_with_reader(path);
    } catch (const TraceError& e) {
      unreadable(e.what());
      return;
    }
    OpenedTrace t;
    try {
      t = open_for_reading(path);
      trace_layout::check_trace_root(t.file, path);
    } catch (const std::exception& e) {
      unreadable(e.what());
      return;
    }
    rep_.readable = true;
    rep_.parts = t.parts;
    for (const TracePart& part : t.parts)
      if (!part.seal.ok()) problem("seal", fmt::format("part {}: {}", part.path, seal_problem(part.seal)));
    const h5::Object& root = t.file;
    rep_.writer_flag = t.writer_flag;
    // Past a seal that does not match, the structure is still checked (and the steps read): salvage
    // needs to know which steps are intact.
    if (t.writer_flag)
      problem(
          "file",
          "the file is marked as open for writing: its writer is still running or died while creating a step "
          "(outside SWMR mode); `dsv4 trace salvage` copies the complete steps into a new trace");
    guarded("/", [&] {
      version_ = h5::read_attr_int(root, kFormatVersion);
      if (version_ < 1) problem("/", "format_version is below 1");
      for (const char* a : {kProducer, kCreated})
        if (!h5::has_attr(root, a)) problem("/", fmt::format("attribute '{}' is missing", a));
    });
    check_meta(root);
    check_steps(root);
    if (!t.writer_flag) check_with_reader();
  }

 private:
  // ---- reporting --------------------------------------------------------------------------------
  void problem(const std::string& where, const std::string& what) {
    rep_.problems.push_back(TraceProblem{where, what, step_ ? step_->index : -1});
    if (step_) ++step_->problems;
  }
  void unreadable(const std::string& why) {
    rep_.readable = false;
    problem("file", why);
  }
  // Runs `f`; an exception (an HDF5 failure, a checksum error) becomes a problem at `where`. The
  // "FILE: PATH: " prefix of h5 errors is dropped when it repeats what the problem already names.
  template <typename F>
  bool guarded(const std::string& where, F&& f) {
    try {
      f();
      return true;
    } catch (const std::exception& e) {
      std::string what = e.what();
      if (what.rfind(path_ + ": ", 0) == 0) {
        const std::string rest = what.substr(path_.size() + 2);
        what = rest.rfind(where + ": ", 0) == 0 ? rest.substr(where.size() + 2) : rest;
      }
      problem(where, what);
      return false;
    }
  }

  // Findings about the rows of one dataset, capped at kFindingsPerDataset.
  class Findings {
   public:
    Findings(Validator& v, std::string where) : v_(v), where_(std::move(where)) {}
    ~Findings() {
      if (n_ > kFindingsPerDataset)
        v_.problem(where_, fmt::format("... and {} more like these", n_ - kFindingsPerDataset));
    }
    void add(const std::string& what) {
      if (n_++ < kFindingsPerDataset) v_.problem(where_, what);
    }

   private:
    Validator& v_;
    std::string where_;
    int n_ = 0;
  };

  // A dataset `name` of `parent` stored as one of `types` with shape `dims` (-1: any extent). Reports
  // a problem and returns nullopt when it is missing, not a dataset, or of another type or shape.
  std::optional<h5::Object> dataset(const h5::Object& parent, const std::string& name,
                                    const std::vector<h5::Type>& types, const std::vector<int64_t>& dims) {
    const std::string where = parent.child(name);
    std::optional<h5::Object> out;
    guarded(where, [&] {
      if (!h5::exists(parent, name)) {
        problem(where, "missing");
        return;
      }
      h5::Object ds = h5::open(parent, name);
      if (H5Iget_type(ds.get()) != H5I_DATASET) {
        problem(where, "is a group, expected a dataset");
        return;
      }
      const std::optional<h5::Type> t = h5::stored_type(ds);
      if (!t || std::find(types.begin(), types.end(), *t) == types.end()) {
        std::vector<std::string> want;
        for (h5::Type w : types) want.push_back(h5::type_name(w));
        problem(where, fmt::format("stored as {}, expected {}", t ? h5::type_name(*t) : "an unsupported type",
                                   fmt::join(want, " or ")));
        return;
      }
      const std::vector<hsize_t> shape = h5::shape(ds);
      bool same = shape.size() == dims.size();
      for (size_t i = 0; same && i < dims.size(); ++i) same = dims[i] < 0 || int64_t(shape[i]) == dims[i];
      if (!same) {
        std::vector<std::string> want;
        for (int64_t d : dims) want.push_back(d < 0 ? "*" : std::to_string(d));
        problem(where,
                fmt::format("shape [{}], expected [{}]", fmt::join(shape, ", "), fmt::join(want, ", ")));
        return;
      }
      out = std::move(ds);
    });
    return out;
  }

  // The values of a dataset checked by dataset(); nullopt (after a problem) when reading fails.
  template <typename T>
  std::optional<std::vector<T>> values(const std::optional<h5::Object>& ds) {
    if (!ds) return std::nullopt;
    std::optional<std::vector<T>> out;
    guarded(ds->path, [&] { out = h5::read<T>(*ds); });
    return out;
  }
  template <typename T>
  std::optional<std::vector<T>> read(const h5::Object& parent, const std::string& name,
                                     const std::vector<h5::Type>& types, const std::vector<int64_t>& dims) {
    return values<T>(dataset(parent, name, types, dims));
  }

  // Every value finite; `row` elements per reported row (token).
  void check_finite(const std::string& where, const std::vector<float>& v, int64_t row, const char* what) {
    Findings f(*this, where);
    for (size_t i = 0; i < v.size(); ++i)
      if (!std::isfinite(v[i]))
        f.add(fmt::format("{} {} at token {} (element {}) is not finite", what, v[i], int64_t(i) / row,
                          int64_t(i) % row));
  }

  // ---- what the commands read ------------------------------------------------------------------
  // Every accessor of TraceReader (what info, dump, replay, diff and the viewer read) over every
  // complete step that passed the checks above, so that a file validate accepts is readable by every
  // command: a refusal of the reader is a problem of the step (or of the file) here too.
  void check_with_reader() {
    std::optional<TraceReader> r;
    try {
      r.emplace(TraceReader::open(path_, SealPolicy::report));
    } catch (const std::exception& e) {
      // The reader lists /steps when it opens a trace: a refusal there is about the step list (which
      // salvage rebuilds), anything else about the file.
      const std::string what = e.what();
      problem(what.find("/" + std::string(kSteps)) != std::string::npos ? "/steps" : "file", what);
      return;
    }
    guarded("/", [&] {
      r->created();
      r->env();
      r->model();
      r->config();
      r->tensor_names();
    });
    guarded("/steps", [&] { r->sizes(); });  // opens every step group, damaged ones too
    const std::vector<TraceStepInfo> infos = r->steps();
    for (StepState& st : rep_.steps) {
      if (!st.complete || st.problems > 0) continue;
      step_ = &st;
      const std::string where = step_path(st.index);
      auto info = std::find_if(infos.begin(), infos.end(), [&](const TraceStepInfo& i) { return i.index == st.index; });
      if (info == infos.end() || !info->complete) {
        problem(where, info == infos.end() ? "not listed by the reader" : "the reader cannot use it: " + info->why_not_complete());
        step_ = nullptr;
        continue;
      }
      guarded(where, [&] {
        for (int q = 0; q < int(info->seq_lengths.size()); ++q) {
          r->tokens(st.index, q);
          if (!info->external() || r->has_logprobs(st.index, q)) r->logprobs(st.index, q);
          for (int L : r->decision_layers(st.index, q)) {
            r->indexer(st.index, q, L);
            r->routing(st.index, q, L);
            r->mhc(st.index, q, L, Sublayer::attn);
            r->mhc(st.index, q, L, Sublayer::ffn);
          }
          if (!info->external()) r->digests(st.index, q);
          for (const auto& [name, L] : r->full_tensors(st.index, q)) r->tensor(st.index, q, L, name);
        }
        r->kernels(st.index);
        r->generation(st.index);
        r->training(st.index);
      });
      step_ = nullptr;
    }
  }

  // ---- /meta ------------------------------------------------------------------------------------
  void check_meta(const h5::Object& root) {
    guarded("/meta", [&] {
      if (!h5::exists(root, kMeta)) {
        problem("/meta", "missing");
        return;
      }
      const h5::Object meta = h5::open(root, kMeta);
      guarded("/meta/env", [&] {
        if (!h5::exists(meta, kEnv)) {
          problem("/meta/env", "missing");
          return;
        }
        const h5::Object env = h5::open(meta, kEnv);
        for (const char* k : {"host", "os", "cpu_model", "cpu_flags", "compiler", "compile_flags", "build_id",
                              "gpu", "gpu_driver", "cuda", "cupti", "nccl", "hdf5"})
          if (!h5::has_attr(env, k)) problem("/meta/env", fmt::format("attribute '{}' is missing", k));
      });
      guarded("/meta/model", [&] {
        if (!h5::exists(meta, kModel)) {
          problem("/meta/model", "missing");
          return;
        }
        check_model(h5::open(meta, kModel));
      });
      if (auto names = read_strings(meta, kTensorNames)) tensor_names_ = *names;
    });
  }

  std::optional<std::vector<std::string>> read_strings(const h5::Object& parent, const std::string& name) {
    auto ds = dataset(parent, name, {h5::Type::str}, {-1});
    if (!ds) return std::nullopt;
    std::optional<std::vector<std::string>> out;
    guarded(ds->path, [&] { out = h5::read_strings(*ds); });
    return out;
  }

  void check_model(const h5::Object& model) {
    const std::string where = "/meta/model";
    for (const char* a : {kConfigJson, kWeightsPath, kModelDigest})
      if (!h5::has_attr(model, a)) problem(where, fmt::format("attribute '{}' is missing", a));
    if (h5::has_attr(model, kConfigJson)) {
      try {
        cfg_ = config_from_json(h5::read_attr_string(model, kConfigJson), kConfigJson);
      } catch (const std::exception& e) {
        problem(
            where,
            fmt::format("the recorded config cannot be used ({}); per-step checks that need it are skipped",
                        e.what()));
      }
    }
    auto names = read_strings(model, kTensorNames);
    auto digests = names ? read<uint64_t>(model, kTensorDigests, {h5::Type::u64}, {int64_t(names->size())})
                         : std::nullopt;
    if (!names || !digests) return;
    // An external trace may not know the engine's weights: model_digest "unknown", no tensor list.
    if (names->empty() && h5::has_attr(model, kModelDigest) &&
        h5::read_attr_string(model, kModelDigest) == kUnknownDigest)
      return;
    const std::string nwhere = model.child(kTensorNames);
    if (!std::is_sorted(names->begin(), names->end())) problem(nwhere, "the names are not sorted");
    if (cfg_) {
      std::vector<std::string> want;
      for (const WeightSpec& s : weight_specs(*cfg_)) want.push_back(s.name);
      std::sort(want.begin(), want.end());
      if (*names != want) {
        size_t i = 0;
        while (i < names->size() && i < want.size() && (*names)[i] == want[i]) ++i;
        problem(nwhere,
                fmt::format("{} names, the config's weights are {}; first difference at {}: '{}' vs '{}'",
                            names->size(), want.size(), i, i < names->size() ? (*names)[i] : "(end)",
                            i < want.size() ? want[i] : "(end)"));
      }
    }
    // The whole-model digest is a function of the per-tensor digests (capture/digest.h).
    if (h5::has_attr(model, kModelDigest)) {
      std::vector<uint8_t> all;
      for (size_t i = 0; i < names->size(); ++i) {
        all.insert(all.end(), (*names)[i].begin(), (*names)[i].end());
        all.push_back(0);
        for (int b = 0; b < 8; ++b) all.push_back(uint8_t((*digests)[i] >> (8 * b)));
      }
      const std::string recorded = h5::read_attr_string(model, kModelDigest);
      const std::string computed = hex16(xxh3_64(all.data(), all.size()));
      if (recorded != computed)
        problem(where, fmt::format("model_digest {} does not match the tensor digests (they give {})",
                                   recorded, computed));
    }
  }

  // ---- /steps -----------------------------------------------------------------------------------
  void check_steps(const h5::Object& root) {
    guarded("/steps", [&] {
      if (!h5::exists(root, kSteps)) {
        problem("/steps", "missing");
        return;
      }
      const h5::Object steps = h5::open(root, kSteps);
      const std::vector<std::string> names = h5::children(steps);
      int expected = 0;
      for (const std::string& name : names) {
        if (!is_step_name(name)) {
          problem("/steps", fmt::format("'{}' is not a step group (names are NNNNNN)", name));
          continue;
        }
        const int index = std::stoi(name);
        if (index != expected)
          problem("/steps", fmt::format("step {} follows step {} (steps are numbered from 0 without gaps)",
                                        name, expected - 1));
        expected = index + 1;
        rep_.steps.push_back(StepState{index, false, 0});
      }
      size_t k = 0;
      for (const std::string& name : names) {
        if (!is_step_name(name)) continue;
        step_ = &rep_.steps[k++];
        guarded(steps.child(name), [&] { check_step(h5::open(steps, name)); });
        step_ = nullptr;
      }
    });
  }

  void check_step(const h5::Object& step) {
    const std::optional<int> status = step_status(step);
    if (!status) {
      problem(step.child(kStatus), "missing or unreadable: the step cannot be told complete");
      return;
    }
    if (*status == 0) {
      problem(step.child(kStatus),
              fmt::format(
                  "step {} is incomplete (status 0): its recorder stopped during the step; readers skip it "
                  "and `dsv4 trace salvage` keeps the complete steps",
                  step_->index));
      return;
    }
    if (*status != 1) {
      problem(step.child(kStatus), fmt::format("status is {}, expected 0 or 1", *status));
      return;
    }
    step_->complete = true;

    std::optional<CapturePolicy> policy;
    int64_t n_seqs = -1;
    step_kind_.clear();
    // An external step (capture/external.h): another engine's decisions, no digests.
    external_ = h5::has_attr(step, kEngine);
    if (external_ && version_ >= 1 && version_ < kExternalFormatVersion)
      problem(step.path, fmt::format("an external step needs format_version {}, the file has {}", kExternalFormatVersion,
                                     version_));
    guarded(step.path, [&] {
      for (const char* a : {kKind, kProfile, kSeed, kThreads, kCapture, kNSeqs})
        if (!h5::has_attr(step, a)) problem(step.path, fmt::format("attribute '{}' is missing", a));
      if (h5::has_attr(step, kKind)) {
        const std::string kind = h5::read_attr_string(step, kKind);
        step_kind_ = kind;
        if (!is_step_kind(kind))
          problem(step.path, fmt::format("kind '{}', expected {}", kind, step_kinds_text()));
        if (kind == kKindGenerate && !h5::exists(step, kGeneration))
          problem(step.path, fmt::format("a generation step without its '{}' group", kGeneration));
        if (kind == kKindTrainStep) {
          if (!has_training(step))
            problem(step.child(kTraining),
                    fmt::format("missing: a '{}' step holds its training record there", kKindTrainStep));
          else
            guarded(step.child(kTraining), [&] { read_training(step, path_); });
        }
        if (is_step_kind(kind) && version_ >= 1 && step_format_version(kind) > version_)
          problem(step.path, fmt::format("a '{}' step needs format_version {}, the file has {}", kind,
                                         step_format_version(kind), version_));
      }
      if (h5::has_attr(step, kProfileText)) {  // the recorded precision map: digest, text and name agree
        TraceStepInfo info;
        info.group = step.path;
        info.profile = h5::has_attr(step, kProfile) ? h5::read_attr_string(step, kProfile) : "";
        info.profile_text = h5::read_attr_string(step, kProfileText);
        info.profile_digest = h5::has_attr(step, kProfileDigest) ? h5::read_attr_string(step, kProfileDigest) : "";
        try {
          recorded_profile(info, path_);
        } catch (const Error& e) {
          problem(step.path, e.what());
        }
      } else if (h5::has_attr(step, kProfile) && !external_) {  // an engine's numerics need not be ours
        const std::string profile = h5::read_attr_string(step, kProfile);
        if (!is_builtin_profile(profile))
          problem(step.path, fmt::format("profile '{}' is not one of {} and the step stores no profile text",
                                         profile, fmt::join(profile_names(), ", ")));
      }
      if (h5::has_attr(step, kSeed)) h5::read_attr_u64(step, kSeed);
      if (h5::has_attr(step, kThreads) && h5::read_attr_int(step, kThreads) < 0)
        problem(step.path, "threads is negative");
      if (external_) {
        if (!h5::has_attr(step, kCapture) || h5::read_attr_string(step, kCapture) != kExternalCapture)
          problem(step.path, fmt::format("an external step's capture is '{}'", kExternalCapture));
        if (h5::read_attr_string(step, kEngine).empty()) problem(step.path, "the engine attribute is empty");
        if (step_kind_ != "rollout" && step_kind_ != "train")
          problem(step.path, fmt::format("an external step of kind '{}', expected 'rollout' or 'train'", step_kind_));
      } else if (h5::has_attr(step, kCapture)) {
        try {
          policy = CapturePolicy::parse(h5::read_attr_string(step, kCapture));
          if (cfg_) policy->check_matches(*cfg_);
        } catch (const InputError& e) {
          problem(step.path, e.what());
        }
      }
      if (h5::has_attr(step, kNSeqs)) {
        n_seqs = h5::read_attr_int(step, kNSeqs);
        if (n_seqs < 0) problem(step.path, fmt::format("n_seqs is {}", n_seqs));
      }
    });
    if (n_seqs < 0) return;
    const auto lengths = read<int64_t>(step, kSeqLengths, {h5::Type::i32}, {n_seqs});
    if (!lengths) return;
    for (int64_t s = 0; s < n_seqs; ++s) {
      const std::string name = seq_name(int(s));
      const std::string where = step.child(name);
      const int64_t T = (*lengths)[size_t(s)];
      if (T < 1) {
        problem(step.child(kSeqLengths), fmt::format("sequence {} has length {}", s, T));
        continue;
      }
      guarded(where, [&] {
        if (!h5::exists(step, name)) {
          problem(where, "missing");
          return;
        }
        check_sequence(h5::open(step, name), T, policy ? &*policy : nullptr);
      });
    }
    // Sequence groups beyond n_seqs (other names are left alone: readers ignore what they do not know).
    guarded(step.path, [&] {
      for (const std::string& child : h5::children(step))
        if (child.size() == 7 && child.rfind(kSeqPrefix, 0) == 0 &&
            std::all_of(child.begin() + 4, child.end(), [](char c) { return c >= '0' && c <= '9'; }) &&
            std::stoll(child.substr(4)) >= n_seqs)
          problem(step.child(child), fmt::format("unexpected: the step has n_seqs = {}", n_seqs));
    });
  }

  // ---- one sequence -----------------------------------------------------------------------------
  // Token ids of a sequence: int32 [T], inside the vocabulary.
  void check_tokens(const h5::Object& seq, int64_t T) {
    const auto tokens = read<int32_t>(seq, kTokens, {h5::Type::i32}, {T});
    if (!tokens || !cfg_) return;
    Findings f(*this, seq.child(kTokens));
    for (size_t t = 0; t < tokens->size(); ++t)
      if ((*tokens)[t] < 0 || (*tokens)[t] >= cfg_->vocab_size)
        f.add(fmt::format("token id {} at token {} is outside [0, vocab_size = {})", (*tokens)[t], t,
                          cfg_->vocab_size));
  }

  // An external step's sequence: tokens, log-probs when the engine reported them, the decisions of the
  // layers it reported (T or T - 1 rows, margins and weights optional), no digests.
  void check_external_sequence(const h5::Object& seq, int64_t T) {
    check_tokens(seq, T);
    if (h5::exists(seq, kLogprobs))
      if (auto lp = read<float>(seq, kLogprobs, {h5::Type::f32}, {T - 1})) check_finite(seq.child(kLogprobs), *lp, 1, "log-prob");
    if (!cfg_ || !h5::exists(seq, kDecisions)) return;
    const h5::Object dec = h5::open(seq, kDecisions);
    for (const std::string& child : h5::children(dec)) {
      const int L = child.size() == 9 && child.rfind(kLayerPrefix, 0) == 0 ? std::atoi(child.c_str() + 6) : -1;
      if (L < 0 || L >= cfg_->num_hidden_layers) {
        problem(dec.child(child), fmt::format("unexpected: the config has {} layers", cfg_->num_hidden_layers));
        continue;
      }
      guarded(dec.child(child), [&] {
        const h5::Object g = h5::open(dec, child);
        check_hashed_attr(g, cfg_->is_hash_layer(L));
        for (const char* n : {kIndexerCount, kExperts}) {
          if (!h5::exists(g, n)) continue;
          const int64_t rows = int64_t(h5::shape(h5::open(g, n)).at(0));
          if (rows != T && rows != T - 1) {
            problem(g.child(n), fmt::format("{} rows for {} tokens (expected {} or {})", rows, T, T, T - 1));
            return;
          }
          if (n == kIndexerCount) {
            if (cfg_->ratio(L) != 4)
              problem(g.child(n), fmt::format("unexpected on a layer with compress ratio {}", cfg_->ratio(L)));
            else
              check_indexer(g, T, rows);
          } else {
            check_routing(g, L, rows);
          }
        }
      });
    }
  }

  void check_sequence(const h5::Object& seq, int64_t T, const CapturePolicy* policy) {
    if (external_) {
      check_external_sequence(seq, T);
      return;
    }
    check_tokens(seq, T);
    if (auto lp = read<float>(seq, kLogprobs, {h5::Type::f32}, {T - 1})) {
      Findings f(*this, seq.child(kLogprobs));
      for (size_t t = 0; t < lp->size(); ++t)
        if (!std::isfinite((*lp)[t]) || (*lp)[t] > 0.0f)
          f.add(fmt::format("log-prob {} at token {} is {}", (*lp)[t], t,
                            std::isfinite((*lp)[t]) ? "positive" : "not finite"));
    }
    if (!cfg_) return;
    guarded(seq.child(kDecisions), [&] {
      if (!h5::exists(seq, kDecisions)) {
        problem(seq.child(kDecisions), "missing");
        return;
      }
      const h5::Object dec = h5::open(seq, kDecisions);
      std::set<std::string> expected;
      for (int L = 0; L < cfg_->num_hidden_layers; ++L) {
        const std::string name = layer_name(L);
        expected.insert(name);
        guarded(dec.child(name), [&] {
          if (!h5::exists(dec, name)) {
            problem(dec.child(name), "missing");
            return;
          }
          check_layer(h5::open(dec, name), L, T);
        });
      }
      for (const std::string& child : h5::children(dec))
        if (!expected.count(child))
          problem(dec.child(child),
                  fmt::format("unexpected: the config has {} layers (layer_000 .. layer_{:03})",
                              cfg_->num_hidden_layers, cfg_->num_hidden_layers - 1));
    });
    const std::vector<TensorSpecT> manifest = tensor_manifest(*cfg_, T);
    std::vector<int64_t> first;  // per manifest entry: offset of its rows in `value`; empty if unusable
    std::vector<uint64_t> digest_values;
    guarded(seq.child(kDigests), [&] {
      if (!h5::exists(seq, kDigests)) {
        problem(seq.child(kDigests), "missing");
        return;
      }
      check_digests(h5::open(seq, kDigests), manifest, first, digest_values);
    });
    guarded(seq.child(kTensors), [&] { check_tensors(seq, manifest, first, digest_values, policy); });
  }

  // Decisions of one layer (traces/FORMAT.md "decisions/layer_LLL").
  void check_layer(const h5::Object& g, int L, int64_t T) {
    const ModelConfig& c = *cfg_;
    // Indexer: only on ratio-4 layers.
    const bool indexed = c.ratio(L) == 4;
    if (indexed) {
      check_indexer(g, T);
    } else {
      for (const char* n : {kIndexerCount, kIndexerGaps, kIndexerMargin})
        if (h5::exists(g, n))
          problem(g.child(n),
                  fmt::format("unexpected on a layer with compress ratio {} (only ratio-4 layers have an "
                              "indexer)",
                              c.ratio(L)));
    }
    check_routing(g, L, T);
    check_hashed_attr(g, c.is_hash_layer(L));
    // mHC mixing.
    const int64_t hc = c.hc_mult;
    for (const char* sub : {"attn", "ffn"}) {
      for (const char* part : {"pre", "post"}) {
        const std::string n = mhc_name(sub, part);
        if (auto v = read<float>(g, n, {h5::Type::f32}, {T, hc}))
          check_finite(g.child(n), *v, hc, "mHC weight");
      }
      const std::string n = mhc_name(sub, "comb");
      if (auto v = read<float>(g, n, {h5::Type::f32}, {T, hc, hc}))
        check_finite(g.child(n), *v, hc * hc, "mHC weight");
    }
  }

  // Routing of layer L over `T` rows: ids ascending, distinct and in range, weights finite, margins
  // (optional on external steps, like the weights) never NaN.
  void check_routing(const h5::Object& g, int L, int64_t T) {
    const ModelConfig& c = *cfg_;
    const int k = c.num_experts_per_tok;
    const h5::Type id_type = c.n_routed_experts - 1 <= 0xff ? h5::Type::u8 : h5::Type::u16;
    if (auto ids = read<int32_t>(g, kExperts, {id_type}, {T, k})) {
      Findings f(*this, g.child(kExperts));
      for (int64_t t = 0; t < T; ++t)
        for (int j = 0; j < k; ++j) {
          const int32_t e = (*ids)[size_t(t * k + j)];
          if (e >= c.n_routed_experts)
            f.add(fmt::format("expert id {} at token {} is >= n_routed_experts ({})", e, t,
                              c.n_routed_experts));
          else if (j > 0 && e <= (*ids)[size_t(t * k + j - 1)])
            f.add(fmt::format("expert ids at token {} are not ascending and distinct ({} after {})", t, e,
                              (*ids)[size_t(t * k + j - 1)]));
        }
    }
    if (external_ && !h5::exists(g, kExpertWeights)) {
    } else if (auto w = read<float>(g, kExpertWeights, {h5::Type::f32}, {T, k})) {
      check_finite(g.child(kExpertWeights), *w, k, "routing weight");
    }
    const bool hashed = c.is_hash_layer(L);
    if (external_ && !h5::exists(g, kRouterMargin)) {
    } else if (auto m = read<float>(g, kRouterMargin, {h5::Type::f32}, {T})) {
      Findings f(*this, g.child(kRouterMargin));
      for (int64_t t = 0; t < T; ++t) {
        const float x = (*m)[size_t(t)];
        if (std::isnan(x))
          f.add(fmt::format("margin at token {} is NaN", t));
        else if (hashed && !(std::isinf(x) && x > 0))
          f.add(fmt::format("margin {} at token {} of a hash-routed layer, expected +inf", x, t));
        else if (x < 0 && !margins_may_be_negative())
          f.add(fmt::format("margin {} at token {} is negative (a top-k margin is >= 0)", x, t));
      }
    }
  }

  // A margin is score(k-th chosen) - score(best unchosen) >= 0 (kernels/indexer.h topk_row). Only a
  // training step may have run with forced decisions (R3), whose margins are measured against the
  // free choice and can be negative (kernels/moe.h).
  bool margins_may_be_negative() const { return step_kind_ == kKindTrainStep; }
  bool external_ = false;  // the step being checked is an external step

  // The `hashed` flag: an attribute of the layer group or of its router_margin dataset.
  void check_hashed_attr(const h5::Object& g, bool hashed) {
    guarded(g.path, [&] {
      std::optional<h5::Object> margin;
      if (!h5::has_attr(g, kHashed) && h5::exists(g, kRouterMargin)) margin = h5::open(g, kRouterMargin);
      const h5::Object* holder = h5::has_attr(g, kHashed)                   ? &g
                                 : margin && h5::has_attr(*margin, kHashed) ? &*margin
                                                                            : nullptr;
      if (!holder) {
        problem(g.path, "attribute 'hashed' is missing");
        return;
      }
      const int64_t v = h5::read_attr_int(*holder, kHashed);
      if (v != (hashed ? 1 : 0))
        problem(holder->path, fmt::format("hashed = {}, expected {} (num_hash_layers = {})", v,
                                          hashed ? 1 : 0, cfg_->num_hash_layers));
    });
  }

  // The indexer of a sequence of T tokens over `rows` rows (T; T - 1 on an external step).
  void check_indexer(const h5::Object& g, int64_t T, int64_t rows = -1) {
    if (rows < 0) rows = T;
    const int64_t width = cfg_->indexer_width(T);
    // indexer_width: on the layer group or on indexer_margin.
    guarded(g.path, [&] {
      std::string holder_path;
      int64_t recorded = -1;
      if (h5::has_attr(g, kIndexerWidth)) {
        holder_path = g.path;
        recorded = h5::read_attr_int(g, kIndexerWidth);
      } else if (h5::exists(g, kIndexerMargin) && h5::has_attr(h5::open(g, kIndexerMargin), kIndexerWidth)) {
        holder_path = g.child(kIndexerMargin);
        recorded = h5::read_attr_int(h5::open(g, kIndexerMargin), kIndexerWidth);
      } else {
        problem(g.path, "attribute 'indexer_width' is missing");
        return;
      }
      if (recorded != width)
        problem(holder_path,
                fmt::format("indexer_width = {}, expected min(index_topk = {}, floor(T / 4) = {}) = {}",
                            recorded, cfg_->index_topk, T / 4, width));
    });
    if (external_ && !h5::exists(g, kIndexerMargin)) {
    } else if (auto m = read<float>(g, kIndexerMargin, {h5::Type::f32}, {rows})) {
      Findings f(*this, g.child(kIndexerMargin));
      for (int64_t t = 0; t < rows; ++t) {
        const float x = (*m)[size_t(t)];
        if (std::isnan(x))
          f.add(fmt::format("margin at token {} is NaN", t));
        else if (x < 0 && !margins_may_be_negative())
          f.add(fmt::format("margin {} at token {} is negative (a top-k margin is >= 0)", x, t));
      }
    }
    const auto count = read<int64_t>(g, kIndexerCount, {h5::Type::u16}, {rows});
    if (!count) return;
    int64_t total = 0;
    bool counts_ok = true;
    {
      Findings f(*this, g.child(kIndexerCount));
      for (int64_t t = 0; t < rows; ++t) {
        const int64_t n = (*count)[size_t(t)];
        const int64_t visible = (t + 1) / 4;
        if (n > width) {
          f.add(fmt::format("{} ids at token {}, more than indexer_width = {}", n, t, width));
          counts_ok = false;
        } else if (n > visible) {
          f.add(fmt::format("{} ids at token {}, which sees only {} compressed groups", n, t, visible));
          counts_ok = false;
        }
        total += n;
      }
    }
    const auto gaps = read<int64_t>(g, kIndexerGaps, {h5::Type::u8, h5::Type::u16, h5::Type::u32}, {total});
    if (!gaps || !counts_ok) return;
    // Decoding makes the ids ascending and distinct by construction; what can be wrong is visibility.
    Findings f(*this, g.child(kIndexerGaps));
    size_t pos = 0;
    for (int64_t t = 0; t < rows; ++t) {
      const int64_t visible = (t + 1) / 4;
      int64_t id = -1;
      for (int64_t j = 0; j < (*count)[size_t(t)]; ++j) {
        id += (*gaps)[pos++] + 1;
        if (id >= visible)
          f.add(fmt::format("indexer id {} at token {} (gaps[{}]) is not visible: token {} sees groups < {}",
                            id, t, pos - 1, t, visible));
      }
    }
  }

  // Digest records against the manifest of the config and the sequence length. On success `first`
  // holds each record's offset into `values`.
  void check_digests(const h5::Object& d, const std::vector<TensorSpecT>& manifest,
                     std::vector<int64_t>& first, std::vector<uint64_t>& values_out) {
    const auto tensor = read<int32_t>(d, kDigestTensor, {h5::Type::i32}, {-1});
    const int64_t M = tensor ? int64_t(tensor->size()) : -1;
    const auto layer = tensor ? read<int32_t>(d, kDigestLayer, {h5::Type::i32}, {M}) : std::nullopt;
    const auto rows = tensor ? read<int64_t>(d, kDigestRows, {h5::Type::i64}, {M}) : std::nullopt;
    const auto value = read<uint64_t>(d, kDigestValue, {h5::Type::u64}, {-1});
    if (!tensor || !layer || !rows || !value) return;
    bool ok = true;
    {
      Findings f(*this, d.child(kDigestTensor));
      for (int64_t i = 0; i < M; ++i)
        if ((*tensor)[size_t(i)] < 0 || size_t((*tensor)[size_t(i)]) >= tensor_names_.size()) {
          f.add(fmt::format("record {} names tensor {}, /meta/tensor_names has {}", i, (*tensor)[size_t(i)],
                            tensor_names_.size()));
          ok = false;
        }
    }
    if (!ok) return;
    auto describe = [](const std::string& name, int l, int64_t r) {
      return fmt::format("{} of {} ({} rows)", name, l < 0 ? "the model" : fmt::format("layer {}", l), r);
    };
    const int64_t n = std::min<int64_t>(M, int64_t(manifest.size()));
    for (int64_t i = 0; i < n && ok; ++i) {
      const TensorSpecT& m = manifest[size_t(i)];
      const std::string& name = tensor_names_[size_t((*tensor)[size_t(i)])];
      if (name != m.name || (*layer)[size_t(i)] != m.layer || (*rows)[size_t(i)] != m.rows()) {
        const std::string which = name != m.name                   ? "tensor"
                                  : (*layer)[size_t(i)] != m.layer ? "layer"
                                                                   : "rows";
        problem(d.child(which), fmt::format("record {} is {}, expected {} (the tensor manifest)", i,
                                            describe(name, (*layer)[size_t(i)], (*rows)[size_t(i)]),
                                            describe(m.name, m.layer, m.rows())));
        ok = false;
      }
    }
    if (ok && M != int64_t(manifest.size())) {
      problem(
          d.child(kDigestTensor),
          M < int64_t(manifest.size())
              ? fmt::format(
                    "{} records, the manifest has {}: the first missing is {}", M, manifest.size(),
                    describe(manifest[size_t(M)].name, manifest[size_t(M)].layer, manifest[size_t(M)].rows()))
              : fmt::format("{} records, the manifest has {}: record {} is extra", M, manifest.size(),
                            manifest.size()));
      ok = false;
    }
    int64_t sum = 0;
    for (int64_t r : *rows) sum += r;
    if (sum != int64_t(value->size())) {
      problem(d.child(kDigestValue),
              fmt::format("{} digests, the records' rows add up to {}", value->size(), sum));
      ok = false;
    }
    if (!ok) return;
    first.resize(size_t(M));
    int64_t off = 0;
    for (int64_t i = 0; i < M; ++i) {
      first[size_t(i)] = off;
      off += (*rows)[size_t(i)];
    }
    values_out = std::move(*value);
  }

  // Full tensors kept by the capture policy: each must be a manifest entry of the right dtype and
  // shape whose row digests equal the recorded ones, and every tensor the policy wants must be there.
  void check_tensors(const h5::Object& seq, const std::vector<TensorSpecT>& manifest,
                     const std::vector<int64_t>& first, const std::vector<uint64_t>& values,
                     const CapturePolicy* policy) {
    const bool present = h5::exists(seq, kTensors);
    std::optional<h5::Object> tg;
    if (present) tg = h5::open(seq, kTensors);
    std::set<std::pair<std::string, int>> found;
    if (tg) {
      for (const std::string& name : h5::children(*tg)) {
        const std::string nwhere = tg->child(name);
        guarded(nwhere, [&] {
          const h5::Object ng = h5::open(*tg, name);
          for (const std::string& lname : h5::children(ng)) {
            const std::string where = ng.child(lname);
            auto it = std::find_if(manifest.begin(), manifest.end(), [&](const TensorSpecT& m) {
              return m.name == name && layer_name(m.layer) == lname;
            });
            if (it == manifest.end()) {
              problem(where, "not a tensor of the manifest for this config and sequence length");
              continue;
            }
            found.insert({name, it->layer});
            const size_t idx = size_t(it - manifest.begin());
            check_full_tensor(ng, lname, *it, first.empty() ? -1 : first[idx], values);
          }
        });
      }
    }
    if (!policy) return;
    Findings f(*this, seq.child(kTensors));
    for (const TensorSpecT& m : manifest)
      if (policy->wants_tensor(m.name, m.layer) && !found.count({m.name, m.layer}))
        f.add(fmt::format("the capture policy '{}' keeps {} of {}, which is missing", policy->text(), m.name,
                          m.layer < 0 ? "the model" : fmt::format("layer {}", m.layer)));
  }

  void check_full_tensor(const h5::Object& parent, const std::string& lname, const TensorSpecT& m,
                         int64_t first, const std::vector<uint64_t>& values) {
    const h5::Type type = m.dtype == DType::bf16  ? h5::Type::u16
                          : m.dtype == DType::f32 ? h5::Type::f32
                                                  : h5::Type::i32;
    const char* dtype_attr = m.dtype == DType::bf16  ? "bfloat16"
                             : m.dtype == DType::f32 ? "float32"
                                                     : "int32";
    const auto ds = dataset(parent, lname, {type}, m.shape);
    if (!ds) return;
    guarded(ds->path, [&] {
      if (!h5::has_attr(*ds, kDtype))
        problem(ds->path, "attribute 'dtype' is missing");
      else if (const std::string a = h5::read_attr_string(*ds, kDtype); a != dtype_attr)
        problem(ds->path, fmt::format("dtype = '{}', expected '{}'", a, dtype_attr));
      if (first < 0) return;  // the digest table is unusable (reported there)
      const int64_t rows = m.rows(), elems = m.row_elems();
      std::vector<uint64_t> got;
      if (type == h5::Type::u16) {
        const auto v = h5::read<uint16_t>(*ds);
        for (int64_t r = 0; r < rows; ++r) got.push_back(xxh3_64(v.data() + r * elems, size_t(elems) * 2));
      } else if (type == h5::Type::f32) {
        const auto v = h5::read<float>(*ds);
        for (int64_t r = 0; r < rows; ++r) got.push_back(xxh3_64(v.data() + r * elems, size_t(elems) * 4));
      } else {
        const auto v = h5::read<int32_t>(*ds);
        for (int64_t r = 0; r < rows; ++r) got.push_back(xxh3_64(v.data() + r * elems, size_t(elems) * 4));
      }
      Findings f(*this, ds->path);
      for (int64_t r = 0; r < rows; ++r)
        if (got[size_t(r)] != values[size_t(first + r)])
          f.add(fmt::format("row {} hashes to {}, its recorded digest is {}", r, hex16(got[size_t(r)]),
                            hex16(values[size_t(first + r)])));
    });
  }

  ValidateReport& rep_;
  std::string path_;
  StepState* step_ = nullptr;
  int64_t version_ = 0;  // the root's format_version
  std::optional<ModelConfig> cfg_;
  std::vector<std::string> tensor_names_;
  std::string step_kind_;  // the kind of the step being checked ("" when unreadable)
};

}  // namespace

ValidateReport validate_trace(const std::string& path) {
  ValidateReport rep;
  rep.path = path;
  rep.incomplete_file = ends_with(path, ".incomplete");
  try {
    Validator(rep).run(path);
  } catch (const std::exception& e) {  // a failure outside every guarded check: report, never throw
    rep.problems.push_back(TraceProblem{"file", e.what()});
  }
  return rep;
}

}  // namespace dsv4
