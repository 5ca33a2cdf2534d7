// Raw edits of trace copies for the tests, with the HDF5 C API (no dsv4 code in between): what a
// corrupted or doctored file looks like. The edited file is sealed again when the editor closes it
// (capture/trace_seal.h), as a writer with that bug would have sealed it: what the tests exercise is
// what the commands make of the contents, behind the seal.
#pragma once

#include <hdf5.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "capture/trace_seal.h"

namespace dsv4::test {

class H5Edit {
 public:
  explicit H5Edit(const std::filesystem::path& p) : path_(p) {
    H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);
    f_ = H5Fopen(p.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
    if (f_ < 0) throw std::runtime_error("cannot open " + p.string() + " for writing");
  }
  ~H5Edit() {
    H5Fclose(f_);
    dsv4::seal_trace(path_.string());
  }

  // The whole dataset converted to T (mem: the matching native HDF5 type); dims in `dims`.
  template <typename T>
  std::vector<T> read(const std::string& path, hid_t mem, std::vector<hsize_t>* dims = nullptr) {
    const hid_t ds = open(path);
    const hid_t sp = H5Dget_space(ds);
    std::vector<hsize_t> d(size_t(H5Sget_simple_extent_ndims(sp)));
    H5Sget_simple_extent_dims(sp, d.data(), nullptr);
    std::vector<T> v(size_t(H5Sget_simple_extent_npoints(sp)));
    const herr_t rc = H5Dread(ds, mem, H5S_ALL, H5S_ALL, H5P_DEFAULT, v.data());
    H5Sclose(sp);
    H5Dclose(ds);
    if (rc < 0) throw std::runtime_error("cannot read " + path);
    if (dims) *dims = d;
    return v;
  }
  template <typename T>
  void write(const std::string& path, hid_t mem, const std::vector<T>& v) {
    const hid_t ds = open(path);
    const herr_t rc = H5Dwrite(ds, mem, H5S_ALL, H5S_ALL, H5P_DEFAULT, v.data());
    H5Dclose(ds);
    if (rc < 0) throw std::runtime_error("cannot write " + path);
  }
  // Replaces dataset `path` by a new one (create): a dataset of another length, shape or type.
  template <typename T>
  void replace(const std::string& path, hid_t file_type, hid_t mem, const std::vector<T>& v,
               std::vector<hsize_t> dims = {}) {
    remove(path);
    create(path, file_type, mem, v, std::move(dims));
  }
  // Creates dataset `path` of `dims` (1-D of v.size() when empty) stored as `file_type`, holding `v`
  // (mem: the matching native type), contiguous and without filters.
  template <typename T>
  void create(const std::string& path, hid_t file_type, hid_t mem, const std::vector<T>& v,
              std::vector<hsize_t> dims = {}) {
    if (dims.empty()) dims = {hsize_t(v.size())};
    const hid_t sp = H5Screate_simple(int(dims.size()), dims.data(), nullptr);
    const hid_t ds = H5Dcreate2(f_, path.c_str(), file_type, sp, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
    const herr_t rc = ds < 0      ? -1
                      : v.empty() ? 0
                                  : H5Dwrite(ds, mem, H5S_ALL, H5S_ALL, H5P_DEFAULT, v.data());
    if (ds >= 0) H5Dclose(ds);
    H5Sclose(sp);
    if (rc < 0) throw std::runtime_error("cannot create " + path);
  }
  // Unlinks the group or dataset at `path`.
  void remove(const std::string& path) {
    if (H5Ldelete(f_, path.c_str(), H5P_DEFAULT) < 0) throw std::runtime_error("cannot remove " + path);
  }
  // Replaces a string attribute (the trace's attributes are variable-length UTF-8).
  void set_attr(const std::string& object, const std::string& name, const std::string& value) {
    const hid_t o = H5Oopen(f_, object.c_str(), H5P_DEFAULT);
    if (o < 0) throw std::runtime_error("no object " + object);
    if (H5Aexists(o, name.c_str()) > 0) H5Adelete(o, name.c_str());
    const hid_t t = H5Tcopy(H5T_C_S1);
    H5Tset_size(t, H5T_VARIABLE);
    H5Tset_cset(t, H5T_CSET_UTF8);
    const hid_t sp = H5Screate(H5S_SCALAR);
    const hid_t a = H5Acreate2(o, name.c_str(), t, sp, H5P_DEFAULT, H5P_DEFAULT);
    const char* s = value.c_str();
    const herr_t rc = a < 0 ? -1 : H5Awrite(a, t, &s);
    if (a >= 0) H5Aclose(a);
    H5Sclose(sp);
    H5Tclose(t);
    H5Oclose(o);
    if (rc < 0) throw std::runtime_error("cannot write attribute " + object + " " + name);
  }

 private:
  hid_t open(const std::string& path) {
    const hid_t ds = H5Dopen2(f_, path.c_str(), H5P_DEFAULT);
    if (ds < 0) throw std::runtime_error("no dataset " + path);
    return ds;
  }
  std::filesystem::path path_;
  hid_t f_ = -1;
};

// A doctored routing decision: in routing row `row` of sequence 0, step 0, at `layer`, the first expert
// id is replaced by the smallest expert (of n_experts) not in the row, and the row is kept ascending,
// as recorded.
inline void doctor_routing_row(const std::filesystem::path& trace, int layer, int64_t row, int n_experts) {
  H5Edit e(trace);
  char ds[96];
  std::snprintf(ds, sizeof ds, "/steps/000000/seq_000/decisions/layer_%03d/experts", layer);
  std::vector<hsize_t> dims;
  auto v = e.read<int32_t>(ds, H5T_NATIVE_INT32, &dims);
  if (dims.size() != 2 || int64_t(dims[0]) <= row) throw std::runtime_error(std::string(ds) + ": no such row");
  const int64_t k = int64_t(dims[1]);
  int32_t* r = v.data() + row * k;
  for (int32_t id = 0; id < n_experts; ++id) {
    if (std::find(r, r + k, id) != r + k) continue;
    r[0] = id;
    break;
  }
  std::sort(r, r + k);
  e.write(ds, H5T_NATIVE_INT32, v);
}

}  // namespace dsv4::test
