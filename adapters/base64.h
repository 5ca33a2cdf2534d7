// Base64 (RFC 4648, standard alphabet, '=' padding, no line breaks): SGLang returns the R3 buffers as
// such strings. Decoding: a table decoder for text of the alphabet only, else OpenSSL's EVP_DecodeBlock;
// encoding: EVP_EncodeBlock. The work is cut into blocks so that buffers beyond EVP's int lengths (a Flash
// indexer buffer of 32k tokens is 1.4 GB) go through, on several threads.
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
// The same in two steps, so that the caller can decode straight into its own storage (an int32 buffer
// of 1.4 GB is then allocated once): the decoded size (0 with `error` set for a length that is not a
// multiple of 4), then the decoding into `out`, which must hold base64_decoded_size() + 2 bytes (EVP
// writes whole 3-byte quanta, padding included). Returns false with `error` set for invalid text.
size_t base64_decoded_size(std::string_view text, std::string& error);
bool base64_decode_into(std::string_view text, uint8_t* out, std::string& error);
// The fast path of base64_decode_into: true when `text` (a multiple of 4 characters) holds only the
// alphabet and '=', decoded into `out` exactly as base64_decode_into would; false otherwise (`out` then
// holds garbage). Table-driven, in 4 MiB pieces on several threads.
bool base64_decode_fast(std::string_view text, uint8_t* out);
// Bytes [from, from + n) of the data `text` encodes (a multiple of 4 characters; from + n at most
// base64_decoded_size), decoded into out[0, n): a large buffer read a piece at a time, never decoded
// whole. False when a character of the quanta holding them is outside the alphabet and '=' (out then
// holds garbage; base64_decode_into names the character).
bool base64_decode_range(std::string_view text, size_t from, size_t n, uint8_t* out);
std::string base64_encode(std::span<const uint8_t> bytes);

}  // namespace dsv4
