#include "adapters/base64.h"

#include <fmt/core.h>
#include <openssl/evp.h>

#include <algorithm>
#include <atomic>

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

// Decodes `len` characters (a multiple of 4) into len / 4 * 3 bytes; false when a character is outside
// the alphabet and '='.
bool decode_plain(const char* in, size_t len, uint8_t* out) {
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
