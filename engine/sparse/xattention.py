"""XAttention (Xu et al., 2025): block-sparse prefill attention chosen by antidiagonal scoring.

The attention matrix is cut into B x B blocks (query block m: q rows [m*B, (m+1)*B); key block n: keys
[n*B, (n+1)*B)). A block's importance is estimated from sums along antidiagonals: inside every S x S cell
(S = stride) take the S products q[a*S + S-1-i] . k[b*S + i], i = 0..S-1. That sum is one dot product of
strided, reordered vectors (q rows of a cell reversed and concatenated, k rows concatenated: S*D long), so the
whole estimate is a matmul of (Tq/S) x (Tk/S): 1/S of dense attention's work. Each strided row's scores (times
scale / S, the mean) go through a causal softmax; summing them over the cells of a block and normalizing per
query block gives each key block's share of the query block's attention. Per query block and head, key blocks
are kept from the largest share down until the kept shares reach the threshold tau; the first key block (the
sink) and the query block's own diagonal blocks always are. Every antidiagonal crosses every row and column of
its cell once, so a vertical or a slash line inside a block shows up in its score (the paper's point).

The shares come from engine.ops.xattn_estimate (one Triton launch on CUDA; elsewhere per chunk of query blocks
in torch, memory Hq x chunk x Tk/S floats); the selection [Hq, Tq/B, Tk/B] runs in
engine.ops.sparse_triton's block-sparse kernel on CUDA, engine.ops.sparse_gather elsewhere.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.errors import ConfigError
from engine.ops.sparse_prefill import block_pairs, block_sparse_attention, block_sparse_keep, causal_pairs
from engine.ops.xattn_estimate import block_shares, select_blocks
from engine.sparse.policy import SparsePrefillPolicy
from engine.sparse.specs import SPECS

_IMAGE = 128  # the trace gets each head's block mask binned to at most this many rows and columns


class XAttentionPolicy(SparsePrefillPolicy):
    spec = SPECS["xattention"]
    auto_min_len = (4096, 8192)   # the CPU's gathered path pays from ~4K tokens, our CUDA kernels from ~8K

    def __init__(self, **params):
        p = self.spec.validate(params)
        super().__init__(p["min_len"], p["cpu_dense_above"], p["gpu_dense_above"])
        self.threshold, self.stride, self.block, self.chunk_rows = p["threshold"], p["stride"], p["block"], p["chunk_rows"]
        if self.block % self.stride:
            raise ConfigError(f"xattention stride {self.stride} must divide the block of {self.block} tokens")

    @torch.no_grad()
    def estimate(self, q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
        """q [Tq, Hq, D] (the last Tq of Tk positions), k [Tk, Hkv, D] -> kept blocks [Hq, nQB, nKB] bool."""
        share = block_shares(q, k, scale, self.stride, self.block, self.chunk_rows)
        return select_blocks(share, self.threshold, q.shape[0], k.shape[0], self.block)

    def kernel(self, q, k, v, blocks, scale, skip=None):
        return block_sparse_attention(q, k, v, blocks, self.block, scale, skip)

    def pattern_density(self, blocks, tq, tk):
        return block_pairs(blocks, self.block, tq, tk).sum().double() / (blocks.shape[0] * causal_pairs(tq, tk))

    def keep(self, blocks, tq, tk):
        return block_sparse_keep(blocks, self.block, tq, tk)

    def block_table(self, blocks):
        return blocks

    def record(self, recorder, layer, blocks: torch.Tensor, density, n):
        hq, nqb, nkb = blocks.shape
        f = max(1, -(-max(nqb, nkb) // _IMAGE))                                 # binned picture, at most _IMAGE
        img = F.avg_pool2d(blocks.float()[:, None], f, ceil_mode=True)[:, 0].mul_(255).to(torch.uint8)
        recorder.mask_summaries(layer, None, None, n, density, images=img)
