// TraceReader for Python: every accessor returns plain Python values and numpy arrays (dicts of
// arrays for a record), None where the trace holds nothing. The row arguments [r0, r1) read only
// those rows from the file; r1 < 0 means "to the end".
#include <fmt/core.h>

#include <cstring>
#include <limits>

#include "capture/errors.h"
#include "capture/trace_reader.h"
#include "python/src/bindings.h"

namespace dsv4::python {

namespace {

// The reader's end of rows [r0, r1): r1 < 0 ("to the end") is every row.
int64_t end_of(int64_t r1) { return r1 < 0 ? std::numeric_limits<int64_t>::max() : r1; }

py::dict step_dict(const TraceStepInfo& s) {
  py::dict d;
  d["index"] = s.index;
  d["group"] = s.group;
  d["kind"] = s.kind;
  d["profile"] = s.profile;
  d["profile_text"] = s.profile_text;  // the recorded precision map (docs/PROFILES.md), "" when not stored
  d["capture"] = s.capture;
  d["seed"] = s.seed;
  d["threads"] = s.threads;
  d["complete"] = s.complete;
  d["damage"] = s.damage;
  d["seq_lengths"] = s.seq_lengths;
  d["engine"] = s.engine;
  d["source"] = s.source;
  d["why_not_complete"] = s.why_not_complete();
  return d;
}

// Margins and weights are absent (None) from records that have rows but not those values (external
// steps); a slice of no rows has empty arrays of everything the record holds.
bool absent(const std::vector<float>& v, int64_t rows) { return v.empty() && rows > 0; }

py::object indexer_dict(std::optional<IndexerRecord> rec) {
  if (!rec) return py::none();
  py::dict d;
  const auto rows = static_cast<py::ssize_t>(rec->T);
  d["ids"] = to_numpy(std::move(rec->ids), {rows, rec->k});
  d["margin"] = absent(rec->margin, rec->T) ? py::object(py::none()) : py::object(to_numpy(std::move(rec->margin)));
  return d;
}

py::object routing_dict(std::optional<RoutingRecord> rec) {
  if (!rec) return py::none();
  py::dict d;
  const auto rows = static_cast<py::ssize_t>(rec->T);
  d["ids"] = to_numpy(std::move(rec->ids), {rows, rec->k});
  d["weights"] = absent(rec->weights, rec->T) ? py::object(py::none())
                                              : py::object(to_numpy(std::move(rec->weights), {rows, rec->k}));
  d["margin"] = absent(rec->margin, rec->T) ? py::object(py::none()) : py::object(to_numpy(std::move(rec->margin)));
  d["hashed"] = rec->hashed;
  return d;
}

// bf16 values arrive widened to fp32 (exactly); the package hands them out as they are stored, the
// upper 16 bits, so nothing is widened before the caller asks (dsv4.bf16_to_float32).
py::array_t<uint16_t> bf16_bits(const std::vector<float>& f, std::vector<py::ssize_t> shape) {
  std::vector<uint16_t> u(f.size());
  for (size_t i = 0; i < f.size(); ++i) {
    uint32_t bits;
    std::memcpy(&bits, &f[i], sizeof bits);
    u[i] = static_cast<uint16_t>(bits >> 16);
  }
  return to_numpy(std::move(u), std::move(shape));
}

py::object tensor_dict(std::optional<TensorCopy> t) {
  if (!t) return py::none();
  std::vector<py::ssize_t> shape(t->shape.begin(), t->shape.end());
  py::dict d;
  d["dtype"] = to_string(t->dtype);
  d["shape"] = t->shape;
  switch (t->dtype) {
    case DType::bf16:
      d["values"] = bf16_bits(t->f, std::move(shape));
      break;
    case DType::f32:
      d["values"] = to_numpy(std::move(t->f), std::move(shape));
      break;
    case DType::i32:
      d["values"] = to_numpy(std::move(t->i), std::move(shape));
      break;
  }
  return d;
}

Sublayer sublayer_of(const std::string& s) {
  if (s == "attn") return Sublayer::attn;
  if (s == "ffn") return Sublayer::ffn;
  throw py::value_error(fmt::format("sublayer '{}': expected 'attn' or 'ffn'", s));
}

// A generation step's record (capture/generation.h): the engine's settings, per request its sampling
// settings, generated tokens and log-probs and Philox counters, and the schedule as parallel arrays.
py::object generation_dict(std::optional<GenerationRecord> g) {
  if (!g) return py::none();
  py::dict d;
  d["max_batch"] = g->max_batch;
  d["page_size"] = g->page_size;
  d["prefill_chunk"] = g->prefill_chunk;
  d["token_budget"] = g->token_budget;
  d["prefix_sharing"] = g->prefix_sharing;
  d["decode_attention"] = g->decode_attention;
  py::list requests;
  for (GenerationRequestRecord& q : g->requests) {
    py::dict r;
    r["id"] = q.id;
    r["request_key"] = q.request_key;
    r["prompt_length"] = q.prompt_length;
    r["max_new_tokens"] = q.max_new_tokens;
    r["stop_ids"] = to_numpy(std::move(q.stop_ids));
    r["temperature"] = q.temperature;
    r["top_k"] = q.top_k;
    r["top_p"] = q.top_p;
    r["sampling_seed"] = q.sampling_seed;
    r["tokens"] = to_numpy(std::move(q.tokens));
    r["logprobs"] = to_numpy(std::move(q.logprobs));
    std::vector<uint32_t> counters;
    for (const auto& c : q.counters) counters.insert(counters.end(), c.begin(), c.end());
    r["counters"] = to_numpy(std::move(counters), {static_cast<py::ssize_t>(q.counters.size()), 4});
    r["finish_reason"] = q.finish_reason;
    r["prefix_source"] = q.prefix_source;
    r["shared_prefix"] = q.shared_prefix;
    requests.append(r);
  }
  d["requests"] = requests;
  std::vector<int32_t> step, request;
  std::vector<int64_t> pos0, length;
  std::vector<uint8_t> sampled;
  for (const GenerationChunk& c : g->schedule) {
    step.push_back(c.step);
    request.push_back(c.request);
    pos0.push_back(c.pos0);
    length.push_back(c.length);
    sampled.push_back(c.sampled);
  }
  py::dict sch;
  sch["step"] = to_numpy(std::move(step));
  sch["request"] = to_numpy(std::move(request));
  sch["pos0"] = to_numpy(std::move(pos0));
  sch["length"] = to_numpy(std::move(length));
  sch["sampled"] = to_numpy(std::move(sampled));
  d["schedule"] = sch;
  return d;
}

// A training step's record (capture/training.h): settings (JSON text), optimizer provenance, per
// sample its loss inputs, the metrics, per weight its row digests (gradient, weight, master, moments),
// the activation-gradient digests and the full gradients and weights the capture policy kept.
py::object training_dict(std::optional<TrainingRecord> t) {
  if (!t) return py::none();
  py::dict d;
  d["settings_json"] = t->settings_json;
  d["optimizer_step_before"] = t->optimizer_step_before;
  d["optimizer_state_path"] = t->optimizer_state_path;
  d["optimizer_state_digest"] = t->optimizer_state_digest;
  py::list samples;
  for (SampleLossInputs& s : t->samples) {
    py::dict x;
    x["id"] = s.id;
    x["prompt_length"] = s.prompt_length;
    x["advantage"] = s.advantage;
    x["reward"] = s.has_reward ? py::object(py::float_(s.reward)) : py::object(py::none());
    x["group"] = s.group;
    x["rollout_logprobs"] = to_numpy(std::move(s.rollout_logprobs));
    x["old_logprobs"] = to_numpy(std::move(s.old_logprobs));
    x["ref_logprobs"] = to_numpy(std::move(s.ref_logprobs));
    samples.append(x);
  }
  d["samples"] = samples;
  d["metrics"] = t->metrics;
  py::dict params;
  for (ParamDigests& p : t->params) {
    py::dict x;
    x["rows"] = p.rows;
    x["row_elems"] = p.row_elems;
    x["grad"] = p.grad.empty() ? py::object(py::none()) : py::object(to_numpy(std::move(p.grad)));
    x["weight"] = to_numpy(std::move(p.weight));
    x["master"] = p.master.empty() ? py::object(py::none()) : py::object(to_numpy(std::move(p.master)));
    x["m"] = p.m.empty() ? py::object(py::none()) : py::object(to_numpy(std::move(p.m)));
    x["v"] = p.v.empty() ? py::object(py::none()) : py::object(to_numpy(std::move(p.v)));
    params[py::str(p.name)] = x;
  }
  d["params"] = params;
  py::list act;
  for (ActGradDigests& a : t->act_grads) {
    py::dict x;
    x["seq"] = a.seq;
    x["layer"] = a.layer;
    x["name"] = a.name;
    x["rows"] = a.rows;
    x["cols"] = a.cols;
    x["digests"] = to_numpy(std::move(a.digests));
    act.append(x);
  }
  d["act_grads"] = act;
  for (auto [key, src] : {std::pair{"full_grads", &t->full_grads}, std::pair{"full_weights", &t->full_weights}}) {
    py::dict x;
    for (auto& [name, v] : *src) x[py::str(name)] = to_numpy(std::move(v));
    d[key] = x;
  }
  return d;
}

// A step's GPU kernel records (capture/cupti.h): whether they were recorded (and why not), and per
// kernel in launch order its name, launch configuration and times, as parallel arrays.
py::dict kernels_dict(KernelRecords k) {
  py::dict d;
  d["available"] = k.available;
  d["reason"] = k.reason;
  std::vector<std::string> names;
  std::vector<int32_t> grid, block, registers;
  std::vector<int64_t> shared, stream, start, end, correlation;
  for (const KernelRecord& r : k.kernels) {
    names.push_back(r.name);
    grid.insert(grid.end(), r.grid.begin(), r.grid.end());
    block.insert(block.end(), r.block.begin(), r.block.end());
    registers.push_back(r.registers);
    shared.push_back(r.shared_bytes);
    stream.push_back(r.stream);
    start.push_back(r.start_ns);
    end.push_back(r.end_ns);
    correlation.push_back(r.correlation);
  }
  const auto n = static_cast<py::ssize_t>(names.size());
  d["names"] = names;
  d["grid"] = to_numpy(std::move(grid), {n, 3});
  d["block"] = to_numpy(std::move(block), {n, 3});
  d["shared_bytes"] = to_numpy(std::move(shared));
  d["registers"] = to_numpy(std::move(registers));
  d["stream"] = to_numpy(std::move(stream));
  d["start_ns"] = to_numpy(std::move(start));
  d["end_ns"] = to_numpy(std::move(end));
  d["correlation"] = to_numpy(std::move(correlation));
  return d;
}

}  // namespace

void bind_reader(py::module_& m) {
  py::class_<TraceReader>(m, "TraceReader")
      .def(py::init([](const std::string& path) { return std::make_unique<TraceReader>(TraceReader::open(path)); }),
           py::arg("path"))
      .def_property_readonly("path", &TraceReader::path)
      .def_property_readonly("format_version", &TraceReader::format_version)
      .def_property_readonly("producer", &TraceReader::producer)
      .def_property_readonly("created", &TraceReader::created)
      .def_property_readonly("seal", [](const TraceReader& r) { return seal_state_name(r.seal().state); })
      .def("env", &TraceReader::env)
      .def("model",
           [](const TraceReader& r) {
             TraceModelMeta meta = r.model();
             py::dict d;
             d["config_json"] = meta.config_json;
             d["weights_path"] = meta.weights_path;
             d["digest"] = meta.model_digest;
             d["tensor_names"] = meta.tensor_names;
             d["tensor_digests"] = to_numpy(std::move(meta.tensor_digests));
             return d;
           })
      .def("steps",
           [](const TraceReader& r) {
             py::list l;
             for (const auto& s : r.steps()) l.append(step_dict(s));
             return l;
           })
      .def("refresh", &TraceReader::refresh)
      .def("tokens", [](const TraceReader& r, int step, int seq) { return to_numpy(r.tokens(step, seq)); })
      .def("has_logprobs", &TraceReader::has_logprobs)
      .def("logprobs", [](const TraceReader& r, int step, int seq) { return to_numpy(r.logprobs(step, seq)); })
      .def("sequence_id", &TraceReader::sequence_id)
      .def("prompt_length", &TraceReader::prompt_length)
      .def("decision_layers", &TraceReader::decision_layers)
      .def(
          "indexer",
          [](const TraceReader& r, int step, int seq, int layer, int64_t r0, int64_t r1) {
            return indexer_dict(r.indexer_rows(step, seq, layer, r0, end_of(r1)));
          },
          py::arg("step"), py::arg("seq"), py::arg("layer"), py::arg("r0") = 0, py::arg("r1") = -1)
      .def(
          "routing",
          [](const TraceReader& r, int step, int seq, int layer, int64_t r0, int64_t r1) {
            return routing_dict(r.routing_rows(step, seq, layer, r0, end_of(r1)));
          },
          py::arg("step"), py::arg("seq"), py::arg("layer"), py::arg("r0") = 0, py::arg("r1") = -1)
      .def("mhc",
           [](const TraceReader& r, int step, int seq, int layer, const std::string& sublayer) -> py::object {
             std::optional<MhcRecord> rec = r.mhc(step, seq, layer, sublayer_of(sublayer));
             if (!rec) return py::none();
             const auto T = static_cast<py::ssize_t>(rec->T);
             py::dict d;
             d["pre"] = to_numpy(std::move(rec->pre), {T, rec->hc});
             d["post"] = to_numpy(std::move(rec->post), {T, rec->hc});
             d["comb"] = to_numpy(std::move(rec->comb), {T, rec->hc, rec->hc});
             return d;
           })
      .def("digests",
           [](const TraceReader& r, int step, int seq) {
             DigestTable t = r.digests(step, seq);
             std::vector<std::string> names;
             std::vector<int32_t> layers;
             std::vector<int64_t> rows, first;
             for (const auto& rec : t.records) {
               names.push_back(rec.name);
               layers.push_back(rec.layer);
               rows.push_back(rec.rows);
               first.push_back(rec.first);
             }
             py::dict d;
             d["names"] = names;
             d["layers"] = to_numpy(std::move(layers));
             d["rows"] = to_numpy(std::move(rows));
             d["first"] = to_numpy(std::move(first));
             d["values"] = to_numpy(std::move(t.values));
             return d;
           })
      .def("full_tensors", &TraceReader::full_tensors)
      .def(
          "tensor",
          [](const TraceReader& r, int step, int seq, int layer, const std::string& name, int64_t r0, int64_t r1) {
            return tensor_dict(r.tensor_rows(step, seq, layer, name, r0, end_of(r1)));
          },
          py::arg("step"), py::arg("seq"), py::arg("layer"), py::arg("name"), py::arg("r0") = 0,
          py::arg("r1") = -1)
      .def("generation", [](const TraceReader& r, int step) { return generation_dict(r.generation(step)); })
      .def("training", [](const TraceReader& r, int step) { return training_dict(r.training(step)); })
      .def("kernels", [](const TraceReader& r, int step) { return kernels_dict(r.kernels(step)); })
      .def("file_bytes", &TraceReader::file_bytes);
}

}  // namespace dsv4::python
