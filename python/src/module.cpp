// The extension module _dsv4: the C++ half of the Python package dsv4 (python/dsv4 is the other).
// Every C++ exception becomes a Python exception: the library's error vocabulary maps onto
// dsv4.Error > dsv4.InputError > dsv4.TraceError (> its kinds), with the C++ message unchanged.
#include "capture/errors.h"
#include "capture/version.h"
#include "python/src/bindings.h"

namespace dsv4::python {

PYBIND11_MODULE(_dsv4, m) {
  m.doc() = "Bindings over the dsv4 trace reader and writer, forward, replay and diff";
  m.attr("__version__") = version();

  // pybind11 tries the most recently registered translator first: bases first, then their kinds, so
  // each exception lands on its most specific Python class.
  auto& error = py::register_exception<Error>(m, "Error", PyExc_RuntimeError);
  auto& input = py::register_exception<InputError>(m, "InputError", error.ptr());
  py::register_exception<ConfigError>(m, "ConfigError", input.ptr());
  py::register_exception<WeightsError>(m, "WeightsError", input.ptr());
  py::register_exception<OverrideError>(m, "OverrideError", input.ptr());
  auto& trace = py::register_exception<TraceError>(m, "TraceError", input.ptr());
  py::register_exception<TraceCorrupt>(m, "TraceCorrupt", trace.ptr());
  py::register_exception<NotATrace>(m, "NotATrace", trace.ptr());
  py::register_exception<UnsupportedTraceVersion>(m, "UnsupportedTraceVersion", trace.ptr());
  py::register_exception<TraceIncomplete>(m, "TraceIncomplete", trace.ptr());

  bind_reader(m);
  bind_writer(m);
  bind_run(m);
#ifdef DSV4_HAVE_ADAPTERS
  bind_adapters(m);
#endif
}

}  // namespace dsv4::python
