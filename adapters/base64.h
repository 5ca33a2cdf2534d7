// Base64 (RFC 4648, standard alphabet, '=' padding, no line breaks) through OpenSSL's
// EVP_EncodeBlock / EVP_DecodeBlock: SGLang returns the R3 buffers as such strings. The work is cut into
// blocks so that buffers beyond EVP's int lengths (a Flash indexer buffer of 32k tokens is 1.4 GB) go
// through, on several threads.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace dsv4 {

// Decoded bytes; nullopt-like failure is reported through `error` (empty on success) so the caller can
// name the request and field: "not base64: character 'x' at offset N", "length N is not a multiple of 4".
std::vector<uint8_t> base64_decode(std::string_view text, std::string& error);
std::string base64_encode(std::span<const uint8_t> bytes);

}  // namespace dsv4
