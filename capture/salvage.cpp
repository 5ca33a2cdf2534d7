#include "capture/salvage.h"

#include <fmt/format.h>
#include <hdf5.h>

#include <algorithm>
#include <filesystem>
#include <optional>
#include <vector>

#include "capture/env.h"
#include "capture/errors.h"
#include "capture/h5.h"
#include "capture/layout.h"
#include "capture/trace_open.h"
#include "capture/trace_seal.h"
#include "capture/validate.h"

namespace dsv4 {
namespace {

using namespace trace_layout;  // the format's names

// Copies every attribute of `src` onto `dst` by value (same file type and dataspace).
void copy_attributes(const h5::Object& src, const h5::Object& dst) {
  struct Ctx {
    hid_t dst;
    std::string failed;
  } ctx{dst.get(), ""};
  auto copy_one = [](hid_t loc, const char* name, const H5A_info_t*, void* data) -> herr_t {
    auto& c = *static_cast<Ctx*>(data);
    h5::Id a(H5Aopen(loc, name, H5P_DEFAULT));
    h5::Id ftype(a.valid() ? H5Aget_type(a.get()) : H5I_INVALID_HID);
    h5::Id space(a.valid() ? H5Aget_space(a.get()) : H5I_INVALID_HID);
    h5::Id mtype(ftype.valid() ? H5Tget_native_type(ftype.get(), H5T_DIR_ASCEND) : H5I_INVALID_HID);
    const hssize_t n = space.valid() ? H5Sget_simple_extent_npoints(space.get()) : -1;
    if (!mtype.valid() || n < 0) {
      c.failed = name;
      return -1;
    }
    std::vector<uint8_t> buf(size_t(std::max<hssize_t>(n, 1)) * H5Tget_size(mtype.get()));
    if (H5Aread(a.get(), mtype.get(), buf.data()) < 0) {
      c.failed = name;
      return -1;
    }
    h5::Id b(H5Acreate2(c.dst, name, ftype.get(), space.get(), H5P_DEFAULT, H5P_DEFAULT));
    const bool ok = b.valid() && H5Awrite(b.get(), mtype.get(), buf.data()) >= 0;
    H5Dvlen_reclaim(mtype.get(), space.get(), H5P_DEFAULT, buf.data());  // variable-length strings
    if (!ok) c.failed = name;
    return ok ? 0 : -1;
  };
  hsize_t idx = 0;
  if (H5Aiterate2(src.get(), H5_INDEX_NAME, H5_ITER_INC, &idx, copy_one, &ctx) < 0)
    h5::fail(dst.file, dst.path,
             fmt::format("cannot copy attribute '{}' from {}:{}", ctx.failed, src.file, src.path));
}

// Copies the object `name` of `src` (a group with everything below it) to `dst_parent/dst_name`.
// Datasets keep their filters and stored chunks. Attributes are copied one by one rather than by
// H5Ocopy: HDF5 1.10 crashes copying an object whose attributes are in dense storage (more than 8,
// as /meta/env has) when they include variable-length strings.
void copy_tree(const h5::Object& src, const std::string& name, const h5::Object& dst_parent,
               const std::string& dst_name) {
  h5::Id ocpypl(
      h5::check(H5Pcreate(H5P_OBJECT_COPY), dst_parent, "cannot create an object-copy property list"));
  h5::check(H5Pset_copy_object(ocpypl.get(), H5O_COPY_WITHOUT_ATTR_FLAG), dst_parent,
            "cannot set the object-copy flags");
  h5::check(H5Ocopy(src.get(), name.c_str(), dst_parent.get(), dst_name.c_str(), ocpypl.get(), H5P_DEFAULT),
            dst_parent, fmt::format("cannot copy {} from {}", src.child(name), src.file));
  const h5::Object from = h5::open(src, name), to = h5::open(dst_parent, dst_name);
  std::vector<std::string> below;
  auto collect = [](hid_t, const char* n, const H5O_info_t*, void* data) -> herr_t {
    if (std::string(n) != ".") static_cast<std::vector<std::string>*>(data)->emplace_back(n);
    return 0;
  };
  h5::check(H5Ovisit2(from.get(), H5_INDEX_NAME, H5_ITER_INC, collect, &below, H5O_INFO_BASIC), from,
            "cannot list the objects");
  copy_attributes(from, to);
  for (const std::string& rel : below) copy_attributes(h5::open(from, rel), h5::open(to, rel));
}

}  // namespace

SalvageResult salvage_trace(const std::string& in, const std::string& out) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (fs::exists(out, ec))
    throw InputError(fmt::format(
        "{}: already exists; salvage writes a new trace (remove it or choose another name)", out));
  if (!fs::exists(in, ec)) throw TraceError(fmt::format("{}: no such file", in));
  classify_with_reader(in);

  // What validate finds decides what is copied: a step is copied only when it is complete and has no
  // problem; /meta and the root must have none (they are copied as they are).
  const ValidateReport v = validate_trace(in);
  if (!v.readable) throw TraceError(v.problems.empty() ? in + ": cannot be read" : v.problems.front().what);
  for (const TraceProblem& p : v.problems) {
    if (p.step >= 0 || p.where.rfind("/steps", 0) == 0) continue;
    if (p.where == "file" && v.writer_flag) continue;  // what salvage is for
    if (p.where == "seal") continue;                    // too: the steps' own checks decide
    throw TraceCorrupt(fmt::format("{}: {}: {}; salvage copies /meta as it is and cannot repair this", in,
                                   p.where, p.what));
  }
  SalvageResult result;
  result.seal_problem = seal_problem(v.seal);
  for (const StepState& st : v.steps) {
    if (st.complete && st.problems == 0) {
      result.copied.push_back(st.index);
      continue;
    }
    std::string reason = st.complete ? "damaged" : "incomplete";
    for (const TraceProblem& p : v.problems)
      if (p.step == st.index) {
        reason = p.where + ": " + p.what;
        break;
      }
    result.skipped.push_back({st.index, reason});
  }
  if (result.copied.empty()) {
    std::string why;
    for (const auto& k : result.skipped) why += fmt::format("; step {}: {}", k.step, k.reason);
    throw TraceIncomplete(fmt::format("{}: no intact step to salvage ({} step group{}{})", in, v.steps.size(),
                                      v.steps.size() == 1 ? "" : "s", why));
  }

  OpenedTrace src = open_for_reading(in);
  const int version = trace_layout::check_trace_root(src.file, in);
  // Written under NAME.incomplete and renamed at the end, as the recorder does: a file named `out`
  // is whole.
  const std::string tmp = out + ".incomplete";
  try {
    h5::Id fapl = h5::file_access(true, false);
    h5::Object dst = h5::create_file(tmp, fapl.get(), kSealBlockBytes);
    h5::write_attr(dst, kFormat, std::string(kFormatValue));
    // The steps keep their layout, so the copy keeps the source's version (readers of that version
    // read the copy too).
    h5::write_attr(dst, kFormatVersion, int32_t(std::max(version, kPrefillFormatVersion)));
    h5::write_attr(dst, kProducer,
                   h5::has_attr(src.file, kProducer) ? h5::read_attr_string(src.file, kProducer) : "unknown");
    h5::write_attr(dst, kCreated, utc_now_iso8601());
    h5::write_attr(dst, kSalvagedFrom, in);
    copy_tree(src.file, kMeta, dst, kMeta);
    // A joined trace's copy holds its sequences itself: no parts, and each sequence link replaced by a
    // copy of the group it points to.
    if (h5::exists(dst, kMetaParts) && H5Ldelete(dst.get(), kMetaParts, H5P_DEFAULT) < 0)
      dst.fail(std::string("cannot remove ") + kMetaParts);
    {
      const h5::Object steps = h5::create_group(dst, kSteps);
      for (size_t i = 0; i < result.copied.size(); ++i) {
        const std::string from = step_path(result.copied[i]).substr(1);
        copy_tree(src.file, from, steps, step_name(int(i)));
        const h5::Object step_src = h5::open(src.file, from), step_dst = h5::open(steps, step_name(int(i)));
        for (const std::string& name : h5::children(step_dst)) {
          if (!h5::external_link(step_dst, name)) continue;
          if (H5Ldelete(step_dst.get(), name.c_str(), H5P_DEFAULT) < 0)
            step_dst.fail(fmt::format("cannot remove the link {}", name));
          copy_tree(step_src, name, step_dst, name);
        }
      }
    }
    h5::close_file(dst);
    seal_trace(tmp);
    const ValidateReport check = validate_trace(tmp);
    if (!check.ok())
      throw TraceCorrupt(fmt::format("{}: the copy does not validate ({}: {}); nothing was written", in,
                                     check.problems.front().where, check.problems.front().what));
  } catch (...) {
    fs::remove(tmp, ec);
    throw;
  }
  h5::close_file(src.file);
  fs::rename(tmp, out, ec);
  if (ec) throw Error(fmt::format("{}: cannot rename to {}: {}", tmp, out, ec.message()));
  return result;
}

}  // namespace dsv4
