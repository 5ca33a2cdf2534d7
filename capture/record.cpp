#include "capture/record.h"

#include <fmt/format.h>

#include <chrono>
#include <csignal>
#include <filesystem>
#include <functional>

#include "capture/cupti.h"
#include "capture/joined.h"
#include "capture/env.h"
#include "model/error.h"
#include "model/fanout.h"
#include "model/forward.h"
#include "model/profile.h"

namespace dsv4 {

namespace {

// Kills the process halfway through the layers of the step (RecordOptions::fault), once what the
// writer was handed so far is on disk (the step laid out, its first layers in it), so that the fault
// leaves the same file whatever the writer thread's pace.
class MidStepKill : public Observer {
 public:
  MidStepKill(int layers, std::function<void()> before) : layers_(layers), before_(std::move(before)) {}
  void on_mhc(const MhcDecision& d) override {
    if (d.sublayer != Sublayer::ffn || d.layer != layers_ / 2) return;
    before_();
    raise(SIGKILL);
  }
  bool wants_tensors() const override { return false; }
  bool deferrable() const override { return true; }  // halfway through the step's reports

 private:
  int layers_;
  std::function<void()> before_;
};

// The step a recording writes: its kind ("rollout" for the rollout profile, else "train", unless
// opt.kind says), profile, seed, threads and batch.
StepSpec step_spec(const NumericsProfile& profile, const std::vector<std::vector<int32_t>>& batch,
                   const RecordOptions& opt) {
  StepSpec step;
  step.set_profile(profile);
  step.kind = opt.kind.empty() ? (numerics_base_name(profile) == "rollout" ? "rollout" : "train") : opt.kind;
  step.seed = opt.seed;
  step.threads = opt.threads;
  step.seqs = batch;
  return step;
}

}  // namespace

RecordResult record_step(const Weights& w, const std::vector<std::vector<int32_t>>& batch,
                         const std::string& out, const RecordOptions& opt) {
  const CapturePolicy policy = CapturePolicy::parse(opt.capture);
  const NumericsProfile profile = load_profile(opt.profile, opt.numerics);  // both checked before the file exists
  require_profile_runs_on(profile, opt.device, "record");
  StepSpec step = step_spec(profile, batch, opt);
  step.allow_empty = opt.split_sequences;

  TraceWriter::Options wo;
  wo.policy = policy;
  TraceHeader header = make_trace_header(w);
  if (opt.experts && opt.experts->size() > 1)
    header.env[kEnvParallel] = parallel_layout(*opt.experts, opt.split_sequences);
  if (opt.experts && opt.split_sequences)
    header.env[kEnvRank] = fmt::format("{} of {}", opt.experts->rank(), opt.experts->size());
  auto writer = opt.append ? TraceWriter::append(out, w.config(), header, wo)
                           : TraceWriter::create(out, w.config(), header, wo);
  const int index = writer->next_step();
  MidStepKill kill(w.config().num_hidden_layers, [&writer] { writer->flush(); });
  std::vector<Observer*> targets{&writer->begin_step(step)};
  if (opt.also) targets.push_back(opt.also);
  if (opt.fault == "kill-mid-step") targets.push_back(&kill);
  FanoutObserver fan(targets);
  RunOptions ro;
  ro.profile = profile;
  ro.threads = opt.threads;
  ro.device = opt.device;
  ro.observer = &fan;
  ro.experts = opt.experts;
  ro.split_sequences = opt.split_sequences;
  // On CUDA the step's kernel launches are recorded with CUPTI; where CUPTI cannot record, the trace
  // says why (available = 0) and the recording goes on.
  KernelRecorder kernels;
  if (ro.device == Device::cuda && !kernels.start() && opt.note)
    opt.note("no kernel records for this step: " + kernels.reason());
  const auto t0 = std::chrono::steady_clock::now();
  const ForwardResult result = forward(w, batch, ro);
  if (ro.device == Device::cuda) {
    writer->set_kernel_records(kernels.stop());
  } else {
    KernelRecords none;
    none.reason = "recorded on the cpu";
    writer->set_kernel_records(std::move(none));
  }
  writer->end_step(result);
  if (opt.fault == "kill-after-step") {
    writer->flush();  // the step is on disk, the trace not yet closed
    raise(SIGKILL);
  }
  writer->close();

  RecordResult r;
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  for (const auto& s : batch) r.tokens += int64_t(s.size());
  r.step = index;
  r.path = writer->final_path();
  r.capture = policy.text();
  r.stats = writer->stats();
  return r;
}

RecordResult record_split_step(const Weights& w, const std::vector<std::vector<int32_t>>& batch,
                               const std::string& out, const RecordOptions& opt) {
  if (!opt.experts) throw Error("record_split_step: no communicator");
  Communicator& comm = *opt.experts;
  const int n = comm.size(), me = comm.rank(), S = int(batch.size());
  if (me == 0 && !opt.append && std::filesystem::exists(out))
    throw InputError(fmt::format("{}: exists; refusing to overwrite it (choose another name, or append to it)", out));
  const BlockRange mine = sequence_range(S, me, n);
  RecordOptions po = opt;
  po.split_sequences = true;
  const std::vector<std::vector<int32_t>> own(batch.begin() + mine.first, batch.begin() + mine.last);
  RecordResult r = record_step(w, own, part_trace_path(out, me), po);

  // Every rank's step is complete on disk once every rank is here; the ranks agree on its index.
  const int32_t index = r.step;
  std::vector<int32_t> indices(static_cast<size_t>(n));
  comm.all_gather_v(&index, indices.data(), std::vector<int64_t>(size_t(n), int64_t(sizeof index)));
  for (int q = 0; q < n; ++q)
    if (indices[size_t(q)] != index)
      comm.abort(fmt::format("{}: rank {} wrote step {} of its trace, rank {} step {}: the ranks' traces were changed "
                             "apart from each other",
                             out, q, indices[size_t(q)], me, index),
                 2);
  if (me != 0) return r;

  const StepSpec step = step_spec(load_profile(opt.profile, opt.numerics), batch, opt);
  TraceHeader header = make_trace_header(w);
  header.env[kEnvParallel] = parallel_layout(comm, true);
  std::vector<StepLayout::PartSeq> where;
  for (int q = 0; q < n; ++q) {
    header.parts.push_back(part_trace_name(out, q));
    const BlockRange b = sequence_range(S, q, n);
    for (int i = 0; i < b.size(); ++i) where.push_back({q, i});
  }
  write_joined_step(out, w.config(), header, index, step, CapturePolicy::parse(opt.capture), where, opt.append);
  r.path = out;
  r.tokens = 0;
  for (const auto& s : batch) r.tokens += int64_t(s.size());
  return r;
}

}  // namespace dsv4
