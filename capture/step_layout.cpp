// StepLayout (capture/step_layout.h): the layout of traces/FORMAT.md, written by one thread.
//
// HDF5 1.10's SWMR mode allows writing raw data and extending datasets but not creating objects, so a
// step is written in two phases: begin_step() opens the file read-write (not SWMR), creates every
// group and dataset the step will receive, closes them and switches to SWMR writing; from then on a
// reader in another process can follow the step while the forward streams into it. end_step() writes
// the last raw data, closes the SWMR file and reopens it read-write without SWMR to create the step's
// `kernels` group (its size is known only once the step ran) and its `generation` or `training` group,
// then marks the step complete (status = 1), flushes and closes the file, so between steps the file on
// disk is whole and closed.
//
// The writer opens files without POSIX locks: a reader following the trace in SWMR mode holds a
// shared lock that would otherwise make the next begin_step() fail. Concurrent access is governed by
// SWMR and by HDF5's superblock flags instead (an open for writing is refused while another writer
// has the file open).
#include "capture/step_layout.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <optional>

#include "capture/digest.h"
#include "capture/env.h"
#include "capture/errors.h"
#include "capture/h5_tracked.h"
#include "capture/layout.h"
#include "capture/trace_seal.h"
#include "capture/version.h"
#include "model/huge_pages.h"

namespace dsv4 {
namespace {

using namespace trace_layout;  // the format's names

std::vector<hsize_t> dims(std::initializer_list<int64_t> d) {
  std::vector<hsize_t> v;
  for (int64_t x : d) v.push_back(hsize_t(x));
  return v;
}

}  // namespace

// The smallest unsigned storage type that holds `max`.
h5::Type unsigned_for(uint64_t max) {
  if (max <= 0xff) return h5::Type::u8;
  if (max <= 0xffff) return h5::Type::u16;
  return h5::Type::u32;
}

h5::Type storage_type(DType t) {
  switch (t) {
    case DType::bf16:
      return h5::Type::u16;
    case DType::f32:
      return h5::Type::f32;
    case DType::i32:
      return h5::Type::i32;
  }
  return h5::Type::f32;
}

const char* dtype_attr(DType t) {
  switch (t) {
    case DType::bf16:
      return "bfloat16";
    case DType::f32:
      return "float32";
    case DType::i32:
      return "int32";
  }
  return "?";
}

// Writes integer ids in the storage width chosen at creation (ranges were checked by the caller).
void stage_narrowed(h5::StagedWrites& w, const h5::Object& ds, h5::Type t, std::vector<uint32_t> v,
                    std::optional<hsize_t> extend_to) {
  switch (t) {
    case h5::Type::u8: {
      std::vector<uint8_t> n;
      reserve_huge(n, v.size());
      n.assign(v.begin(), v.end());
      w.add(ds, std::move(n), extend_to);
      break;
    }
    case h5::Type::u16: {
      std::vector<uint16_t> n;
      reserve_huge(n, v.size());
      n.assign(v.begin(), v.end());
      w.add(ds, std::move(n), extend_to);
      break;
    }
    default:
      w.add(ds, std::move(v), extend_to);
      break;
  }
}

void write_narrowed(const h5::Object& ds, h5::Type t, const std::vector<uint32_t>& v) {
  h5::StagedWrites w;
  stage_narrowed(w, ds, t, v);
  w.store();
}

IndexerGaps encode_indexer_gaps(const int32_t* ids, int64_t rows, int k, int64_t groups) {
  IndexerGaps e;
  e.count.resize(size_t(rows));
  reserve_huge(e.gaps, size_t(rows * k));
  for (int64_t p = 0; p < rows; ++p) {
    int64_t prev = -1;
    int n = 0;
    for (int j = 0; j < k; ++j) {
      const int32_t g = ids[p * k + j];
      if (g == -1) continue;
      if (n != j || g <= prev || g >= groups) {
        e.bad_row = p;
        e.bad_slot = j;
        e.bad_id = g;
        return e;
      }
      e.gaps.push_back(uint32_t(g - prev - 1));
      prev = g;
      ++n;
    }
    e.count[size_t(p)] = uint16_t(n);
  }
  return e;
}

StepLayout::StepLayout(std::string writing_path, const ModelConfig& c)
    : writing_path(std::move(writing_path)), cfg(c), names(tensor_names(c)) {
  for (size_t i = 0; i < names.size(); ++i) name_index[names[i]] = int32_t(i);
}

// ---- file header --------------------------------------------------------------------------------

void StepLayout::write_header(const TraceHeader& h) {
  h5::Id fapl = h5::writing_access(&written_);
  h5::Object f = h5::create_file(writing_path, fapl.get(), kSealBlockBytes);
  {
    h5::write_attr(f, kFormat, std::string(kFormatValue));
    h5::write_attr(f, kFormatVersion, int32_t(kPrefillFormatVersion));
    h5::write_attr(f, kProducer, std::string("dsv4 ") + version());
    h5::write_attr(f, kCreated, utc_now_iso8601());
    h5::Object meta = h5::create_group(f, kMeta);
    h5::Object env = h5::create_group(meta, kEnv);
    for (const auto& [k, v] : h.env) h5::write_attr(env, k, v);
    h5::Object model = h5::create_group(meta, kModel);
    h5::write_attr(model, kConfigJson, h.config_json);
    h5::write_attr(model, kWeightsPath, h.weights_path);
    h5::write_attr(model, kModelDigest, hex16(h.model.whole));
    if (h.model.names.size() != h.model.digests.size())
      throw Error("TraceHeader: model digest lists differ in length");
    h5::Object tn =
        h5::create_dataset(model, kTensorNames, h5::Type::str, dims({int64_t(h.model.names.size())}));
    h5::write_strings(tn, h.model.names);
    h5::Object td =
        h5::create_dataset(model, kTensorDigests, h5::Type::u64, dims({int64_t(h.model.digests.size())}));
    h5::write(td, h.model.digests);
    h5::Object n = h5::create_dataset(meta, kTensorNames, h5::Type::str, dims({int64_t(names.size())}));
    h5::write_strings(n, names);
    if (!h.parts.empty()) {
      h5::Object p = h5::create_dataset(meta, kParts, h5::Type::str, dims({int64_t(h.parts.size())}));
      h5::write_strings(p, h.parts);
    }
    h5::create_group(f, kSteps);
  }
  h5::close_file(f);
  mark_trace_open(writing_path, false);  // sealed by TraceWriter::close(); a new .incomplete file
}

// ---- step layout --------------------------------------------------------------------------------

h5::Object StepLayout::create_step_group(int index, const StepSpec& s, const CapturePolicy& policy) {
  h5::Object steps = h5::open(file, kSteps);
  if (h5::exists(steps, step_name(index))) steps.fail(fmt::format("step {} exists already", step_name(index)));
  h5::Object g = h5::create_group(steps, step_name(index));
  // The file's version is the highest its steps' kinds need: a trace of prefill steps stays
  // version 1, one with a generation step (and no training step) version 2.
  if (step_format_version(s.kind) > h5::read_attr_int(file, kFormatVersion))
    h5::write_attr(file, kFormatVersion, int32_t(step_format_version(s.kind)));
  h5::write_attr(g, kKind, s.kind);
  h5::write_attr(g, kProfile, s.profile);
  if (!s.profile_text.empty()) {
    h5::write_attr(g, kProfileText, s.profile_text);
    h5::write_attr(g, kProfileDigest, profile_text_digest(s.profile_text));
  }
  h5::write_attr(g, kSeed, uint64_t(s.seed));
  h5::write_attr(g, kThreads, int32_t(s.threads));
  h5::write_attr(g, kCapture, policy.text());
  h5::write_attr(g, kNSeqs, int32_t(s.seqs.size()));
  h5::Object status = h5::create_dataset(g, kStatus, h5::Type::u8, {1});
  h5::write(status, std::vector<uint8_t>{0});
  std::vector<int32_t> lengths;
  for (const auto& q : s.seqs) lengths.push_back(int32_t(q.size()));
  h5::Object sl = h5::create_dataset(g, kSeqLengths, h5::Type::i32, dims({int64_t(lengths.size())}));
  h5::write(sl, lengths);
  return g;
}

void StepLayout::write_joined_step(int index, const StepSpec& s, const CapturePolicy& policy,
                                   const std::vector<std::string>& parts, const std::vector<PartSeq>& where) {
  if (where.size() != s.seqs.size())
    throw Error(fmt::format("joined step {}: {} sequence places for {} sequences", index, where.size(), s.seqs.size()));
  h5::Id fapl = h5::writing_access(&written_);
  file = h5::open_file(writing_path, H5F_ACC_RDWR, fapl.get());
  step_index = index;
  step_group = step_path(step_index);
  {
    h5::Object g = create_step_group(index, s, policy);
    for (size_t i = 0; i < where.size(); ++i) {
      if (where[i].part < 0 || size_t(where[i].part) >= parts.size())
        throw Error(fmt::format("joined step {}: sequence {} in part {} of {}", index, i, where[i].part, parts.size()));
      const std::string target = step_path(index) + "/" + seq_name(where[i].seq);
      if (H5Lcreate_external(parts[size_t(where[i].part)].c_str(), target.c_str(), g.get(), seq_name(int(i)).c_str(),
                             H5P_DEFAULT, H5P_DEFAULT) < 0)
        g.fail(fmt::format("cannot link {} to {}:{}", seq_name(int(i)), parts[size_t(where[i].part)], target));
    }
  }
  KernelRecords none;
  none.reason = "recorded by each rank: see the rank's trace (/meta/parts)";
  write_kernels(file, none);
  h5::write(h5::open(file, step_group.substr(1) + "/" + kStatus), std::vector<uint8_t>{1});
  if (H5Fflush(file.get(), H5F_SCOPE_GLOBAL) < 0) file.fail("cannot flush");
  h5::close_file(file);
  file = h5::Object{};
}

void StepLayout::create_step(int index, const StepSpec& s, const CapturePolicy& policy) {
  h5::Id fapl = h5::writing_access(&written_);
  file = h5::open_file(writing_path, H5F_ACC_RDWR, fapl.get());
  step_index = index;
  step_group = step_path(step_index);
  seqs.clear();
  seqs.resize(s.seqs.size());
  {
    h5::Object g = create_step_group(index, s, policy);
    for (size_t i = 0; i < s.seqs.size(); ++i) create_seq(g, int(i), s.seqs[i], policy);
  }
  // SWMR writing needs every object closed; from here on only raw data is written. A reader in
  // this process that kept the file open across steps keeps HDF5's shared file (and its SWMR
  // mode) alive: the file is then in SWMR mode already.
  unsigned intent = 0;
  if (H5Fget_intent(file.get(), &intent) < 0) file.fail("cannot read the file's access mode");
  if (!(intent & H5F_ACC_SWMR_WRITE) && H5Fstart_swmr_write(file.get()) < 0)
    file.fail("cannot switch to SWMR writing");
}

void StepLayout::create_seq(const h5::Object& step, int si, const std::vector<int32_t>& tokens,
                            const CapturePolicy& policy) {
  SeqLayout& L = seqs[size_t(si)];
  const int64_t T = int64_t(tokens.size());
  L.T = T;
  L.group = step.child(seq_name(si));
  L.manifest = tensor_manifest(cfg, T);
  L.got.assign(L.manifest.size(), 0);
  int64_t R = 0;
  for (size_t r = 0; r < L.manifest.size(); ++r) {
    const auto& spec = L.manifest[r];
    if (!L.index.emplace(std::make_pair(spec.layer, spec.name), r).second)
      throw Error(fmt::format("tensor manifest lists '{}' layer {} twice", spec.name, spec.layer));
    L.first.push_back(R);
    R += spec.rows();
  }
  L.digests.assign(size_t(R), 0);
  const int64_t groups = T / 4;
  L.width = cfg.indexer_width(T);
  L.gap_type = unsigned_for(uint64_t(groups));

  h5::Object g = h5::create_group(step, seq_name(si));
  h5::Object tok = h5::create_dataset(g, kTokens, h5::Type::i32, dims({T}));
  h5::write(tok, tokens);
  h5::create_dataset(g, kLogprobs, h5::Type::f32, dims({T - 1}));

  const int64_t hc = cfg.hc_mult, ke = cfg.num_experts_per_tok;
  const h5::Type expert_type = unsigned_for(uint64_t(std::max(cfg.n_routed_experts - 1, 0)));
  h5::Object dec = h5::create_group(g, kDecisions);
  for (int layer = 0; layer < cfg.num_hidden_layers; ++layer) {
    const std::string ln = layer_name(layer);
    h5::Object d = h5::create_group(dec, ln);
    h5::write_attr(d, kHashed, uint8_t(cfg.is_hash_layer(layer) ? 1 : 0));
    if (cfg.ratio(layer) == 4) {
      h5::write_attr(d, kIndexerWidth, int32_t(L.width));
      h5::create_dataset(d, kIndexerCount, h5::Type::u16, dims({T}));
      // At most T * width ids (fewer where fewer groups are visible).
      h5::create_dataset(d, kIndexerGaps, L.gap_type, {0}, true, hsize_t(T * L.width));
      h5::create_dataset(d, kIndexerMargin, h5::Type::f32, dims({T}));
      L.pending.insert(ln + "/indexer");
    }
    h5::create_dataset(d, kExperts, expert_type, dims({T, ke}));
    h5::create_dataset(d, kExpertWeights, h5::Type::f32, dims({T, ke}));
    h5::create_dataset(d, kRouterMargin, h5::Type::f32, dims({T}));
    L.pending.insert(ln + "/routing");
    for (const char* sub : {"attn", "ffn"}) {
      h5::create_dataset(d, mhc_name(sub, "pre"), h5::Type::f32, dims({T, hc}));
      h5::create_dataset(d, mhc_name(sub, "post"), h5::Type::f32, dims({T, hc}));
      h5::create_dataset(d, mhc_name(sub, "comb"), h5::Type::f32, dims({T, hc, hc}));
      L.pending.insert(ln + "/" + mhc_name(sub));
    }
  }

  h5::Object dg = h5::create_group(g, kDigests);
  const int64_t M = int64_t(L.manifest.size());
  std::vector<int32_t> tensor(static_cast<size_t>(M)), layer(static_cast<size_t>(M));
  std::vector<int64_t> rows(static_cast<size_t>(M));
  for (int64_t r = 0; r < M; ++r) {
    const auto& spec = L.manifest[size_t(r)];
    auto it = name_index.find(spec.name);
    if (it == name_index.end())
      throw Error(fmt::format("tensor '{}' of the manifest is missing from tensor_names()", spec.name));
    tensor[size_t(r)] = it->second;
    layer[size_t(r)] = spec.layer;
    rows[size_t(r)] = spec.rows();
  }
  L.digest_chunk = int64_t(h5::chunk_rows(
      h5::create_dataset(dg, kDigestValue, h5::Type::u64, dims({R}), false, 0, h5::Compress::no)));
  h5::Object dt = h5::create_dataset(dg, kDigestTensor, h5::Type::i32, dims({M}));
  h5::write(dt, tensor);
  h5::Object dl = h5::create_dataset(dg, kDigestLayer, h5::Type::i32, dims({M}));
  h5::write(dl, layer);
  h5::Object dr = h5::create_dataset(dg, kDigestRows, h5::Type::i64, dims({M}));
  h5::write(dr, rows);

  std::optional<h5::Object> tensors;
  for (const auto& spec : L.manifest) {
    if (!policy.wants_tensor(spec.name, spec.layer)) continue;
    if (!tensors) tensors = h5::create_group(g, kTensors);
    if (!h5::exists(*tensors, spec.name)) h5::create_group(*tensors, spec.name);
    h5::Object parent = h5::open(*tensors, spec.name);
    std::vector<hsize_t> shape(spec.shape.begin(), spec.shape.end());
    h5::Object ds = h5::create_dataset(parent, layer_name(spec.layer), storage_type(spec.dtype), shape);
    h5::write_attr(ds, kDtype, std::string(dtype_attr(spec.dtype)));
  }
}

// ---- streamed data ------------------------------------------------------------------------------

StepLayout::SeqLayout& StepLayout::seq_of(const StepRecord& m) {
  if (step_index < 0) throw Error("data reported outside begin_step()/end_step()");
  if (m.seq < 0 || size_t(m.seq) >= seqs.size())
    throw Error(fmt::format("step {}: data reported for sequence {} of a batch of {}", step_index, m.seq,
                            seqs.size()));
  return seqs[size_t(m.seq)];
}

h5::Object StepLayout::open_in_seq(const SeqLayout& L, const std::string& rel) {
  return h5::open(file, L.group.substr(1) + "/" + rel);
}

void StepLayout::done_decision(SeqLayout& L, const StepRecord& m, const std::string& what) {
  const std::string key = layer_name(m.layer) + "/" + what;
  if (!L.pending.erase(key))
    throw Error(fmt::format("step {} seq {}: unexpected or repeated decision {}", step_index, m.seq, key));
}

void StepLayout::stage_tensor(const StepRecord& m, h5::StagedWrites& w) {
  SeqLayout& L = seq_of(m);
  auto it = L.index.find({m.layer, m.name});
  if (it == L.index.end())
    throw Error(
        fmt::format("step {} seq {}: the forward reported tensor '{}' layer {}, which the tensor "
                    "manifest (model/manifest.h) does not list for T={}",
                    step_index, m.seq, m.name, m.layer, L.T));
  const size_t r = it->second;
  const TensorSpecT& spec = L.manifest[r];
  if (L.got[r])
    throw Error(fmt::format("step {} seq {}: tensor '{}' layer {} reported twice", step_index, m.seq, m.name,
                            m.layer));
  if (int64_t(m.digests.size()) != spec.rows() || m.dtype != spec.dtype)
    throw Error(
        fmt::format("step {} seq {}: tensor '{}' layer {} reported as {} rows of {}, the manifest says {} "
                    "rows of {}",
                    step_index, m.seq, m.name, m.layer, m.digests.size(), to_string(m.dtype), spec.rows(),
                    to_string(spec.dtype)));
  std::copy(m.digests.begin(), m.digests.end(), L.digests.begin() + L.first[r]);
  L.got[r] = 1;
  stage_digests(L, w, false);
  if (m.store) {
    const h5::Object& ds = w.hold(open_in_seq(L, tensor_path(m.name, m.layer)));
    const h5::Type t = storage_type(m.dtype);
    if (m.bytes.size() % h5::type_size(t))
      ds.fail(fmt::format("{} bytes are not whole values of {} bytes", m.bytes.size(), h5::type_size(t)));
    w.add(ds, t, m.bytes.data(), m.bytes.size() / h5::type_size(t), true);
  }
}

// The rows of the digests dataset are the records' in manifest (execution) order, so chunk after chunk
// completes while the forward runs: they are stored then, kDigestChunksAtOnce at a time (512 KiB),
// from the step's own buffer, rather than all of them (4 MB for mid at T = 4096) when the step ends.
// Which rows a record completes depends on the order of the records only, so the file is the same
// whatever batches the writer took them in.
void StepLayout::stage_digests(SeqLayout& L, h5::StagedWrites& w, bool all) {
  constexpr int64_t kDigestChunksAtOnce = 8;
  while (L.next_record < L.got.size() && L.got[L.next_record]) ++L.next_record;
  const int64_t R = int64_t(L.digests.size());
  const int64_t ready = L.next_record == L.got.size() ? R : L.first[L.next_record];
  const int64_t end = all || ready == R ? R : ready / L.digest_chunk * L.digest_chunk;
  if (end <= L.digests_stored || (end < R && end - L.digests_stored < kDigestChunksAtOnce * L.digest_chunk))
    return;
  if (!L.digests_ds.id.valid()) L.digests_ds = open_in_seq(L, std::string(kDigests) + "/" + kDigestValue);
  w.add_rows(L.digests_ds, h5::Type::u64, L.digests.data(), L.digests.size(), hsize_t(L.digests_stored),
             hsize_t(end));
  L.digests_stored = end;
}

void StepLayout::stage_indexer(const StepRecord& m, h5::StagedWrites& w) {
  SeqLayout& L = seq_of(m);
  const std::string d = decisions_path(m.layer) + "/";
  if (m.layer < 0 || m.layer >= cfg.num_hidden_layers || cfg.ratio(m.layer) != 4)
    throw Error(fmt::format("step {} seq {}: indexer decision for layer {}, which is not a C4 layer",
                            step_index, m.seq, m.layer));
  if (m.T != L.T || m.k != L.width)
    throw Error(fmt::format("step {} seq {} layer {}: indexer ids [{}, {}], expected [{}, {}]", step_index,
                            m.seq, m.layer, m.T, m.k, L.T, L.width));
  // The encoding assumes ids ascending, valid ones first, and bounded by the group count.
  IndexerGaps e = encode_indexer_gaps(m.ids.data(), L.T, m.k, L.T / 4);
  if (e.bad_row >= 0)
    throw Error(fmt::format("step {} seq {} layer {} token {}: indexer ids are not an ascending, -1-tailed "
                            "list of groups < {} (slot {} holds {})",
                            step_index, m.seq, m.layer, e.bad_row, L.T / 4, e.bad_slot, e.bad_id));
  const hsize_t gaps = hsize_t(e.gaps.size());
  w.add(w.hold(open_in_seq(L, d + kIndexerCount)), std::move(e.count));
  stage_narrowed(w, w.hold(open_in_seq(L, d + kIndexerGaps)), L.gap_type, std::move(e.gaps), gaps);
  w.add(w.hold(open_in_seq(L, d + kIndexerMargin)), h5::Type::f32, m.margin.data(), m.margin.size());
  done_decision(L, m, "indexer");
}

void StepLayout::stage_routing(const StepRecord& m, h5::StagedWrites& w) {
  SeqLayout& L = seq_of(m);
  const std::string d = decisions_path(m.layer) + "/";
  if (m.layer < 0 || m.layer >= cfg.num_hidden_layers)
    throw Error(fmt::format("step {} seq {}: routing decision for layer {}", step_index, m.seq, m.layer));
  if (m.T != L.T || m.k != cfg.num_experts_per_tok || m.hashed != cfg.is_hash_layer(m.layer))
    throw Error(fmt::format(
        "step {} seq {} layer {}: routing [{}, {}] hashed={}, expected [{}, {}] hashed={}", step_index, m.seq,
        m.layer, m.T, m.k, m.hashed, L.T, cfg.num_experts_per_tok, cfg.is_hash_layer(m.layer)));
  std::vector<uint32_t> ids(m.ids.size());
  for (size_t i = 0; i < ids.size(); ++i) {
    if (m.ids[i] < 0 || m.ids[i] >= cfg.n_routed_experts)
      throw Error(fmt::format("step {} seq {} layer {}: expert id {} outside [0, {})", step_index, m.seq,
                              m.layer, m.ids[i], cfg.n_routed_experts));
    ids[i] = uint32_t(m.ids[i]);
  }
  stage_narrowed(w, w.hold(open_in_seq(L, d + kExperts)), unsigned_for(uint64_t(std::max(cfg.n_routed_experts - 1, 0))),
                 std::move(ids));
  w.add(w.hold(open_in_seq(L, d + kExpertWeights)), h5::Type::f32, m.weights.data(), m.weights.size());
  w.add(w.hold(open_in_seq(L, d + kRouterMargin)), h5::Type::f32, m.margin.data(), m.margin.size());
  done_decision(L, m, "routing");
}

void StepLayout::stage_mhc(const StepRecord& m, h5::StagedWrites& w) {
  SeqLayout& L = seq_of(m);
  const std::string sub = to_string(m.sub);
  const std::string d = decisions_path(m.layer) + "/";
  if (m.layer < 0 || m.layer >= cfg.num_hidden_layers || m.T != L.T || m.k != cfg.hc_mult)
    throw Error(fmt::format("step {} seq {} layer {}: mHC {} decision of [{}, {}], expected [{}, {}]",
                            step_index, m.seq, m.layer, sub, m.T, m.k, L.T, cfg.hc_mult));
  w.add(w.hold(open_in_seq(L, d + mhc_name(sub, "pre"))), h5::Type::f32, m.pre.data(), m.pre.size());
  w.add(w.hold(open_in_seq(L, d + mhc_name(sub, "post"))), h5::Type::f32, m.post.data(), m.post.size());
  w.add(w.hold(open_in_seq(L, d + mhc_name(sub, "comb"))), h5::Type::f32, m.comb.data(), m.comb.size());
  done_decision(L, m, mhc_name(sub));
}

void StepLayout::write_records(const std::vector<const StepRecord*>& records, double* seconds) {
  using Clock = std::chrono::steady_clock;
  Clock::time_point t = Clock::now();
  auto lap = [&](int i) {
    const Clock::time_point now = Clock::now();
    if (seconds) seconds[i] += std::chrono::duration<double>(now - t).count();
    t = now;
  };
  h5::StagedWrites w;
  std::exception_ptr failed;
  for (const StepRecord* m : records) {
    try {
      switch (m->kind) {
        case StepRecord::Kind::tensor: stage_tensor(*m, w); break;
        case StepRecord::Kind::indexer: stage_indexer(*m, w); break;
        case StepRecord::Kind::routing: stage_routing(*m, w); break;
        case StepRecord::Kind::mhc: stage_mhc(*m, w); break;
      }
    } catch (...) {  // the records before it are written, as one at a time would have
      failed = std::current_exception();
      break;
    }
  }
  lap(0);
  w.encode();
  lap(1);
  w.store();
  lap(2);
  if (failed) std::rethrow_exception(failed);
}

// Creates /steps/NNNNNN/kernels (traces/FORMAT.md) in `f`, which must be open without SWMR.
void StepLayout::write_kernels(const h5::Object& f, const KernelRecords& k) {
  h5::Object g = h5::create_group(h5::open(f, step_group.substr(1)), kKernels);
  h5::write_attr(g, kAvailable, uint8_t(k.available ? 1 : 0));
  h5::write_attr(g, kReason, k.available ? std::string() : k.reason);
  const int64_t n = k.available ? int64_t(k.kernels.size()) : 0;
  std::vector<std::string> names;
  std::vector<int32_t> grid, block, regs;
  std::vector<int64_t> shared, stream, start, end, corr;
  for (int64_t i = 0; i < n; ++i) {
    const KernelRecord& r = k.kernels[size_t(i)];
    names.push_back(r.name);
    grid.insert(grid.end(), r.grid.begin(), r.grid.end());
    block.insert(block.end(), r.block.begin(), r.block.end());
    shared.push_back(r.shared_bytes);
    regs.push_back(r.registers);
    stream.push_back(r.stream);
    start.push_back(r.start_ns);
    end.push_back(r.end_ns);
    corr.push_back(r.correlation);
  }
  h5::Object ds = h5::create_dataset(g, kKernelName, h5::Type::str, dims({n}));
  if (n > 0) h5::write_strings(ds, names);
  const auto put = [&](const char* name, h5::Type t, const std::vector<hsize_t>& shape, const auto& v) {
    h5::Object d = h5::create_dataset(g, name, t, shape);
    if (n > 0) h5::write(d, v);
  };
  put(kGrid, h5::Type::i32, dims({n, 3}), grid);
  put(kBlock, h5::Type::i32, dims({n, 3}), block);
  put(kSharedBytes, h5::Type::i64, dims({n}), shared);
  put(kRegisters, h5::Type::i32, dims({n}), regs);
  put(kStream, h5::Type::i64, dims({n}), stream);
  put(kStartNs, h5::Type::i64, dims({n}), start);
  put(kEndNs, h5::Type::i64, dims({n}), end);
  put(kCorrelation, h5::Type::i64, dims({n}), corr);
}

void StepLayout::finish_step(const ForwardResult& r, const KernelRecords& k,
                             const GenerationRecord* generation, const TrainingRecord* training) {
  if (r.seqs.size() != seqs.size())
    throw Error(
        fmt::format("end_step: the result has {} sequences, the step {}", r.seqs.size(), seqs.size()));
  for (size_t s = 0; s < seqs.size(); ++s) {
    SeqLayout& L = seqs[s];
    // The manifest is the contract that laid out this step: a tensor it lists but the forward did not
    // report means the two disagree, which is a bug in the model or the manifest, not in the input.
    for (size_t i = 0; i < L.manifest.size(); ++i)
      if (!L.got[i])
        throw Error(
            fmt::format("step {} seq {}: the forward did not report tensor '{}' layer {}, which the tensor "
                        "manifest (model/manifest.h) lists for T={}",
                        step_index, s, L.manifest[i].name, L.manifest[i].layer, L.T));
    if (!L.pending.empty())
      throw Error(fmt::format("step {} seq {}: the forward did not report decision {}", step_index, s,
                              *L.pending.begin()));
    if (int64_t(r.seqs[s].logprobs.size()) != std::max<int64_t>(L.T - 1, 0))
      throw Error(fmt::format("end_step: sequence {} has {} log-probs for {} tokens", s,
                              r.seqs[s].logprobs.size(), L.T));
    h5::StagedWrites w;
    stage_digests(L, w, true);
    w.store();
    L.digests_ds = h5::Object{};
    h5::write(open_in_seq(L, kLogprobs), r.seqs[s].logprobs);
  }
  // HDF5 1.10 creates no objects in SWMR mode: close the SWMR file and reopen it without SWMR for the
  // kernels group. Until status = 1 below the step stays incomplete, so a crash in between loses
  // only this step, as anywhere else in it.
  if (H5Fflush(file.get(), H5F_SCOPE_GLOBAL) < 0) file.fail("cannot flush");
  h5::close_file(file);
  file = h5::Object{};
  {
    h5::Id fapl = h5::writing_access(&written_);
    file = h5::open_file(writing_path, H5F_ACC_RDWR, fapl.get());
  }
  write_kernels(file, k);
  if (generation) {
    std::vector<std::string> seq_groups;
    for (size_t i = 0; i < seqs.size(); ++i) seq_groups.push_back(seq_name(int(i)));
    write_generation(h5::open(file, step_group.substr(1)), seq_groups, *generation);
  }
  if (training) write_training(h5::open(file, step_group.substr(1)), *training);
  h5::Object status = h5::open(file, step_group.substr(1) + "/" + kStatus);
  h5::write(status, std::vector<uint8_t>{1});
  status = h5::Object{};
  if (H5Fflush(file.get(), H5F_SCOPE_GLOBAL) < 0) file.fail("cannot flush");
  h5::close_file(file);
  file = h5::Object{};
  h5::start_writeback(writing_path);  // the step's bytes go to disk while the next step computes
  seqs.clear();
  step_index = -1;
}

void StepLayout::close_file() {
  for (SeqLayout& L : seqs) L.digests_ds = h5::Object{};  // a step abandoned mid-way
  try {
    h5::close_file(file);
  } catch (...) {
  }
  file = h5::Object{};
}

}  // namespace dsv4
