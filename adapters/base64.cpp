#include "adapters/base64.h"

#include <fmt/core.h>
#include <openssl/evp.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cstring>

namespace dsv4 {

namespace {
// 48 MiB of text per block: a multiple of 4 characters (whole quanta), well inside EVP's int lengths.
constexpr size_t kTextBlock = size_t(48) << 20;
// Its encoding counterpart: a multiple of 3 bytes.
constexpr size_t kByteBlock = kTextBlock / 4 * 3;

bool is_b64(char ch) {
  return (ch >= 'A' && ch <= 'Z') || (ch >= 'a' && ch <= 'z') || (ch >= '0' && ch <= '9') || ch == '+' ||
         ch == '/';
}
}  // namespace

size_t base64_decoded_size(std::string_view text, std::string& error) {
  error.clear();
  if (text.size() % 4 != 0) {
    error = fmt::format("base64 text of {} characters is not a multiple of 4", text.size());
    return 0;
  }
  size_t pad = 0;
  while (pad < 2 && pad < text.size() && text[text.size() - 1 - pad] == '=') ++pad;
  return text.size() / 4 * 3 - pad;
}

namespace {
// The table decoder: each character's 6 bits pre-shifted to its place in the 24-bit quantum, one table per
// position; anything outside the alphabet sets bit 31. '=' reads as 0 wherever it stands, as in EVP
// (whose output therefore holds whole quanta, padding included).
struct Tables {
  uint32_t t[4][256];
  Tables() {
    const char* alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    for (int p = 0; p < 4; ++p)
      for (int c = 0; c < 256; ++c) t[p][c] = 0x80000000u;
    for (uint32_t d = 0; d < 64; ++d)
      for (int p = 0; p < 4; ++p) t[p][uint8_t(alphabet[d])] = d << (6 * (3 - p));
    for (int p = 0; p < 4; ++p) t[p][uint8_t('=')] = 0;
  }
};
const Tables kTables;

// 4 MiB of text per parallel piece (whole quanta).
constexpr size_t kFastBlock = size_t(4) << 20;

// Decodes `len` characters (a multiple of 4) into len / 4 * 3 bytes through the tables; false when a
// character is outside the alphabet and '='.
bool decode_scalar(const char* in, size_t len, uint8_t* out) {
  const auto& T = kTables.t;
  uint32_t bad = 0;
  for (size_t i = 0; i < len; i += 4, out += 3) {
    const auto* q = reinterpret_cast<const uint8_t*>(in + i);
    const uint32_t v = T[0][q[0]] | T[1][q[1]] | T[2][q[2]] | T[3][q[3]];
    bad |= v;
    out[0] = uint8_t(v >> 16);
    out[1] = uint8_t(v >> 8);
    out[2] = uint8_t(v);
  }
  return (bad & 0x80000000u) == 0;
}

#if defined(__x86_64__)
// 32 characters → 24 bytes at a time with AVX2: each character's 6-bit value is the character plus the
// offset of its range (A–Z −65, a–z −71, 0–9 +4, '+' +19, '/' +16); four values are packed into 24
// bits by two multiply-adds, and the three bytes of each 32-bit lane picked out in order. A block that
// holds anything else ('=', or a character outside the alphabet) goes through the tables, which decide.
// Bytes of c in [lo, hi] (signed compares: bytes from 0x80 up are below every range here).
__attribute__((target("avx2"))) inline __m256i in_range(__m256i c, char lo, char hi) {
  return _mm256_and_si256(_mm256_cmpgt_epi8(c, _mm256_set1_epi8(char(lo - 1))),
                          _mm256_cmpgt_epi8(_mm256_set1_epi8(char(hi + 1)), c));
}

__attribute__((target("avx2"))) bool decode_avx2(const char* in, size_t len, uint8_t* out) {
  bool ok = true;
  size_t i = 0;
  const __m256i pack_ab = _mm256_set1_epi32(0x01400140), pack_abcd = _mm256_set1_epi32(0x00011000);
  const __m256i order = _mm256_setr_epi8(2, 1, 0, 6, 5, 4, 10, 9, 8, 14, 13, 12, -1, -1, -1, -1,  //
                                         2, 1, 0, 6, 5, 4, 10, 9, 8, 14, 13, 12, -1, -1, -1, -1);
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 4, 5, 6, 7, 7);
  for (; i + 32 <= len; i += 32, out += 24) {
    const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(in + i));
    const __m256i upper = in_range(c, 'A', 'Z'), lower = in_range(c, 'a', 'z'), digit = in_range(c, '0', '9');
    const __m256i plus = _mm256_cmpeq_epi8(c, _mm256_set1_epi8('+'));
    const __m256i slash = _mm256_cmpeq_epi8(c, _mm256_set1_epi8('/'));
    const __m256i valid =
        _mm256_or_si256(_mm256_or_si256(upper, lower), _mm256_or_si256(digit, _mm256_or_si256(plus, slash)));
    if (_mm256_movemask_epi8(valid) != -1) {
      ok &= decode_scalar(in + i, 32, out);
      continue;
    }
    __m256i offset = _mm256_and_si256(upper, _mm256_set1_epi8(-65));
    offset = _mm256_or_si256(offset, _mm256_and_si256(lower, _mm256_set1_epi8(-71)));
    offset = _mm256_or_si256(offset, _mm256_and_si256(digit, _mm256_set1_epi8(4)));
    offset = _mm256_or_si256(offset, _mm256_and_si256(plus, _mm256_set1_epi8(19)));
    offset = _mm256_or_si256(offset, _mm256_and_si256(slash, _mm256_set1_epi8(16)));
    const __m256i v = _mm256_add_epi8(c, offset);
    // Per 32-bit lane: (a << 6 | b, c << 6 | d) as 16-bit halves, then a << 18 | b << 12 | c << 6 | d.
    const __m256i word = _mm256_madd_epi16(_mm256_maddubs_epi16(v, pack_ab), pack_abcd);
    const __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_shuffle_epi8(word, order), lanes);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm256_castsi256_si128(bytes));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(out + 16), _mm256_extracti128_si256(bytes, 1));
  }
  return decode_scalar(in + i, len - i, out) && ok;
}

const bool kHaveAvx2 = [] {
  __builtin_cpu_init();  // static initializers may run before the compiler's own CPU probe
  return __builtin_cpu_supports("avx2") != 0;
}();
#endif

// Decodes `len` characters (a multiple of 4) into len / 4 * 3 bytes; false when a character is outside
// the alphabet and '='.
bool decode_plain(const char* in, size_t len, uint8_t* out) {
#if defined(__x86_64__)
  if (kHaveAvx2) return decode_avx2(in, len, out);
#endif
  return decode_scalar(in, len, out);
}
}  // namespace

bool base64_decode_fast(std::string_view text, uint8_t* out) {
  if (text.size() % 4 != 0) return false;
  const int64_t blocks = int64_t((text.size() + kFastBlock - 1) / kFastBlock);
  int ok = 1;
#pragma omp parallel for schedule(static) reduction(& : ok)
  for (int64_t b = 0; b < blocks; ++b) {
    const size_t at = size_t(b) * kFastBlock, len = std::min(kFastBlock, text.size() - at);
    ok &= decode_plain(text.data() + at, len, out + at / 4 * 3) ? 1 : 0;
  }
  return ok != 0;
}

bool base64_decode_range(std::string_view text, size_t from, size_t n, uint8_t* out) {
  bool ok = true;
  // A quantum that holds only some of the bytes wanted goes through a 3-byte buffer.
  auto partial = [&](size_t pos, size_t take) {
    uint8_t q[3];
    ok &= decode_plain(text.data() + pos / 3 * 4, 4, q);
    std::memcpy(out, q + pos % 3, take);
    out += take;
  };
  if (from % 3 != 0 && n > 0) {
    const size_t take = std::min(3 - from % 3, n);
    partial(from, take);
    from += take;
    n -= take;
  }
  const size_t whole = n / 3;
  ok &= decode_plain(text.data() + from / 3 * 4, whole * 4, out);
  out += whole * 3;
  from += whole * 3;
  n -= whole * 3;
  if (n > 0) partial(from, n);
  return ok;
}

bool base64_decode_into(std::string_view text, uint8_t* out, std::string& error) {
  error.clear();
  // Text of the alphabet and '=' only decodes the same through the tables; anything else (EVP trims
  // whitespace and '-' at a block's ends, and names the error) takes EVP's path.
  if (base64_decode_fast(text, out)) return true;
  const int64_t blocks = int64_t((text.size() + kTextBlock - 1) / kTextBlock);
  std::atomic<int64_t> bad{-1};  // lowest failing block
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < blocks; ++b) {
    const size_t at = size_t(b) * kTextBlock, len = std::min(kTextBlock, text.size() - at);
    const int n =
        EVP_DecodeBlock(out + at / 4 * 3, reinterpret_cast<const unsigned char*>(text.data() + at), int(len));
    if (n < 0) {
      int64_t cur = bad.load();
      while ((cur < 0 || b < cur) && !bad.compare_exchange_weak(cur, b)) {
      }
    }
  }
  if (bad.load() < 0) return true;
  // EVP says only "invalid": find the character for the message.
  const size_t from = size_t(bad.load()) * kTextBlock, to = std::min(text.size(), from + kTextBlock);
  for (size_t i = from; i < to; ++i)
    if (!is_b64(text[i]) && !(text[i] == '=' && i + 2 >= text.size())) {
      error = fmt::format("not base64: byte {} at offset {}", int(uint8_t(text[i])), i);
      return false;
    }
  error = fmt::format("not base64 (block at offset {})", from);
  return false;
}

std::vector<uint8_t> base64_decode(std::string_view text, std::string& error) {
  const size_t n = base64_decoded_size(text, error);
  if (!error.empty()) return {};
  std::vector<uint8_t> out(n + 2);
  if (!base64_decode_into(text, out.data(), error)) return {};
  out.resize(n);
  return out;
}

std::string base64_encode(std::span<const uint8_t> bytes) {
  std::string out((bytes.size() + 2) / 3 * 4, '\0');
  const int64_t blocks = int64_t((bytes.size() + kByteBlock - 1) / kByteBlock);
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < blocks; ++b) {
    const size_t at = size_t(b) * kByteBlock, len = std::min(kByteBlock, bytes.size() - at);
    // EVP_EncodeBlock NUL-terminates its output: each block goes through its own buffer so that the
    // terminator cannot land on the first character of the next block while another thread writes it.
    std::vector<unsigned char> tmp((len + 2) / 3 * 4 + 1);
    const int n = EVP_EncodeBlock(tmp.data(), bytes.data() + at, int(len));
    std::copy(tmp.data(), tmp.data() + n, out.data() + at / 3 * 4);
  }
  return out;
}

}  // namespace dsv4
