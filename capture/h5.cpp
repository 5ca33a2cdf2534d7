#include "capture/h5.h"

#include <fmt/format.h>

#include <fcntl.h>
#include <omp.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <mutex>
#include <new>
#include <optional>
#include <stdexcept>
#include <type_traits>

#include "capture/chunk_codec.h"
#include "capture/errors.h"
#include "capture/h5_tracked.h"

namespace dsv4::h5 {

static_assert(std::endian::native == std::endian::little, "the trace writer assumes a little-endian host");

namespace {

template <typename T>
struct TypeOf;
template <>
struct TypeOf<uint8_t> {
  static constexpr Type value = Type::u8;
};
template <>
struct TypeOf<uint16_t> {
  static constexpr Type value = Type::u16;
};
template <>
struct TypeOf<uint32_t> {
  static constexpr Type value = Type::u32;
};
template <>
struct TypeOf<uint64_t> {
  static constexpr Type value = Type::u64;
};
template <>
struct TypeOf<int32_t> {
  static constexpr Type value = Type::i32;
};
template <>
struct TypeOf<int64_t> {
  static constexpr Type value = Type::i64;
};
template <>
struct TypeOf<float> {
  static constexpr Type value = Type::f32;
};
template <>
struct TypeOf<double> {
  static constexpr Type value = Type::f64;
};

// The in-memory type for `t`: native values, or (le_bytes) the little-endian storage type for
// buffers that already hold little-endian bytes (digest.h storage_bytes()).
hid_t mem_type(Type t, bool le_bytes = false) {
  if (le_bytes) return file_type(t);
  switch (t) {
    case Type::u8:
      return H5T_NATIVE_UINT8;
    case Type::u16:
      return H5T_NATIVE_UINT16;
    case Type::u32:
      return H5T_NATIVE_UINT32;
    case Type::u64:
      return H5T_NATIVE_UINT64;
    case Type::i32:
      return H5T_NATIVE_INT32;
    case Type::i64:
      return H5T_NATIVE_INT64;
    case Type::f32:
      return H5T_NATIVE_FLOAT;
    case Type::f64:
      return H5T_NATIVE_DOUBLE;
    case Type::str:
      break;
  }
  return H5I_INVALID_HID;
}

// Variable-length UTF-8 string type (owned).
Id vlen_string_type(const Object& at) {
  Id t(check(H5Tcopy(H5T_C_S1), at, "cannot copy the string type"));
  check(H5Tset_size(t.get(), H5T_VARIABLE), at, "cannot make a variable-length string type");
  check(H5Tset_cset(t.get(), H5T_CSET_UTF8), at, "cannot set the string type's character set");
  return t;
}

Id scalar_space(const Object& at) {
  return Id(check(H5Screate(H5S_SCALAR), at, "cannot create a dataspace"));
}

hsize_t npoints(hid_t space) {
  const hssize_t n = H5Sget_simple_extent_npoints(space);
  return n < 0 ? 0 : hsize_t(n);
}

// Type conversion on read: abort (the read fails) instead of clipping a value that does not fit.
H5T_conv_ret_t abort_on_range(H5T_conv_except_t except, hid_t, hid_t, void*, void*, void*) {
  if (except == H5T_CONV_EXCEPT_RANGE_HI || except == H5T_CONV_EXCEPT_RANGE_LOW) return H5T_CONV_ABORT;
  return H5T_CONV_UNHANDLED;
}

herr_t collect_error(unsigned n, const H5E_error2_t* e, void* data) {
  auto* out = static_cast<std::string*>(data);
  char maj[128] = "", min[128] = "";
  H5Eget_msg(e->maj_num, nullptr, maj, sizeof(maj));
  H5Eget_msg(e->min_num, nullptr, min, sizeof(min));
  if (!out->empty()) *out += "; ";
  *out += fmt::format("#{:03} {}(): {} ({}; {})", n, e->func_name ? e->func_name : "?",
                      e->desc ? e->desc : "", maj, min);
  return 0;
}

herr_t collect_link(hid_t, const char* name, const H5L_info_t*, void* data) {
  static_cast<std::vector<std::string>*>(data)->emplace_back(name);
  return 0;
}

herr_t collect_attr(hid_t, const char* name, const H5A_info_t*, void* data) {
  static_cast<std::vector<std::string>*>(data)->emplace_back(name);
  return 0;
}

Object open_attr(const Object& o, const std::string& name) {
  Object a{Id(H5Aopen(o.get(), name.c_str(), H5P_DEFAULT)), o.file, o.path + "@" + name};
  if (!a.id.valid()) o.fail(fmt::format("cannot open attribute '{}'", name));
  return a;
}

void write_numeric_attr(const Object& o, const std::string& name, hid_t ftype, hid_t mtype, const void* v) {
  quiet();
  if (H5Aexists(o.get(), name.c_str()) > 0)
    check(H5Adelete(o.get(), name.c_str()), o, "cannot replace attribute " + name);
  Id space = scalar_space(o);
  Id a(check(H5Acreate2(o.get(), name.c_str(), ftype, space.get(), H5P_DEFAULT, H5P_DEFAULT), o,
             "cannot create attribute " + name));
  check(H5Awrite(a.get(), mtype, v), o, "cannot write attribute " + name);
}

void check_scalar_attr(const Object& a) {
  Id space(check(H5Aget_space(a.get()), a, "cannot read the dataspace"));
  if (npoints(space.get()) != 1) a.fail("expected a single value");
}

}  // namespace

void Id::reset() {
  if (id_ >= 0) {
    quiet();
    H5Idec_ref(id_);
    id_ = H5I_INVALID_HID;
  }
}

void quiet() {
  thread_local bool done = false;
  if (!done) {
    H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);
    done = true;
  }
}

std::string error_stack() {
  // Walk a copy: H5Eget_msg is itself an API call and must not clear the stack being walked.
  hid_t stack = H5Eget_current_stack();
  if (stack < 0) return "";
  std::string out;
  H5Ewalk2(stack, H5E_WALK_DOWNWARD, collect_error, &out);
  H5Eclose_stack(stack);
  return out;
}

namespace {
std::atomic<bool> g_verbose{false};

herr_t innermost_error(unsigned, const H5E_error2_t* e, void* data) {
  *static_cast<std::string*>(data) = e->desc ? e->desc : "";
  return 0;
}
}  // namespace

void set_verbose_errors(bool on) {
  g_verbose = on;
}

// ---- read scopes ---------------------------------------------------------------------------------
// Per thread (a crash is handled on the thread that faulted): the depth and the description of the
// outermost scope. Process-wide (for the watchdog thread): when the outermost scope of the last thread
// that entered one began, and its description.
namespace {
thread_local int t_scope_depth = 0;
thread_local char t_scope_text[768];
char g_scope_text[768];
std::atomic<int64_t> g_scope_since{0};  // 0: no scope active
std::atomic<const void*> g_scope_owner{nullptr};

int64_t steady_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}
}  // namespace

ReadScope::ReadScope(const std::string& file, const std::string& path, const char* what, bool bulk) {
  if (t_scope_depth++ > 0) return;
  std::snprintf(t_scope_text, sizeof t_scope_text, "%s%s%s: %s", file.c_str(), path.empty() ? "" : ": ",
                path.c_str(), what);
  if (bulk) return;
  g_scope_since = 0;
  std::memcpy(g_scope_text, t_scope_text, sizeof g_scope_text);
  g_scope_owner = &t_scope_depth;
  g_scope_since = steady_ns();
}

ReadScope::~ReadScope() {
  if (--t_scope_depth > 0) return;
  const void* me = &t_scope_depth;
  if (g_scope_owner.compare_exchange_strong(me, nullptr)) g_scope_since = 0;
}

const char* active_read_scope(int64_t* since_ns) {
  if (since_ns) {  // the watchdog's question: any thread
    const int64_t since = g_scope_since.load();
    *since_ns = since;
    return since ? g_scope_text : nullptr;
  }
  return t_scope_depth > 0 ? t_scope_text : nullptr;
}

std::string error_cause() {
  hid_t stack = H5Eget_current_stack();
  if (stack < 0) return "";
  std::string out;
  H5Ewalk2(stack, H5E_WALK_DOWNWARD, innermost_error, &out);
  H5Eclose_stack(stack);
  return out;
}

void fail(const std::string& file, const std::string& path, const std::string& what) {
  const std::string stack = g_verbose ? error_stack() : error_cause();
  std::string msg = file;
  if (!path.empty()) msg += ": " + path;
  msg += ": " + what;
  if (!stack.empty()) msg += " (HDF5: " + stack + ")";
  throw TraceError(msg);
}

// ---- files and groups ------------------------------------------------------------------------

Id file_access(bool latest, bool lock) {
  quiet();
  const Object at{Id(), "", ""};
  Id fapl(check(H5Pcreate(H5P_FILE_ACCESS), at, "cannot create a file access property list"));
  if (latest)
    check(H5Pset_libver_bounds(fapl.get(), H5F_LIBVER_LATEST, H5F_LIBVER_LATEST), at,
          "cannot set libver bounds");
  // ignore_when_disabled: file systems without flock() support still open.
  check(H5Pset_file_locking(fapl.get(), lock, true), at, "cannot set file locking");
  return fapl;
}

// Links and attributes stay in their object's header (compact storage, covered by the header's
// checksum) up to these counts, instead of moving to "dense" storage in a fractal heap whose direct
// blocks HDF5 1.10 does not checksum (a damaged one makes the library crash; traces/FORMAT.md
// "Reading damaged files"). No group or object of a trace comes near them.
constexpr unsigned kMaxCompact = 65535;

void keep_compact(hid_t plist, const Object& at) {
  check(H5Pset_link_phase_change(plist, kMaxCompact, kMaxCompact), at, "cannot keep links compact");
  check(H5Pset_attr_phase_change(plist, kMaxCompact, kMaxCompact), at, "cannot keep attributes compact");
}

Object create_file(const std::string& path, hid_t fapl, hsize_t user_block) {
  quiet();
  const Object at{Id(), path, "/"};
  Id fcpl(check(H5Pcreate(H5P_FILE_CREATE), at, "cannot create a file creation property list"));
  keep_compact(fcpl.get(), at);
  if (user_block > 0) check(H5Pset_userblock(fcpl.get(), user_block), at, "cannot reserve the user block");
  Object f{Id(H5Fcreate(path.c_str(), H5F_ACC_TRUNC, fcpl.get(), fapl)), path, "/"};
  if (!f.id.valid()) fail(path, "", "cannot create the file");
  return f;
}

Object open_file(const std::string& path, unsigned flags, hid_t fapl) {
  quiet();
  ReadScope scope(path, "", "opening the file");
  Object f{Id(H5Fopen(path.c_str(), flags, fapl)), path, "/"};
  if (!f.id.valid()) fail(path, "", "cannot open the file as HDF5");
  return f;
}

void close_file(Object& f) {
  quiet();
  if (!f.id.valid()) return;
  if (H5Fclose(f.id.release()) < 0) f.fail("cannot close the file");
}

Object open(const Object& parent, const std::string& name) {
  quiet();
  ReadScope scope(parent.file, parent.child(name), "opening the object");
  Object o{Id(H5Oopen(parent.get(), name.c_str(), H5P_DEFAULT)), parent.file, parent.child(name)};
  if (!o.id.valid()) o.fail("missing or unreadable");
  return o;
}

Object create_group(const Object& parent, const std::string& name) {
  quiet();
  const Object at{Id(), parent.file, parent.child(name)};
  Id gcpl(check(H5Pcreate(H5P_GROUP_CREATE), at, "cannot create a group creation property list"));
  keep_compact(gcpl.get(), at);
  Object g{Id(H5Gcreate2(parent.get(), name.c_str(), H5P_DEFAULT, gcpl.get(), H5P_DEFAULT)), parent.file,
           parent.child(name)};
  if (!g.id.valid()) g.fail("cannot create the group");
  return g;
}

bool exists(const Object& parent, const std::string& path) {
  quiet();
  ReadScope scope(parent.file, parent.child(path), "looking the object up");
  // H5Lexists fails (rather than answering false) when an intermediate component is missing.
  size_t pos = 0;
  while (true) {
    const size_t slash = path.find('/', pos);
    const std::string prefix = path.substr(0, slash);
    if (H5Lexists(parent.get(), prefix.c_str(), H5P_DEFAULT) <= 0) return false;
    if (slash == std::string::npos) break;
    pos = slash + 1;
  }
  return H5Oexists_by_name(parent.get(), path.c_str(), H5P_DEFAULT) > 0;
}

std::optional<ExternalLink> external_link(const Object& parent, const std::string& name) {
  quiet();
  ReadScope scope(parent.file, parent.child(name), "reading the link");
  H5L_info_t info;
  if (H5Lget_info(parent.get(), name.c_str(), &info, H5P_DEFAULT) < 0 || info.type != H5L_TYPE_EXTERNAL)
    return std::nullopt;
  std::vector<char> val(info.u.val_size + 1, 0);
  if (H5Lget_val(parent.get(), name.c_str(), val.data(), val.size(), H5P_DEFAULT) < 0)
    fail(parent.file, parent.child(name), "cannot read the external link");
  unsigned flags = 0;
  const char* file = nullptr;
  const char* object = nullptr;
  if (H5Lunpack_elink_val(val.data(), val.size(), &flags, &file, &object) < 0 || !file || !object)
    fail(parent.file, parent.child(name), "cannot decode the external link");
  return ExternalLink{file, object};
}

std::vector<std::string> children(const Object& group) {
  quiet();
  ReadScope scope(group.file, group.path, "listing the group");
  std::vector<std::string> names;
  hsize_t idx = 0;
  check(H5Literate(group.get(), H5_INDEX_NAME, H5_ITER_INC, &idx, collect_link, &names), group,
        "cannot list the group");
  std::sort(names.begin(), names.end());
  return names;
}

// ---- attributes --------------------------------------------------------------------------------

bool has_attr(const Object& o, const std::string& name) {
  quiet();
  ReadScope scope(o.file, o.path, "looking attributes up");
  return H5Aexists(o.get(), name.c_str()) > 0;
}

void write_attr(const Object& o, const std::string& name, const std::string& value) {
  quiet();
  if (H5Aexists(o.get(), name.c_str()) > 0)
    check(H5Adelete(o.get(), name.c_str()), o, "cannot replace attribute " + name);
  Id type = vlen_string_type(o);
  Id space = scalar_space(o);
  Id a(check(H5Acreate2(o.get(), name.c_str(), type.get(), space.get(), H5P_DEFAULT, H5P_DEFAULT), o,
             "cannot create attribute " + name));
  const char* p = value.c_str();
  check(H5Awrite(a.get(), type.get(), &p), o, "cannot write attribute " + name);
}

void write_attr(const Object& o, const std::string& name, int32_t value) {
  write_numeric_attr(o, name, H5T_STD_I32LE, H5T_NATIVE_INT32, &value);
}
void write_attr(const Object& o, const std::string& name, uint64_t value) {
  write_numeric_attr(o, name, H5T_STD_U64LE, H5T_NATIVE_UINT64, &value);
}
void write_attr(const Object& o, const std::string& name, uint8_t value) {
  write_numeric_attr(o, name, H5T_STD_U8LE, H5T_NATIVE_UINT8, &value);
}
void write_attr(const Object& o, const std::string& name, int64_t value) {
  write_numeric_attr(o, name, H5T_STD_I64LE, H5T_NATIVE_INT64, &value);
}
void write_attr(const Object& o, const std::string& name, float value) {
  write_numeric_attr(o, name, H5T_IEEE_F32LE, H5T_NATIVE_FLOAT, &value);
}

namespace {
void check_attr_references(const Object& o, const Object& attr, const std::string& name);
}  // namespace

std::string read_attr_string(const Object& o, const std::string& name) {
  ReadScope scope(o.file, o.path + "@" + name, "reading a string attribute");
  Object a = open_attr(o, name);
  check_scalar_attr(a);
  Id type(check(H5Aget_type(a.get()), a, "cannot read the type"));
  if (H5Tget_class(type.get()) != H5T_STRING) a.fail("expected a string");
  const htri_t vlen = H5Tis_variable_str(type.get());
  if (vlen > 0) {
    check_attr_references(o, a, name);
    Id mt = vlen_string_type(a);
    check(H5Tset_cset(mt.get(), H5Tget_cset(type.get())), a, "cannot set the character set");
    char* p = nullptr;
    check(H5Aread(a.get(), mt.get(), &p), a, "cannot read");
    std::string s = p ? p : "";
    H5free_memory(p);
    return s;
  }
  const size_t n = H5Tget_size(type.get());
  std::string s(n, '\0');
  Id mt(check(H5Tcopy(H5T_C_S1), a, "cannot copy the string type"));
  check(H5Tset_size(mt.get(), n), a, "cannot size the string type");
  if (n > 0) check(H5Aread(a.get(), mt.get(), s.data()), a, "cannot read");
  s.resize(std::strlen(s.c_str()));
  return s;
}

namespace {
// A scalar numeric attribute read as `mem`, the native type of T; its stored class must be an integer
// for an integral T and a floating-point value otherwise.
template <typename T>
T read_numeric_attr(const Object& o, const std::string& name, hid_t mem) {
  constexpr bool integral = std::is_integral_v<T>;
  ReadScope scope(o.file, o.path + "@" + name, "reading an attribute");
  Object a = open_attr(o, name);
  check_scalar_attr(a);
  Id type(check(H5Aget_type(a.get()), a, "cannot read the type"));
  if (H5Tget_class(type.get()) != (integral ? H5T_INTEGER : H5T_FLOAT))
    a.fail(integral ? "expected an integer" : "expected a floating-point value");
  T v{};
  check(H5Aread(a.get(), mem, &v), a, "cannot read");
  return v;
}
}  // namespace

int64_t read_attr_int(const Object& o, const std::string& name) {
  return read_numeric_attr<int64_t>(o, name, H5T_NATIVE_INT64);
}

float read_attr_f32(const Object& o, const std::string& name) {
  return read_numeric_attr<float>(o, name, H5T_NATIVE_FLOAT);
}

uint64_t read_attr_u64(const Object& o, const std::string& name) {
  return read_numeric_attr<uint64_t>(o, name, H5T_NATIVE_UINT64);
}

std::vector<std::string> attr_names(const Object& o) {
  quiet();
  ReadScope scope(o.file, o.path, "listing attributes");
  std::vector<std::string> names;
  hsize_t idx = 0;
  check(H5Aiterate2(o.get(), H5_INDEX_NAME, H5_ITER_INC, &idx, collect_attr, &names), o,
        "cannot list attributes");
  return names;
}

// ---- datasets ---------------------------------------------------------------------------------

hid_t file_type(Type t) {
  switch (t) {
    case Type::u8:
      return H5T_STD_U8LE;
    case Type::u16:
      return H5T_STD_U16LE;
    case Type::u32:
      return H5T_STD_U32LE;
    case Type::u64:
      return H5T_STD_U64LE;
    case Type::i32:
      return H5T_STD_I32LE;
    case Type::i64:
      return H5T_STD_I64LE;
    case Type::f32:
      return H5T_IEEE_F32LE;
    case Type::f64:
      return H5T_IEEE_F64LE;
    case Type::str:
      break;
  }
  return H5I_INVALID_HID;
}

size_t type_size(Type t) {
  switch (t) {
    case Type::u8:
      return 1;
    case Type::u16:
      return 2;
    case Type::u32:
    case Type::i32:
    case Type::f32:
      return 4;
    case Type::u64:
    case Type::i64:
    case Type::f64:
      return 8;
    case Type::str:
      return sizeof(hvl_t);
  }
  return 0;
}

const char* type_name(Type t) {
  switch (t) {
    case Type::u8:
      return "uint8";
    case Type::u16:
      return "uint16";
    case Type::u32:
      return "uint32";
    case Type::u64:
      return "uint64";
    case Type::i32:
      return "int32";
    case Type::i64:
      return "int64";
    case Type::f32:
      return "float32";
    case Type::f64:
      return "float64";
    case Type::str:
      return "string";
  }
  return "?";
}

std::vector<hsize_t> chunk_for(const std::vector<hsize_t>& dims, size_t elem) {
  constexpr hsize_t kChunkBytes = 64 << 10;
  hsize_t row = elem;
  for (size_t i = 1; i < dims.size(); ++i) row *= std::max<hsize_t>(dims[i], 1);
  std::vector<hsize_t> c = dims;
  for (size_t i = 1; i < c.size(); ++i) c[i] = std::max<hsize_t>(c[i], 1);
  c[0] = std::max<hsize_t>(1, kChunkBytes / row);
  return c;
}

namespace {

// The creation properties of a dataset of `dims` with the trace's conventions (create_dataset).
Id dataset_plist(const Object& at, Type t, const std::vector<hsize_t>& dims, bool extendible,
                 hsize_t expected_rows, Compress compress) {
  Id dcpl(check(H5Pcreate(H5P_DATASET_CREATE), at, "cannot create a dataset property list"));
  check(H5Pset_attr_phase_change(dcpl.get(), kMaxCompact, kMaxCompact), at, "cannot keep attributes compact");
  const bool empty = std::any_of(dims.begin(), dims.end(), [](hsize_t d) { return d == 0; });
  // HDF5 filters cannot apply to variable-length data: string datasets are contiguous.
  if (extendible && t == Type::str) at.fail("string datasets are not extendible");
  if (extendible || (!empty && t != Type::str)) {
    std::vector<hsize_t> chunk = chunk_for(dims, type_size(t));
    // A fixed dimension bounds its chunk size (only axis 0 of an extendible dataset is unbounded).
    if (!extendible) chunk[0] = std::min(chunk[0], dims[0]);
    if (extendible && expected_rows > 0) chunk[0] = std::min(chunk[0], expected_rows);
    // Uncompressed chunks are stored whole, so the last one's padding would be written as is: spread
    // the rows evenly over the same number of chunks instead.
    if (compress == Compress::no && !extendible && chunk[0] > 0) {
      const hsize_t n = (dims[0] + chunk[0] - 1) / chunk[0];
      chunk[0] = (dims[0] + n - 1) / n;
    }
    check(H5Pset_chunk(dcpl.get(), int(chunk.size()), chunk.data()), at, "cannot set the chunk size");
    if (compress == Compress::yes) {
      check(H5Pset_shuffle(dcpl.get()), at, "cannot add the shuffle filter");
      check(H5Pset_deflate(dcpl.get(), 4), at, "cannot add the deflate filter");
    }
    check(H5Pset_fletcher32(dcpl.get()), at, "cannot add the fletcher32 filter");
  }
  return dcpl;
}

}  // namespace

Object create_dataset(const Object& parent, const std::string& name, Type t, const std::vector<hsize_t>& dims,
                      bool extendible, hsize_t expected_rows, Compress compress) {
  quiet();
  Object at{Id(), parent.file, parent.child(name)};
  if (dims.empty()) at.fail("datasets of the trace have at least one dimension");
  std::vector<hsize_t> maxdims = dims;
  if (extendible) {
    if (dims.size() != 1) at.fail("only 1-D datasets are extendible");
    maxdims[0] = H5S_UNLIMITED;
  }
  Id space(check(H5Screate_simple(int(dims.size()), dims.data(), maxdims.data()), at,
                 "cannot create the dataspace"));
  Id dcpl = dataset_plist(at, t, dims, extendible, expected_rows, compress);
  Id str_type;
  hid_t type = file_type(t);
  if (t == Type::str) {
    str_type = vlen_string_type(at);
    type = str_type.get();
  }
  at.id = Id(H5Dcreate2(parent.get(), name.c_str(), type, space.get(), H5P_DEFAULT, dcpl.get(), H5P_DEFAULT));
  if (!at.id.valid()) at.fail("cannot create the dataset");
  return at;
}

std::vector<hsize_t> shape(const Object& ds) {
  quiet();
  Id space(check(H5Dget_space(ds.get()), ds, "cannot read the dataspace"));
  const int rank = H5Sget_simple_extent_ndims(space.get());
  if (rank < 0) ds.fail("cannot read the rank");
  std::vector<hsize_t> d(static_cast<size_t>(rank));
  if (rank > 0) check(H5Sget_simple_extent_dims(space.get(), d.data(), nullptr), ds, "cannot read the shape");
  return d;
}

std::optional<Type> stored_type(const Object& ds) {
  quiet();
  Id type(check(H5Dget_type(ds.get()), ds, "cannot read the type"));
  const size_t size = H5Tget_size(type.get());
  switch (H5Tget_class(type.get())) {
    case H5T_INTEGER: {
      const bool sign = H5Tget_sign(type.get()) == H5T_SGN_2;
      if (!sign && size == 1) return Type::u8;
      if (!sign && size == 2) return Type::u16;
      if (!sign && size == 4) return Type::u32;
      if (!sign && size == 8) return Type::u64;
      if (sign && size == 4) return Type::i32;
      if (sign && size == 8) return Type::i64;
      return std::nullopt;
    }
    case H5T_FLOAT:
      if (size == 4) return Type::f32;
      if (size == 8) return Type::f64;
      return std::nullopt;
    case H5T_STRING:
      return Type::str;
    default:
      return std::nullopt;
  }
}

namespace {

std::atomic<bool> g_all_cores{false};

int encode_threads() {
  static const int env = [] {
    if (const char* e = std::getenv("DSV4_WRITER_THREADS")) {
      const int v = std::atoi(e);
      if (v >= 1) return std::min(v, 64);
    }
    return 0;
  }();
  if (env > 0) return env;
  return std::clamp(g_all_cores.load() ? omp_get_num_procs() : omp_get_num_procs() / 2, 1, 8);
}

// The plan of writing one whole dataset through our own chunk encoder: its chunks (whole rows) and
// the filter pipeline. plan_chunks returns nullopt, having touched nothing, when the dataset is not
// one this path handles (not chunked, chunks not whole rows, another filter pipeline) or the build
// has no zlib; such datasets go through H5Dwrite.
struct ChunkPlan {
  const Object* ds = nullptr;
  const uint8_t* src = nullptr;
  size_t elem = 0, row_bytes = 0, rows = 0, per_chunk = 0, nchunks = 0;
  size_t first_chunk = 0, end_chunk = 0;  // the chunks written: all, or those of StagedWrites::add_rows
  bool compress = false;
  std::vector<EncodedChunk> encoded;
  std::vector<std::string> errors;
};

std::optional<ChunkPlan> plan_chunks(const Object& ds, Type t, const void* data, hid_t space) {
  if (t == Type::str || !chunk_codec_available()) return std::nullopt;
  Id dcpl(check(H5Dget_create_plist(ds.get()), ds, "cannot read the creation properties"));
  if (H5Pget_layout(dcpl.get()) != H5D_CHUNKED) return std::nullopt;
  const int rank = H5Sget_simple_extent_ndims(space);
  if (rank < 1 || rank > 8) return std::nullopt;
  hsize_t dims[8], chunk[8];
  H5Sget_simple_extent_dims(space, dims, nullptr);
  if (H5Pget_chunk(dcpl.get(), rank, chunk) != rank) return std::nullopt;
  for (int i = 1; i < rank; ++i)
    if (chunk[i] != dims[i]) return std::nullopt;  // only chunks of whole rows
  std::vector<H5Z_filter_t> filters;
  for (int i = 0, nf = H5Pget_nfilters(dcpl.get()); i < nf; ++i) {
    unsigned flags = 0, cd[8], config = 0;
    size_t nelem = 8;
    char name[64];
    const H5Z_filter_t f =
        H5Pget_filter2(dcpl.get(), unsigned(i), &flags, &nelem, cd, sizeof name, name, &config);
    if (f == H5Z_FILTER_DEFLATE && (nelem < 1 || cd[0] != 4)) return std::nullopt;
    filters.push_back(f);
  }
  ChunkPlan p;
  if (filters == std::vector<H5Z_filter_t>{H5Z_FILTER_SHUFFLE, H5Z_FILTER_DEFLATE, H5Z_FILTER_FLETCHER32})
    p.compress = true;
  else if (filters != std::vector<H5Z_filter_t>{H5Z_FILTER_FLETCHER32})
    return std::nullopt;
  p.ds = &ds;
  p.src = static_cast<const uint8_t*>(data);
  p.elem = type_size(t);
  p.row_bytes = p.elem;
  for (int i = 1; i < rank; ++i) p.row_bytes *= dims[i];
  p.rows = size_t(dims[0]);
  p.per_chunk = size_t(chunk[0]);
  p.nchunks = (p.rows + p.per_chunk - 1) / p.per_chunk;
  p.end_chunk = p.nchunks;
  p.encoded.resize(p.nchunks);
  p.errors.resize(p.nchunks);
  return p;
}

// Chunk c of a plan through the trace's filter pipeline; the last chunk is padded with zeros (the
// fill value) to the chunk's size, as HDF5 stores it.
void encode_one(ChunkPlan& p, size_t c) {
  try {
    const size_t chunk_bytes = p.per_chunk * p.row_bytes, first = c * chunk_bytes;
    const size_t have = std::min(chunk_bytes, p.rows * p.row_bytes - first);
    if (have == chunk_bytes) {
      p.encoded[c] = encode_chunk(p.src + first, chunk_bytes, p.elem, p.compress);
    } else {
      std::vector<uint8_t> padded(chunk_bytes, 0);
      std::memcpy(padded.data(), p.src + first, have);
      p.encoded[c] = encode_chunk(padded.data(), chunk_bytes, p.elem, p.compress);
    }
  } catch (const std::exception& e) {
    p.errors[c] = e.what();
  }
}

// Rows [first, last) along axis 0 of `ds` from `data`, which holds all of the dataset's values.
void write_rows(const Object& ds, hid_t mem, const void* data, hsize_t first, hsize_t last) {
  if (first == last) return;
  Id fspace(check(H5Dget_space(ds.get()), ds, "cannot read the dataspace"));
  const int rank = H5Sget_simple_extent_ndims(fspace.get());
  if (rank < 1 || rank > 8) ds.fail("cannot write rows of a dataset of this rank");
  hsize_t dims[8], start[8] = {};
  H5Sget_simple_extent_dims(fspace.get(), dims, nullptr);
  size_t row_bytes = H5Tget_size(mem);
  for (int i = 1; i < rank; ++i) row_bytes *= size_t(dims[i]);
  start[0] = first;
  dims[0] = last - first;
  check(H5Sselect_hyperslab(fspace.get(), H5S_SELECT_SET, start, nullptr, dims, nullptr), ds,
        "cannot select");
  Id mspace(check(H5Screate_simple(rank, dims, nullptr), ds, "cannot create the dataspace"));
  check(H5Dwrite(ds.get(), mem, mspace.get(), fspace.get(), H5P_DEFAULT,
                 static_cast<const uint8_t*>(data) + first * row_bytes),
        ds, "cannot write");
}

}  // namespace

void encode_on_all_cores(bool all) {
  g_all_cores.store(all);
}

struct StagedWrites::Write {
  const Object* ds;
  Type t;
  const void* data;
  size_t n;
  bool le_bytes;
  std::shared_ptr<const void> owner;
  std::optional<hsize_t> extend_to;
  std::optional<ChunkPlan> plan;  // nullopt: stored with H5Dwrite
  std::optional<std::pair<hsize_t, hsize_t>> rows;  // add_rows: only these rows
};

StagedWrites::StagedWrites() = default;
StagedWrites::~StagedWrites() = default;
size_t StagedWrites::size() const { return writes_.size(); }

const Object& StagedWrites::hold(Object ds) {
  held_.push_back(std::make_unique<Object>(std::move(ds)));
  return *held_.back();
}

void StagedWrites::add(const Object& ds, Type t, const void* data, size_t n, bool le_bytes,
                       std::shared_ptr<const void> owner, std::optional<hsize_t> extend_to) {
  quiet();
  Write w{&ds, t, data, n, le_bytes, std::move(owner), extend_to, {}, {}};
  const Object& d = *w.ds;
  Id space(check(H5Dget_space(d.get()), d, "cannot read the dataspace"));
  if (extend_to) {  // the dataspace as set_extent will make it
    const int rank = H5Sget_simple_extent_ndims(space.get());
    if (rank < 1 || rank > 8) d.fail("cannot extend a dataset of this rank");
    hsize_t dims[8];
    H5Sget_simple_extent_dims(space.get(), dims, nullptr);
    dims[0] = *extend_to;
    space = Id(check(H5Screate_simple(rank, dims, nullptr), d, "cannot create the dataspace"));
  }
  const hsize_t want = npoints(space.get());
  if (want != n) d.fail(fmt::format("writing {} values into a dataset of {}", n, want));
  // Memory values are little endian already (le_bytes, or native on this little-endian host).
  if (n > 0) w.plan = plan_chunks(d, t, data, space.get());
  writes_.push_back(std::move(w));
  encoded_ = false;
}

void StagedWrites::add_rows(const Object& ds, Type t, const void* data, size_t n, hsize_t first,
                            hsize_t last) {
  add(ds, t, data, n);
  Write& w = writes_.back();
  const hsize_t rows = w.plan ? hsize_t(w.plan->rows) : shape(ds).at(0),
                per_chunk = w.plan ? hsize_t(w.plan->per_chunk) : chunk_rows(ds);
  if (first > last || last > rows || first % per_chunk != 0 || (last % per_chunk != 0 && last != rows))
    ds.fail(fmt::format("writing rows [{}, {}) of {}: not whole chunks of {} rows", first, last, rows,
                        per_chunk));
  w.rows = {first, last};
  if (w.plan) {
    w.plan->first_chunk = size_t(first / per_chunk);
    w.plan->end_chunk = size_t((last + per_chunk - 1) / per_chunk);
  }
}

template <typename T>
void StagedWrites::add(const Object& ds, std::vector<T> values, std::optional<hsize_t> extend_to) {
  auto held = std::make_shared<const std::vector<T>>(std::move(values));
  add(ds, TypeOf<T>::value, held->data(), held->size(), false, held, extend_to);
}

// Every chunk of every plan on encode_threads() threads (one task per chunk, across datasets). The
// stored values are exactly those H5Dwrite would store (little-endian, the file type equals the memory
// type on this host).
void StagedWrites::encode() {
  std::vector<std::pair<ChunkPlan*, size_t>> tasks;
  for (Write& w : writes_)
    if (w.plan)
      for (size_t c = w.plan->first_chunk; c < w.plan->end_chunk; ++c) tasks.emplace_back(&*w.plan, c);
  const int64_t ntasks = int64_t(tasks.size());
#pragma omp parallel for num_threads(encode_threads()) schedule(dynamic, 1) if (ntasks > 1)
  for (int64_t k = 0; k < ntasks; ++k) encode_one(*tasks[size_t(k)].first, tasks[size_t(k)].second);
  encoded_ = true;
}

void StagedWrites::store() {
  if (!encoded_) encode();
  for (Write& w : writes_) {
    const Object& d = *w.ds;
    if (w.extend_to) set_extent(d, [&] {
        std::vector<hsize_t> dims = shape(d);
        dims[0] = *w.extend_to;
        return dims;
      }());
    if (w.n == 0) continue;
    if (!w.plan && w.rows) {
      write_rows(d, mem_type(w.t, w.le_bytes), w.data, w.rows->first, w.rows->second);
      continue;
    }
    if (!w.plan) {
      check(H5Dwrite(d.get(), mem_type(w.t, w.le_bytes), H5S_ALL, H5S_ALL, H5P_DEFAULT, w.data), d, "cannot write");
      continue;
    }
    ChunkPlan& p = *w.plan;
    for (size_t c = p.first_chunk; c < p.end_chunk; ++c) {
      if (!p.errors[c].empty()) d.fail(fmt::format("cannot encode chunk {}: {}", c, p.errors[c]));
      hsize_t offset[8] = {};
      offset[0] = hsize_t(c * p.per_chunk);
      check(H5Dwrite_chunk(d.get(), H5P_DEFAULT, p.encoded[c].filter_mask, offset, p.encoded[c].bytes.size(),
                           p.encoded[c].bytes.data()),
            d, fmt::format("cannot write chunk {}", c));
      p.encoded[c] = EncodedChunk{};  // release as we go
    }
  }
  writes_.clear();
  held_.clear();
  encoded_ = false;
}

void write_all(const std::vector<WriteJob>& jobs) {
  StagedWrites w;
  for (const WriteJob& j : jobs) w.add(*j.ds, j.t, j.data, j.n, j.le_bytes);
  w.store();
}

void write(const Object& ds, Type t, const void* data, size_t n, bool le_bytes) {
  write_all({WriteJob{&ds, t, data, n, le_bytes}});
}

ChunkStream::ChunkStream(Type t, std::shared_ptr<ChunkFile> file, int stream)
    : t_(t), elem_(type_size(t)), file_(std::move(file)), stream_(stream) {
  if (file_ && !chunk_codec_available())
    throw std::logic_error("ChunkStream: a chunk file needs the chunk codec");
  if (t == Type::str) throw std::logic_error("ChunkStream: string datasets are not chunked");
  per_chunk_ = size_t(chunk_for({1}, elem_)[0]);  // a long 1-D dataset's chunk; a short one is one chunk
  // With the codec, the chunk being filled is held shuffled (HDF5's filter: byte j of value i at
  // j * per_chunk + i), so that encoding it needs no pass of its own.
  if (chunk_codec_available()) buf_.assign(per_chunk_ * elem_, 0);
}

void ChunkStream::append(const void* values, size_t n) {
  const auto* p = static_cast<const uint8_t*>(values);
  total_ += n;
  if (!chunk_codec_available()) {
    buf_.insert(buf_.end(), p, p + n * elem_);
    return;
  }
  while (n > 0) {
    const size_t take = std::min(n, per_chunk_ - fill_);
    uint8_t* plane = buf_.data() + fill_;
    switch (elem_) {
      case 1:
        std::memcpy(plane, p, take);
        break;
      case 2:
        for (size_t i = 0; i < take; ++i) {
          plane[i] = p[2 * i];
          plane[per_chunk_ + i] = p[2 * i + 1];
        }
        break;
      default:
        for (size_t i = 0; i < take; ++i)
          for (size_t j = 0; j < elem_; ++j) plane[j * per_chunk_ + i] = p[elem_ * i + j];
        break;
    }
    p += take * elem_;
    n -= take;
    fill_ += take;
    if (fill_ == per_chunk_) flush_chunk();
  }
}

void ChunkStream::flush_chunk() {
  if (finished_) throw std::logic_error("ChunkStream: values appended after finish()");
  // A chunk flushed before it is full (the last, of an extendible dataset) is padded with zeros, as
  // HDF5 pads it.
  for (size_t j = 0; j < elem_; ++j) std::memset(buf_.data() + j * per_chunk_ + fill_, 0, per_chunk_ - fill_);
  EncodedChunk c = encode_shuffled_chunk(buf_.data(), per_chunk_ * elem_);
  if (file_)
    file_->put(stream_, put_++, std::move(c));
  else
    chunks_.push_back(std::move(c));
  fill_ = 0;
}

void ChunkStream::finish() {
  if (!file_ || finished_) return;
  // Closed first, so that the file knows which chunk is the last when it comes. The dataset is
  // extendible, so its chunks are whole: the last one is padded with zeros.
  file_->close(stream_, total_);
  if (fill_ > 0) flush_chunk();
  finished_ = true;
}

std::vector<uint8_t> ChunkStream::values() const {
  if (file_) throw std::logic_error("ChunkStream: values() of a stream written into its file");
  if (!chunk_codec_available()) return buf_;
  std::vector<uint8_t> v;
  v.reserve(total_ * elem_);
  for (const EncodedChunk& c : chunks_) {
    const std::vector<uint8_t> d = decode_chunk(c, per_chunk_ * elem_, elem_, true);
    v.insert(v.end(), d.begin(), d.end());
  }
  for (size_t i = 0; i < fill_; ++i)
    for (size_t j = 0; j < elem_; ++j) v.push_back(buf_[j * per_chunk_ + i]);
  return v;
}

void ChunkStream::store(const Object& parent, const std::string& name) const {
  quiet();
  if (file_) {
    if (!finished_) throw std::logic_error("ChunkStream: store() before finish()");
    file_->link(stream_, parent, name);
    return;
  }
  const size_t n = total_;
  Object ds = create_dataset(parent, name, t_, {hsize_t(n)});
  if (!chunk_codec_available() || n == 0) {
    if (n) write(ds, t_, buf_.data(), n);
    return;
  }
  // The chunk create_dataset chose: per_chunk_, or the whole length when shorter. The last chunk is
  // padded with zeros (the fill value) to its size, as HDF5 stores it.
  Id dcpl(check(H5Dget_create_plist(ds.get()), ds, "cannot read the creation properties"));
  hsize_t chunk = 0;
  if (H5Pget_chunk(dcpl.get(), 1, &chunk) != 1 || chunk != hsize_t(std::min(n, per_chunk_)))
    ds.fail(fmt::format("chunk of {} values where the stream made {}", chunk, std::min(n, per_chunk_)));
  auto put = [&](size_t c, const EncodedChunk& e) {
    hsize_t offset = hsize_t(c * per_chunk_);
    check(H5Dwrite_chunk(ds.get(), H5P_DEFAULT, e.filter_mask, &offset, e.bytes.size(), e.bytes.data()), ds,
          fmt::format("cannot write chunk {}", c));
  };
  for (size_t c = 0; c < chunks_.size(); ++c) put(c, chunks_[c]);
  if (fill_ > 0) {  // the chunk being filled: padded to a whole one, or the whole (short) dataset
    const size_t count = chunks_.empty() ? fill_ : per_chunk_;
    std::vector<uint8_t> last(count * elem_, 0);
    for (size_t j = 0; j < elem_; ++j)
      std::memcpy(last.data() + j * count, buf_.data() + j * per_chunk_, fill_);
    put(chunks_.size(), encode_shuffled_chunk(last.data(), last.size()));
  }
}

ChunkFile::ChunkFile(const Object& file, Type t, int streams)
    : per_chunk_(size_t(chunk_for({1}, type_size(t))[0])) {
  quiet();
  const hsize_t zero = 0, unlimited = H5S_UNLIMITED;
  for (int s = 0; s < streams; ++s) {
    Object at{Id(), file.file, "/(stream " + std::to_string(s) + ")"};
    Id space(check(H5Screate_simple(1, &zero, &unlimited), at, "cannot create the dataspace"));
    Id dcpl = dataset_plist(at, t, {0}, true, 0, Compress::yes);
    at.id = Id(H5Dcreate_anon(file.get(), file_type(t), space.get(), dcpl.get(), H5P_DEFAULT));
    if (!at.id.valid()) at.fail("cannot create the dataset");
    Stream st;
    st.ds = std::move(at);
    streams_.push_back(std::move(st));
  }
  fd_ = posix_descriptor(file.get());
  H5Eclear2(H5E_DEFAULT);
}

void ChunkFile::start_writeback(size_t bytes) {
  constexpr size_t kWriteback = size_t(32) << 20;
  unsynced_ += bytes;
  if (fd_ < 0 || unsynced_ < kWriteback) return;
  unsynced_ = 0;
  h5::start_writeback(fd_);
}

void start_writeback(int fd) {
  if (fd >= 0) (void)::sync_file_range(fd, 0, 0, SYNC_FILE_RANGE_WRITE);
}

void start_writeback(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return;
  start_writeback(fd);
  ::close(fd);
}

ChunkFile::~ChunkFile() = default;

void ChunkFile::put(int s, size_t index, EncodedChunk&& c) {
  std::lock_guard<std::mutex> lock(mu_);
  Stream& st = streams_.at(size_t(s));
  st.pending.emplace(index, std::move(c));
  drain();
}

void ChunkFile::close(int s, size_t n) {
  std::lock_guard<std::mutex> lock(mu_);
  Stream& st = streams_.at(size_t(s));
  st.closed = true;
  st.values = n;
  st.chunks = (n + per_chunk_ - 1) / per_chunk_;
  drain();
}

// Writes every chunk whose turn has come, in the order (chunk index, stream): chunk 0 of every stream,
// then chunk 1 of every stream that has one, ...; a stream closed with fewer chunks drops out of the
// round. Streams filled at the same pace (an importer's layers, row by row) keep little waiting.
// Called with mu_ held.
void ChunkFile::drain() {
  for (;;) {
    if (next_stream_ == streams_.size()) {
      next_stream_ = 0;
      ++next_chunk_;
    }
    bool any_left = false;
    for (const Stream& st : streams_) any_left |= !st.closed || st.written < st.chunks || !st.extent_set;
    if (!any_left) return;
    Stream& st = streams_[next_stream_];
    if (st.closed && next_chunk_ >= st.chunks) {  // this stream is done: its extent is exact
      if (!st.extent_set) {
        const hsize_t n = hsize_t(st.values);
        check(H5Dset_extent(st.ds.get(), &n), st.ds, "cannot set the extent");
        st.extent_set = true;
      }
      ++next_stream_;
      continue;
    }
    auto it = st.pending.find(next_chunk_);
    if (it == st.pending.end()) return;  // its turn, not there yet
    // The last chunk of a closed stream sets the exact length (shrinking later would make HDF5 rewrite
    // the chunk's tail with its own filters).
    const bool last = st.closed && next_chunk_ + 1 == st.chunks;
    const hsize_t extent = last ? hsize_t(st.values) : hsize_t((next_chunk_ + 1) * per_chunk_);
    const hsize_t offset = hsize_t(next_chunk_ * per_chunk_);
    check(H5Dset_extent(st.ds.get(), &extent), st.ds, "cannot extend");
    st.extent_set = last;
    check(H5Dwrite_chunk(st.ds.get(), H5P_DEFAULT, it->second.filter_mask, &offset, it->second.bytes.size(),
                         it->second.bytes.data()),
          st.ds, fmt::format("cannot write chunk {}", next_chunk_));
    start_writeback(it->second.bytes.size());
    st.pending.erase(it);
    ++st.written;
    ++next_stream_;
  }
}

void ChunkFile::link(int s, const Object& parent, const std::string& name) {
  quiet();
  std::lock_guard<std::mutex> lock(mu_);
  Stream& st = streams_.at(size_t(s));
  if (!st.closed || st.written < st.chunks || !st.extent_set)
    throw std::logic_error("ChunkFile: link() of a stream not written whole");
  check(H5Olink(st.ds.get(), parent.get(), name.c_str(), H5P_DEFAULT, H5P_DEFAULT), parent,
        "cannot link the dataset " + name);
}

void write_le_bytes(const Object& ds, Type t, const std::vector<uint8_t>& bytes) {
  const size_t elem = type_size(t);
  if (bytes.size() % elem)
    ds.fail(fmt::format("{} bytes are not whole values of {} bytes", bytes.size(), elem));
  write(ds, t, bytes.data(), bytes.size() / elem, true);
}

void write_range(const Object& ds, Type t, const void* data, hsize_t offset, hsize_t n) {
  quiet();
  if (n == 0) return;
  Id fspace(check(H5Dget_space(ds.get()), ds, "cannot read the dataspace"));
  if (H5Sget_simple_extent_ndims(fspace.get()) != 1) ds.fail("write_range needs a 1-D dataset");
  if (offset + n > npoints(fspace.get()))
    ds.fail(fmt::format("writing [{}, {}) past the end ({})", offset, offset + n, npoints(fspace.get())));
  check(H5Sselect_hyperslab(fspace.get(), H5S_SELECT_SET, &offset, nullptr, &n, nullptr), ds,
        "cannot select");
  Id mspace(check(H5Screate_simple(1, &n, nullptr), ds, "cannot create the dataspace"));
  check(H5Dwrite(ds.get(), mem_type(t), mspace.get(), fspace.get(), H5P_DEFAULT, data), ds, "cannot write");
}

hsize_t chunk_rows(const Object& ds) {
  quiet();
  Id dcpl(check(H5Dget_create_plist(ds.get()), ds, "cannot read the creation properties"));
  if (H5Pget_layout(dcpl.get()) == H5D_CHUNKED) {
    hsize_t chunk[32];
    if (H5Pget_chunk(dcpl.get(), 32, chunk) < 1) ds.fail("cannot read the chunk size");
    return chunk[0];
  }
  const std::vector<hsize_t> dims = shape(ds);
  return std::max<hsize_t>(dims.at(0), 1);
}

void set_extent(const Object& ds, const std::vector<hsize_t>& dims) {
  quiet();
  check(H5Dset_extent(ds.get(), dims.data()), ds, "cannot extend");
}

template <typename T>
void write(const Object& ds, const std::vector<T>& v) {
  write(ds, TypeOf<T>::value, v.data(), v.size());
}

void write_strings(const Object& ds, const std::vector<std::string>& v) {
  quiet();
  Id space(check(H5Dget_space(ds.get()), ds, "cannot read the dataspace"));
  if (npoints(space.get()) != v.size())
    ds.fail(fmt::format("writing {} strings into a dataset of {}", v.size(), npoints(space.get())));
  if (v.empty()) return;
  std::vector<const char*> p(v.size());
  for (size_t i = 0; i < v.size(); ++i) p[i] = v[i].c_str();
  Id type = vlen_string_type(ds);
  check(H5Dwrite(ds.get(), type.get(), H5S_ALL, H5S_ALL, H5P_DEFAULT, p.data()), ds, "cannot write");
}

// Refuses a dataset whose stored class does not convert to T (integers to integers, floats to floats).
template <typename T>
void require_class(const Object& ds) {
  Id type(check(H5Dget_type(ds.get()), ds, "cannot read the type"));
  const H5T_class_t cls = H5Tget_class(type.get());
  const bool want_int = std::numeric_limits<T>::is_integer;
  if ((want_int && cls != H5T_INTEGER) || (!want_int && cls != H5T_FLOAT))
    ds.fail(want_int ? "expected an integer dataset" : "expected a floating-point dataset");
}

// n values for `ds`, or a message naming it when a damaged or hostile shape asks for too many.
template <typename T>
std::vector<T> allocate_values(const Object& ds, hsize_t n) {
  std::vector<T> v;
  try {
    v.resize(n);
  } catch (const std::exception&) {  // bad_alloc, length_error
    ds.fail(fmt::format("not enough memory for its {} values ({} bytes)", n, n * sizeof(T)));
  }
  return v;
}

template <typename T>
std::vector<T> read(const Object& ds) {
  quiet();
  ReadScope scope(ds.file, ds.path, "reading the dataset", true);
  require_class<T>(ds);
  Id space(check(H5Dget_space(ds.get()), ds, "cannot read the dataspace"));
  std::vector<T> v = allocate_values<T>(ds, npoints(space.get()));
  if (v.empty()) return v;
  Id dxpl(check(H5Pcreate(H5P_DATASET_XFER), ds, "cannot create a transfer property list"));
  check(H5Pset_type_conv_cb(dxpl.get(), abort_on_range, nullptr), ds, "cannot set the conversion callback");
  check(H5Dread(ds.get(), mem_type(TypeOf<T>::value), H5S_ALL, H5S_ALL, dxpl.get(), v.data()), ds,
        "cannot read");
  return v;
}

template <typename T>
std::vector<T> read_rows(const Object& ds, hsize_t r0, hsize_t r1) {
  quiet();
  ReadScope scope(ds.file, ds.path, "reading rows of the dataset", true);
  require_class<T>(ds);
  Id space(check(H5Dget_space(ds.get()), ds, "cannot read the dataspace"));
  const int rank = H5Sget_simple_extent_ndims(space.get());
  if (rank < 1) ds.fail("has no row axis");
  std::vector<hsize_t> dims(static_cast<size_t>(rank)), start(static_cast<size_t>(rank), 0), count;
  H5Sget_simple_extent_dims(space.get(), dims.data(), nullptr);
  if (r0 > r1 || r1 > dims[0]) ds.fail(fmt::format("rows [{}, {}) asked of {} rows", r0, r1, dims[0]));
  count = dims;
  count[0] = r1 - r0;
  start[0] = r0;
  hsize_t n = 1;
  for (hsize_t c : count) n *= c;
  std::vector<T> v = allocate_values<T>(ds, n);
  if (v.empty()) return v;
  check(H5Sselect_hyperslab(space.get(), H5S_SELECT_SET, start.data(), nullptr, count.data(), nullptr), ds,
        "cannot select rows");
  Id mem(check(H5Screate_simple(rank, count.data(), nullptr), ds, "cannot create a memory dataspace"));
  Id dxpl(check(H5Pcreate(H5P_DATASET_XFER), ds, "cannot create a transfer property list"));
  check(H5Pset_type_conv_cb(dxpl.get(), abort_on_range, nullptr), ds, "cannot set the conversion callback");
  check(H5Dread(ds.get(), mem_type(TypeOf<T>::value), mem.get(), space.get(), dxpl.get(), v.data()), ds,
        "cannot read");
  return v;
}

namespace {

// A file's bytes at [at, at + n), or false when they are not all there.
bool read_bytes(int fd, uint64_t at, void* out, size_t n) {
  size_t done = 0;
  while (done < n) {
    const ssize_t r = ::pread(fd, static_cast<char*>(out) + done, n - done, off_t(at + done));
    if (r <= 0) return false;
    done += size_t(r);
  }
  return true;
}

uint64_t le(const uint8_t* p, size_t n) {
  uint64_t v = 0;
  for (size_t i = 0; i < n; ++i) v |= uint64_t(p[i]) << (8 * i);
  return v;
}

// The objects of the global heap collection at `addr` (index -> size), walked the way HDF5 1.10
// deserializes a collection (file format specification, "Global Heap"): "GCOL", version 1, three
// reserved bytes, the collection size, then objects (index 2 bytes, reference count 2, reserved 4,
// size, data padded to 8 bytes) up to the free-space object (index 0, whose size spans the rest).
// Returns "" or what is wrong: a walk that would not advance, overrun the collection or not end at
// its end makes HDF5 loop or read out of bounds.
std::string walk_collection(int fd, uint64_t file_size, uint64_t addr, size_t L,
                            std::map<uint32_t, uint64_t>& objects) {
  const size_t hdr = 8 + L, objhdr = 8 + L;
  std::vector<uint8_t> head(hdr);
  if (addr >= file_size || !read_bytes(fd, addr, head.data(), hdr))
    return fmt::format("heap collection address {} is outside the file ({} bytes)", addr, file_size);
  if (std::memcmp(head.data(), "GCOL", 4) != 0 || head[4] != 1)
    return fmt::format("no heap collection at address {}", addr);
  const uint64_t size = le(head.data() + 8, L);
  if (size < hdr || size > file_size - addr || size > (uint64_t(1) << 30))
    return fmt::format("heap collection at {} has size {} (the file has {} bytes)", addr, size, file_size);
  std::vector<uint8_t> c(size);
  if (!read_bytes(fd, addr, c.data(), size)) return fmt::format("heap collection at {} is cut short", addr);
  uint64_t p = hdr;
  while (p < size) {
    if (p + objhdr > size) break;  // too small for an object: free space
    const uint32_t idx = uint32_t(le(&c[p], 2));
    const uint64_t osize = le(&c[p + 8], L);
    uint64_t need = osize;
    if (idx > 0) {
      if (osize > size) return fmt::format("heap object {} at {} has size {}", idx, addr + p, osize);
      need = objhdr + ((osize + 7) & ~uint64_t(7));
      if (!objects.emplace(idx, osize).second)
        return fmt::format("heap collection at {} holds object {} twice", addr, idx);
    }
    if (need == 0 || need > size - p)
      return fmt::format("heap object {} at {} has size {}: it does not fit its collection", idx, addr + p,
                         osize);
    p += need;
  }
  return "";
}

// The file facts that heap references need: its descriptor and size, the base of its addresses (after
// the user block that holds a trace's seal) and its address and length widths.
struct RawFile {
  int fd = -1;
  uint64_t size = 0;
  uint64_t base = 0;
  size_t sizeof_addr = 8, sizeof_size = 8;
  RawFile(const RawFile&) = delete;
  RawFile& operator=(const RawFile&) = delete;
  explicit RawFile(const Object& at) {
    Id file(check(H5Iget_file_id(at.get()), at, "cannot get the file"));
    Id fcpl(check(H5Fget_create_plist(file.get()), at, "cannot read the file's creation properties"));
    check(H5Pget_sizes(fcpl.get(), &sizeof_addr, &sizeof_size), at, "cannot read the file's offset sizes");
    if (sizeof_addr < 2 || sizeof_addr > 8 || sizeof_size < 2 || sizeof_size > 8)
      at.fail("the file's offset sizes are not usable");
    // Addresses inside the file are relative to its base, which follows the user block (a trace's
    // seal); H5Dget_offset already counts from the start of the file.
    hsize_t ub = 0;
    check(H5Pget_userblock(fcpl.get(), &ub), at, "cannot read the file's user block size");
    base = ub;
    fd = ::open(at.file.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) at.fail("cannot open the file to check its strings");
    struct stat st {};
    if (::fstat(fd, &st) != 0) {
      ::close(fd);
      at.fail("cannot read the file size");
    }
    size = uint64_t(st.st_size);
  }
  ~RawFile() { ::close(fd); }
  size_t ref_bytes() const { return 4 + sizeof_addr + 4; }  // length, collection address, index
};

// A damaged file found by our own checks: TraceCorrupt naming the file and object.
[[noreturn]] void damaged(const Object& at, const std::string& what) {
  throw TraceCorrupt(at.file + (at.path.empty() ? "" : ": " + at.path) + ": " + what);
}

// Checks `n` variable-length references laid out as on disk (length, 4 bytes; the collection's address;
// the object's index, 4 bytes) and the heap collections they point into, before HDF5 follows them.
// `what` names an element in messages ("string 3").
void check_heap_refs(const RawFile& f, const Object& at, const uint8_t* refs, uint64_t n, const char* what) {
  std::map<uint64_t, std::map<uint32_t, uint64_t>> collections;
  for (uint64_t i = 0; i < n; ++i) {
    const uint8_t* r = refs + i * f.ref_bytes();
    const uint64_t len = le(r, 4), rel = le(r + 4, f.sizeof_addr);
    const uint32_t idx = uint32_t(le(r + 4 + f.sizeof_addr, 4));
    if (len == 0) continue;  // an empty string: HDF5 reads no heap object
    if (rel > UINT64_MAX - f.base) damaged(at, fmt::format("{} {}: damaged: heap address {}", what, i, rel));
    const uint64_t addr = rel + f.base;
    auto it = collections.find(addr);
    if (it == collections.end()) {
      it = collections.emplace(addr, std::map<uint32_t, uint64_t>{}).first;
      const std::string why = walk_collection(f.fd, f.size, addr, f.sizeof_size, it->second);
      if (!why.empty()) damaged(at, fmt::format("{} {}: damaged: {}", what, i, why));
    }
    const auto obj = it->second.find(idx);
    if (obj == it->second.end())
      damaged(at, fmt::format("{} {}: damaged: heap object {} is not in the collection at {}", what, i, idx,
                              addr));
    if (obj->second != len)
      damaged(at, fmt::format("{} {}: damaged: {} bytes long, its heap object holds {}", what, i, len,
                              obj->second));
  }
}

// Checks the heap reference of every element of a contiguous variable-length string dataset.
void check_vlen_references(const Object& ds, hsize_t n) {
  Id dcpl(check(H5Dget_create_plist(ds.get()), ds, "cannot read the creation properties"));
  if (H5Pget_layout(dcpl.get()) != H5D_CONTIGUOUS)
    ds.fail("variable-length strings not stored contiguously (traces/FORMAT.md)");
  const haddr_t at = H5Dget_offset(ds.get());
  if (at == HADDR_UNDEF) return;  // never written: every element is the empty fill value
  const RawFile f(ds);
  const size_t ref = f.ref_bytes();
  if (n > f.size / ref || at > f.size - n * ref)
    ds.fail(fmt::format("{} string references at {} do not fit in the file ({} bytes)", n, at, f.size));
  std::vector<uint8_t> refs(size_t(n) * ref);
  if (!read_bytes(f.fd, at, refs.data(), refs.size())) ds.fail("the string references are cut short");
  check_heap_refs(f, ds, refs.data(), n, "string");
}

// The raw bytes of an attribute's message, found by walking the object header of `o` as the file
// format specification lays it out (version 2, "OHDR", its continuation blocks "OCHK"; attribute
// messages of versions 1 to 3), with every offset bounded by the header. Empty when the attribute is
// not in the header (dense storage, a version-1 header, a shared datatype or dataspace): then it is
// not checked here.
struct AttrRaw {
  std::vector<uint8_t> datatype, dataspace, data;
};
std::optional<AttrRaw> find_attr_message(const RawFile& f, const Object& o, const std::string& name) {
  H5O_info_t info{};
  if (H5Oget_info2(o.get(), &info, H5O_INFO_BASIC) < 0 || info.addr == HADDR_UNDEF) return std::nullopt;
  if (info.addr > UINT64_MAX - f.base) return std::nullopt;
  // The chunks to read: [address, length) of message bytes, the first found in the prefix.
  std::vector<std::pair<uint64_t, uint64_t>> chunks;
  uint8_t hflags = 0;
  {
    uint8_t head[6 + 16 + 4 + 8];
    const uint64_t at = info.addr + f.base;
    if (at >= f.size) return std::nullopt;
    const size_t got = size_t(std::min<uint64_t>(sizeof head, f.size - at));
    if (!read_bytes(f.fd, at, head, got) || got < 7 || std::memcmp(head, "OHDR", 4) != 0 || head[4] != 2)
      return std::nullopt;
    hflags = head[5];
    size_t p = 6 + ((hflags & 0x20) ? 16 : 0) + ((hflags & 0x10) ? 4 : 0);
    const size_t width = size_t(1) << (hflags & 3);
    if (p + width > got) return std::nullopt;
    chunks.push_back({at + p + width, le(head + p, width)});
  }
  // A message: type (1), size (2), flags (1), creation order (2, when the header tracks it).
  const size_t msg_head = 4 + ((hflags & 0x04) ? 2 : 0);
  for (size_t c = 0; c < chunks.size() && c < 4096; ++c) {
    const auto [addr, len] = chunks[c];
    if (addr >= f.size || len > f.size - addr || len > (uint64_t(1) << 26)) return std::nullopt;
    std::vector<uint8_t> b(static_cast<size_t>(len));
    if (!read_bytes(f.fd, addr, b.data(), b.size())) return std::nullopt;
    size_t p = 0;
    while (p + msg_head <= b.size()) {
      const uint8_t type = b[p];
      const size_t size = size_t(le(&b[p + 1], 2));
      const size_t d = p + msg_head;
      if (size > b.size() - d) break;
      if (type == 0x10 &&
          size >= f.sizeof_addr + f.sizeof_size) {  // continuation: "OCHK", messages, checksum
        const uint64_t ca = le(&b[d], f.sizeof_addr), cl = le(&b[d + f.sizeof_addr], f.sizeof_size);
        if (cl >= 8 && ca <= UINT64_MAX - f.base - 4) chunks.push_back({ca + f.base + 4, cl - 8});
      } else if (type == 0x0C && size >= 8) {
        const uint8_t* m = &b[d];
        const uint8_t version = m[0];
        if (version < 1 || version > 3 || (m[1] & 0x03)) {  // shared datatype or dataspace: not here
          p = d + size;
          continue;
        }
        const size_t nlen = size_t(le(m + 2, 2)), tlen = size_t(le(m + 4, 2)), slen = size_t(le(m + 6, 2));
        const auto pad = [&](size_t x) { return version == 1 ? (x + 7) & ~size_t(7) : x; };
        size_t q = version == 3 ? 9 : 8;
        if (nlen == 0 || q + pad(nlen) + pad(tlen) + pad(slen) > size) {
          p = d + size;
          continue;
        }
        const std::string found(reinterpret_cast<const char*>(m + q),
                                strnlen(reinterpret_cast<const char*>(m + q), nlen));
        q += pad(nlen);
        if (found == name) {
          AttrRaw r;
          r.datatype.assign(m + q, m + q + tlen);
          q += pad(tlen);
          r.dataspace.assign(m + q, m + q + slen);
          q += pad(slen);
          r.data.assign(m + q, m + size);
          return r;
        }
      }
      p = d + size;
    }
  }
  return std::nullopt;
}

// Before a variable-length string attribute is read: its heap references, found in the checksummed
// object header, and the collections they point into (HDF5 1.10 loops or crashes on a damaged one).
void check_attr_references(const Object& o, const Object& attr, const std::string& name) {
  const RawFile f(attr);
  const std::optional<AttrRaw> raw = find_attr_message(f, o, name);
  if (!raw) return;
  const auto& t = raw->datatype;
  // Datatype class 9 (variable-length), type 1 (string).
  if (t.size() < 8 || (t[0] & 0x0f) != 9 || (t[1] & 0x0f) != 1) return;
  // The number of elements from the dataspace message (versions 1 and 2).
  const auto& sp = raw->dataspace;
  if (sp.size() < 4) damaged(attr, "damaged: the attribute's dataspace message is cut short");
  const int rank = sp[1];
  uint64_t n = 1;
  size_t q = sp[0] == 1 ? 8 : 4;
  if (sp[0] == 2 && sp[3] == 2) n = 0;  // a null dataspace
  for (int i = 0; i < rank; ++i, q += f.sizeof_size) {
    if (q + f.sizeof_size > sp.size())
      damaged(attr, "damaged: the attribute's dataspace message is cut short");
    const uint64_t dim = le(&sp[q], f.sizeof_size);
    if (dim != 0 && n > UINT64_MAX / dim) damaged(attr, "damaged: the attribute's dimensions overflow");
    n *= dim;
  }
  if (n > raw->data.size() / f.ref_bytes())
    damaged(attr, fmt::format("damaged: {} string references do not fit the attribute's {} bytes", n,
                              raw->data.size()));
  check_heap_refs(f, attr, raw->data.data(), n, "string");
}
}  // namespace

std::vector<std::string> read_strings(const Object& ds) {
  quiet();
  ReadScope scope(ds.file, ds.path, "reading strings");
  Id type(check(H5Dget_type(ds.get()), ds, "cannot read the type"));
  if (H5Tget_class(type.get()) != H5T_STRING) ds.fail("expected a string dataset");
  Id space(check(H5Dget_space(ds.get()), ds, "cannot read the dataspace"));
  const size_t n = npoints(space.get());
  std::vector<std::string> out;
  try {
    out.resize(n);
  } catch (const std::exception&) {  // bad_alloc, length_error: a damaged or hostile shape
    ds.fail(fmt::format("not enough memory for its {} strings", n));
  }
  if (n == 0) return out;
  if (H5Tis_variable_str(type.get()) > 0) {
    check_vlen_references(ds, n);
    Id mt = vlen_string_type(ds);
    check(H5Tset_cset(mt.get(), H5Tget_cset(type.get())), ds, "cannot set the character set");
    std::vector<char*> p(n, nullptr);
    check(H5Dread(ds.get(), mt.get(), H5S_ALL, H5S_ALL, H5P_DEFAULT, p.data()), ds, "cannot read");
    for (size_t i = 0; i < n; ++i) out[i] = p[i] ? p[i] : "";
    H5Dvlen_reclaim(mt.get(), space.get(), H5P_DEFAULT, p.data());
    return out;
  }
  const size_t size = H5Tget_size(type.get());
  Id mt(check(H5Tcopy(H5T_C_S1), ds, "cannot copy the string type"));
  check(H5Tset_size(mt.get(), size), ds, "cannot size the string type");
  std::vector<char> buf(n * size + 1, '\0');
  check(H5Dread(ds.get(), mt.get(), H5S_ALL, H5S_ALL, H5P_DEFAULT, buf.data()), ds, "cannot read");
  for (size_t i = 0; i < n; ++i) {
    const char* s = buf.data() + i * size;
    out[i] = std::string(s, strnlen(s, size));
  }
  return out;
}

int64_t storage_bytes(const Object& ds) {
  quiet();
  return int64_t(H5Dget_storage_size(ds.get()));
}

int64_t logical_bytes(const Object& ds) {
  quiet();
  Id space(check(H5Dget_space(ds.get()), ds, "cannot read the dataspace"));
  Id type(check(H5Dget_type(ds.get()), ds, "cannot read the type"));
  return int64_t(npoints(space.get()) * H5Tget_size(type.get()));
}

#define DSV4_H5_INSTANTIATE(T)                                  \
  template void write<T>(const Object&, const std::vector<T>&); \
  template void StagedWrites::add<T>(const Object&, std::vector<T>, std::optional<hsize_t>); \
  template std::vector<T> read<T>(const Object&);               \
  template std::vector<T> read_rows<T>(const Object&, hsize_t, hsize_t);
DSV4_H5_INSTANTIATE(uint8_t)
DSV4_H5_INSTANTIATE(uint16_t)
DSV4_H5_INSTANTIATE(uint32_t)
DSV4_H5_INSTANTIATE(uint64_t)
DSV4_H5_INSTANTIATE(int32_t)
DSV4_H5_INSTANTIATE(int64_t)
DSV4_H5_INSTANTIATE(float)
DSV4_H5_INSTANTIATE(double)
#undef DSV4_H5_INSTANTIATE

}  // namespace dsv4::h5
