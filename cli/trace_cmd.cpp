// dsv4 record | trace info | trace validate | trace dump | trace salvage
#include <fmt/core.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>

#include "capture/errors.h"
#include "capture/joined.h"
#include "capture/record.h"
#include "capture/salvage.h"
#include "capture/trace_reader.h"
#include "capture/trace_writer.h"
#include "capture/validate.h"
#include "cli/commands.h"
#include "model/decision_sets.h"
#include "model/error.h"
#include "model/fanout.h"
#include "model/forward.h"
#include "model/tokens.h"

namespace dsv4::cli {

namespace {

// Progress on stderr: one line per finished layer when stderr is a terminal, else per sequence.
class Progress : public Observer {
 public:
  Progress(int layers, int seqs) : layers_(layers), seqs_(seqs), tty_(isatty(2)) {}
  void on_mhc(const MhcDecision& d) override {
    if (d.sublayer != Sublayer::ffn) return;
    if (tty_)
      fmt::print(stderr, "\rrecord: sequence {}/{} layer {}/{}   ", d.seq + 1, seqs_, d.layer + 1, layers_);
    if (d.layer + 1 == layers_) {
      if (tty_) fmt::print(stderr, "\r");
      fmt::print(stderr, "record: sequence {}/{} done ({} tokens)\n", d.seq + 1, seqs_, d.T);
    }
  }
  bool wants_tensors() const override { return false; }
  bool deferrable() const override { return true; }  // progress may lag the GPU by a few layers

 private:
  int layers_, seqs_;
  bool tty_;
};

struct RecordArgs {
  ModelArgs model;
  std::string tokens, batch;
  int64_t random = 0;
  uint64_t token_seed = 1;
  std::string profile = "train";
  std::string numerics = "exact";
  std::string kind;
  std::string capture = "decisions";
  std::string out;
  bool append = false;
  int threads = 0;
  std::string device = "cpu";
  ParallelArgs parallel;
};

// The recording's options from the command line.
RecordOptions record_options(const RecordArgs& a, Communicator* comm) {
  RecordOptions o;
  o.experts = comm;
  o.profile = a.profile;
  o.numerics = parse_numerics(a.numerics);
  o.kind = a.kind;
  o.capture = a.capture;
  o.seed = a.model.seed;
  o.threads = a.threads;
  o.device = parse_device(a.device);
  o.append = a.append;
  o.note = [](const std::string& m) { fmt::print(stderr, "record: {}\n", m); };
  // Fault injection for crash tests (RecordOptions::fault), on the rank DSV4_FAULT_RANK names (0 by
  // default); nothing else reads these variables.
  const char* f = std::getenv("DSV4_FAULT");
  const char* r = std::getenv("DSV4_FAULT_RANK");
  if (f && (r ? std::atoi(r) : 0) == (comm ? comm->rank() : 0)) o.fault = f;
  return o;
}

// What expert parallelism cost rank 0: the bytes it received from the other ranks and the weights it holds.
void print_parallel_costs(const Communicator& comm, const Weights& w, int64_t tokens) {
  fmt::print(stderr, "record: experts over {} {} ranks: rank 0 received {:.1f} MB ({:.0f} bytes per token), holds "
             "{:.1f} MB of weights\n",
             comm.size(), comm.transport(), double(comm.bytes_received()) / 1e6,
             double(comm.bytes_received()) / double(std::max<int64_t>(tokens, 1)), double(w.loaded_bytes()) / 1e6);
}

// record --ep N --dp: every rank records its own sequences; rank 0 joins them (capture/joined.h).
int record_split(const RecordArgs& a, const Weights& w, const std::vector<std::vector<int32_t>>& batch,
                 Communicator& comm) {
  const BlockRange mine = sequence_range(int(batch.size()), comm.rank(), comm.size());
  Progress progress(w.config().num_hidden_layers, mine.size());
  RecordOptions o = record_options(a, &comm);
  o.split_sequences = true;
  if (comm.rank() == 0) o.also = &progress;
  const RecordResult r = record_split_step(w, batch, a.out, o);
  int64_t own_tokens = 0;
  for (int s = mine.first; s < mine.last; ++s) own_tokens += int64_t(batch[size_t(s)].size());
  fmt::print(stderr, "record: rank {} of {}: {} of {} sequences ({} tokens) in {}\n", comm.rank(), comm.size(),
             mine.size(), batch.size(), own_tokens, part_trace_path(a.out, comm.rank()));
  if (comm.rank() == 0)
    fmt::print(stderr, "record: step {} ({} sequences, {} tokens, profile {}, {} numerics, capture {}) in {:.2f} s; {} joins "
               "the {} ranks' traces\n",
               r.step, batch.size(), r.tokens, a.profile, a.numerics, r.capture, r.seconds, r.path, comm.size());
  if (comm.rank() == 0) print_parallel_costs(comm, w, r.tokens);
  return 0;
}

int run_record(const RecordArgs& a) {
  Communicator* const comm = open_parallel(a.parallel, a.device);
  Weights w = open_model(a.model, comm);
  std::vector<std::vector<int32_t>> batch;
  if (!a.batch.empty()) {
    if (!a.tokens.empty() || a.random > 0) throw InputError("give --batch or --tokens/--random, not both");
    batch = parse_batch_jsonl(a.batch);
  } else {
    batch.push_back(get_tokens(a.tokens, a.random, a.token_seed, w.config()));
  }
  if (comm && a.parallel.dp) return record_split(a, w, batch, *comm);
  if (comm && comm->rank() != 0) {  // rank 0 records; the others share the experts of the same forward
    RunOptions ro;
    ro.profile = load_profile(a.profile, parse_numerics(a.numerics));
    ro.threads = a.threads;
    ro.device = parse_device(a.device);
    ro.experts = comm;
    forward(w, batch, ro);
    return 0;
  }
  Progress progress(w.config().num_hidden_layers, int(batch.size()));
  RecordOptions o = record_options(a, comm);
  o.also = &progress;
  const RecordResult r = record_step(w, batch, a.out, o);
  fmt::print(stderr, "record: step {} ({} sequences, {} tokens, profile {}, {} numerics, capture {}) in {:.2f} s; {}\n",
             r.step, batch.size(), r.tokens, a.profile, a.numerics, r.capture, r.seconds, r.path);
  fmt::print(stderr,
             "record: {:.1f} MB queued to the writer, compute blocked {:.3f} s, writer busy {:.3f} s\n",
             r.stats.bytes_queued / 1e6, r.stats.seconds_blocked, r.stats.seconds_writing);
  if (comm) print_parallel_costs(*comm, w, r.tokens);
  return 0;
}

struct TraceArgs {
  std::string path, out, what = "indexer", tensor;
  int step = 0, seq = 0, layer = -1;
  bool json = false;
};

int run_info(const TraceArgs& a) {
  TraceReader r = TraceReader::open(a.path);
  const auto steps = r.steps();
  const ModelConfig c = r.config();
  const TraceModelMeta m = r.model();
  const auto sizes = r.sizes();
  if (a.json) {
    nlohmann::json j;
    j["path"] = a.path;
    j["format_version"] = r.format_version();
    j["producer"] = r.producer();
    j["created"] = r.created();
    j["seal"] = seal_state_name(r.seal().state);
    j["model"] = {{"digest", m.model_digest},
                  {"weights_path", m.weights_path},
                  {"layers", c.num_hidden_layers},
                  {"hidden_size", c.hidden_size}};
    for (const auto& s : steps) {
      nlohmann::json step = {{"index", s.index},       {"kind", s.kind},       {"profile", s.profile},
                             {"complete", s.complete}, {"capture", s.capture}, {"seq_lengths", s.seq_lengths},
                             {"seed", s.seed}};
      if (!s.profile_digest.empty()) step["profile_digest"] = s.profile_digest;
      if (s.external()) step["external"] = {{"engine", s.engine}, {"source", s.source}};
      if (s.complete) {
        const KernelRecords k = r.kernels(s.index);
        step["kernels"] = k.available ? nlohmann::json{{"available", true}, {"launches", k.kernels.size()}}
                                      : nlohmann::json{{"available", false}, {"reason", k.reason}};
      }
      j["steps"].push_back(step);
    }
    for (const auto& g : sizes)
      j["sizes"][g.group] = {{"stored", g.stored_bytes}, {"logical", g.logical_bytes}};
    j["file_bytes"] = r.file_bytes();
    for (const TracePart& p : r.parts())
      j["parts"].push_back({{"name", p.name}, {"seal", seal_state_name(p.seal.state)}});
    j["env"] = r.env();
    fmt::print("{}\n", j.dump(2));
    return 0;
  }
  fmt::print("trace: {} (format {}, {}, created {})\n", a.path, r.format_version(), r.producer(),
             r.created());
  fmt::print("seal: {}\n", seal_summary(r.seal()));
  if (!r.parts().empty())
    fmt::print("joins the traces of {} ranks (their sequences are read through links):\n", r.parts().size());
  for (size_t i = 0; i < r.parts().size(); ++i)
    fmt::print("  rank {}: {} (seal: {})\n", i, r.parts()[i].name, seal_summary(r.parts()[i].seal));
  fmt::print("model: {} layers, hidden {}, digest {}, weights {}\n", c.num_hidden_layers, c.hidden_size,
             m.model_digest, m.weights_path.empty() ? "(not named)" : m.weights_path);
  fmt::print("steps: {}\n", steps.size());
  for (const auto& s : steps) {
    std::string kernels;
    if (s.complete) {
      const KernelRecords k = r.kernels(s.index);
      kernels = k.available ? fmt::format("  GPU kernels {}", k.kernels.size()) : "";
    }
    const std::string engine =
        s.external() ? fmt::format("  engine {}{}", s.engine, s.source.empty() ? "" : " from " + s.source) : "";
    fmt::print("  {:>4}  {:<10} profile {:<8} capture {:<12} sequences [{}]{}{}{}\n", s.index, s.kind, s.profile,
               s.capture, fmt::join(s.seq_lengths, ", "), s.complete ? "" : "  INCOMPLETE", kernels, engine);
  }
  fmt::print("sizes (stored / in memory):\n");
  for (const auto& g : sizes)
    fmt::print("  {:<48} {:>12} {:>12}\n", g.group, g.stored_bytes, g.logical_bytes);
  fmt::print("  {:<48} {:>12}\n", "file", r.file_bytes());
  fmt::print("environment:\n");
  for (const auto& [k, v] : r.env())
    fmt::print("  {:<14} {}\n", k, v.size() > 100 ? v.substr(0, 97) + "..." : v);
  return 0;
}

int run_validate(const TraceArgs& a) {
  const ValidateReport rep = validate_trace(a.path);
  if (a.json) {
    nlohmann::json j;
    j["path"] = rep.path;
    j["readable"] = rep.readable;
    j["incomplete_file"] = rep.incomplete_file;
    j["seal"] = seal_state_name(rep.seal.state);
    for (const TracePart& p : rep.parts)
      j["parts"].push_back({{"name", p.name}, {"seal", seal_state_name(p.seal.state)}});
    j["ok"] = rep.ok();
    j["steps"] = nlohmann::json::array();
    for (const auto& s : rep.steps)
      j["steps"].push_back({{"index", s.index}, {"complete", s.complete}, {"problems", s.problems}});
    j["problems"] = nlohmann::json::array();
    for (const auto& p : rep.problems) j["problems"].push_back({{"where", p.where}, {"what", p.what}});
    fmt::print("{}\n", j.dump(2));
  } else {
    if (rep.incomplete_file)
      fmt::print(
          "{}: the recorder did not close this file (a crash or a kill); `dsv4 trace salvage` recovers the "
          "complete steps\n",
          a.path);
    if (rep.readable) fmt::print("seal: {}\n", seal_summary(rep.seal));
    for (size_t i = 0; i < rep.parts.size(); ++i)
      fmt::print("part {}: {} (seal: {})\n", i, rep.parts[i].name, seal_summary(rep.parts[i].seal));
    for (const auto& s : rep.steps)
      fmt::print("step {}: {}{}\n", s.index, s.complete ? "complete" : "INCOMPLETE",
                 s.problems ? fmt::format(", {} problems", s.problems) : "");
    for (const auto& p : rep.problems) fmt::print("problem: {}: {}\n", p.where, p.what);
    fmt::print("{}: {}\n", a.path, rep.ok() ? "valid" : fmt::format("{} problems", rep.problems.size()));
  }
  if (!rep.readable) return 2;
  return rep.ok() ? 0 : 1;
}

int run_salvage(const TraceArgs& a) {
  const SalvageResult r = salvage_trace(a.path, a.out);
  for (const auto& k : r.skipped) fmt::print("step {}: skipped: {}\n", k.step, k.reason);
  const size_t n = r.copied.size();
  fmt::print("salvaged {} intact step{} (of {}) from {} into {}\n", n, n == 1 ? "" : "s", n + r.skipped.size(),
             a.path, a.out);
  if (!r.seal_problem.empty())
    fmt::print(
        "warning: {} was {}; the copied steps pass every check of `dsv4 trace validate`, but damage those "
        "checks cannot see (a value still within its range) may remain: `dsv4 replay {}` re-executes and "
        "compares them\n",
        a.path, r.seal_problem, a.out);
  return 0;
}

std::string fmt_float(float v) {
  return fmt::format("{:.9g}", v);
}

// The GPU kernels of one step (CUPTI records): every launch in order, then the time per kernel name,
// largest first, which is where the recorded step spent its GPU time.
int dump_kernels(const TraceReader& r, const TraceArgs& a) {
  const KernelRecords k = r.kernels(a.step);
  nlohmann::json j;
  j["step"] = a.step;
  j["available"] = k.available;
  if (!k.available) {
    j["reason"] = k.reason;
    if (a.json)
      fmt::print("{}\n", j.dump());
    else
      fmt::print("step {}: no kernel records ({})\n", a.step, k.reason);
    return 0;
  }
  struct ByName {
    std::string name;
    int64_t launches = 0, ns = 0;
  };
  std::vector<ByName> by_name;
  std::map<std::string, size_t> where;
  int64_t total_ns = 0;
  std::string text;
  for (size_t i = 0; i < k.kernels.size(); ++i) {
    const KernelRecord& kr = k.kernels[i];
    const int64_t ns = kr.end_ns - kr.start_ns;
    total_ns += ns;
    auto [it, added] = where.emplace(kr.name, by_name.size());
    if (added) by_name.push_back({kr.name});
    by_name[it->second].launches += 1;
    by_name[it->second].ns += ns;
    j["kernels"].push_back({{"index", i},
                            {"name", kr.name},
                            {"grid", kr.grid},
                            {"block", kr.block},
                            {"shared_bytes", kr.shared_bytes},
                            {"registers", kr.registers},
                            {"stream", kr.stream},
                            {"start_ns", kr.start_ns},
                            {"end_ns", kr.end_ns},
                            {"correlation", kr.correlation}});
    text += fmt::format(
        "{:>5}  {:>10.1f} us  grid ({},{},{}) block ({},{},{}) smem {:>6} regs {:>3} stream {}  {}\n", i,
        double(ns) * 1e-3, kr.grid[0], kr.grid[1], kr.grid[2], kr.block[0], kr.block[1], kr.block[2],
        kr.shared_bytes, kr.registers, kr.stream, kr.name);
  }
  std::stable_sort(by_name.begin(), by_name.end(),
                   [](const ByName& x, const ByName& y) { return x.ns > y.ns; });
  text += fmt::format("\n{} launches, {:.3f} ms of kernel time; by kernel:\n", k.kernels.size(),
                      double(total_ns) * 1e-6);
  for (const ByName& b : by_name) {
    const double share = total_ns > 0 ? 100.0 * double(b.ns) / double(total_ns) : 0.0;
    j["by_name"].push_back({{"name", b.name}, {"launches", b.launches}, {"ns", b.ns}, {"share", share}});
    text += fmt::format("  {:>10.3f} ms {:>5.1f} %  {:>5} x  {}\n", double(b.ns) * 1e-6, share, b.launches,
                        b.name);
  }
  j["total_ns"] = total_ns;
  if (a.json)
    fmt::print("{}\n", j.dump());
  else
    fmt::print("{}", text);
  return 0;
}

int run_dump(const TraceArgs& a) {
  TraceReader r = TraceReader::open(a.path);
  const auto steps = r.steps();
  if (a.step < 0 || a.step >= int(steps.size()))
    throw InputError(fmt::format("{}: no step {} (the trace has {})", a.path, a.step, steps.size()));
  if (a.seq < 0 || a.seq >= int(steps[a.step].seq_lengths.size()))
    throw InputError(fmt::format("{}: step {} has no sequence {} (it has {})", a.path, a.step, a.seq,
                                 steps[a.step].seq_lengths.size()));
  if (a.what == "kernels") return dump_kernels(r, a);
  const ModelConfig c = r.config();
  const bool need_layer = a.what == "indexer" || a.what == "experts" || a.what == "mhc";
  if (need_layer && (a.layer < 0 || a.layer >= c.num_hidden_layers))
    throw InputError(
        fmt::format("--layer: give a layer in [0, {}) for --what {}", c.num_hidden_layers, a.what));
  nlohmann::json j;
  std::string text;
  if (a.what == "indexer") {
    auto rec = r.indexer(a.step, a.seq, a.layer);
    if (!rec)
      throw InputError(fmt::format("layer {} has no indexer (compress ratio {})", a.layer, c.ratio(a.layer)));
    // External steps may hold no margins (capture/external.h): the key is left out, the text says "-".
    const bool margins = !rec->margin.empty();
    for (int64_t t = 0; t < rec->T; ++t) {
      const std::vector<int32_t> s = valid_ids(rec->ids, rec->k, t);
      nlohmann::json row = {{"token", t}, {"ids", s}};
      if (margins) row["margin"] = rec->margin[t];
      j["rows"].push_back(row);
      text += fmt::format("token {:>6}  margin {:>14}  ids [{}]\n", t, margins ? fmt_float(rec->margin[t]) : "-",
                          fmt::join(s, ", "));
    }
  } else if (a.what == "experts") {
    auto rec = r.routing(a.step, a.seq, a.layer);
    if (!rec)
      throw TraceError(
          fmt::format("{}: step {} sequence {} has no routing for layer {}", a.path, a.step, a.seq, a.layer));
    // External steps may hold no weights or margins: their keys are left out, the text says "-".
    const bool weights = !rec->weights.empty(), margins = !rec->margin.empty();
    for (int64_t t = 0; t < rec->T; ++t) {
      std::vector<int32_t> ids(rec->ids.begin() + t * rec->k, rec->ids.begin() + (t + 1) * rec->k);
      nlohmann::json row = {{"token", t}, {"experts", ids}};
      std::vector<std::string> ws;
      if (weights) {
        std::vector<float> wts(rec->weights.begin() + t * rec->k, rec->weights.begin() + (t + 1) * rec->k);
        for (float v : wts) ws.push_back(fmt_float(v));
        row["weights"] = wts;
      }
      if (margins) row["margin"] = rec->margin[t];
      j["rows"].push_back(row);
      text += fmt::format("token {:>6}  experts [{}]  weights [{}]  margin {}{}\n", t, fmt::join(ids, ", "),
                          weights ? fmt::format("{}", fmt::join(ws, ", ")) : "-",
                          margins ? fmt_float(rec->margin[t]) : "-", rec->hashed ? "  (hash)" : "");
    }
  } else if (a.what == "mhc") {
    for (Sublayer s : {Sublayer::attn, Sublayer::ffn}) {
      auto rec = r.mhc(a.step, a.seq, a.layer, s);
      if (!rec) continue;
      for (int64_t t = 0; t < rec->T; ++t) {
        const int hc = rec->hc;
        std::vector<float> pre(rec->pre.begin() + t * hc, rec->pre.begin() + (t + 1) * hc);
        std::vector<float> post(rec->post.begin() + t * hc, rec->post.begin() + (t + 1) * hc);
        std::vector<float> comb(rec->comb.begin() + t * hc * hc, rec->comb.begin() + (t + 1) * hc * hc);
        j[to_string(s)].push_back({{"token", t}, {"pre", pre}, {"post", post}, {"comb", comb}});
        std::vector<std::string> cs;
        for (float v : comb) cs.push_back(fmt_float(v));
        text += fmt::format("{} token {:>6}  pre [{}]  post [{}]  comb [{}]\n", to_string(s), t,
                            fmt::join(pre, ", "), fmt::join(post, ", "), fmt::join(cs, ", "));
      }
    }
  } else if (a.what == "digests") {
    if (steps[size_t(a.step)].external())
      throw InputError(fmt::format("{}: step {} is an external step (engine '{}'): it holds no digests", a.path, a.step,
                                   steps[size_t(a.step)].engine));
    const DigestTable d = r.digests(a.step, a.seq);
    const uint64_t all = xxh3_64(d.values.data(), d.values.size() * sizeof(uint64_t));
    j["all_rows_xxh3"] = hex16(all);
    text += fmt::format("all {} digests: xxh3 {}\n", d.values.size(), hex16(all));
    for (const auto& rec : d.records) {
      if (a.layer >= 0 && rec.layer != a.layer) continue;
      std::vector<std::string> hs;
      for (int64_t i = 0; i < rec.rows; ++i) hs.push_back(hex16(d.values[rec.first + i]));
      j["records"].push_back({{"tensor", rec.name}, {"layer", rec.layer}, {"digests", hs}});
      text += fmt::format("{:<20} layer {:>3}  rows {:>6}  first {}  last {}\n", rec.name, rec.layer,
                          rec.rows, hs.empty() ? "-" : hs.front(), hs.empty() ? "-" : hs.back());
    }
  } else if (a.what == "tensor") {
    if (a.tensor.empty()) throw InputError("--what tensor needs --tensor NAME");
    auto t = r.tensor(a.step, a.seq, a.layer, a.tensor);
    if (!t) {
      std::vector<std::string> have;
      for (const auto& [n, l] : r.full_tensors(a.step, a.seq)) have.push_back(fmt::format("{}@{}", n, l));
      throw InputError(fmt::format("{}: tensor '{}' layer {} is not stored (capture policy '{}'; stored: {})",
                                   a.path, a.tensor, a.layer, steps[a.step].capture,
                                   have.empty() ? "none" : fmt::format("{}", fmt::join(have, ", "))));
    }
    j["shape"] = t->shape;
    j["dtype"] = to_string(t->dtype);
    const int64_t rows = t->shape.empty() ? 1 : t->shape[0];
    const int64_t n = t->dtype == DType::i32 ? int64_t(t->i.size()) : int64_t(t->f.size());
    const int64_t per = rows ? n / rows : 0;
    text += fmt::format("{} layer {} {} [{}]\n", a.tensor, a.layer, to_string(t->dtype),
                        fmt::join(t->shape, ", "));
    for (int64_t row = 0; row < rows; ++row) {
      std::vector<std::string> vs;
      for (int64_t i = 0; i < per; ++i)
        vs.push_back(t->dtype == DType::i32 ? std::to_string(t->i[row * per + i])
                                            : fmt_float(t->f[row * per + i]));
      j["rows"].push_back(vs);
      text += fmt::format("row {:>6}: {}\n", row, fmt::join(vs, " "));
    }
  } else {
    throw InputError(
        fmt::format("--what '{}': expected indexer, experts, mhc, digests, tensor or kernels", a.what));
  }
  if (a.json)
    fmt::print("{}\n", j.dump());
  else
    fmt::print("{}", text);
  return 0;
}

}  // namespace

void register_trace_commands(CLI::App& app) {
  auto ra = std::make_shared<RecordArgs>();
  CLI::App* rec = app.add_subcommand("record", "Run one step and write it to an HDF5 trace");
  add_model_options(rec, ra->model);
  rec->add_option("--tokens", ra->tokens, "Token ids: 1,2,3 or @file");
  rec->add_option("--random", ra->random, "Use N seeded random token ids");
  rec->add_option("--token-seed", ra->token_seed, "Seed of --random")->capture_default_str()->check(CLI::NonNegativeNumber);
  rec->add_option("--batch", ra->batch,
                  "JSONL file, one sequence per line: [ids], {\"tokens\": [ids]}, or a dsv4 generate sample "
                  "(prompt + response)");
  rec->add_option("--profile", ra->profile, kProfileHelp)
      ->capture_default_str();
  add_numerics_option(rec, ra->numerics);
  rec->add_option("--kind", ra->kind, "Step kind recorded in the trace (default: the profile's)")
      ->check(CLI::IsMember({"train", "rollout"}));
  rec->add_option("--capture", ra->capture,
                  "decisions | full | pattern[@layers],... (e.g. attn.*@3-5,moe.out)")
      ->capture_default_str();
  rec->add_option("--out", ra->out, "Trace file (NAME.h5)")->required();
  rec->add_flag("--append", ra->append, "Add a step to an existing trace (same model required)");
  add_threads_option(rec, ra->threads, "CPU threads (0: all)");
  rec->add_option("--device", ra->device, "Where the forward runs: cpu or cuda (cuda also records kernels)")
      ->capture_default_str();
  add_parallel_options(rec, ra->parallel, true);
  rec->callback([ra] { set_action([ra] { return run_record(*ra); }); });

  CLI::App* trace = app.add_subcommand("trace", "Inspect, check or repair trace files");
  trace->require_subcommand(1);
  auto ta = std::make_shared<TraceArgs>();
  CLI::App* info = trace->add_subcommand("info", "Steps, profiles, sizes per group and the environment");
  info->add_option("TRACE", ta->path, "Trace file")->required();
  info->add_flag("--json", ta->json, "Print JSON");
  info->callback([ta] { set_action([ta] { return run_info(*ta); }); });

  CLI::App* val =
      trace->add_subcommand("validate", "Check structure, dtypes, shapes and value ranges (exit 0/1)");
  val->add_option("TRACE", ta->path, "Trace file (also a leftover NAME.h5.incomplete)")->required();
  val->add_flag("--json", ta->json, "Print JSON");
  val->callback([ta] { set_action([ta] { return run_validate(*ta); }); });

  CLI::App* dump = trace->add_subcommand("dump", "Print decisions, digests or a tensor of one step as text");
  dump->add_option("TRACE", ta->path, "Trace file")->required();
  dump->add_option("--step", ta->step, "Step index")->capture_default_str()->check(CLI::NonNegativeNumber);
  dump->add_option("--seq", ta->seq, "Sequence of the step's batch")->capture_default_str();
  dump->add_option("--layer", ta->layer, "Layer (-1: model-level tensors)");
  dump->add_option("--what", ta->what, "indexer | experts | mhc | digests | tensor | kernels (GPU launches)")
      ->capture_default_str();
  dump->add_option("--tensor", ta->tensor, "Tensor name for --what tensor (e.g. attn.q)");
  dump->add_flag("--json", ta->json, "Print JSON");
  dump->callback([ta] { set_action([ta] { return run_dump(*ta); }); });

  CLI::App* salv =
      trace->add_subcommand("salvage", "Copy the complete steps of a damaged trace into a new one");
  salv->add_option("TRACE", ta->path, "Trace file (e.g. NAME.h5.incomplete)")->required();
  salv->add_option("--out", ta->out, "New trace file")->required();
  salv->callback([ta] { set_action([ta] { return run_salvage(*ta); }); });

  register_bundle_command(*trace);
}

}  // namespace dsv4::cli
