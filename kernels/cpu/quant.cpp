// Block FP8 / FP4 simulation (MODEL.md §4.1-4.3) in the operation order documented in kernels/quant.h.
// Every block is independent and its amax is a max (exact in any order), so results do not depend on
// the thread count; rows are spread over OpenMP threads only when the tensor is large.
#include "kernels/quant.h"

#include "kernels/detail/quant.h"

namespace dsv4 {

namespace {

constexpr int64_t kParallelMin = int64_t(1) << 15;  // elements; below this threads cost more than they save

const char* block_params_check(int64_t rows, int64_t cols, int block, const char* what_block) {
  if (rows < 0) return "rows is negative";
  if (cols < 0) return "cols is negative";
  if (block <= 0) return what_block;
  if (cols % block != 0) return "cols is not a multiple of block";
  return nullptr;
}

}  // namespace

const char* act_quant_check(const ActQuantParams& p) {
  if (const char* e = block_params_check(p.rows, p.cols, p.block, "block is not positive")) return e;
  if (p.rows > 0 && p.cols > 0) {
    if (!p.x) return "x is null";
    if (!p.q) return "q is null";
    if (!p.scale) return "scale is null";
  }
  return nullptr;
}

void act_quant(const ActQuantParams& p) {
  const int64_t nb = p.cols / p.block;
#pragma omp parallel for schedule(static) if (p.rows * p.cols >= kParallelMin)
  for (int64_t r = 0; r < p.rows; ++r) {
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t off = r * p.cols + b * p.block;
      p.scale[r * nb + b] = common::act_quant_block(p.x + off, p.block, p.fmt, p.q + off);
    }
  }
}

const char* fp8_sim_check(const Fp8SimParams& p) {
  if (const char* e = block_params_check(p.rows, p.cols, p.block, "block is not positive")) return e;
  if (p.rows > 0 && p.cols > 0) {
    if (p.ld < p.cols) return "ld is less than cols";
    if (!p.x) return "x is null";
  }
  return nullptr;
}

void fp8_sim(const Fp8SimParams& p) {
  const int64_t nb = p.cols / p.block;
#pragma omp parallel for schedule(static) if (p.rows * p.cols >= kParallelMin)
  for (int64_t r = 0; r < p.rows; ++r) {
    for (int64_t b = 0; b < nb; ++b) common::fp8_sim_block(p.x + r * p.ld + b * p.block, p.block, p.fmt);
  }
}

void fp8_sim_inplace_bf16_cast(const Fp8SimParams& p) {
  const int64_t nb = p.cols / p.block;
#pragma omp parallel for schedule(static) if (p.rows * p.cols >= kParallelMin)
  for (int64_t r = 0; r < p.rows; ++r) {
    for (int64_t b = 0; b < nb; ++b)
      common::fp8_bf16_cast_block(p.x + r * p.ld + b * p.block, p.block, p.fmt);
  }
}

void fp4_sim(const Fp8SimParams& p) {
  const int64_t nb = p.cols / p.block;
#pragma omp parallel for schedule(static) if (p.rows * p.cols >= kParallelMin)
  for (int64_t r = 0; r < p.rows; ++r) {
    for (int64_t b = 0; b < nb; ++b) common::fp4_sim_block(p.x + r * p.ld + b * p.block, p.block);
  }
}

}  // namespace dsv4
