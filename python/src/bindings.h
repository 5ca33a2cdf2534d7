// Shared pieces of the _dsv4 extension module: numpy arrays that take over a std::vector's memory,
// and the parts of the module (reader.cpp, writer.cpp, run.cpp, adapters.cpp).
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <utility>
#include <vector>

namespace dsv4::python {

namespace py = pybind11;

// A numpy array over the vector's own buffer: the vector moves to the heap and the array's base (a
// capsule) frees it, so the values the reader produced are never copied again on the way to Python.
template <class T>
py::array_t<T> to_numpy(std::vector<T>&& v, std::vector<py::ssize_t> shape) {
  auto* owned = new std::vector<T>(std::move(v));
  py::capsule base(owned, [](void* p) { delete static_cast<std::vector<T>*>(p); });
  return py::array_t<T>(std::move(shape), owned->data(), base);
}

template <class T>
py::array_t<T> to_numpy(std::vector<T>&& v) {
  const auto n = static_cast<py::ssize_t>(v.size());
  return to_numpy(std::move(v), {n});
}

void bind_reader(py::module_& m);
void bind_writer(py::module_& m);
void bind_run(py::module_& m);
void bind_adapters(py::module_& m);

}  // namespace dsv4::python
