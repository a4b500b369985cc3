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

The estimate runs per kv head and per chunk of query blocks (memory G x chunk x Tk/S floats); the selection
[Hq, Tq/B, Tk/B] runs in engine.ops.sparse_prefill's block-sparse kernel on CUDA, engine.ops.sparse_gather elsewhere.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.errors import ConfigError
from engine.ops.flex_sparse import block_pairs
from engine.ops.sparse_prefill import block_sparse_attention, block_sparse_keep, causal_pairs
from engine.sparse.policy import SparsePrefillPolicy
from engine.sparse.specs import SPECS

_IMAGE = 128  # the trace gets each head's block mask binned to at most this many rows and columns


class XAttentionPolicy(SparsePrefillPolicy):
    spec = SPECS["xattention"]

    def __init__(self, **params):
        p = self.spec.validate(params)
        super().__init__(p["min_len"], p["cpu_dense_above"], p["gpu_dense_above"])
        self.threshold, self.stride, self.block, self.chunk_rows = p["threshold"], p["stride"], p["block"], p["chunk_rows"]
        if self.block % self.stride:
            raise ConfigError(f"xattention stride {self.stride} must divide the block of {self.block} tokens")

    @torch.no_grad()
    def estimate(self, q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
        """q [Tq, Hq, D] (the last Tq of Tk positions), k [Tk, Hkv, D] -> kept blocks [Hq, nQB, nKB] bool."""
        (tq, hq, d), (tk, hkv) = q.shape, k.shape[:2]
        g, s, b = hq // hkv, self.stride, self.block
        off, nqb, nkb = tk - tq, -(-tq // b), -(-tk // b)
        cells = b // s                                                           # strided rows per block
        keep = torch.zeros(hq, nqb, nkb, dtype=torch.bool, device=q.device)
        kpos = torch.arange(nkb * cells, device=q.device) * s                    # first key of each strided column
        qb_per_chunk = max(1, self.chunk_rows // cells)
        for h in range(hkv):
            kh = F.pad(k[:, h], (0, 0, 0, nkb * b - tk)).reshape(nkb * cells, s * d)          # [Tk/S, S*D]
            for m0 in range(0, nqb, qb_per_chunk):
                m1 = min(nqb, m0 + qb_per_chunk)
                kb = min(nkb, (off + m1 * b - 1) // b + 1)        # key blocks after the chunk's last row: masked
                rows = q[m0 * b:m1 * b, h * g:(h + 1) * g] * (scale / s)                       # [r, G, D]
                rows = F.pad(rows, (0, 0, 0, 0, 0, (m1 - m0) * b - rows.shape[0]))
                qs = rows.reshape(-1, s, g, d).flip(1).permute(2, 0, 1, 3).reshape(g, -1, s * d)  # [G, r/S, S*D]
                a = qs @ kh[:kb * cells].T                                                     # [G, r/S, kb*cells]
                last = off + (m0 * cells + torch.arange(a.shape[1], device=q.device)) * s + s - 1
                a.masked_fill_(kpos[None, None, :kb * cells] > last[None, :, None], float("-inf"))
                a = a.softmax(dim=-1, dtype=torch.float32)
                if last[-1] - s + 1 >= tk:
                    a[:, last - s + 1 >= tk] = 0                                  # padding rows past the prompt
                share = a.reshape(g, m1 - m0, cells, kb, cells).sum(dim=(2, 4))   # [G, chunk, kb]
                share /= share.sum(dim=-1, keepdim=True).clamp_min(1e-30)
                keep[h * g:(h + 1) * g, m0:m1, :kb] = self._select(share)
        first = (off + torch.arange(nqb, device=q.device) * b) // b             # the diagonal: a query block's own
        lastb = (off + torch.clamp(torch.arange(1, nqb + 1, device=q.device) * b, max=tq) - 1) // b  # key blocks
        n = torch.arange(nkb, device=q.device)
        keep |= ((n[None] >= first[:, None]) & (n[None] <= lastb[:, None]))[None]
        keep[:, :, 0] = True
        return keep

    def _select(self, share: torch.Tensor) -> torch.Tensor:
        """Keep the largest shares of each row until they sum to the threshold (equal shares in index order: an
        unstable sort may order them differently from run to run on CUDA, and so cut the row elsewhere)."""
        p, order = share.sort(dim=-1, descending=True, stable=True)
        before = p.cumsum(dim=-1) - p
        kept = (before < self.threshold) & (p > 0)
        return torch.zeros_like(kept).scatter_(-1, order, kept)

    def kernel(self, q, k, v, blocks, scale):
        return block_sparse_attention(q, k, v, blocks, self.block, scale)

    def pattern_density(self, blocks, tq, tk):
        return float(block_pairs(blocks, self.block, tq, tk).sum()) / (blocks.shape[0] * causal_pairs(tq, tk))

    def keep(self, blocks, tq, tk):
        return block_sparse_keep(blocks, self.block, tq, tk)

    def record(self, recorder, layer, blocks: torch.Tensor, density, n):
        hq, nqb, nkb = blocks.shape
        f = max(1, -(-max(nqb, nkb) // _IMAGE))                                 # binned picture, at most _IMAGE
        img = F.avg_pool2d(blocks.float()[:, None], f, ceil_mode=True)[:, 0].mul_(255).to(torch.uint8)
        empty = torch.zeros(0, dtype=torch.int32)
        for h, dens in enumerate(density):
            recorder.mask_summary(layer, h, empty, empty, n, dens, image=img[h])
