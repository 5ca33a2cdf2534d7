// The environment fingerprint recorded in a trace and compared by replay: host, CPU, GPU stack,
// compiler and flags, build id, library versions. Keys are those of traces/FORMAT.md /meta/env.
#pragma once

#include <map>
#include <string>

namespace dsv4 {

using EnvFingerprint = std::map<std::string, std::string>;

// The key of a parallel run's layout in words ("expert parallel over 2 MPI ranks": parallel_layout in
// model/communicator.h); a trace recorded in one process has none.
inline constexpr char kEnvParallel[] = "parallel";
// A rank's own trace of a run with the sequences split among the ranks (capture/joined.h): "1 of 2".
inline constexpr char kEnvRank[] = "rank";
// The layout a trace was recorded with: its "parallel" value, else "one process".
inline std::string recorded_layout(const EnvFingerprint& env) {
  const auto it = env.find(kEnvParallel);
  return it == env.end() ? "one process" : it->second;
}
// The architecture of the GPU that would run a forward ("sm_90"), "none" without one: what makes a
// step in fast numerics reproducible (model/profile.h Numerics).
inline constexpr char kEnvGpuArch[] = "gpu_arch";
std::string gpu_arch();
// The revision of this build's tensor-core kernels (kernels/reduce.h kTensorCoreRevision), recorded in
// every trace: with gpu_arch it says which builds reproduce a fast step bit for bit.
inline constexpr char kEnvTensorCoreRevision[] = "tensor_core_revision";
EnvFingerprint environment_fingerprint();
// The instruction set this build was compiled for: "x86-64-v3" (AVX2 and FMA), "x86-64" (the
// baseline, DSV4_X86_64_V3=OFF), "aarch64", or the compiler's name for another target. The env key
// "isa"; "machine" is the processor the run saw (uname -m).
std::string build_isa();
// Where a run happened, in words, from its fingerprint: "x86-64-v3 build on x86_64, Intel(R) Xeon(R) ...;
// GPU NVIDIA H200 (sm_90, ...)" (the GPU part only when a device was used). Replay reports "recorded
// on …, replayed on …" with it. Keys a fingerprint lacks (traces written before they existed) are
// left out.
std::string machine_summary(const EnvFingerprint& env);
// The current UTC time as ISO-8601 to the second ("2026-11-29T10:31:00Z"): the traces' `created`.
std::string utc_now_iso8601();

}  // namespace dsv4
