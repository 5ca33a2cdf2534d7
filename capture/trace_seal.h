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
#include <cstdint>
#include <string>

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

// The writer's side. Both do nothing on a file without a seal header slot (no 512-byte user block
// starting with zeros or the magic), so appending to a trace written before seals keeps it unsealed.
// Marks `path` open (a writer is about to change it). Throws Error naming the file on an I/O error.
void mark_trace_open(const std::string& path);
// Seals `path`: digest of its bytes after the header, written with the file size into the header,
// then fsync. Call with the file closed by HDF5. Throws Error naming the file on an I/O error.
void seal_trace(const std::string& path);

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
