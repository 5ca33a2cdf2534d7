# DeepSeek's official DSV4 inference code, initial release (inference/model.py), as measured on the
# same weights and tokens as `train` (MODEL.md §12.1): the formulas agree, these precision choices
# differ. Sites the release leaves to PyTorch (reduction blocking, top-k ties) keep train's values.
dsv4-profile = 1
name = deepseek-inference
description = DeepSeek official inference code, initial release

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
# in-place act_quant: its inner cast goes to bf16, an identity under ue8m0 scales (MODEL.md §4.2)
kv.quant = fp8_inplace_bf16_cast
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
moe.shared_clamp = off
topk.ties = lower_index
