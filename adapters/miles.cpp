#include "adapters/miles.h"

#include <fmt/core.h>
#include <zip.h>

#include <algorithm>
#include <filesystem>
#include <functional>
#include <fstream>
#include <map>
#include <memory>
#include <optional>

#include "adapters/npy.h"
#include "model/error.h"

namespace dsv4 {

namespace fs = std::filesystem;

namespace {

constexpr const char* kMembers[] = {"tokens", "rollout_routed_experts", "rollout_indexer_topk",
                                    "response_length", "rollout_log_probs"};

bool is_sample_dir(const fs::path& p) {
  return fs::is_directory(p) && fs::is_regular_file(p / "tokens.npy");
}

std::string zip_message(int code) {
  zip_error_t e;
  zip_error_init_with_code(&e, code);
  std::string s = zip_error_strerror(&e);
  zip_error_fini(&e);
  return s;
}

// The named arrays of a sample (those of kMembers that are there).
std::map<std::string, NpyArray> read_npz(const std::string& path) {
  int code = 0;
  std::unique_ptr<zip_t, decltype(&zip_discard)> z(zip_open(path.c_str(), ZIP_RDONLY, &code), &zip_discard);
  if (!z) throw InputError(fmt::format("{}: not a readable .npz (zip) file: {}", path, zip_message(code)));
  std::map<std::string, NpyArray> out;
  for (const char* name : kMembers) {
    const std::string member = std::string(name) + ".npy";
    const zip_int64_t idx = zip_name_locate(z.get(), member.c_str(), 0);
    if (idx < 0) continue;
    zip_stat_t st;
    if (zip_stat_index(z.get(), zip_uint64_t(idx), 0, &st) != 0 || !(st.valid & ZIP_STAT_SIZE))
      throw InputError(fmt::format("{}: {}: cannot read its size: {}", path, member, zip_strerror(z.get())));
    std::vector<uint8_t> bytes(st.size);
    std::unique_ptr<zip_file_t, decltype(&zip_fclose)> f(zip_fopen_index(z.get(), zip_uint64_t(idx), 0),
                                                         &zip_fclose);
    if (!f) throw InputError(fmt::format("{}: {}: cannot open: {}", path, member, zip_strerror(z.get())));
    zip_uint64_t got = 0;
    while (got < st.size) {
      const zip_int64_t n = zip_fread(f.get(), bytes.data() + got, st.size - got);
      if (n <= 0)
        throw InputError(fmt::format("{}: {}: read failed after {} of {} bytes: {}", path, member, got,
                                     st.size, zip_file_strerror(f.get())));
      got += zip_uint64_t(n);
    }
    const std::string what = fmt::format("{}: {}", path, member);
    out.emplace(name, npy_parse(bytes, what));
  }
  return out;
}

std::map<std::string, NpyArray> read_npy_dir(const fs::path& dir) {
  std::map<std::string, NpyArray> out;
  for (const char* name : kMembers) {
    const fs::path p = dir / (std::string(name) + ".npy");
    if (!fs::exists(p)) continue;
    std::ifstream f(p, std::ios::binary);
    if (!f) throw InputError(fmt::format("{}: cannot open", p.string()));
    std::vector<uint8_t> bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    out.emplace(name, npy_parse(bytes, p.string()));
  }
  return out;
}

}  // namespace

std::vector<std::string> miles_sample_paths(const std::vector<std::string>& inputs) {
  std::vector<std::string> out;
  for (const std::string& in : inputs) {
    const fs::path p(in);
    if (fs::is_regular_file(p) && p.extension() == ".npz") {
      out.push_back(in);
    } else if (is_sample_dir(p)) {
      out.push_back(in);
    } else if (fs::is_directory(p)) {
      std::vector<std::string> found;
      for (const auto& e : fs::directory_iterator(p))
        if ((e.is_regular_file() && e.path().extension() == ".npz") || is_sample_dir(e.path()))
          found.push_back(e.path().string());
      if (found.empty())
        throw InputError(
            fmt::format("{}: no miles samples here (no .npz files, no directories with tokens.npy)", in));
      std::sort(found.begin(), found.end());
      out.insert(out.end(), found.begin(), found.end());
    } else if (fs::is_regular_file(p) && p.extension() == ".pt") {
      throw InputError(fmt::format(
          "{}: a PyTorch pickle (miles' --save-debug-rollout-data dump); the dsv4 Python package reads "
          "those without running their code: python3 -m dsv4 import miles {} (the same options)",
          in, in));
    } else {
      throw InputError(fmt::format("{}: not a miles sample (an .npz file or a directory of .npy files)", in));
    }
  }
  return out;
}

R3Request miles_request(std::map<std::string, NpyArray> arrays, R3Origin origin,
                        const std::function<std::string(const char*)>& what, std::vector<std::string>& notes) {
  const std::string where = origin.describe();
  R3Request q;
  q.origin = std::move(origin);
  auto tok = arrays.find("tokens");
  if (tok == arrays.end()) throw InputError(fmt::format("{}: no tokens array", where));
  if (tok->second.shape.size() != 1)
    throw InputError(
        fmt::format("{}: tokens has {} dimensions, expected 1", what("tokens"), tok->second.shape.size()));
  q.tokens = npy_int32(tok->second, what("tokens"), /*widen_i8=*/true);
  if (auto r = arrays.find("response_length"); r != arrays.end()) {
    const int64_t R = npy_scalar_int(r->second, what("response_length"));
    if (R < 0 || R > int64_t(q.tokens.size()))
      throw InputError(fmt::format("{}: {} is not within [0, {}] (the tokens)", what("response_length"), R,
                                   q.tokens.size()));
    q.prompt_length = int64_t(q.tokens.size()) - R;
  }
  auto take = [&](const char* name, R3Buffer& b) {
    auto it = arrays.find(name);
    if (it == arrays.end()) return;
    b.present = true;
    b.shape = it->second.shape;
    b.words = npy_int32(it->second, what(name));
    it->second.data = {};
  };
  take("rollout_routed_experts", q.routed_experts);
  take("rollout_indexer_topk", q.indexer_topk);
  if (!q.routed_experts.present && !q.indexer_topk.present)
    throw InputError(fmt::format("{}: neither rollout_routed_experts nor rollout_indexer_topk", where));
  if (arrays.count("rollout_log_probs"))
    notes.push_back(
        fmt::format("{}: rollout_log_probs cover the response only; not stored, since a trace holds "
                    "log-probs for every position or none",
                    where));
  return q;
}

R3Request miles_sample(const std::string& path, int64_t index, std::vector<std::string>& notes) {
  const bool dir = fs::is_directory(path);
  auto what = [&](const char* name) {
    return dir ? (fs::path(path) / (std::string(name) + ".npy")).string()
               : fmt::format("{}: {}.npy", path, name);
  };
  return miles_request(dir ? read_npy_dir(path) : read_npz(path), R3Origin{path, "", index}, what, notes);
}

void miles_write_npz(const std::string& path, const std::vector<int32_t>& tokens, int64_t prompt_length,
                     const R3EngineBuffers& b) {
  if (fs::exists(path)) throw InputError(fmt::format("{}: exists; not overwritten", path));
  int code = 0;
  zip_t* z = zip_open(path.c_str(), ZIP_CREATE | ZIP_EXCL, &code);
  if (!z) throw InputError(fmt::format("{}: cannot create: {}", path, zip_message(code)));
  // libzip reads the sources at zip_close(), so the encoded arrays live until then.
  std::vector<std::pair<std::string, std::vector<uint8_t>>> members;
  members.emplace_back("tokens.npy", npy_encode_int32(tokens, {int64_t(tokens.size())}));
  if (prompt_length >= 0) {
    const int64_t R = int64_t(tokens.size()) - prompt_length;
    members.emplace_back("response_length.npy", npy_encode_int64(std::span<const int64_t>(&R, 1), {}));
  }
  if (b.num_layers > 0)
    members.emplace_back("rollout_routed_experts.npy",
                         npy_encode_int32(b.routed_experts, {b.rows, b.num_layers, b.k}));
  if (b.indexer_num_layers > 0)
    members.emplace_back("rollout_indexer_topk.npy",
                         npy_encode_int32(b.indexer_topk, {b.rows, b.indexer_num_layers, b.width}));
  auto fail = [&](const std::string& what) {
    const std::string msg = fmt::format("{}: {}: {}", path, what, zip_strerror(z));
    zip_discard(z);
    fs::remove(path);
    throw InputError(msg);
  };
  for (auto& [name, bytes] : members) {
    zip_source_t* src = zip_source_buffer(z, bytes.data(), bytes.size(), 0);
    if (!src) fail("cannot add " + name);
    const zip_int64_t idx = zip_file_add(z, name.c_str(), src, ZIP_FL_ENC_UTF_8);
    if (idx < 0) {
      zip_source_free(src);
      fail("cannot add " + name);
    }
    // Stored, not deflated: numpy.load reads either, and the ids would cost time to deflate for a file
    // that is read once.
    if (zip_set_file_compression(z, zip_uint64_t(idx), ZIP_CM_STORE, 0) != 0) fail("cannot store " + name);
  }
  if (zip_close(z) != 0) fail("cannot write");
}

}  // namespace dsv4
