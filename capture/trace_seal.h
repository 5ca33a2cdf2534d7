// The seal of a trace: a whole-file digest that readers verify before HDF5 parses any metadata.
//
// HDF5 checksums most of its metadata, but not all of it (the global heap of variable-length
// strings, fractal-heap direct blocks of older files), and a damaged piece it does not check can make
// the library loop or crash. A trace therefore starts with a 512-byte HDF5 user block (HDF5 ignores it
// and finds its superblock after it; h5py reads such files as any other) that holds the seal:
//
//   offset  size  field
//        0     8  magic "DSV4SEAL"
//        8     4  seal layout version (1), little endian
//       12     4  state: 1 open (a recorder is writing the file, or died doing so), 2 sealed
//       16     8  user block size (512)
//       24     8  file size when sealed
//       32    16  XXH3-128 (seed 0) of bytes [56, file size), canonical (big-endian) form
//       48     8  XXH3-64 (seed 0) of bytes [0, 48): the header's own checksum
//       56   456  zero
//
// Every byte of the file is covered: the header by its checksum, the rest of the user block and the
// whole HDF5 file by the digest.
//
// A recorder creates the file with the user block, marks it open, and seals it when it closes the
// file (before the rename of NAME.h5.incomplete to NAME.h5); `record --append` marks the file open
// again before it changes it and seals it at its close; salvage and bundle seal what they write.
// A file without the magic (a trace written before seals existed, or by another tool) has no seal
// and is read as before. traces/FORMAT.md ("Seal") says what the digest covers.
#pragma once

#include <array>
#include <bitset>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "capture/h5_tracked.h"

namespace dsv4 {

constexpr uint64_t kSealBlockBytes = 512;  // the HDF5 user block of a trace

// What a file's seal says, read with plain file reads (no HDF5 call).
struct SealCheck {
  enum class State {
    none,        // no seal: no user block, or one without the magic
    open,        // marked open: a recorder is writing the file (or died doing so); not verified
    verified,    // sealed and the digest matches the file's bytes
    unchecked,   // sealed, not hashed: seal checks are off (set_seal_checks)
    mismatch,    // sealed, but the file's bytes (or size) differ from what was sealed
    bad_header,  // the magic is there but the header's checksum, version or fields are wrong
  };
  State state = State::none;
  std::string detail;  // for mismatch and bad_header: what differs, naming sizes and digests
  bool ok() const { return state != State::mismatch && state != State::bad_header; }
};
// A few words for reports: "none", "open", "verified", "unchecked", "mismatch", "bad header".
const char* seal_state_name(SealCheck::State s);
// One line for `trace info` and `trace validate`: the state and what it means for the reader.
std::string seal_summary(const SealCheck& c);

// Checks the seal of `path`: reads the header and, when the file is sealed, hashes every byte after the
// header. Results are remembered per (device, inode, size, modification time), so a file opened
// again by the same process is not hashed again. When the header changes while the file is hashed (a
// recorder took the file for `--append`), the file is reported open. Throws TraceError naming the file
// when it cannot be read.
SealCheck check_seal(const std::string& path);

// XXH3-128 (seed 0) of bytes [begin, end) of the open file `fd`, in canonical (big-endian) form: the
// digest libxxhash's XXH3_128bits gives for those bytes, and the seal's. `threads` threads share the
// work, each reading and hashing 16 MiB parts of the range (at most one thread per 32 MiB); 0: one a
// core, up to 8, and the calling thread alone below 64 MiB. A file shorter than `end` is hashed up
// to its end. Throws TraceError naming `path` on a read error.
std::array<unsigned char, 16> hash_file_range(int fd, const std::string& path, uint64_t begin, uint64_t end,
                                              int threads = 0);

// The seal's hash formed while the file is written. Told of each write (h5::track_writes), it keeps
// the XXH3 sums of every 1024-byte block of the digested range (bytes 56 to the end) that the write
// covered whole, formed from the bytes written; a block that a later write covers in part, or that a
// truncation cuts, is forgotten. The seal then reads back only the blocks it does not know (the edges
// of writes, the header's block, what the file held before the tracking began) and the tail, instead of
// the whole file, and its digest is the same: XXH3-128 of the file's bytes, whatever the writes were.
// A block that one write covers in part and the next covers the rest of (consecutive chunks) is
// put together from the two. Memory: 65 bytes a KiB of file written, up to `max_file_bytes` of file
// (blocks past it are read at the seal), and at most 4 MiB of blocks written in part. Thread-safe.
class SealHasher final : public h5::WriteListener {
 public:
  static constexpr uint64_t kDefaultMaxFileBytes = uint64_t(4) << 30;  // 260 MiB of sums at most
  // Past this many unknown bytes the seal hashes the whole file as hash_file_range does, on its threads.
  static constexpr uint64_t kMaxReadBack = uint64_t(64) << 20;
  explicit SealHasher(uint64_t max_file_bytes = kDefaultMaxFileBytes);
  void wrote(uint64_t at, const void* data, size_t n) override;
  void resized(uint64_t size) override;
  // XXH3-128 of bytes [56, size) of the open file `fd`, canonical, as hash_file_range gives it: the
  // known blocks' sums, the rest read from the file (and then known). Throws TraceError naming `path`
  // on a read error or a file shorter than `size`.
  std::array<unsigned char, 16> digest(int fd, const std::string& path, uint64_t size);
  uint64_t bytes_read() const;  // bytes the last digest() read from the file

 private:
  // A block that writes have covered in part, since it was last known or forgotten: the bytes they
  // wrote. Once they cover it whole (the next chunk of an append), its sums are formed from them.
  struct Partial {
    std::array<unsigned char, 1024> bytes{};
    std::bitset<1024> have;
  };
  static constexpr size_t kMaxPartial = 4096;  // blocks kept in part at most (4 MiB)
  void add_partial(uint64_t block, uint64_t at, const unsigned char* data, uint64_t from, uint64_t to);
  void set_sums(uint64_t block, const unsigned char* bytes, uint64_t count);

  mutable std::mutex mu_;
  uint64_t max_blocks_;
  std::vector<uint64_t> sums_;  // 8 a block (the block's delta: the sums of its stripes' terms)
  std::vector<uint8_t> known_;  // 1: sums_ of the block are those of the file's bytes
  std::map<uint64_t, Partial> partial_;
  uint64_t read_ = 0;
};

// The writer's side. Both do nothing on a file without a seal header slot (no 512-byte user block
// starting with zeros or the magic), so appending to a trace written before seals keeps it unsealed.
// Marks `path` open (a writer is about to change it) and syncs the header, so that a writer that dies
// while it changes the file leaves it marked open. `sync` false: for a file just created under a name
// that says it is incomplete (NAME.h5.incomplete), whose header goes to disk with its first steps.
// Throws Error naming the file on an I/O error.
void mark_trace_open(const std::string& path, bool sync = true);
// What a seal took.
struct SealTimes {
  double hash_seconds = 0;  // the digest
  double sync_seconds = 0;  // the header written and the file synced
  uint64_t bytes_read = 0;  // of the file, for the digest
};
// Seals `path`: digest of its bytes after the header, written with the file size into the header,
// then fsync. `written`: the hasher its writer told of every write since the file was created or
// opened (it then reads back only what they did not cover); without one the whole file is read. Call
// with the file closed by HDF5. Throws Error naming the file on an I/O error.
SealTimes seal_trace(const std::string& path, SealHasher* written = nullptr);

// What a reader does with a seal that does not match: `enforce` throws TraceCorrupt naming the file,
// what differs and `dsv4 trace salvage` (every command's reader); `report` opens the file anyway and
// leaves the finding to the caller (validate, salvage). A file without a seal, or marked open, is
// read as before either way.
enum class SealPolicy { enforce, report };
// What is wrong with a check that is not ok() ("damaged: ..."), without the file name; "" when ok().
std::string seal_problem(const SealCheck& c);
// Throws TraceCorrupt for a check that is not ok(), worded for the commands.
void throw_seal_problem(const std::string& path, const SealCheck& c);

// Process-wide switch for readers (default on): off, check_seal() reports a sealed file as unchecked
// without hashing it (`dsv4 --no-seal-check`, and fuzzing of the layers behind the seal).
void set_seal_checks(bool on);
bool seal_checks();

}  // namespace dsv4
