// Block FP8 / FP4 simulation (MODEL.md §4.1-4.3). Operates on rows of `cols` values; every row is
// cut into cols / block contiguous blocks, each with its own scale.
#pragma once

#include <cstdint>

namespace dsv4 {

enum class ScaleFmt { none, ue8m0 };  // none: s = amax/448; ue8m0: s = 2^ceil(log2(amax/448))

// act_quant: quantise x [rows, cols] to e4m3 codes `q` [rows, cols] and fp32 scales [rows, cols/block].
//   amax = max(max|x_block|, 1e-4); v = amax * fp32(1/448); s = v or 2^ceil(log2 v) from v's bits;
//   q = e4m3(clamp(x / s, -448, 448)) with x / s an IEEE fp32 division.
struct ActQuantParams {
  int64_t rows = 0, cols = 0;
  int block = 128;
  ScaleFmt fmt = ScaleFmt::ue8m0;
  const float* x = nullptr;
  uint8_t* q = nullptr;
  float* scale = nullptr;
};
const char* act_quant_check(const ActQuantParams& p);  // nullptr if it can run, else the reason
void act_quant(const ActQuantParams& p);

// fp8_sim (miles `fp8_simulate`): y = bf16(fp32(e4m3 q) * s) with (q, s) = act_quant(x). In place
// on x; only the first `cols` values of each row of stride `ld` are touched (the KV sites simulate
// only the nope dims: cols = Dh - rd, ld = Dh).
struct Fp8SimParams {
  int64_t rows = 0, cols = 0, ld = 0;
  int block = 64;
  ScaleFmt fmt = ScaleFmt::ue8m0;
  float* x = nullptr;
};
const char* fp8_sim_check(const Fp8SimParams& p);
void fp8_sim(const Fp8SimParams& p);

// The official inference code's in-place act_quant (MODEL.md §4.2): its inner cast goes to the
// input dtype (bf16) instead of e4m3, so it only re-rounds x / s to bf16 and multiplies back.
// With ue8m0 scales this is an exact identity on bf16 inputs. Kept to reproduce that engine.
void fp8_sim_inplace_bf16_cast(const Fp8SimParams& p);

// fp4_sim (MODEL.md §4.3): block b (32), amax = max(max|x|, 6*2^-126), s = 2^ceil(log2(amax*fp32(1/6))),
// y = bf16(e2m1(clamp(x/s, -6, 6)) * s). In place, first `cols` of each row of stride `ld`.
void fp4_sim(const Fp8SimParams& p);

}  // namespace dsv4
