"""Time the sparse prefill kernels over launch configurations (CUDA): python tools/tune_sparse.py [tokens]"""
import itertools
import sys

import torch

from bench.kernels import _band_blocks, _time_ms, _vs_pattern
from engine.ops.attention import causal_attention
from engine.ops.sparse_prefill import block_sparse_triton, vertical_slash_triton

tk, hq, hkv, d = int(sys.argv[1]) if len(sys.argv) > 1 else 32768, 32, 8, 128
g = torch.Generator().manual_seed(0)
q = torch.randn(tk, hq, d, device="cuda", dtype=torch.bfloat16)
k = torch.randn(hkv, tk, d, device="cuda", dtype=torch.bfloat16).transpose(0, 1)
v = torch.randn(hkv, tk, d, device="cuda", dtype=torch.bfloat16).transpose(0, 1)
print("dense ms", round(_time_ms(lambda: causal_attention(q, k, v, 0.088)), 2))
pat = _vs_pattern(tk, hq, 0.1, "cuda", g)
for bn, w, st in itertools.product([64, 128], [4, 8], [2, 3]):
    print("vertical-slash BN, warps, stages", bn, w, st, round(_time_ms(
        lambda: vertical_slash_triton(q, k, v, pat, 0.088, bn, w, st)), 2))
blocks = _band_blocks(tk, hq, 128, 32, 32, "cuda", g)
for bn, w, st in itertools.product([64, 128], [4, 8], [2, 3]):
    print("block-sparse BN, warps, stages", bn, w, st, round(_time_ms(
        lambda: block_sparse_triton(q, k, v, blocks, 128, 0.088, bn, w, st)), 2))
