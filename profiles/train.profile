# The training engine's prefill numerics: bf16 storage, fp32 accumulation and arithmetic
# (MODEL.md §3.11), no FP8 or FP4 simulation. Format: docs/PROFILES.md.
dsv4-profile = 1
name = train
description = training engine prefill: bf16 storage, fp32 math, no FP8

reduce.gemm = 0
reduce.norm = 0
reduce.compressor = 0
reduce.mhc = 0
reduce.indexer = 0
reduce.attention = 0
reduce.moe = 0
attention.q_norm = fp32
attention.softmax = two_pass
attention.decode = exact
kv.quant = none
kv.quant_block = 64
kv.quant_scale = ue8m0
indexer.quant = none
indexer.quant_block = auto
indexer.quant_scale = ue8m0
indexer.score = fp32
moe.expert_output = sum_fp32
moe.shared_clamp = off
topk.ties = lower_index
