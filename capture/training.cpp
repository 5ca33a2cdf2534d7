// The training record of a step (capture/training.h) in HDF5: the layout of traces/FORMAT.md
// "Training steps". Every name comes from capture/layout.h; the rules a record must satisfy are in
// training_problem(), which the writer applies before writing and the reader after reading, so what
// one accepts the other reads back.
#include "capture/training.h"

#include <fmt/format.h>

#include <optional>
#include <utility>

#include "capture/errors.h"
#include "capture/layout.h"
#include "model/error.h"

namespace dsv4 {
namespace {

using namespace trace_layout;  // the format's names

// The per-row digest lists of a parameter, as stored: params/<name> with params/<name>_count.
constexpr std::pair<const char*, std::vector<uint64_t> ParamDigests::*> kParamDigestSets[] = {
    {kTrainGrad, &ParamDigests::grad},     {kTrainWeight, &ParamDigests::weight},
    {kTrainMaster, &ParamDigests::master}, {kTrainM, &ParamDigests::m},
    {kTrainV, &ParamDigests::v},
};
// The per-token loss inputs of a sample, as stored: samples/<name> with samples/<name>_count.
constexpr std::pair<const char*, std::vector<float> SampleLossInputs::*> kSampleArrays[] = {
    {kTrainRolloutLogprobs, &SampleLossInputs::rollout_logprobs},
    {kTrainOldLogprobs, &SampleLossInputs::old_logprobs},
    {kTrainRefLogprobs, &SampleLossInputs::ref_logprobs},
};
// The full tensors, each group a dataset per tensor name.
using FullTensors = std::map<std::string, std::vector<float>>;
constexpr std::pair<const char*, FullTensors TrainingRecord::*> kFullTensors[] = {
    {kTrainFullGrads, &TrainingRecord::full_grads},
    {kTrainFullWeights, &TrainingRecord::full_weights},
};

std::string sub(const char* group, const std::string& name) {
  return fmt::format("{}/{}", group, name);
}

// What makes a record unwritable (and a stored one corrupt), beyond the datasets' own consistency:
// the dataset (relative to the training group) and what is wrong with it; nullopt when none.
struct Problem {
  std::string dataset, what;
};
std::optional<Problem> training_problem(const TrainingRecord& t, const std::vector<int64_t>& seq_lengths) {
  const size_t S = seq_lengths.size();
  if (t.samples.size() != S)
    return Problem{sub(kTrainSamples, kTrainSampleId),
                   fmt::format("{} samples for a step of {} sequences", t.samples.size(), S)};
  for (size_t i = 0; i < S; ++i) {
    const SampleLossInputs& s = t.samples[i];
    const int64_t T = seq_lengths[i];
    if (s.prompt_length < 0 || s.prompt_length > T)
      return Problem{
          sub(kTrainSamples, kTrainPromptLength),
          fmt::format("sample {} has prompt length {}, its sequence {} tokens", i, s.prompt_length, T)};
    for (const auto& [name, member] : kSampleArrays) {
      const size_t n = (s.*member).size();
      if (n != 0 && int64_t(n) != T - s.prompt_length)
        return Problem{sub(kTrainSamples, name),
                       fmt::format("sample {} has {} values, its response {} tokens (empty when absent)", i,
                                   n, T - s.prompt_length)};
    }
  }
  std::map<std::string, const ParamDigests*> by_name;
  for (const ParamDigests& p : t.params) {
    if (p.name.empty() || p.name == "." || p.name.find('/') != std::string::npos)
      return Problem{sub(kTrainParams, kTrainParamName),
                     fmt::format("'{}' is not a tensor name (empty, '.' or holding '/')", p.name)};
    if (!by_name.emplace(p.name, &p).second)
      return Problem{sub(kTrainParams, kTrainParamName), fmt::format("'{}' is listed twice", p.name)};
    if (p.rows < 0 || p.row_elems < 0)
      return Problem{sub(kTrainParams, kTrainParamRows),
                     fmt::format("parameter '{}' is [{}, {}]", p.name, p.rows, p.row_elems)};
    for (const auto& [name, member] : kParamDigestSets) {
      const size_t n = (p.*member).size();
      if (n != 0 && int64_t(n) != p.rows)
        return Problem{sub(kTrainParams, name),
                       fmt::format("parameter '{}' has {} digests for {} rows (or none)", p.name, n, p.rows)};
    }
  }
  for (size_t i = 0; i < t.act_grads.size(); ++i) {
    const ActGradDigests& a = t.act_grads[i];
    if (a.seq < 0 || size_t(a.seq) >= S)
      return Problem{sub(kTrainActGrads, kTrainActSeq),
                     fmt::format("entry {} ('{}') is of sequence {}, the step has {}", i, a.name, a.seq, S)};
    if (a.layer < -1)
      return Problem{sub(kTrainActGrads, kTrainActLayer),
                     fmt::format("entry {} ('{}') has layer {}", i, a.name, a.layer)};
    if (a.rows < 0 || a.cols < 0)
      return Problem{sub(kTrainActGrads, kTrainActRows),
                     fmt::format("entry {} ('{}') is [{}, {}]", i, a.name, a.rows, a.cols)};
    if (int64_t(a.digests.size()) != a.rows)
      return Problem{
          sub(kTrainActGrads, kTrainActDigests),
          fmt::format("entry {} ('{}') has {} digests for {} rows", i, a.name, a.digests.size(), a.rows)};
  }
  for (const auto& [group, member] : kFullTensors) {
    for (const auto& [name, values] : t.*member) {
      auto it = by_name.find(name);
      if (it == by_name.end())
        return Problem{sub(group, name), fmt::format("'{}' is not one of the parameters ({}/{})", name,
                                                     kTrainParams, kTrainParamName)};
      const ParamDigests& p = *it->second;
      if (int64_t(values.size()) != p.rows * p.row_elems)
        return Problem{sub(group, name), fmt::format("{} values for a parameter of [{}, {}]", values.size(),
                                                     p.rows, p.row_elems)};
    }
  }
  return std::nullopt;
}

std::vector<hsize_t> dims(int64_t n) {
  return {hsize_t(n)};
}

// ---- writing ------------------------------------------------------------------------------------

template <typename T>
void put(const h5::Object& g, const std::string& name, h5::Type t, const std::vector<T>& v,
         h5::Compress c = h5::Compress::yes) {
  h5::Object d = h5::create_dataset(g, name, t, dims(int64_t(v.size())), false, 0, c);
  if (!v.empty()) h5::write(d, v);
}

void put_strings(const h5::Object& g, const std::string& name, const std::vector<std::string>& v) {
  h5::Object d = h5::create_dataset(g, name, h5::Type::str, dims(int64_t(v.size())));
  if (!v.empty()) h5::write_strings(d, v);
}

// A ragged list: `name` holds the entries concatenated, count_name(name) their lengths.
template <typename T, typename Get>
void put_ragged(const h5::Object& g, const char* name, h5::Type t, size_t n, Get get,
                h5::Compress c = h5::Compress::yes) {
  std::vector<T> all;
  std::vector<int64_t> count(n);
  for (size_t i = 0; i < n; ++i) {
    const std::vector<T>& v = get(i);
    count[i] = int64_t(v.size());
    all.insert(all.end(), v.begin(), v.end());
  }
  put(g, name, t, all, c);
  put(g, count_name(name), h5::Type::i64, count);
}

// ---- reading ------------------------------------------------------------------------------------

// Opens and checks what read_training reads; every failure is a TraceCorrupt naming the object.
class In {
 public:
  explicit In(const std::string& where) : where_(where) {}

  [[noreturn]] void corrupt(const std::string& path, const std::string& what) const {
    throw TraceCorrupt(fmt::format("{}: {}: {}", where_, path, what));
  }

  h5::Object group(const h5::Object& parent, const char* name) const {
    if (!h5::exists(parent, name)) corrupt(parent.child(name), "missing");
    h5::Object g = h5::open(parent, name);
    if (H5Iget_type(g.get()) != H5I_GROUP) corrupt(g.path, "not a group");
    return g;
  }

  void attr(const h5::Object& o, const char* name) const {
    if (!h5::has_attr(o, name)) corrupt(o.path, fmt::format("attribute '{}' is missing", name));
  }

  // Dataset `name` of `g`, stored as `t`, of rank `rank`.
  h5::Object dataset(const h5::Object& g, const std::string& name, h5::Type t, size_t rank = 1) const {
    const std::string path = g.child(name);
    if (!h5::exists(g, name)) corrupt(path, "missing");
    h5::Object d = h5::open(g, name);
    if (H5Iget_type(d.get()) != H5I_DATASET) corrupt(path, "not a dataset");
    const std::optional<h5::Type> st = h5::stored_type(d);
    if (!st || *st != t)
      corrupt(path, fmt::format("stored as {}, expected {}", st ? h5::type_name(*st) : "an unsupported type",
                                h5::type_name(t)));
    const size_t r = h5::shape(d).size();
    if (r != rank) corrupt(path, fmt::format("{} dimensions, expected {}", r, rank));
    return d;
  }

  // A 1-D dataset with one entry per entry of `as` (n of them; n < 0: any length, which defines n).
  template <typename T>
  std::vector<T> column(const h5::Object& g, const std::string& name, h5::Type t, int64_t n,
                        const char* as) const {
    const h5::Object d = dataset(g, name, t);
    check_length(d, n, as);
    return h5::read<T>(d);
  }
  std::vector<std::string> strings(const h5::Object& g, const std::string& name, int64_t n,
                                   const char* as) const {
    const h5::Object d = dataset(g, name, h5::Type::str);
    check_length(d, n, as);
    return h5::read_strings(d);
  }

  // A ragged list of n entries (put_ragged): every count non-negative, the counts summing to the
  // concatenated dataset's length.
  template <typename T>
  std::vector<std::vector<T>> ragged(const h5::Object& g, const char* name, h5::Type t, int64_t n,
                                     const char* as) const {
    const std::string cn = count_name(name);
    const std::vector<int64_t> count = column<int64_t>(g, cn, h5::Type::i64, n, as);
    const std::vector<T> all = column<T>(g, name, t, -1, nullptr);
    std::vector<std::vector<T>> out(count.size());
    size_t first = 0;
    for (size_t i = 0; i < count.size(); ++i) {
      if (count[i] < 0) corrupt(g.child(cn), fmt::format("entry {} has length {}", i, count[i]));
      if (uint64_t(count[i]) > all.size() - first)
        corrupt(g.child(name), fmt::format("holds {} values; {} runs past its end at entry {} ([{}, {}))",
                                           all.size(), cn, i, first, first + uint64_t(count[i])));
      out[i].assign(all.begin() + std::ptrdiff_t(first),
                    all.begin() + std::ptrdiff_t(first + size_t(count[i])));
      first += size_t(count[i]);
    }
    if (first != all.size())
      corrupt(g.child(name), fmt::format("holds {} values, {} sums to {}", all.size(), cn, first));
    return out;
  }

 private:
  void check_length(const h5::Object& d, int64_t n, const char* as) const {
    const int64_t len = int64_t(h5::shape(d)[0]);
    if (n >= 0 && len != n) corrupt(d.path, fmt::format("{} entries, expected {} (as {})", len, n, as));
  }

  const std::string& where_;
};

TrainingRecord read_record(const h5::Object& step, const In& in) {
  const std::vector<int64_t> seq_lengths = h5::read<int64_t>(h5::open(step, kSeqLengths));
  const h5::Object g = in.group(step, kTraining);
  TrainingRecord t;
  for (const char* a :
       {kTrainSettingsJson, kTrainOptimizerStepBefore, kTrainOptimizerStatePath, kTrainOptimizerStateDigest})
    in.attr(g, a);
  t.settings_json = h5::read_attr_string(g, kTrainSettingsJson);
  t.optimizer_step_before = h5::read_attr_int(g, kTrainOptimizerStepBefore);
  t.optimizer_state_path = h5::read_attr_string(g, kTrainOptimizerStatePath);
  t.optimizer_state_digest = h5::read_attr_u64(g, kTrainOptimizerStateDigest);

  {
    const auto names = in.strings(g, kTrainMetricNames, -1, nullptr);
    const auto values =
        in.column<double>(g, kTrainMetricValues, h5::Type::f64, int64_t(names.size()), kTrainMetricNames);
    for (size_t i = 0; i < names.size(); ++i)
      if (!t.metrics.emplace(names[i], values[i]).second)
        in.corrupt(g.child(kTrainMetricNames), fmt::format("'{}' is listed twice", names[i]));
  }

  {
    const h5::Object s = in.group(g, kTrainSamples);
    const auto id = in.strings(s, kTrainSampleId, -1, nullptr);
    const int64_t n = int64_t(id.size());
    const auto prompt = in.column<int64_t>(s, kTrainPromptLength, h5::Type::i64, n, kTrainSampleId);
    const auto adv = in.column<double>(s, kTrainAdvantage, h5::Type::f64, n, kTrainSampleId);
    const auto reward = in.column<double>(s, kTrainReward, h5::Type::f64, n, kTrainSampleId);
    const auto has = in.column<uint8_t>(s, kTrainHasReward, h5::Type::u8, n, kTrainSampleId);
    const auto group = in.strings(s, kTrainGroup, n, kTrainSampleId);
    t.samples.resize(size_t(n));
    for (size_t i = 0; i < size_t(n); ++i) {
      SampleLossInputs& x = t.samples[i];
      if (has[i] > 1)
        in.corrupt(s.child(kTrainHasReward), fmt::format("{} at sample {}, expected 0 or 1", has[i], i));
      x.id = id[i];
      x.prompt_length = prompt[i];
      x.advantage = adv[i];
      x.reward = reward[i];
      x.has_reward = has[i] != 0;
      x.group = group[i];
    }
    for (const auto& [name, member] : kSampleArrays) {
      auto v = in.ragged<float>(s, name, h5::Type::f32, n, kTrainSampleId);
      for (size_t i = 0; i < size_t(n); ++i) t.samples[i].*member = std::move(v[i]);
    }
  }

  {
    const h5::Object p = in.group(g, kTrainParams);
    const auto name = in.strings(p, kTrainParamName, -1, nullptr);
    const int64_t n = int64_t(name.size());
    const auto rows = in.column<int64_t>(p, kTrainParamRows, h5::Type::i64, n, kTrainParamName);
    const auto elems = in.column<int64_t>(p, kTrainParamRowElems, h5::Type::i64, n, kTrainParamName);
    t.params.resize(size_t(n));
    for (size_t i = 0; i < size_t(n); ++i) {
      t.params[i].name = name[i];
      t.params[i].rows = rows[i];
      t.params[i].row_elems = elems[i];
    }
    for (const auto& [set, member] : kParamDigestSets) {
      auto v = in.ragged<uint64_t>(p, set, h5::Type::u64, n, kTrainParamName);
      for (size_t i = 0; i < size_t(n); ++i) t.params[i].*member = std::move(v[i]);
    }
  }

  {
    const h5::Object a = in.group(g, kTrainActGrads);
    const auto name = in.strings(a, kTrainActName, -1, nullptr);
    const int64_t n = int64_t(name.size());
    const auto seq = in.column<int32_t>(a, kTrainActSeq, h5::Type::i32, n, kTrainActName);
    const auto layer = in.column<int32_t>(a, kTrainActLayer, h5::Type::i32, n, kTrainActName);
    const auto rows = in.column<int64_t>(a, kTrainActRows, h5::Type::i64, n, kTrainActName);
    const auto cols = in.column<int64_t>(a, kTrainActCols, h5::Type::i64, n, kTrainActName);
    const auto digests = in.column<uint64_t>(a, kTrainActDigests, h5::Type::u64, -1, nullptr);
    t.act_grads.resize(size_t(n));
    size_t first = 0;
    for (size_t i = 0; i < size_t(n); ++i) {
      ActGradDigests& x = t.act_grads[i];
      if (rows[i] < 0) in.corrupt(a.child(kTrainActRows), fmt::format("entry {} has {} rows", i, rows[i]));
      if (uint64_t(rows[i]) > digests.size() - first)
        in.corrupt(a.child(kTrainActDigests),
                   fmt::format("holds {} digests; {} runs past its end at entry {} ([{}, {}))",
                               digests.size(), kTrainActRows, i, first, first + uint64_t(rows[i])));
      x.seq = seq[i];
      x.layer = layer[i];
      x.name = name[i];
      x.rows = rows[i];
      x.cols = cols[i];
      x.digests.assign(digests.begin() + std::ptrdiff_t(first),
                       digests.begin() + std::ptrdiff_t(first + size_t(rows[i])));
      first += size_t(rows[i]);
    }
    if (first != digests.size())
      in.corrupt(a.child(kTrainActDigests),
                 fmt::format("holds {} digests, {} sums to {}", digests.size(), kTrainActRows, first));
  }

  std::map<std::string, const ParamDigests*> by_name;
  for (const ParamDigests& p : t.params) by_name.emplace(p.name, &p);
  for (const auto& [group, member] : kFullTensors) {
    const h5::Object fg = in.group(g, group);
    for (const std::string& name : h5::children(fg)) {
      const h5::Object d = in.dataset(fg, name, h5::Type::f32, 2);
      auto it = by_name.find(name);
      if (it == by_name.end())
        in.corrupt(d.path, fmt::format("not one of the parameters ({}/{})", kTrainParams, kTrainParamName));
      const std::vector<hsize_t> want{hsize_t(it->second->rows), hsize_t(it->second->row_elems)};
      const std::vector<hsize_t> shape = h5::shape(d);
      if (shape != want)
        in.corrupt(d.path, fmt::format("shape [{}, {}], the parameter is [{}, {}]", shape[0], shape[1],
                                       want[0], want[1]));
      (t.*member)[name] = h5::read<float>(d);
    }
  }

  if (const auto p = training_problem(t, seq_lengths)) in.corrupt(g.child(p->dataset), p->what);
  return t;
}

}  // namespace

std::string training_record_problem(const TrainingRecord& t, const std::vector<int64_t>& seq_lengths) {
  const auto p = training_problem(t, seq_lengths);
  return p ? fmt::format("{}/{}: {}", kTraining, p->dataset, p->what) : std::string();
}

void write_training(const h5::Object& step, const TrainingRecord& t) {
  const std::vector<int64_t> seq_lengths = h5::read<int64_t>(h5::open(step, kSeqLengths));
  if (const std::string why = training_record_problem(t, seq_lengths); !why.empty())
    throw Error(fmt::format("{}: the training record does not fit the step: {}", step.path, why));
  using h5::Type;
  const h5::Object g = h5::create_group(step, kTraining);
  h5::write_attr(g, kTrainSettingsJson, t.settings_json);
  h5::write_attr(g, kTrainOptimizerStepBefore, int64_t(t.optimizer_step_before));
  h5::write_attr(g, kTrainOptimizerStatePath, t.optimizer_state_path);
  h5::write_attr(g, kTrainOptimizerStateDigest, uint64_t(t.optimizer_state_digest));
  {
    std::vector<std::string> names;
    std::vector<double> values;
    for (const auto& [k, v] : t.metrics) {
      names.push_back(k);
      values.push_back(v);
    }
    put_strings(g, kTrainMetricNames, names);
    put(g, kTrainMetricValues, Type::f64, values);
  }
  {
    const h5::Object s = h5::create_group(g, kTrainSamples);
    const size_t n = t.samples.size();
    std::vector<std::string> id, group;
    std::vector<int64_t> prompt;
    std::vector<double> adv, reward;
    std::vector<uint8_t> has;
    for (const SampleLossInputs& x : t.samples) {
      id.push_back(x.id);
      prompt.push_back(x.prompt_length);
      adv.push_back(x.advantage);
      reward.push_back(x.reward);
      has.push_back(x.has_reward ? 1 : 0);
      group.push_back(x.group);
    }
    put_strings(s, kTrainSampleId, id);
    put(s, kTrainPromptLength, Type::i64, prompt);
    put(s, kTrainAdvantage, Type::f64, adv);
    put(s, kTrainReward, Type::f64, reward);
    put(s, kTrainHasReward, Type::u8, has);
    put_strings(s, kTrainGroup, group);
    for (const auto& [name, member] : kSampleArrays)
      put_ragged<float>(
          s, name, Type::f32, n, [&, m = member ](size_t i) -> const auto& { return t.samples[i].*m; });
  }
  {
    const h5::Object p = h5::create_group(g, kTrainParams);
    const size_t n = t.params.size();
    std::vector<std::string> name;
    std::vector<int64_t> rows, elems;
    for (const ParamDigests& x : t.params) {
      name.push_back(x.name);
      rows.push_back(x.rows);
      elems.push_back(x.row_elems);
    }
    put_strings(p, kTrainParamName, name);
    put(p, kTrainParamRows, Type::i64, rows);
    put(p, kTrainParamRowElems, Type::i64, elems);
    for (const auto& [set, member] : kParamDigestSets)
      put_ragged<uint64_t>(
          p, set, Type::u64, n, [&, m = member ](size_t i) -> const auto& { return t.params[i].*m; },
          h5::Compress::no);
  }
  {
    const h5::Object a = h5::create_group(g, kTrainActGrads);
    std::vector<std::string> name;
    std::vector<int32_t> seq, layer;
    std::vector<int64_t> rows, cols;
    std::vector<uint64_t> digests;
    for (const ActGradDigests& x : t.act_grads) {
      name.push_back(x.name);
      seq.push_back(x.seq);
      layer.push_back(x.layer);
      rows.push_back(x.rows);
      cols.push_back(x.cols);
      digests.insert(digests.end(), x.digests.begin(), x.digests.end());
    }
    put_strings(a, kTrainActName, name);
    put(a, kTrainActSeq, Type::i32, seq);
    put(a, kTrainActLayer, Type::i32, layer);
    put(a, kTrainActRows, Type::i64, rows);
    put(a, kTrainActCols, Type::i64, cols);
    put(a, kTrainActDigests, Type::u64, digests, h5::Compress::no);
  }
  std::map<std::string, const ParamDigests*> by_name;
  for (const ParamDigests& p : t.params) by_name.emplace(p.name, &p);
  for (const auto& [group, member] : kFullTensors) {
    const h5::Object fg = h5::create_group(g, group);
    for (const auto& [name, values] : t.*member) {
      const ParamDigests& p = *by_name.at(name);  // training_problem: every name is a parameter's
      h5::Object d = h5::create_dataset(fg, name, Type::f32, {hsize_t(p.rows), hsize_t(p.row_elems)});
      if (!values.empty()) h5::write(d, values);
    }
  }
}

TrainingRecord read_training(const h5::Object& step, const std::string& where) {
  const In in(where);
  try {
    return read_record(step, in);
  } catch (const TraceCorrupt&) {
    throw;
  } catch (const TraceError& e) {  // an HDF5 failure (a checksum error, an unreadable object)
    throw TraceCorrupt(fmt::format("{}: {}", where, e.what()));
  }
}

bool has_training(const h5::Object& step) {
  return h5::exists(step, kTraining);
}

}  // namespace dsv4
