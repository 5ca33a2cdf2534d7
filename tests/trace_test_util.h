// Shared test helpers for GPU kernel records without a GPU: made-up launches, and a trace of the
// tiny preset whose steps hold them (written through the library as a CUDA recording would).
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "capture/cupti.h"
#include "capture/trace_writer.h"
#include "model/forward.h"
#include "model/tokens.h"
#include "model/weights.h"

namespace dsv4::test {

struct Launch {
  std::string name;
  std::array<int32_t, 3> grid{1, 1, 1};
  int64_t shared_bytes = 0;
  int32_t registers = 0;
  int64_t start_ns = 0, ns = 0;
};

// Available records of the given launches in order: block (256, 1, 1), stream 13, correlation ids
// 100, 101, ...
inline KernelRecords kernel_records(const std::vector<Launch>& launches) {
  KernelRecords r;
  r.available = true;
  for (const Launch& l : launches) {
    KernelRecord k;
    k.name = l.name;
    k.grid = l.grid;
    k.block = {256, 1, 1};
    k.shared_bytes = l.shared_bytes;
    k.registers = l.registers;
    k.stream = 13;
    k.start_ns = l.start_ns;
    k.end_ns = l.start_ns + l.ns;
    k.correlation = 100 + int64_t(r.kernels.size());
    r.kernels.push_back(k);
  }
  return r;
}

// Writes `path` with one step per entry of `steps`, each a forward of `w` over `tokens` with capture
// 'decisions', and the entry's kernel records (nullopt: none given, the step says "not recorded").
inline void write_trace_with_kernels(const std::string& path, const Weights& w,
                                     const std::vector<int32_t>& tokens,
                                     const std::vector<std::optional<KernelRecords>>& steps) {
  TraceWriter::Options opt;
  opt.policy = CapturePolicy::parse("decisions");
  auto wr = TraceWriter::create(path, w.config(), make_trace_header(w), opt);
  for (const auto& k : steps) {
    StepSpec spec;
    spec.seqs = {tokens};
    RunOptions ro;
    ro.observer = &wr->begin_step(spec);
    const ForwardResult fr = forward(w, spec.seqs, ro);
    if (k) wr->set_kernel_records(*k);
    wr->end_step(fr);
  }
  wr->close();
}

}  // namespace dsv4::test
