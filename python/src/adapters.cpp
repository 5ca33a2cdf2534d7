// dsv4 import for Python: the import the CLI runs (adapters/convert.h run_import), with the requests
// either read by the C++ readers from the inputs, or handed over by python/dsv4/adapters.py (the
// samples of miles' .pt dumps, which only Python reads: they are pickles). Each handed-over sample is a
// dict of numpy arrays named as miles' Sample fields; adapters/miles.h miles_request turns it into a
// request by the same rule as an .npz file's members.
#include <fmt/core.h>

#include <cstring>
#include <map>

#include "adapters/convert.h"
#include "adapters/miles.h"
#include "model/error.h"
#include "python/src/bindings.h"

namespace dsv4::python {

namespace {

// A numpy array as the .npy reader's NpyArray: its dtype string ("<i4", "<i8", "<f8", ...), shape and
// C-order bytes. python/dsv4/adapters.py hands over C-contiguous little-endian arrays.
NpyArray npy_of(const py::array& a, const std::string& what) {
  if (!(a.flags() & py::array::c_style))
    throw InputError(fmt::format("{}: not a C-contiguous array", what));
  NpyArray n;
  n.descr = py::str(a.dtype().attr("str"));
  n.shape.assign(a.shape(), a.shape() + a.ndim());
  const auto* p = static_cast<const uint8_t*>(a.data());
  n.data.assign(p, p + a.nbytes());
  return n;
}

}  // namespace

void bind_adapters(py::module_& m) {
  m.def(
      "import_r3",
      [](const std::string& engine, std::vector<std::string> inputs, const std::string& config,
         const std::string& model, const std::string& preset, const std::string& out, const std::string& kind,
         const std::string& profile, int64_t prefix_memory_mb, py::object samples, py::object progress) {
        ImportJob job;
        job.engine = engine;
        job.inputs = std::move(inputs);
        job.config = config;
        job.model = model;
        job.preset = preset;
        job.out = out;
        job.kind = kind;
        job.profile = profile;
        job.prefix_budget_bytes = prefix_memory_mb << 20;
        ProgressFn on_progress;
        if (!progress.is_none())
          on_progress = [&](const ImportProgress& p) { progress(p.requests, p.bytes_read, p.seconds); };
        RequestSource source;
        py::iterator it;
        if (!samples.is_none()) {
          it = py::iter(samples);
          // Each item: (file, index, id, {member: numpy array}).
          source = [&](R3Request& q, std::vector<std::string>& notes) {
            if (it == py::iterator::sentinel()) return false;
            const py::tuple item = py::reinterpret_borrow<py::tuple>(*it);
            ++it;
            R3Origin origin{item[0].cast<std::string>(), item[2].cast<std::string>(), item[1].cast<int64_t>()};
            const std::string where = origin.describe();
            std::map<std::string, NpyArray> members;
            for (auto [name, value] : item[3].cast<py::dict>()) {
              const std::string n = name.cast<std::string>();
              members.emplace(n, npy_of(value.cast<py::array>(), fmt::format("{}: {}", where, n)));
            }
            q = miles_request(std::move(members), std::move(origin),
                              [&](const char* n) { return fmt::format("{}: {}", where, n); }, notes);
            return true;
          };
        }
        const ImportResult r = run_import(job, on_progress, source);
        py::dict d;
        d["requests"] = r.summary.requests;
        d["tokens"] = r.summary.tokens;
        d["routing_rows"] = r.summary.routing_rows;
        d["indexer_rows"] = r.summary.indexer_rows;
        d["input_bytes"] = r.summary.input_bytes;
        d["seconds"] = r.summary.seconds;
        d["notes"] = r.summary.notes;
        d["trace"] = r.trace;
        d["trace_bytes"] = r.trace_bytes;
        d["int32_bytes"] = r.int32_bytes;
        return d;
      },
      py::arg("engine"), py::arg("inputs"), py::arg("config"), py::arg("model"), py::arg("preset"), py::arg("out"),
      py::arg("kind"), py::arg("profile"), py::arg("prefix_memory_mb"), py::arg("samples"), py::arg("progress"));
}

}  // namespace dsv4::python
