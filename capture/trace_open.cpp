#include "capture/trace_open.h"

#include <fmt/format.h>
#include <hdf5.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "capture/errors.h"
#include "capture/layout.h"
#include "capture/trace_reader.h"

namespace dsv4 {

using namespace trace_layout;  // the format's names

WriterMarks writer_marks(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw TraceError(fmt::format("{}: cannot open the file for reading", path));
  f.seekg(0, std::ios::end);
  const auto size = static_cast<long long>(f.tellg());
  WriterMarks m;
  // The superblock is at 0 or after a user block of 512, 1024, 2048, ... bytes.
  for (long long at = 0; at + 12 <= size; at = at == 0 ? 512 : at * 2) {
    unsigned char head[12];
    f.seekg(at);
    if (!f.read(reinterpret_cast<char*>(head), sizeof head)) break;
    if (std::memcmp(head, h5::kSignature, 8) != 0) continue;
    m.hdf5 = true;
    m.version = head[8];
    // Versions 2 and 3: signature, version, size of offsets, size of lengths, file consistency flags
    // (bit 0: open for writing, bit 2: open for SWMR writing).
    if (m.version >= 2) {
      m.write = (head[11] & 0x01) != 0;
      m.swmr = (head[11] & 0x04) != 0;
    }
    break;
  }
  return m;
}

namespace {

// The HDF5 open of open_for_reading(), once the seal was checked.
OpenedTrace open_hdf5_bounded(const std::string& path, const WriterMarks& marks, bool clear_flags) {
  // Without POSIX locks, like the writer: HDF5 refuses to open one file twice in a process with
  // different locking settings, and the superblock's flags already keep readers and the writer apart.
  h5::Id fapl = h5::file_access(false, false);
  if (marks.swmr) {
    const h5::Object at{h5::Id(), path, ""};
    h5::check(H5Pset_metadata_read_attempts(fapl.get(), kSwmrReadAttempts), at,
              "cannot set the metadata read attempts");
    h5::Object f{h5::Id(H5Fopen(path.c_str(), H5F_ACC_RDONLY | H5F_ACC_SWMR_READ, fapl.get())), path, "/"};
    if (f.id.valid()) return OpenedTrace{std::move(f), false, {}, {}};
    // A flipped flag on a closed file: read it as a closed file below.
  }
  if (!marks.write || marks.swmr) {
    h5::Object f{h5::Id(H5Fopen(path.c_str(), H5F_ACC_RDONLY, fapl.get())), path, "/"};
    if (f.id.valid()) return OpenedTrace{std::move(f), false, {}, {}};
    if (!marks.write)
      h5::fail(path, "", "cannot open the file as HDF5 (damaged or truncated; `dsv4 trace validate` tells more)");
  }
  if (!clear_flags)
    throw TraceError(fmt::format(
        "{}: the file is marked as open for writing: its writer is still running or died while creating a "
        "step; `dsv4 trace salvage {} --out NEW.h5` copies its complete steps into a new trace",
        path, path));
  hbool_t yes = true;
  if (H5Pset(fapl.get(), "clear_status_flags", &yes) < 0)
    h5::fail(path, "", "the file is marked as open for writing and this HDF5 cannot ignore the mark");
  h5::Object f{h5::Id(H5Fopen(path.c_str(), H5F_ACC_RDONLY, fapl.get())), path, "/"};
  if (!f.id.valid()) h5::fail(path, "", "cannot open the file as HDF5 (damaged, or open for writing)");
  return OpenedTrace{std::move(f), true, {}, {}};
}

}  // namespace

OpenedTrace open_for_reading(const std::string& path, bool clear_flags, SealPolicy seal_policy) {
  h5::quiet();
  const SealCheck seal = check_seal(path);
  if (seal_policy == SealPolicy::enforce) throw_seal_problem(path, seal);
  const WriterMarks marks = writer_marks(path);
  if (!marks.hdf5) throw NotATrace(fmt::format("{}: not an HDF5 file", path));
  OpenedTrace t = open_hdf5_bounded(path, marks, clear_flags);
  t.seal = seal;
  if (!h5::exists(t.file, kMetaParts)) return t;
  namespace fs = std::filesystem;
  std::vector<std::string> names;
  {
    const h5::Object list = h5::open(t.file, kMetaParts);
    if (H5Iget_type(list.get()) != H5I_DATASET) list.fail("not a dataset");
    names = h5::read_strings(list);
  }  // closed: the file may be opened again below, which HDF5 does only once nothing of it is open
  WriterMarks need = marks;
  int rank = 0;
  for (const std::string& name : names) {
    if (name.empty() || name.find('/') != std::string::npos || name == "." || name == "..")
      h5::fail(path, std::string("/") + kMetaParts,
               fmt::format("part {} is named '{}', not a file name beside the joined trace", rank, name));
    TracePart p;
    p.name = name;
    p.path = (fs::path(path).parent_path() / name).string();
    std::error_code ec;
    if (!fs::exists(p.path, ec))
      throw TraceError(fmt::format("{}: part {} ({}) is missing: a joined trace reads its sequences from its ranks' "
                                   "traces, which must lie beside it",
                                   path, rank, p.path));
    p.seal = check_seal(p.path);
    if (seal_policy == SealPolicy::enforce) throw_seal_problem(p.path, p.seal);
    p.marks = writer_marks(p.path);
    if (!p.marks.hdf5) throw NotATrace(fmt::format("{}: part {} of {}: not an HDF5 file", p.path, rank, path));
    if (p.marks.write && !p.marks.swmr && !clear_flags)
      throw TraceError(fmt::format(
          "{}: part {} of {} is marked as open for writing: its writer is still running or died while creating a "
          "step; `dsv4 trace salvage {} --out NEW.h5` copies the complete steps into a new trace",
          p.path, rank, path, path));
    need.write = need.write || p.marks.write;
    need.swmr = need.swmr || p.marks.swmr;
    t.parts.push_back(std::move(p));
    ++rank;
  }
  if (need.write != marks.write || need.swmr != marks.swmr) {
    std::vector<TracePart> parts = std::move(t.parts);
    t.file = h5::Object{};
    t = open_hdf5_bounded(path, need, clear_flags);
    t.seal = seal;
    t.writer_flag = t.writer_flag && marks.write;
    t.parts = std::move(parts);
  }
  return t;
}

void classify_with_reader(const std::string& path) {
  try {
    TraceReader::open(path);
  } catch (const NotATrace&) {
    throw;
  } catch (const UnsupportedTraceVersion&) {
    throw;
  } catch (const std::exception&) {
  }
}

std::optional<int> step_status(const h5::Object& step) {
  try {
    if (!h5::exists(step, kStatus)) return std::nullopt;
    const auto v = h5::read<uint8_t>(h5::open(step, kStatus));
    if (v.size() != 1) return std::nullopt;
    return int(v[0]);
  } catch (const std::exception&) {
    return std::nullopt;
  }
}

bool is_step_name(const std::string& name) {
  return name.size() == 6 &&
         std::all_of(name.begin(), name.end(), [](char c) { return c >= '0' && c <= '9'; });
}

}  // namespace dsv4
