#include "capture/trace_seal.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>
// The seal hashes whole files (tens to hundreds of MB) when a trace is opened: compiled inline, XXH3
// takes the widest vector unit this build targets (AVX2 on x86-64-v3) rather than the shared
// library's baseline SSE2, about 1.6x faster. The digest is the same.
#ifndef XXH_INLINE_ALL  // a build without libxxhash defines it for every file
#define XXH_INLINE_ALL
#endif
#include <xxhash.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <array>
#include <atomic>
#include <barrier>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <exception>
#include <map>
#include <mutex>
#include <system_error>
#include <thread>
#include <tuple>
#include <vector>

#include "capture/errors.h"
#include "capture/h5.h"
#include "kernels/xxh3.h"

namespace dsv4 {
namespace {

constexpr char kMagic[8] = {'D', 'S', 'V', '4', 'S', 'E', 'A', 'L'};
constexpr uint32_t kSealVersion = 1;
constexpr uint32_t kStateOpen = 1;
constexpr uint32_t kStateSealed = 2;
constexpr size_t kHeaderBytes = 56;  // magic .. header checksum
constexpr size_t kChecked = 48;      // bytes covered by the header checksum
constexpr size_t kReadBlock = size_t(1) << 18;  // hashed while still in the L2 cache
constexpr uint64_t kHashPart = uint64_t(16) << 20;  // a thread's part of a window (hash_parallel)

std::atomic<bool> g_checks{true};

using Block = std::array<unsigned char, kSealBlockBytes>;

void put_u32(unsigned char* p, uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<unsigned char>(v >> (8 * i));
}
void put_u64(unsigned char* p, uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<unsigned char>(v >> (8 * i));
}
uint32_t get_u32(const unsigned char* p) {
  uint32_t v = 0;
  for (int i = 3; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}
uint64_t get_u64(const unsigned char* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

// A file descriptor closed on scope exit.
class Fd {
 public:
  Fd(const std::string& path, int flags) : fd_(::open(path.c_str(), flags | O_CLOEXEC)) {}
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }

 private:
  int fd_;
};

// Reads up to n bytes at `at`, fewer only at the end of the file; throws on an I/O error.
size_t read_some(int fd, const std::string& path, uint64_t at, unsigned char* out, size_t n) {
  size_t got = 0;
  while (got < n) {
    const ssize_t r = ::pread(fd, out + got, n - got, off_t(at + got));
    if (r < 0) {
      if (errno == EINTR) continue;
      throw TraceError(fmt::format("{}: cannot read: {}", path, std::strerror(errno)));
    }
    if (r == 0) break;
    got += size_t(r);
  }
  return got;
}

// Reads exactly n bytes at `at`; false at the end of the file, throws on an I/O error.
bool read_at(int fd, const std::string& path, uint64_t at, void* out, size_t n) {
  return read_some(fd, path, at, static_cast<unsigned char*>(out), n) == n;
}

void write_at(int fd, const std::string& path, uint64_t at, const void* data, size_t n) {
  const auto* p = static_cast<const unsigned char*>(data);
  while (n > 0) {
    const ssize_t r = ::pwrite(fd, p, n, off_t(at));
    if (r < 0) {
      if (errno == EINTR) continue;
      throw Error(fmt::format("{}: cannot write the trace's seal: {}", path, std::strerror(errno)));
    }
    p += r, at += uint64_t(r), n -= size_t(r);
  }
}

// The user block of a file, when the file is long enough to have one.
bool read_block(int fd, const std::string& path, Block& b) {
  return read_at(fd, path, 0, b.data(), b.size());
}

bool has_magic(const Block& b) {
  return std::memcmp(b.data(), kMagic, sizeof kMagic) == 0;
}

// HDF5's superblock signature right after a 512-byte user block.
bool follows_block(int fd, const std::string& path) {
  unsigned char sig[8];
  return read_at(fd, path, kSealBlockBytes, sig, sizeof sig) && std::memcmp(sig, h5::kSignature, sizeof sig) == 0;
}

// A slot for a seal: a 512-byte user block (HDF5's superblock signature at 512) holding zeros (a file
// just created) or a seal header.
bool has_slot(int fd, const std::string& path, const Block& b) {
  if (!follows_block(fd, path)) return false;
  if (has_magic(b)) return true;
  for (unsigned char c : b)
    if (c != 0) return false;
  return true;
}

struct Header {
  uint32_t state = 0;
  uint64_t size = 0;
  XXH128_canonical_t digest{};
};

// Parses a header that has the magic; an empty string when it is sound, else what is wrong.
std::string parse(const Block& b, Header& h) {
  if (XXH3_64bits(b.data(), kChecked) != get_u64(b.data() + kChecked))
    return "its header checksum does not match (the first 56 bytes of the file are damaged)";
  const uint32_t version = get_u32(b.data() + 8);
  if (version != kSealVersion)
    return fmt::format("seal layout version {} (this build reads version {})", version, kSealVersion);
  h.state = get_u32(b.data() + 12);
  if (h.state != kStateOpen && h.state != kStateSealed) return fmt::format("unknown seal state {}", h.state);
  if (get_u64(b.data() + 16) != kSealBlockBytes)
    return fmt::format("user block size {} (expected {})", get_u64(b.data() + 16), kSealBlockBytes);
  h.size = get_u64(b.data() + 24);
  std::memcpy(&h.digest, b.data() + 32, sizeof h.digest);
  return {};
}

void write_header(int fd, const std::string& path, uint32_t state, uint64_t size, const XXH128_canonical_t& d) {
  Block b{};
  std::memcpy(b.data(), kMagic, sizeof kMagic);
  put_u32(b.data() + 8, kSealVersion);
  put_u32(b.data() + 12, state);
  put_u64(b.data() + 16, kSealBlockBytes);
  put_u64(b.data() + 24, size);
  std::memcpy(b.data() + 32, &d, sizeof d);
  put_u64(b.data() + kChecked, XXH3_64bits(b.data(), kChecked));
  static_assert(kChecked + 8 == kHeaderBytes);
  write_at(fd, path, 0, b.data(), b.size());
}

std::string hex(const XXH128_canonical_t& d) {
  std::string s;
  for (unsigned char c : d.digest) s += fmt::format("{:02x}", c);
  return s;
}

// The range read and hashed by this thread alone, 256 KiB at a time (hashed while still in the L2
// cache): ranges below the parallel path's threshold, and files that end before the range does.
void hash_sequential(XXH3_state_t* st, int fd, const std::string& path, uint64_t begin, uint64_t end) {
  std::vector<unsigned char> buf(kReadBlock);
  for (uint64_t at = begin; at < end;) {
    const size_t want = size_t(std::min<uint64_t>(kReadBlock, end - at));
    const size_t n = read_some(fd, path, at, buf.data(), want);
    XXH3_128bits_update(st, buf.data(), n);
    if (n < want) return;  // shorter than asked: hash what is there
    at += n;
  }
}

// XXH3-128 over many threads. For inputs over 240 bytes, XXH3 folds the input into 8 accumulators in
// 1024-byte blocks: each block adds to accumulator j the sum of its 16 stripes' terms
// (xxh3::stripe_term), then scrambles. The sums are integer sums (mod 2^64), so the threads form
// each block's 8 sums (its "delta") in any order, each from its own range read into a cache-sized
// buffer, and one thread then runs the scrambles over the deltas in block order: the same bits as
// libxxhash. The tail (the last, partial block and the last stripe) and the 128-bit merge follow
// XXH3_hashLong_128b.

// The deltas of `blocks` whole blocks at `in`: out[8 b + j] = sum over the stripes st of block b of
// stripe_term(stripe, secret + 8 st, j).
void block_deltas(const unsigned char* in, uint64_t blocks, uint64_t* out) {
  const uint8_t* s = xxh3::kSecret;
#if defined(__AVX2__)
  __m256i key[xxh3::kStripesPerBlock][2];
  for (int st = 0; st < xxh3::kStripesPerBlock; ++st)
    for (int h = 0; h < 2; ++h)
      key[st][h] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 8 * st + 32 * h));
  for (uint64_t b = 0; b < blocks; ++b) {
    __m256i d[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
    for (int st = 0; st < xxh3::kStripesPerBlock; ++st)
      for (int h = 0; h < 2; ++h) {
        const __m256i w = _mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(in + b * xxh3::kBlockLen + st * xxh3::kStripeLen + 32 * h));
        const __m256i k = _mm256_xor_si256(w, key[st][h]);
        const __m256i product = _mm256_mul_epu32(k, _mm256_srli_epi64(k, 32));   // lo32 x hi32 of each lane
        const __m256i other = _mm256_shuffle_epi32(w, _MM_SHUFFLE(1, 0, 3, 2));  // lane j ^ 1's word
        d[h] = _mm256_add_epi64(d[h], _mm256_add_epi64(other, product));
      }
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 8 * b), d[0]);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 8 * b + 4), d[1]);
  }
#else
  for (uint64_t b = 0; b < blocks; ++b)
    for (int j = 0; j < 8; ++j) {
      uint64_t d = 0;
      for (int st = 0; st < xxh3::kStripesPerBlock; ++st)
        d += xxh3::stripe_term(in + b * xxh3::kBlockLen + st * xxh3::kStripeLen, s + 8 * st, j);
      out[8 * b + j] = d;
    }
#endif
}

// Scrambles the deltas of `count` blocks (8 a block) into accumulators [kFirst, kFirst + kLanes), in
// block order: each lane a chain of dependent steps, the lanes independent of each other. The lanes
// stay in general-purpose registers (the empty asm): vectorized, the 64-bit multiply takes three AVX2
// instructions on the chain, and the loop runs at 0.6x the speed.
template <int kFirst, int kLanes>
void chain_lanes(uint64_t acc[8], const uint64_t* deltas, uint64_t count) {
  const uint8_t* secret = xxh3::kSecret + xxh3::kSecretSize - xxh3::kStripeLen;
  uint64_t a[kLanes];
  for (int j = 0; j < kLanes; ++j) a[j] = acc[kFirst + j];
  for (uint64_t b = 0; b < count; ++b)
    for (int j = 0; j < kLanes; ++j) {
      uint64_t x = xxh3::scramble(a[j] + deltas[8 * b + kFirst + j], secret, kFirst + j);
      asm("" : "+r"(x));
      a[j] = x;
    }
  for (int j = 0; j < kLanes; ++j) acc[kFirst + j] = a[j];
}

void chain_deltas(uint64_t acc[8], const uint64_t* deltas, uint64_t count) {
  chain_lanes<0, 8>(acc, deltas, count);
}

// chain_deltas for long chains (the seal at a recorder's close: 322,440 blocks for a 330 MB trace):
// lanes 4..7 on a second thread, 1.4x faster on 2 cores. The same accumulators.
void chain_deltas_long(uint64_t acc[8], const uint64_t* deltas, uint64_t count) {
  constexpr uint64_t kShared = uint64_t(1) << 16;  // below this, a thread's start costs what it saves
  if (count < kShared) return chain_deltas(acc, deltas, count);
  std::jthread other;
  try {
    other = std::jthread([&] { chain_lanes<4, 4>(acc, deltas, count); });
  } catch (const std::system_error&) {  // no second thread: all lanes here
    return chain_deltas(acc, deltas, count);
  }
  chain_lanes<0, 4>(acc, deltas, count);
}

// After the whole blocks of a range of `len` bytes (more than 240) at `begin`: the stripes of the last,
// partial block, then the last 64 bytes (which may overlap them), read from the file. False when the
// file ends before the range does.
bool accumulate_file_tail(uint64_t acc[8], int fd, const std::string& path, uint64_t begin, uint64_t len) {
  const uint64_t nb_blocks = (len - 1) / xxh3::kBlockLen;
  const uint64_t tail_at = std::min(nb_blocks * xxh3::kBlockLen, len - xxh3::kStripeLen);
  std::vector<unsigned char> tail(size_t(len - tail_at));
  if (read_some(fd, path, begin + tail_at, tail.data(), tail.size()) < tail.size()) return false;
  const unsigned char* last_block = tail.data() + (nb_blocks * xxh3::kBlockLen - tail_at);
  const int nb_stripes = int(((len - 1) - xxh3::kBlockLen * nb_blocks) / xxh3::kStripeLen);
  xxh3::accumulate_tail(acc, last_block, nb_stripes, tail.data() + tail.size() - xxh3::kStripeLen,
                        xxh3::kSecret);
  return true;
}

// XXH3-128 of a range of `len` bytes (more than 240) from its accumulators after the tail, canonical.
std::array<unsigned char, 16> digest_of(const uint64_t acc[8], uint64_t len) {
  XXH128_hash_t h;
  h.low64 = xxh3::merge(acc, xxh3::kSecret, len);
  h.high64 = xxh3::merge_accs(acc, xxh3::kSecret + xxh3::kSecretSize - 64 - 11, ~(len * xxh3::kP64_2));
  XXH128_canonical_t c;
  XXH128_canonicalFromHash(&c, h);
  std::array<unsigned char, 16> out;
  std::memcpy(out.data(), c.digest, out.size());
  return out;
}

// XXH3-128 of [begin, end) (more than 240 bytes) by `threads` threads, in windows of threads x 16 MiB:
// thread i forms the deltas of its 16 MiB of a window, 256 KiB read at a time; at the window's end
// one thread scrambles them into the accumulators. False when the file ended early (the caller then
// hashes what is there, alone).
bool hash_parallel(uint64_t acc[8], int fd, const std::string& path, uint64_t begin, uint64_t end,
                   int threads) {
  constexpr uint64_t kPiece = kReadBlock;  // whole blocks
  static_assert(kHashPart % kPiece == 0 && kPiece % xxh3::kBlockLen == 0);
  const uint64_t len = end - begin, nb_blocks = (len - 1) / xxh3::kBlockLen;
  const uint64_t window = uint64_t(threads) * kHashPart,
                 windows = (nb_blocks * xxh3::kBlockLen + window - 1) / window;
  std::vector<uint64_t> deltas(size_t(window / xxh3::kBlockLen) * 8);
  std::vector<std::exception_ptr> errors(static_cast<size_t>(threads));
  std::atomic<bool> cut{false};  // a read failed or came up short
  uint64_t w = 0;                // the window the threads are in
  auto chain = [&]() noexcept {
    const uint64_t first = w * (window / xxh3::kBlockLen);
    chain_deltas(acc, deltas.data(), std::min(nb_blocks - first, window / xxh3::kBlockLen));
    ++w;
  };
  std::barrier phase(threads, chain);
  auto worker = [&](int i) {
    std::vector<unsigned char> buf(kPiece);
    for (uint64_t k = 0; k < windows; ++k) {
      const uint64_t from = k * window + uint64_t(i) * kHashPart;  // in bytes of the range
      const uint64_t to = std::min(from + kHashPart, nb_blocks * xxh3::kBlockLen);
      for (uint64_t at = from; at < to && !cut; at += kPiece) {
        const size_t want = size_t(std::min(kPiece, to - at));
        try {
          if (read_some(fd, path, begin + at, buf.data(), want) < want) cut = true;
        } catch (...) {
          errors[size_t(i)] = std::current_exception();
          cut = true;
        }
        if (!cut)
          block_deltas(buf.data(), want / xxh3::kBlockLen,
                       &deltas[size_t((at - k * window) / xxh3::kBlockLen) * 8]);
      }
      phase.arrive_and_wait();
    }
  };
  {
    std::vector<std::jthread> pool;
    std::exception_ptr no_thread;
    for (int i = 1; i < threads; ++i) {
      try {
        pool.emplace_back(worker, i);
      } catch (const std::system_error&) {
        no_thread = std::current_exception();
        cut = true;  // the started threads run out their windows without reading
        for (int k = i; k < threads; ++k) phase.arrive_and_drop();
        break;
      }
    }
    worker(0);
    pool.clear();
    if (no_thread) std::rethrow_exception(no_thread);
  }
  for (const std::exception_ptr& e : errors)
    if (e) std::rethrow_exception(e);
  if (cut) return false;
  return accumulate_file_tail(acc, fd, path, begin, len);
}

}  // namespace

std::array<unsigned char, 16> hash_file_range(int fd, const std::string& path, uint64_t begin, uint64_t end,
                                              int threads) {
  // Each thread takes at least two 16 MiB parts; by default one a core (up to 8), and at least two.
  const uint64_t len = end > begin ? end - begin : 0;
  const bool asked = threads > 0;
  if (!asked) threads = int(std::clamp(std::thread::hardware_concurrency(), 1u, 8u));
  threads = int(std::min<uint64_t>(uint64_t(threads), len / (2 * kHashPart)));
  std::array<unsigned char, 16> out;
  if (threads >= (asked ? 1 : 2)) {
    uint64_t acc[8];
    xxh3::init_acc(acc);
    bool whole = false;
    try {
      whole = hash_parallel(acc, fd, path, begin, end, threads);
    } catch (const std::system_error&) {  // no thread to share the work: hashed here alone
    }
    if (whole) return digest_of(acc, len);
  }
  XXH3_state_t* st = XXH3_createState();
  if (!st) throw Error(fmt::format("{}: not enough memory for the hash state", path));
  XXH3_128bits_reset(st);
  try {
    hash_sequential(st, fd, path, begin, end);
  } catch (...) {
    XXH3_freeState(st);
    throw;
  }
  XXH128_canonical_t c;
  XXH128_canonicalFromHash(&c, XXH3_128bits_digest(st));
  XXH3_freeState(st);
  std::memcpy(out.data(), c.digest, out.size());
  return out;
}

namespace {

// XXH3-128 of bytes [kHeaderBytes, size) of the file: the rest of the user block and the HDF5 file.
XXH128_canonical_t hash_body(int fd, const std::string& path, uint64_t size) {
  const std::array<unsigned char, 16> d = hash_file_range(fd, path, kHeaderBytes, size);
  XXH128_canonical_t out;
  std::memcpy(out.digest, d.data(), d.size());
  return out;
}

// Verified results by (device, inode, size, mtime, ctime).
using CacheKey = std::tuple<uint64_t, uint64_t, int64_t, int64_t, int64_t, int64_t, int64_t>;
std::mutex g_cache_mu;
std::map<CacheKey, SealCheck>& cache() {
  static std::map<CacheKey, SealCheck> m;
  return m;
}
CacheKey key_of(const struct stat& s) {
  return {uint64_t(s.st_dev), uint64_t(s.st_ino), int64_t(s.st_size), int64_t(s.st_mtim.tv_sec),
          int64_t(s.st_mtim.tv_nsec), int64_t(s.st_ctim.tv_sec), int64_t(s.st_ctim.tv_nsec)};
}

}  // namespace

const char* seal_state_name(SealCheck::State s) {
  switch (s) {
    case SealCheck::State::none:
      return "none";
    case SealCheck::State::open:
      return "open";
    case SealCheck::State::verified:
      return "verified";
    case SealCheck::State::unchecked:
      return "unchecked";
    case SealCheck::State::mismatch:
      return "mismatch";
    case SealCheck::State::bad_header:
      return "bad header";
  }
  return "?";
}

std::string seal_summary(const SealCheck& c) {
  switch (c.state) {
    case SealCheck::State::none:
      return "none (written before traces were sealed, or by another tool): not verified";
    case SealCheck::State::open:
      return "open (a recorder is writing the file, or died doing so): not verified";
    case SealCheck::State::verified:
      return "verified (XXH3-128 of the whole file)";
    case SealCheck::State::unchecked:
      return "sealed, not checked (--no-seal-check)";
    case SealCheck::State::mismatch:
      return "MISMATCH: " + c.detail;
    case SealCheck::State::bad_header:
      return "DAMAGED: " + c.detail;
  }
  return "?";
}

std::string seal_problem(const SealCheck& c) {
  if (c.state == SealCheck::State::bad_header)
    return fmt::format("damaged: the seal at the start of the file is unreadable ({})", c.detail);
  if (c.state == SealCheck::State::mismatch)
    return fmt::format("damaged: the file no longer matches the seal written when it was closed ({})", c.detail);
  return {};
}

void throw_seal_problem(const std::string& path, const SealCheck& c) {
  if (c.ok()) return;
  throw TraceCorrupt(fmt::format(
      "{}: {}; `dsv4 trace validate {}` tells which steps still read and `dsv4 trace salvage {} --out "
      "NEW.h5` copies them",
      path, seal_problem(c), path, path));
}

void set_seal_checks(bool on) {
  g_checks = on;
}
bool seal_checks() {
  return g_checks;
}

SealCheck check_seal(const std::string& path) {
  Fd fd(path, O_RDONLY);
  if (fd.get() < 0) throw TraceError(fmt::format("{}: cannot open the file for reading: {}", path, std::strerror(errno)));
  Block first{};
  SealCheck r;
  if (!read_block(fd.get(), path, first)) return r;  // too short for a seal: none
  if (!has_magic(first)) {
    // A 512-byte user block (the superblock right after it) that is not blank: a seal whose magic was
    // damaged. A trace written before seals has its superblock at 0.
    if (has_slot(fd.get(), path, first) || !follows_block(fd.get(), path)) return r;  // blank, or none
    r.state = SealCheck::State::bad_header;
    r.detail = "the 512 bytes before the HDF5 superblock do not start with the seal's magic";
    return r;
  }
  Header h;
  if (std::string why = parse(first, h); !why.empty()) {
    r.state = SealCheck::State::bad_header;
    r.detail = std::move(why);
    return r;
  }
  if (h.state == kStateOpen) {
    r.state = SealCheck::State::open;
    return r;
  }
  if (!g_checks) {
    r.state = SealCheck::State::unchecked;
    return r;
  }
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0)
    throw TraceError(fmt::format("{}: cannot read the file's size: {}", path, std::strerror(errno)));
  const CacheKey key = key_of(st);
  {
    std::lock_guard lk(g_cache_mu);
    if (auto it = cache().find(key); it != cache().end()) return it->second;
  }
  const uint64_t size = uint64_t(st.st_size);
  if (size != h.size) {
    r.state = SealCheck::State::mismatch;
    r.detail = fmt::format("the file has {} bytes, it was sealed with {} ({})", size, h.size,
                           size < h.size ? "cut short" : "grown since");
  } else {
    const XXH128_canonical_t got = hash_body(fd.get(), path, size);
    if (std::memcmp(&got, &h.digest, sizeof got) == 0) {
      r.state = SealCheck::State::verified;
    } else {
      r.state = SealCheck::State::mismatch;
      r.detail = fmt::format("XXH3-128 of bytes {}..{} is {}, it was sealed as {}", kHeaderBytes, size,
                             hex(got), hex(h.digest));
    }
  }
  // A writer that took the file meanwhile (mark_trace_open) changed the header first.
  Block again{};
  if (!read_block(fd.get(), path, again) || again != first) {
    r = SealCheck{};
    r.state = SealCheck::State::open;
    return r;
  }
  std::lock_guard lk(g_cache_mu);
  cache()[key] = r;
  return r;
}

void mark_trace_open(const std::string& path, bool sync) {
  Fd fd(path, O_RDWR);
  if (fd.get() < 0) throw Error(fmt::format("{}: cannot open for writing: {}", path, std::strerror(errno)));
  Block b{};
  if (!read_block(fd.get(), path, b) || !has_slot(fd.get(), path, b)) return;
  write_header(fd.get(), path, kStateOpen, 0, XXH128_canonical_t{});
  if (sync && ::fsync(fd.get()) != 0)
    throw Error(fmt::format("{}: fsync failed: {}", path, std::strerror(errno)));
}

SealTimes seal_trace(const std::string& path, SealHasher* written) {
  using Clock = std::chrono::steady_clock;
  Fd fd(path, O_RDWR);
  if (fd.get() < 0) throw Error(fmt::format("{}: cannot open for writing: {}", path, std::strerror(errno)));
  Block b{};
  SealTimes t;
  if (!read_block(fd.get(), path, b) || !has_slot(fd.get(), path, b)) return t;
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) throw Error(fmt::format("{}: cannot read the file's size: {}", path, std::strerror(errno)));
  const uint64_t size = uint64_t(st.st_size);
  const auto t0 = Clock::now();
  XXH128_canonical_t d;
  if (written) {
    const std::array<unsigned char, 16> h = written->digest(fd.get(), path, size);
    std::memcpy(d.digest, h.data(), h.size());
    t.bytes_read = written->bytes_read();
  } else {
    d = hash_body(fd.get(), path, size);
    t.bytes_read = size > kHeaderBytes ? size - kHeaderBytes : 0;
  }
  const auto t1 = Clock::now();
  write_header(fd.get(), path, kStateSealed, size, d);
  if (::fsync(fd.get()) != 0) throw Error(fmt::format("{}: fsync failed: {}", path, std::strerror(errno)));
  t.hash_seconds = std::chrono::duration<double>(t1 - t0).count();
  t.sync_seconds = std::chrono::duration<double>(Clock::now() - t1).count();
  return t;
}

// ---- SealHasher

namespace {
constexpr uint64_t kBlock = xxh3::kBlockLen;
}  // namespace

static_assert(kBlock == 1024, "SealHasher::Partial holds one block");

SealHasher::SealHasher(uint64_t max_file_bytes) : max_blocks_(max_file_bytes / kBlock) {}

void SealHasher::set_sums(uint64_t block, const unsigned char* bytes, uint64_t count) {
  if (known_.size() < block + count) {
    known_.resize(size_t(block + count), 0);
    sums_.resize(size_t(block + count) * 8);
  }
  block_deltas(bytes, count, &sums_[size_t(block) * 8]);
  std::fill(known_.begin() + ptrdiff_t(block), known_.begin() + ptrdiff_t(block + count), uint8_t(1));
}

// Bytes [from, to) of the file, which lie in `block`, written from data (data[0] at file offset at).
void SealHasher::add_partial(uint64_t block, uint64_t at, const unsigned char* data, uint64_t from,
                             uint64_t to) {
  const uint64_t start = kHeaderBytes + block * kBlock;
  auto it = partial_.find(block);
  if (it == partial_.end()) {
    if (partial_.size() >= kMaxPartial) return;  // left unknown: read at the seal
    it = partial_.emplace(block, Partial{}).first;
  }
  Partial& p = it->second;
  std::memcpy(p.bytes.data() + (from - start), data + (from - at), size_t(to - from));
  for (uint64_t i = from - start; i < to - start; ++i) p.have.set(size_t(i));
  if (!p.have.all()) return;
  set_sums(block, p.bytes.data(), 1);
  partial_.erase(it);
}

void SealHasher::wrote(uint64_t at, const void* data, size_t n) {
  const uint64_t end = at + n;
  if (n == 0 || end <= kHeaderBytes) return;
  const auto* bytes = static_cast<const unsigned char*>(data);
  // Blocks [first, last] are touched; [whole_from, whole_to) lie wholly inside [at, end).
  const uint64_t first = at <= kHeaderBytes ? 0 : (at - kHeaderBytes) / kBlock,
                 last = (end - 1 - kHeaderBytes) / kBlock;
  const uint64_t whole_from = at <= kHeaderBytes ? 0 : (at - kHeaderBytes + kBlock - 1) / kBlock;
  const uint64_t whole_to = (end - kHeaderBytes) / kBlock;
  std::lock_guard lk(mu_);
  for (const uint64_t b : {first, last}) {  // covered in part: no longer what was known
    if (b >= whole_from && b < whole_to) continue;
    if (b < known_.size()) known_[size_t(b)] = 0;
    if (b < max_blocks_) {
      const uint64_t start = kHeaderBytes + b * kBlock;
      add_partial(b, at, bytes, std::max(at, start), std::min(end, start + kBlock));
    }
    if (first == last) break;
  }
  const uint64_t to = std::min(whole_to, max_blocks_);
  if (whole_to > to && known_.size() > to)  // past the limit (a digest() may have read them): forgotten
    std::fill(known_.begin() + ptrdiff_t(std::max(to, whole_from)),
              known_.begin() + ptrdiff_t(std::min<uint64_t>(whole_to, known_.size())), uint8_t(0));
  if (whole_from >= whole_to) return;
  partial_.erase(partial_.lower_bound(whole_from), partial_.lower_bound(whole_to));
  if (whole_from < to)
    set_sums(whole_from, bytes + (kHeaderBytes + whole_from * kBlock - at), to - whole_from);
}

void SealHasher::resized(uint64_t size) {
  std::lock_guard lk(mu_);
  const uint64_t keep =
      size > kHeaderBytes ? (size - kHeaderBytes) / kBlock : 0;  // blocks wholly before size
  if (known_.size() > keep) {
    known_.resize(size_t(keep));
    sums_.resize(size_t(keep) * 8);
  }
  partial_.erase(partial_.lower_bound(keep), partial_.end());
}

uint64_t SealHasher::bytes_read() const {
  std::lock_guard lk(mu_);
  return read_;
}

std::array<unsigned char, 16> SealHasher::digest(int fd, const std::string& path, uint64_t size) {
  std::lock_guard lk(mu_);
  const uint64_t len = size > kHeaderBytes ? size - kHeaderBytes : 0;
  const uint64_t nb = len > 240 ? (len - 1) / kBlock : 0;  // whole blocks before the tail
  // Block 0 is always read: the header's writes (mark_trace_open, the seal) reach it without telling.
  uint64_t unknown = 1;
  for (uint64_t b = 1; b < nb; ++b) unknown += b >= known_.size() || !known_[size_t(b)];
  if (nb == 0 || unknown * kBlock > kMaxReadBack) {
    read_ = len;
    return hash_file_range(fd, path, kHeaderBytes, size);
  }
  if (known_.size() < nb) {
    known_.resize(size_t(nb), 0);
    sums_.resize(size_t(nb) * 8);
  }
  known_[0] = 0;
  read_ = 0;
  std::vector<unsigned char> buf(kReadBlock);
  for (uint64_t b = 0; b < nb;) {
    if (known_[size_t(b)]) {
      ++b;
      continue;
    }
    uint64_t e = b + 1;  // a run of unknown blocks, read at most kReadBlock at a time
    while (e < nb && !known_[size_t(e)] && (e - b) * kBlock < kReadBlock) ++e;
    const size_t want = size_t((e - b) * kBlock);
    if (read_some(fd, path, kHeaderBytes + b * kBlock, buf.data(), want) < want)
      throw TraceError(fmt::format("{}: the file ended at {} bytes while its seal was formed", path, size));
    block_deltas(buf.data(), e - b, &sums_[size_t(b) * 8]);
    std::fill(known_.begin() + ptrdiff_t(b), known_.begin() + ptrdiff_t(e), uint8_t(1));
    read_ += want;
    b = e;
  }
  known_[0] = 0;
  uint64_t acc[8];
  xxh3::init_acc(acc);
  chain_deltas_long(acc, sums_.data(), nb);
  if (!accumulate_file_tail(acc, fd, path, kHeaderBytes, len))
    throw TraceError(fmt::format("{}: the file ended at {} bytes while its seal was formed", path, size));
  read_ += len - std::min(nb * kBlock, len - xxh3::kStripeLen);
  return digest_of(acc, len);
}

}  // namespace dsv4
