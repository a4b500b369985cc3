"""Time the sparse prefill kernels over launch configurations (CUDA): python tools/tune_sparse.py [tokens [head_dim]]
(vertical-slash and block-sparse attention, and XAttention's estimate against its torch form)."""
import itertools
import sys

import torch

from bench.kernels import _band_blocks, _time_ms, _vs_pattern
from engine.ops.attention import causal_attention
from engine.ops.sparse_triton import block_sparse_triton, vertical_slash_triton
from engine.ops.xattn_estimate import block_shares_reference, block_shares_triton

tk = int(sys.argv[1]) if len(sys.argv) > 1 else 32768
d = int(sys.argv[2]) if len(sys.argv) > 2 else 128
hq, hkv = (32, 8) if d == 128 else (9, 3)                   # Qwen3-4B's heads, or the default model's
g = torch.Generator().manual_seed(0)
q = torch.randn(tk, hq, d, device="cuda", dtype=torch.bfloat16)
k = torch.randn(hkv, tk, d, device="cuda", dtype=torch.bfloat16).transpose(0, 1)
v = torch.randn(hkv, tk, d, device="cuda", dtype=torch.bfloat16).transpose(0, 1)
print("dense ms", round(_time_ms(lambda: causal_attention(q, k, v, d ** -0.5)), 2))
for density, block in itertools.product([0.1, 0.5], [64, 128]):
    pat = _vs_pattern(tk, hq, density, "cuda", g, block)
    for split, bn, w, st in itertools.product([False, True], [64, 128], [4, 8], [2, 3]):
        if bn <= block:
            print(f"vertical-slash density {density} block {block}: split, BN, warps, stages", split, bn, w, st,
                  round(_time_ms(lambda: vertical_slash_triton(q, k, v, pat, d ** -0.5, bn, w, st, split=split)), 2))
blocks = _band_blocks(tk, hq, 128, 32, 32, "cuda", g)
for bn, w, st in itertools.product([64, 128], [4, 8], [2, 3]):
    print("block-sparse BN, warps, stages", bn, w, st, round(_time_ms(
        lambda: block_sparse_triton(q, k, v, blocks, 128, d ** -0.5, bn, w, st)), 2))
print("xattention estimate, torch form ms", round(_time_ms(lambda: block_shares_reference(q, k, d ** -0.5, 16, 128)), 2))
for bm, bn, w, st in itertools.product([64, 128], [64, 128], [4, 8], [2, 3]):
    print("xattention estimate BM, BN, warps, stages", bm, bn, w, st, round(_time_ms(
        lambda: block_shares_triton(q, k, d ** -0.5, 16, 128, bm, bn, w, st)), 2))
