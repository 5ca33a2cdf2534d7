// ExternalTraceWriter for Python. A sequence is assembled in an ExternalSequence held by the binding
// (the Python TraceWriter adds its records one call at a time) and handed to the writer whole, which
// checks it against the model config and throws InputError naming the sequence, layer and row.
// Arrays arrive as numpy arrays already of the right dtype (python/dsv4/writer.py converts and
// checks them); here they are only copied into the writer's vectors.
#include <fmt/core.h>

#include <cstring>

#include "capture/external.h"
#include "model/error.h"
#include "python/src/bindings.h"

namespace dsv4::python {

namespace {

template <class T>
using CArray = py::array_t<T, py::array::c_style>;

template <class T>
std::vector<T> values_of(const CArray<T>& a) {
  return std::vector<T>(a.data(), a.data() + a.size());
}

// [rows, width] of a 2-D array, for the writer's row-major records.
std::pair<int64_t, int> matrix_shape(const py::array& a, const char* what, int layer) {
  if (a.ndim() != 2)
    throw InputError(fmt::format("{} of layer {}: expected a 2-D array [rows, width], got {} dimensions", what,
                                 layer, a.ndim()));
  return {a.shape(0), static_cast<int>(a.shape(1))};
}

DType dtype_of(const std::string& s) {
  if (s == "f32") return DType::f32;
  if (s == "bf16") return DType::bf16;
  if (s == "i32") return DType::i32;
  throw InputError(fmt::format("tensor dtype '{}': expected f32, bf16 or i32", s));
}

}  // namespace

void bind_writer(py::module_& m) {
  py::class_<ExternalSequence>(m, "ExternalSequence")
      .def(py::init([](const std::string& id, const CArray<int32_t>& tokens, int64_t prompt_length,
                       std::optional<CArray<float>> logprobs) {
             auto s = std::make_unique<ExternalSequence>();
             s->id = id;
             s->tokens = values_of(tokens);
             s->prompt_length = prompt_length;
             if (logprobs) s->logprobs = values_of(*logprobs);
             return s;
           }),
           py::arg("id"), py::arg("tokens"), py::arg("prompt_length"), py::arg("logprobs"))
      .def_readonly("id", &ExternalSequence::id)
      .def("add_indexer",
           [](ExternalSequence& s, int layer, const CArray<int32_t>& ids) {
             ExternalIndexer x;
             x.layer = layer;
             std::tie(x.rows, x.width) = matrix_shape(ids, "indexer ids", layer);
             x.ids = values_of(ids);
             s.indexer.push_back(std::move(x));
           })
      .def("add_routing",
           [](ExternalSequence& s, int layer, const CArray<int32_t>& ids, std::optional<CArray<float>> weights) {
             ExternalRouting x;
             x.layer = layer;
             std::tie(x.rows, x.k) = matrix_shape(ids, "routing ids", layer);
             x.ids = values_of(ids);
             if (weights) x.weights = values_of(*weights);
             s.routing.push_back(std::move(x));
           })
      // values: float32 for f32, float32 (bf16-exact) or uint16 (the stored bits) for bf16, int32 for i32.
      .def("add_tensor", [](ExternalSequence& s, const std::string& name, int layer, const std::string& dtype,
                            const py::array& values) {
        ExternalTensor t;
        t.name = name;
        t.layer = layer;
        t.dtype = dtype_of(dtype);
        t.shape.assign(values.shape(), values.shape() + values.ndim());
        if (t.dtype == DType::i32) {
          t.i = values_of(CArray<int32_t>::ensure(values));
        } else if (py::isinstance<py::array_t<uint16_t>>(values)) {
          const auto bits = CArray<uint16_t>::ensure(values);
          t.f.resize(bits.size());
          for (py::ssize_t i = 0; i < bits.size(); ++i) {
            const uint32_t wide = uint32_t(bits.data()[i]) << 16;
            std::memcpy(&t.f[i], &wide, sizeof wide);
          }
        } else {
          t.f = values_of(CArray<float>::ensure(values));
        }
        s.tensors.push_back(std::move(t));
      });

  py::class_<ExternalTraceWriter>(m, "ExternalTraceWriter")
      .def(py::init([](const std::string& path, const std::string& config_json, const std::string& weights_path,
                       const std::string& model_digest, std::vector<std::string> weight_names,
                       std::vector<uint64_t> weight_digests) {
             ExternalModel model;
             model.config_json = config_json;
             model.weights_path = weights_path;
             model.model_digest = model_digest;
             model.tensor_names = std::move(weight_names);
             model.tensor_digests = std::move(weight_digests);
             return ExternalTraceWriter::create(path, model);
           }),
           py::arg("path"), py::arg("config_json"), py::arg("weights_path"), py::arg("model_digest"),
           py::arg("weight_names"), py::arg("weight_digests"))
      .def("begin_step",
           [](ExternalTraceWriter& w, const std::string& kind, const std::string& engine, const std::string& profile,
              const std::string& source) {
             ExternalStepSpec s;
             s.kind = kind;
             s.engine = engine;
             s.profile = profile;
             s.source = source;
             w.begin_step(s);
           },
           py::arg("kind"), py::arg("engine"), py::arg("profile"), py::arg("source"))
      .def("add_sequence", &ExternalTraceWriter::add_sequence, py::arg("sequence"))
      .def("end_step", &ExternalTraceWriter::end_step)
      .def("close", &ExternalTraceWriter::close)
      .def_property_readonly("final_path", &ExternalTraceWriter::final_path)
      .def_property_readonly("steps_written", &ExternalTraceWriter::steps_written)
      .def_property_readonly("num_hidden_layers",
                             [](const ExternalTraceWriter& w) { return w.config().num_hidden_layers; });
}

}  // namespace dsv4::python
