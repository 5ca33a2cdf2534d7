# DeepSeek's official DSV4 inference code, later revision (HF revision 60d8d707...): as the initial
# release (deepseek-inference.profile), but the in-place FP8 of the KV is a real e4m3 round trip and
# the shared expert is clamped (MODEL.md §12.1 items 5, 6). Sites left to PyTorch keep train's values.
dsv4-profile = 1
name = deepseek-inference-v2
description = DeepSeek official inference code, later revision (HF revision 60d8d707)

reduce.gemm = 0
reduce.norm = 0
reduce.compressor = 0
reduce.mhc = 0
reduce.indexer = 0
reduce.attention = 0
reduce.moe = 0
# q *= rsqrt(mean(q^2) + eps) on a bf16 tensor
attention.q_norm = bf16
# online softmax in blocks of 64, natural exp, bf16 probabilities before P.V
attention.softmax = online:64
attention.decode = exact
# a real e4m3 round trip of the nope dims
kv.quant = fp8
kv.quant_block = 64
kv.quant_scale = ue8m0
# FP4 e2m1, blocks of 32, power-of-two scales
indexer.quant = fp4
indexer.quant_block = auto
indexer.quant_scale = ue8m0
# einsum, relu * weight and the head sum all in bf16
indexer.score = bf16
# each expert's w2 output is a bf16 tensor added into the fp32 sum
moe.expert_output = bf16_each
moe.shared_clamp = on
topk.ties = lower_index
