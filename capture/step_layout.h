// The HDF5 layout of a trace (traces/FORMAT.md) as the trace writer's thread writes it: the file
// header, then per step its groups and datasets, the streamed tensors and decisions, and the step's
// end (log-probs, digests, kernels, generation and training records, status). Every HDF5 call of
// TraceWriter is here; the queue and the thread that call it are in capture/trace_writer.cpp. Not
// thread-safe: one thread owns a StepLayout.
#pragma once

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "capture/cupti.h"
#include "capture/generation.h"
#include "capture/h5.h"
#include "capture/policy.h"
#include "capture/trace_seal.h"
#include "capture/trace_writer.h"
#include "capture/training.h"
#include "model/config.h"
#include "model/forward.h"
#include "model/manifest.h"

namespace dsv4 {

// One reported item of a step: a tensor's row digests (and its bytes when the policy stores it) or
// one decision (indexer, routing, mHC) of one sequence and layer.
struct StepRecord {
  enum class Kind { tensor, indexer, routing, mhc };
  Kind kind = Kind::tensor;
  int seq = 0, layer = -1;
  std::string name;
  DType dtype = DType::f32;
  Sublayer sub = Sublayer::attn;
  int64_t T = 0;
  int k = 0;  // indexer, routing: ids per row; mhc: hc
  bool hashed = false;
  bool store = false;  // tensor: write `bytes` to tensors/<name>/<layer>
  std::vector<uint64_t> digests;
  std::vector<uint8_t> bytes;
  std::vector<int32_t> ids;            // indexer, routing
  std::vector<float> margin;           // indexer, routing
  std::vector<float> weights;          // routing
  std::vector<float> pre, post, comb;  // mhc
};

// Storage rules shared by the runtime's writer (StepLayout) and the external writer (capture/external.h).
// The smallest unsigned storage type that holds `max` (expert ids, indexer gaps).
h5::Type unsigned_for(uint64_t max);
h5::Type storage_type(DType t);  // bf16 -> uint16, f32 -> float32, i32 -> int32
const char* dtype_attr(DType t);  // the `dtype` attribute of a full tensor
// Writes integer ids in the storage width chosen at creation (ranges checked by the caller); the staged
// form adds the write to `w` (with extend_to as StagedWrites::add).
void write_narrowed(const h5::Object& ds, h5::Type t, const std::vector<uint32_t>& v);
void stage_narrowed(h5::StagedWrites& w, const h5::Object& ds, h5::Type t, std::vector<uint32_t> v,
                    std::optional<hsize_t> extend_to = std::nullopt);

// The compact encoding of indexer rows (traces/FORMAT.md): per row the number of valid ids and the gaps
// between consecutive ones. Each row of `ids` ([rows, k]) must be ascending, its valid ids first (-1
// after them) and below `groups`; the first slot that is not is named by bad_row/bad_slot/bad_id
// (bad_row = -1 when every row is).
struct IndexerGaps {
  std::vector<uint16_t> count;
  std::vector<uint32_t> gaps;
  int64_t bad_row = -1;
  int bad_slot = -1;
  int32_t bad_id = 0;
};
IndexerGaps encode_indexer_gaps(const int32_t* ids, int64_t rows, int k, int64_t groups);

class StepLayout {
 public:
  // The trace file at `writing_path`, of a model of config `c` (/meta/tensor_names).
  StepLayout(std::string writing_path, const ModelConfig& c);

  // Creates the file: the root attributes, /meta and an empty /steps.
  void write_header(const TraceHeader& h);
  // Opens the file, creates step `index` (status 0) with every group and dataset it will receive and
  // switches the file to SWMR writing.
  void create_step(int index, const StepSpec& s, const CapturePolicy& policy);
  // Where a joined trace's sequence lives: sequence `seq` of the same step of part `part`.
  struct PartSeq {
    int part = 0, seq = 0;
  };
  // A joined trace's step `index` in one go (capture/joined.h): the step's attributes as create_step
  // writes them, its sequences as external links to `where` (one per sequence of s.seqs, into the
  // header's parts), kernels not available (the ranks' traces hold theirs), status 1.
  void write_joined_step(int index, const StepSpec& s, const CapturePolicy& policy,
                         const std::vector<std::string>& parts, const std::vector<PartSeq>& where);
  // Streamed data of the open step, in the order reported. Each record is checked against the layout
  // (Error on a mismatch, after the records before it are written); the chunks of all of them are
  // encoded together on the encoder threads (h5::StagedWrites), then the calls that write them are
  // made in record order, the calls one record at a time makes.
  // `seconds` (optional) receives the time spent staging, encoding and storing.
  void write_records(const std::vector<const StepRecord*>& records, double* seconds = nullptr);
  // Writes the log-probs and digests, the kernel records, the generation record and the training
  // record (each when not null), marks the step complete (status 1) and closes the file.
  void finish_step(const ForwardResult& r, const KernelRecords& k, const GenerationRecord* generation,
                   const TrainingRecord* training);
  // Closes whatever is still open (a step abandoned mid-way); never throws.
  void close_file();
  // Told of every write this layout made to the file (h5::track_writes), for its seal.
  SealHasher& written() { return written_; }

 private:
  // What the layout knows about one sequence of the open step.
  struct SeqLayout {
    int64_t T = 0;
    std::string group;  // "/steps/000000/seq_000"
    std::vector<TensorSpecT> manifest;
    std::map<std::pair<int, std::string>, size_t> index;  // (layer, name) -> manifest record
    std::vector<int64_t> first;                           // record -> offset into digests
    std::vector<uint64_t> digests;
    std::vector<char> got;
    // The digests are stored a few chunks at a time as the records before them arrive: rows
    // [0, digests_stored) are staged, records [0, next_record) have arrived, and the digests dataset
    // (digests_ds, open from its first part to the step's end) has chunks of digest_chunk rows.
    size_t next_record = 0;
    int64_t digests_stored = 0, digest_chunk = 1;
    h5::Object digests_ds;
    std::set<std::string> pending;  // decisions not yet received: "layer_001/indexer", ...
    int width = 0;                  // indexer_width
    h5::Type gap_type = h5::Type::u8;
  };

  // The step group with its attributes, status 0 and seq_lengths, in the open file.
  h5::Object create_step_group(int index, const StepSpec& s, const CapturePolicy& policy);
  void create_seq(const h5::Object& step, int si, const std::vector<int32_t>& tokens,
                  const CapturePolicy& policy);
  SeqLayout& seq_of(const StepRecord& m);
  h5::Object open_in_seq(const SeqLayout& L, const std::string& rel);
  void done_decision(SeqLayout& L, const StepRecord& m, const std::string& what);
  void stage_tensor(const StepRecord& m, h5::StagedWrites& w);
  // Stages the chunks of L's digests whose records have all arrived (all of them: every remaining row).
  void stage_digests(SeqLayout& L, h5::StagedWrites& w, bool all);
  void stage_indexer(const StepRecord& m, h5::StagedWrites& w);
  void stage_routing(const StepRecord& m, h5::StagedWrites& w);
  void stage_mhc(const StepRecord& m, h5::StagedWrites& w);
  void write_kernels(const h5::Object& f, const KernelRecords& k);

  const std::string writing_path;
  const ModelConfig cfg;
  SealHasher written_;
  const std::vector<std::string> names;  // /meta/tensor_names
  std::map<std::string, int32_t> name_index;

  h5::Object file;
  int step_index = -1;
  std::string step_group;
  std::vector<SeqLayout> seqs;
};

}  // namespace dsv4
