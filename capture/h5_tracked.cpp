#include "capture/h5_tracked.h"

#include <new>

#define DSV4_TRACKED_DRIVER (H5_VERS_MAJOR == 1 && H5_VERS_MINOR == 10)

namespace dsv4::h5 {

#if DSV4_TRACKED_DRIVER
namespace {

// The driver's part of a file access property list.
struct Info {
  WriteListener* listener = nullptr;
  hbool_t use_locking = false, ignore_disabled_locks = true;  // for the sec2 file underneath
};

// An open file: HDF5's public fields first (the library fills them), then sec2's file underneath.
struct File {
  H5FD_t pub{};
  H5FD_t* sec2 = nullptr;
  Info info;
};

File* as_file(H5FD_t* f) {
  return reinterpret_cast<File*>(f);
}
H5FD_t* under(const H5FD_t* f) {
  return reinterpret_cast<const File*>(f)->sec2;
}

void* info_copy(const void* info) {
  return new (std::nothrow) Info(*static_cast<const Info*>(info));
}
herr_t info_free(void* info) {
  delete static_cast<Info*>(info);
  return 0;
}
void* info_get(H5FD_t* f) {
  return new (std::nothrow) Info(as_file(f)->info);
}

H5FD_t* open(const char* name, unsigned flags, hid_t fapl, haddr_t maxaddr) {
  const auto* info = static_cast<const Info*>(H5Pget_driver_info(fapl));
  if (!info || !info->listener) return nullptr;
  const hid_t plain = H5Pcreate(H5P_FILE_ACCESS);
  if (plain < 0) return nullptr;
  H5FD_t* sec2 = nullptr;
  if (H5Pset_fapl_sec2(plain) >= 0 &&
      H5Pset_file_locking(plain, info->use_locking, info->ignore_disabled_locks) >= 0)
    sec2 = H5FDopen(name, flags, plain, maxaddr);
  H5Pclose(plain);
  if (!sec2) return nullptr;
  File* f = new (std::nothrow) File;
  if (!f) {
    H5FDclose(sec2);
    return nullptr;
  }
  f->sec2 = sec2;
  f->info = *info;
  return &f->pub;
}

herr_t close(H5FD_t* f) {
  File* file = as_file(f);
  const herr_t r = H5FDclose(file->sec2);
  delete file;
  return r;
}

int compare(const H5FD_t* a, const H5FD_t* b) {
  return H5FDcmp(under(a), under(b));
}

herr_t query(const H5FD_t*, unsigned long* flags) {  // sec2's features: HDF5 lays the file out as for sec2
  return H5FDdriver_query(H5FD_SEC2, flags);
}

haddr_t get_eoa(const H5FD_t* f, H5FD_mem_t type) {
  return H5FDget_eoa(under(f), type);
}
herr_t set_eoa(H5FD_t* f, H5FD_mem_t type, haddr_t addr) {
  return H5FDset_eoa(under(f), type, addr);
}
haddr_t get_eof(const H5FD_t* f, H5FD_mem_t type) {
  return H5FDget_eof(under(f), type);
}
herr_t get_handle(H5FD_t* f, hid_t fapl, void** handle) {
  return H5FDget_vfd_handle(under(f), fapl, handle);
}

herr_t read(H5FD_t* f, H5FD_mem_t type, hid_t dxpl, haddr_t addr, size_t size, void* buf) {
  return H5FDread(under(f), type, dxpl, addr, size, buf);
}
herr_t write(H5FD_t* f, H5FD_mem_t type, hid_t dxpl, haddr_t addr, size_t size, const void* buf) {
  if (H5FDwrite(under(f), type, dxpl, addr, size, buf) < 0) return -1;
  try {
    as_file(f)->info.listener->wrote(uint64_t(addr), buf, size);
  } catch (...) {  // the listener's memory: HDF5 sees a failed write
    return -1;
  }
  return 0;
}
herr_t flush(H5FD_t* f, hid_t dxpl, hbool_t closing) {
  return H5FDflush(under(f), dxpl, closing);
}
herr_t truncate(H5FD_t* f, hid_t dxpl, hbool_t closing) {
  if (H5FDtruncate(under(f), dxpl, closing) < 0) return -1;
  try {
    as_file(f)->info.listener->resized(uint64_t(H5FDget_eof(under(f), H5FD_MEM_DEFAULT)));
  } catch (...) {
    return -1;
  }
  return 0;
}
herr_t lock(H5FD_t* f, hbool_t rw) {
  return H5FDlock(under(f), rw);
}
herr_t unlock(H5FD_t* f) {
  return H5FDunlock(under(f));
}

H5FD_class_t make_class() {
  H5FD_class_t c{};
  c.name = "dsv4_tracked";
  c.maxaddr = (haddr_t(1) << 63) - 1;  // sec2's: the largest 64-bit off_t
  c.fc_degree = H5F_CLOSE_WEAK;
  c.fapl_size = sizeof(Info);
  c.fapl_get = info_get;
  c.fapl_copy = info_copy;
  c.fapl_free = info_free;
  c.open = open;
  c.close = close;
  c.cmp = compare;
  c.query = query;
  c.get_eoa = get_eoa;
  c.set_eoa = set_eoa;
  c.get_eof = get_eof;
  c.get_handle = get_handle;
  c.read = read;
  c.write = write;
  c.flush = flush;
  c.truncate = truncate;
  c.lock = lock;
  c.unlock = unlock;
  const H5FD_mem_t map[H5FD_MEM_NTYPES] = H5FD_FLMAP_DICHOTOMY;  // sec2's: metadata and raw data apart
  for (int i = 0; i < H5FD_MEM_NTYPES; ++i) c.fl_map[i] = map[i];
  return c;
}

hid_t driver_id() {
  static const H5FD_class_t cls = make_class();
  static const hid_t id = H5FDregister(&cls);
  return id;
}

}  // namespace

bool track_writes(hid_t fapl, WriteListener* listener) {
  Info info;
  info.listener = listener;
  if (H5Pget_file_locking(fapl, &info.use_locking, &info.ignore_disabled_locks) < 0) return false;
  const hid_t id = driver_id();
  return listener && id >= 0 && H5Pset_driver(fapl, id, &info) >= 0;
}

namespace {
bool is_tracking_driver(hid_t driver) {
  return driver == driver_id();
}
}  // namespace

#else  // another HDF5 series: no tracking (the seal then reads the whole file at close)

bool track_writes(hid_t, WriteListener*) {
  return false;
}

namespace {
bool is_tracking_driver(hid_t) {
  return false;
}
}  // namespace

#endif

Id writing_access(WriteListener* listener) {
  Id fapl = file_access(true, false);
  track_writes(fapl.get(), listener);
  return fapl;
}

int posix_descriptor(hid_t file) {
  const hid_t fapl = H5Fget_access_plist(file);
  if (fapl < 0) return -1;
  const hid_t driver = H5Pget_driver(fapl);
  void* handle = nullptr;
  const bool posix =
      (driver == H5FD_SEC2 || is_tracking_driver(driver)) && H5Fget_vfd_handle(file, fapl, &handle) >= 0;
  H5Pclose(fapl);
  return posix && handle ? *static_cast<int*>(handle) : -1;
}

}  // namespace dsv4::h5
