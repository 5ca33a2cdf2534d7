// A thin RAII layer over the HDF5 C API (1.10, numbered functions), used by the trace writer and
// reader. Every failure throws TraceError with the file, the object path and HDF5's own error stack;
// HDF5's automatic printing to stderr is turned off on every thread that calls in here.
//
// Datasets are created with the trace conventions of traces/FORMAT.md: chunked (~64 KiB chunks made
// of whole rows) with shuffle + deflate(4) + fletcher32 (fletcher32 alone for data that cannot be
// compressed, such as digests); empty datasets use the contiguous layout
// (a chunk must not exceed fixed dimensions of size 0, and there is nothing to compress), and so do
// variable-length string datasets (HDF5 cannot filter variable-length data).
#pragma once

#include <hdf5.h>

#include "capture/chunk_codec.h"

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

namespace dsv4::h5 {

// The signature that starts an HDF5 superblock (at offset 0, 512, 1024, ... of a file).
inline constexpr unsigned char kSignature[8] = {0x89, 'H', 'D', 'F', '\r', '\n', 0x1a, '\n'};

// Owns one HDF5 identifier (file, group, dataset, dataspace, datatype, attribute, property list) and
// releases it with H5Idec_ref, which closes the object when the last reference goes.
class Id {
 public:
  Id() = default;
  explicit Id(hid_t id) : id_(id) {}
  Id(const Id&) = delete;
  Id& operator=(const Id&) = delete;
  Id(Id&& o) noexcept : id_(o.release()) {}
  Id& operator=(Id&& o) noexcept {
    if (this != &o) {
      reset();
      id_ = o.release();
    }
    return *this;
  }
  ~Id() { reset(); }

  hid_t get() const { return id_; }
  bool valid() const { return id_ >= 0; }
  hid_t release() {
    hid_t id = id_;
    id_ = H5I_INVALID_HID;
    return id;
  }
  void reset();  // closes, ignoring errors (destructors must not throw)

 private:
  hid_t id_ = H5I_INVALID_HID;
};

// Turns off HDF5's automatic error printing for the calling thread (the thread-safe build keeps one
// error stack per thread). Every function below calls it; call it before raw H5 calls elsewhere.
void quiet();
// The calling thread's current HDF5 error stack as text, innermost call first ("" when empty).
std::string error_stack();
// The innermost message of the calling thread's HDF5 error stack ("incorrect metadata checksum after
// all read attempts"; "" when empty).
std::string error_cause();
// Whether errors carry HDF5's whole error stack (`dsv4 --verbose`) or only its innermost message (the
// default: one clean line per error).
void set_verbose_errors(bool on);
// Throws TraceError("FILE: PATH: WHAT (HDF5: <innermost message>)", or the whole stack when verbose);
// `path` may be empty.
[[noreturn]] void fail(const std::string& file, const std::string& path, const std::string& what);

// ---- reading damaged files ----------------------------------------------------------------------
// HDF5 1.10 trusts some metadata it cannot check: the global heap that holds variable-length strings
// has no checksum, and a damaged heap can make the library loop forever or crash. Two defences:
//  * read_strings() and read_attr_string() check every string's heap reference (a dataset's in its
//    contiguous data, an attribute's in its message in the object header, walked as the file format
//    specification lays it out) and the heap collection it points into before asking HDF5 for the
//    strings; damage is TraceCorrupt naming the file, object and string;
//  * every reading call below runs inside a ReadScope, which names what is being read; the dsv4
//    command installs signal handlers and a watchdog (cli/main.cpp) that turn a crash or a stall inside
//    a scope into one error line naming the file and object, and exit code 2.
class ReadScope {
 public:
  // `bulk`: reading a dataset's values, which may legitimately take long (not watched for stalls).
  ReadScope(const std::string& file, const std::string& path, const char* what, bool bulk = false);
  ~ReadScope();
  ReadScope(const ReadScope&) = delete;
  ReadScope& operator=(const ReadScope&) = delete;
};
// The calling thread's outermost active scope's description ("FILE: PATH: reading attributes"), or
// nullptr; safe to call from a signal handler. With `since_ns` (the watchdog's question): the last
// outermost non-bulk scope entered by any thread that is still active, and when it began (steady
// clock, nanoseconds).
const char* active_read_scope(int64_t* since_ns = nullptr);

// An open file, group or dataset with the names its errors carry.
struct Object {
  Id id;
  std::string file;  // the file's path on disk
  std::string path;  // the object's path inside the file ("/steps/000000")
  hid_t get() const { return id.get(); }
  std::string child(const std::string& name) const { return path == "/" ? "/" + name : path + "/" + name; }
  [[noreturn]] void fail(const std::string& what) const { h5::fail(file, path, what); }
};

// Checks an HDF5 return value (negative = failure) and throws with the stack otherwise.
inline hid_t check(hid_t r, const Object& at, const std::string& what) {
  if (r < 0) at.fail(what);
  return r;
}

// ---- files and groups ------------------------------------------------------------------------
// File access property list: latest file format (needed for SWMR) and, when `lock` is false, no
// POSIX file locks (see step_layout.cpp for why the writer does not lock). Where the file system
// does not support locks, files open without them.
Id file_access(bool latest, bool lock);
// Truncates. `user_block`: bytes HDF5 leaves to the caller at the start (0, or a power of two >= 512;
// a trace's seal, capture/trace_seal.h).
Object create_file(const std::string& path, hid_t fapl, hsize_t user_block = 0);
Object open_file(const std::string& path, unsigned flags, hid_t fapl);  // H5F_ACC_* flags
void close_file(Object& f);                                             // H5Fclose with error checking
Object open(const Object& parent, const std::string& name);             // group or dataset (H5Oopen)
// Where the link `name` of `parent` points when it is an HDF5 external link (a joined trace's
// sequences): the file as the link stores it and the object's path there; nullopt for other links.
struct ExternalLink {
  std::string file, object;
};
std::optional<ExternalLink> external_link(const Object& parent, const std::string& name);
Object create_group(const Object& parent, const std::string& name);
bool exists(const Object& parent, const std::string& path);  // every component of a relative path
std::vector<std::string> children(const Object& group);      // link names, sorted by name

// ---- attributes (on files, groups and datasets) ----------------------------------------------
bool has_attr(const Object& o, const std::string& name);
void write_attr(const Object& o, const std::string& name, const std::string& value);  // vlen UTF-8
void write_attr(const Object& o, const std::string& name, int32_t value);
void write_attr(const Object& o, const std::string& name, uint64_t value);
void write_attr(const Object& o, const std::string& name, uint8_t value);
void write_attr(const Object& o, const std::string& name, int64_t value);
void write_attr(const Object& o, const std::string& name, float value);
std::string read_attr_string(const Object& o, const std::string& name);  // vlen or fixed-length strings
int64_t read_attr_int(const Object& o, const std::string& name);         // any integer type
uint64_t read_attr_u64(const Object& o, const std::string& name);
float read_attr_f32(const Object& o, const std::string& name);
std::vector<std::string> attr_names(const Object& o);

// ---- datasets ---------------------------------------------------------------------------------
// The storage type of a dataset (little-endian standard types, what h5py reads everywhere).
enum class Type { u8, u16, u32, u64, i32, i64, f32, f64, str };
hid_t file_type(Type t);  // a predefined type (not to be closed); str is handled separately
size_t type_size(Type t);
const char* type_name(Type t);  // "uint8" ... "float64", "string" (numpy's names)

// Chunk dimensions for a dataset of `dims` with `elem` bytes per element: whole rows, about 64 KiB.
std::vector<hsize_t> chunk_for(const std::vector<hsize_t>& dims, size_t elem);
// Whether a chunked dataset is compressed (shuffle + deflate) or only checksummed: hash values are
// incompressible, and deflating them costs more time than the rest of a decisions-only step.
enum class Compress { yes, no };
// Creates a dataset with the conventions above. `extendible`: 1-D, starts at dims[0] elements and
// grows along axis 0 without bound (always chunked); `expected_rows` (> 0) caps its chunk at the
// length it is expected to reach.
Object create_dataset(const Object& parent, const std::string& name, Type t, const std::vector<hsize_t>& dims,
                      bool extendible = false, hsize_t expected_rows = 0, Compress compress = Compress::yes);

std::vector<hsize_t> shape(const Object& ds);
// The stored type's class as a Type, or nullopt for types the trace never uses.
std::optional<Type> stored_type(const Object& ds);

// Writes `n` elements of `t` from `data` into the whole dataset (n must equal its size), or into
// [offset, offset + n) along axis 0 of a 1-D dataset with write_range. `le_bytes`: the buffer holds
// little-endian values (digest.h storage_bytes()) rather than native ones.
void write(const Object& ds, Type t, const void* data, size_t n, bool le_bytes = false);
// Several whole-dataset writes at once: the chunks of all of them are encoded together on the
// writer's encoder threads (capture/chunk_codec.h; DSV4_WRITER_THREADS, default half the cores, at
// most 8), then stored in order. Same result as one write() per job.
struct WriteJob {
  const Object* ds;
  Type t;
  const void* data;
  size_t n;
  bool le_bytes = false;
};
void write_all(const std::vector<WriteJob>& jobs);
// Whole-dataset writes whose chunks are encoded apart from the HDF5 calls that store them, so that a
// writer can encode many datasets' chunks at once (encode(), on the encoder threads, no HDF5 call)
// and still make its HDF5 calls in the order it would one write() at a time (store()). add() only
// reads the dataset's layout. write() and write_all() are built on it.
class StagedWrites {
 public:
  StagedWrites();
  ~StagedWrites();
  StagedWrites(const StagedWrites&) = delete;
  StagedWrites& operator=(const StagedWrites&) = delete;
  // A write of n values of t at `data` into the whole of `ds`; both must live until store() (`owner`
  // keeps the values alive when the caller does not; hold() keeps a dataset). With `extend_to`, store()
  // first sets the dataset's first dimension to it (an extendible dataset whose length the values
  // decide).
  void add(const Object& ds, Type t, const void* data, size_t n, bool le_bytes = false,
           std::shared_ptr<const void> owner = nullptr, std::optional<hsize_t> extend_to = std::nullopt);
  // The same with values the writes hold (T: uint8_t ... double, as write()).
  template <typename T>
  void add(const Object& ds, std::vector<T> values, std::optional<hsize_t> extend_to = std::nullopt);
  // Rows [first, last) along axis 0 of a write of the whole of `ds`: `data` holds all n values of the
  // dataset, of which store() reads only these rows. The chunks holding them are stored whole, so
  // `first` must start a chunk and `last` end one or the dataset (chunk_rows). Parts written this way,
  // in any order and covering every row once, store what one add() of all the values stores.
  void add_rows(const Object& ds, Type t, const void* data, size_t n, hsize_t first, hsize_t last);
  // Keeps `ds` open until store(); the reference stays valid until then.
  const Object& hold(Object ds);
  size_t size() const;
  void encode();  // every chunk of every write added, on the encoder threads
  void store();   // the HDF5 calls, in the order the writes were added (encoding what encode() did not)

 private:
  struct Write;
  std::vector<Write> writes_;
  std::vector<std::unique_ptr<Object>> held_;
  bool encoded_ = false;
};
// The default encoder threads become all the cores (at most 8) rather than half: for a writer that has
// the machine to itself (an import), not one sharing it with a forward. DSV4_WRITER_THREADS still wins.
void encode_on_all_cores(bool all);
class ChunkFile;

// A 1-D dataset whose values arrive in order and whose length is known only at the end (an import's
// indexer gaps): the values are gathered into chunks of the size create_dataset gives a dataset of
// that length, each chunk is encoded (chunk_codec.h) on the appending thread as soon as it is full, and
// store() creates the dataset and writes the encoded chunks. Only the encoded chunks are held, never
// all the values; the file is the one create_dataset + write of every value makes. Compressed datasets
// only (the uncompressed pipeline spreads rows over its chunks, which needs the length first). Without
// zlib (no chunk codec) the values are held and written by write().
//
// With a ChunkFile, the chunks are not held at all: each goes into stream `stream` of that file as it
// is encoded (an extendible dataset, so every chunk is whole), finish() writes the last one, and
// store() links the dataset where it belongs.
class ChunkStream {
 public:
  explicit ChunkStream(Type t, std::shared_ptr<ChunkFile> file = nullptr, int stream = 0);
  // n values of t, native (little-endian) layout.
  void append(const void* values, size_t n);
  size_t size() const { return total_; }
  // No more values (needed with a ChunkFile, before store(); a no-op without).
  void finish();
  // Creates parent/name ([size()] values) and writes it (with a ChunkFile: links it).
  void store(const Object& parent, const std::string& name) const;
  // The values appended so far (decoded back from the chunks; for checks, not the hot path). Not
  // with a ChunkFile.
  std::vector<uint8_t> values() const;

 private:
  void flush_chunk();
  Type t_;
  size_t elem_ = 0, per_chunk_ = 0, total_ = 0, fill_ = 0;
  std::vector<uint8_t> buf_;  // the chunk being filled, shuffled (all the values, plain, without a codec)
  std::vector<EncodedChunk> chunks_;
  std::shared_ptr<ChunkFile> file_;
  int stream_ = 0;
  size_t put_ = 0;
  bool finished_ = false;
};

// Unlinked, extendible, compressed 1-D datasets of one type in an open file, written chunk by chunk
// from several threads (ChunkStream) in an order that does not depend on them: chunk 0 of every
// stream in stream order, then chunk 1 of every stream, ...; a chunk whose turn has not come waits in
// memory. So the file's
// bytes are the same whatever the threads did. A stream is linked into the file by link() once
// written; the datasets never linked are deleted with their chunks when the ChunkFile goes.
class ChunkFile {
 public:
  ChunkFile(const Object& file, Type t, int streams);
  ~ChunkFile();
  ChunkFile(const ChunkFile&) = delete;
  ChunkFile& operator=(const ChunkFile&) = delete;
  // Thread-safe (one lock around the HDF5 calls).
  void put(int stream, size_t index, EncodedChunk&& c);
  void close(int stream, size_t values);
  // Links a closed and written stream as parent/name.
  void link(int stream, const Object& parent, const std::string& name);

 private:
  struct Stream {
    Object ds;
    std::map<size_t, EncodedChunk> pending;
    size_t written = 0, values = 0, chunks = 0;  // chunks: known once closed
    bool closed = false, extent_set = false;
  };
  void drain();
  void start_writeback(size_t bytes);
  size_t per_chunk_;
  std::mutex mu_;
  std::vector<Stream> streams_;
  size_t next_chunk_ = 0, next_stream_ = 0;  // whose turn it is
  // The file's descriptor where HDF5 writes through one (its default sec2 driver), else −1: every
  // kWriteback bytes of chunks, the kernel is asked to start writing them out (sync_file_range), so
  // that the fsync which ends a trace finds little left to write.
  int fd_ = -1;
  size_t unsynced_ = 0;
};

// Asks the kernel to start writing out the dirty pages of the file behind `fd`, or at `path`
// (sync_file_range with SYNC_FILE_RANGE_WRITE; it does not wait), so that the fsync which ends a trace
// finds little left to write. Only a hint: errors (a file system without it) are ignored.
void start_writeback(int fd);
void start_writeback(const std::string& path);

void write_le_bytes(const Object& ds, Type t, const std::vector<uint8_t>& bytes);
void write_range(const Object& ds, Type t, const void* data, hsize_t offset, hsize_t n);
// Rows along axis 0 in each chunk of `ds` (all of them for a dataset that is not chunked).
hsize_t chunk_rows(const Object& ds);
void set_extent(const Object& ds, const std::vector<hsize_t>& dims);

template <typename T>
void write(const Object& ds, const std::vector<T>& v);  // T: uint8_t ... double (see h5.cpp)
void write_strings(const Object& ds, const std::vector<std::string>& v);

// Reads the whole dataset converted to T. Integer datasets read into integer T, float into float T;
// a class mismatch (or a value that does not fit T) throws naming the dataset.
template <typename T>
std::vector<T> read(const Object& ds);
std::vector<std::string> read_strings(const Object& ds);
// Rows [r0, r1) along axis 0 (every element of those rows), converted like read(); only those rows'
// chunks are read from the file.
template <typename T>
std::vector<T> read_rows(const Object& ds, hsize_t r0, hsize_t r1);

// Raw data bytes on disk (after filters) and in memory.
int64_t storage_bytes(const Object& ds);
int64_t logical_bytes(const Object& ds);

}  // namespace dsv4::h5
