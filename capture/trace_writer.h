// Writing traces (traces/FORMAT.md). The model runs on the caller's thread and reports through the
// Observer returned by begin_step(); that observer computes digests on the compute side and hands
// what must be written to one writer thread through a bounded queue (back-pressure: the model waits
// when `queue_bytes` are in flight). All HDF5 calls happen on the writer thread.
//
// Life of a step: begin_step() creates the step's groups and datasets (shapes from the model's
// tensor manifest) with status 0 and switches the file to SWMR writing; the forward streams into
// them; end_step() writes the log-probs, the kernel records (set_kernel_records) and the generation or
// training record (set_generation, set_training), sets status 1, flushes and closes the file. close()
// renames NAME.h5.incomplete to NAME.h5.
//
// begin_step() and end_step() queue their work and return: the next step computes while the last one
// is written. The writer thread's errors (a full disk, a step that broke the manifest's contract)
// surface at the next call that waits for it or queues to it: flush(), close(), begin_step(), a
// report. flush() is the point where everything handed over is on disk.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "capture/cupti.h"
#include "capture/digest.h"
#include "capture/env.h"
#include "capture/generation.h"
#include "capture/policy.h"
#include "capture/trace_seal.h"
#include "capture/training.h"
#include "model/config.h"
#include "model/forward.h"
#include "model/observer.h"

namespace dsv4 {

// What /meta holds.
struct TraceHeader {
  EnvFingerprint env;
  std::string config_json;
  std::string weights_path;
  ModelDigest model;
  // A joined trace's parts (/meta/parts, capture/joined.h); empty for every other trace.
  std::vector<std::string> parts;
};
TraceHeader make_trace_header(const Weights& w);  // env of this machine + the model's digests

struct StepSpec {
  std::string kind = "train";     // "train" | "rollout" | "generate" | "train-step"
  std::string profile = "train";  // numerics profile name
  // The profile's canonical text (model/profile.h profile_text), stored with its digest so that
  // replay runs the recorded precision map; empty: only the name is stored (an external engine's).
  std::string profile_text;
  void set_profile(const NumericsProfile& p) {
    profile = p.name;
    profile_text = dsv4::profile_text(p);
  }
  uint64_t seed = 0;
  int threads = 0;
  std::vector<std::vector<int32_t>> seqs;  // the batch
  // A step of no sequence is refused unless allowed: a rank's own trace of a run whose ranks split the
  // sequences (capture/joined.h), where a rank may hold none of a step's.
  bool allow_empty = false;
};

struct WriterStats {
  int64_t bytes_queued = 0;      // payload handed to the writer thread
  int64_t queue_high_water = 0;  // largest number of bytes in flight
  double seconds_blocked = 0;    // time the compute side waited on a full queue
  double seconds_writing = 0;    // time the writer thread spent in HDF5 calls, of which:
  double seconds_steps = 0;      //   laying out and finishing steps (begin_step, end_step)
  double seconds_staging = 0;    //   checking records and planning their writes
  double seconds_encoding = 0;   //   encoding their chunks (on the encoder threads)
  double seconds_storing = 0;    //   storing the chunks
  int64_t records = 0, batches = 0;  // records written, in this many batches
  // close(), once: the queue drained and the file closed by HDF5; the seal's digest (and the bytes it
  // read back from the file: what no write covered whole, capture/trace_seal.h SealHasher); the
  // header written and the file synced; the rename and the directory's sync.
  double seconds_close_file = 0, seconds_seal_hash = 0, seconds_seal_sync = 0, seconds_rename = 0;
  int64_t seal_bytes_read = 0;
};

class TraceWriter {
 public:
  struct Options {
    CapturePolicy policy = CapturePolicy::parse("decisions");
    int64_t queue_bytes = int64_t(256) << 20;
  };

  // New trace at `path` (must end in .h5): writes path + ".incomplete"; refuses to overwrite an
  // existing `path`.
  static std::unique_ptr<TraceWriter> create(const std::string& path, const ModelConfig& c,
                                             const TraceHeader& h, Options opt);
  // Adds steps to an existing, complete trace `path`. The model digest must equal the recorded one
  // (InputError naming both digests and the first differing tensor otherwise).
  static std::unique_ptr<TraceWriter> append(const std::string& path, const ModelConfig& c,
                                             const TraceHeader& h, Options opt);
  ~TraceWriter();  // without close(): the file stays NAME.h5.incomplete (what a crash leaves)

  Observer& begin_step(const StepSpec& s);
  // The GPU kernels of the open step (capture/cupti.h), written by end_step() to
  // /steps/NNNNNN/kernels. Without a call the step records available = 0 with reason "not recorded".
  void set_kernel_records(KernelRecords k);
  // The generation record of the open step (kind "generate"; capture/generation.h), written by
  // end_step() before the step is marked complete.
  void set_generation(GenerationRecord g);
  // The training record of the open step, which must be of kind "train-step" (capture/training.h),
  // written by end_step() before the step is marked complete. Throws Error, keeping the step open,
  // for another kind or a record that does not fit the step (training_record_problem); end_step() of
  // a "train-step" step without one throws Error likewise.
  void set_training(TrainingRecord t);
  // Queues the step's end and returns without waiting for the disk: the writer thread writes the
  // log-probs and records, marks the step complete and flushes the file while the caller goes on.
  void end_step(const ForwardResult& r);
  // Waits until everything handed over so far is in the file and visible to readers (a step ended
  // before is complete on disk). Throws the writer thread's error, if it had one.
  void flush();
  void close();

  const std::string& final_path() const;
  const std::string& writing_path() const;  // NAME.h5.incomplete for create(), NAME.h5 for append()
  int steps_written() const;  // steps this writer completed
  int next_step() const;      // the index the next begin_step() gets (after the steps already in the file)
  WriterStats stats() const;

  struct Impl;

 private:
  explicit TraceWriter(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// The last act of every trace writer: seals the finished file at `writing_path` (`written`: the
// hasher told of the writer's writes, or none), flushes it to disk and renames it to `final_path`
// (when they differ), so a trace under its final name is always whole. Returns what the seal took.
SealTimes publish_trace(const std::string& writing_path, const std::string& final_path,
                        SealHasher* written = nullptr);

// Points the complete trace `path` at other weights: /meta/model weights_path becomes
// `weights_path` and the previous value is kept as weights_path_recorded (a bundle's trace names the
// model folder beside it).
void set_trace_weights_path(const std::string& path, const std::string& weights_path);

}  // namespace dsv4
