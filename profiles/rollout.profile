# An inference engine's numerics as SGLang runs DSV4 (MODEL.md §4.4, §7.4): the window and main
# compressed KV stored in FP8 (e4m3, blocks of 64, power-of-two scales, rope dims bf16), the indexer
# q and k in FP8 (blocks of 128), and long reductions split into blocks of 64 like a tensor-core
# kernel's k-tiles. Format: docs/PROFILES.md.
dsv4-profile = 1
name = rollout
description = inference engine (SGLang-like): FP8 KV and indexer caches, split-K blocks of 64

reduce.gemm = 64
reduce.norm = 64
reduce.compressor = 64
reduce.mhc = 64
reduce.indexer = 64
reduce.attention = 64
reduce.moe = 64
attention.q_norm = fp32
attention.softmax = two_pass
attention.decode = exact
kv.quant = fp8
kv.quant_block = 64
kv.quant_scale = ue8m0
indexer.quant = fp8
indexer.quant_block = auto
indexer.quant_scale = ue8m0
indexer.score = fp32
moe.expert_output = sum_fp32
moe.shared_clamp = off
topk.ties = lower_index
