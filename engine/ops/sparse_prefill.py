"""Sparse prefill attention: vertical-slash (MInference) and block-sparse (XAttention) patterns.

A pattern says, per query head, which (query, key) pairs are computed; the causal mask applies on top and every
other pair is skipped. Each pattern runs as a Triton kernel on CUDA (engine/ops/sparse_triton.py) and, elsewhere,
as a torch expression of the same mask (exact for the same pattern at dense cost: the CPU path and the test
reference). Both also count the pairs they computed per head, so the density a policy reports is what ran.

Queries are the last Tq of Tk positions (q row i sits at position offset + i, offset = Tk - Tq); a query block m
holds q rows [m*BM, (m+1)*BM), its first position is m0 = offset + m*BM. GQA-native: query head h reads kv head
h // G in place; K/V are never repeated (the CUDA kernel copies only vertical-slash's columns, per query head).

Vertical-slash, per query head: sorted slash diagonals d (key = query position - d) and sorted vertical columns.
In query block m the diagonal d covers the keys [m0 - d, m0 - d + BM - 1] (every row of the block sees the whole
run: MInference's block approximation, which keeps the kernel on contiguous tiles). Diagonals less than BM+1
apart give touching runs, merged into groups (d_lo, d_hi) that cover [m0 - d_hi, m0 - d_lo + BM - 1]. A vertical
column adds itself wherever no run covers it already. So (row r, key c) is computed iff c <= r and
(t = m0 - c lies in some [d - BM + 1, d] or c is a vertical column). `covered` holds that first test as a table
over t, shared by the kernel (to skip covered verticals) and the reference.

Block-sparse: (row r, key c) is computed iff c <= r and key block c // B is selected for query block (r - offset) // B.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

try:
    import triton
except ImportError:  # CPU-only installs use the references
    triton = None

_BIG = 2**30           # a group bound past every diagonal


@dataclass
class VerticalSlash:
    vertical: torch.Tensor   # [Hq, NV] int32 key positions, sorted
    slash: torch.Tensor      # [Hq, NS] int32 diagonals, sorted
    block: int               # BM: query rows per block (and the run length of a diagonal)
    reach: torch.Tensor | None = None   # [2, Hq] int64: queries its columns / runs reach, where the selection counted them

    def groups(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Merged runs: d_lo, d_hi [Hq, NS] int32 sorted, padded with a large value past each head's groups (as
        wide as the diagonals: cutting at the most groups a head has would read that count on the host, a sync)."""
        d = self.slash.long()
        new = torch.ones_like(d, dtype=torch.bool)
        new[:, 1:] = d[:, 1:] - d[:, :-1] > self.block
        last = torch.ones_like(new)
        last[:, :-1] = new[:, 1:]
        d_lo = torch.where(new, d, _BIG).sort(dim=1).values
        d_hi = torch.where(last, d, _BIG).sort(dim=1).values
        return d_lo.int().contiguous(), d_hi.int().contiguous()

    def covered(self, tk: int) -> torch.Tensor:
        """[Hq, tk + BM] bool: entry t + BM - 1 says whether offset t = m0 - c lies in a diagonal's run."""
        bm, d = self.block, self.slash.long()
        diff = torch.zeros(d.shape[0], tk + 2 * bm + 1, dtype=torch.int32, device=d.device)
        ones = torch.ones_like(d, dtype=torch.int32)
        diff.scatter_add_(1, d.clamp(max=tk + bm), ones)               # run of d starts at t = d - BM + 1
        diff.scatter_add_(1, (d + bm).clamp(max=tk + 2 * bm), -ones)  # and ends after t = d
        return diff.cumsum(dim=1)[:, :tk + bm] > 0


def kept_first(keep: torch.Tensor, width: int | None = None, fill: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., n] bool -> (counts [...] int32, indices [..., width] int32: the first `width` kept positions of each
    row in order, then `fill`). width: the most kept in a row (a host sync) unless given. One scatter, no sort."""
    cnt = keep.sum(dim=-1, dtype=torch.int32)
    width = width or max(1, int(cnt.max()))
    slot = keep.cumsum(dim=-1, dtype=torch.int32) - 1
    slot = torch.where(keep & (slot < width), slot, width).long()
    pos = torch.arange(keep.shape[-1], device=keep.device, dtype=torch.int32).expand_as(keep)
    idx = torch.full(keep.shape[:-1] + (width + 1,), fill, dtype=torch.int32, device=keep.device)
    return cnt, idx.scatter_(-1, slot, pos)[..., :width].contiguous()


def causal_pairs(tq: int, tk: int) -> int:
    """(query, key) pairs of dense causal attention for the last tq of tk positions."""
    off = tk - tq
    return tq * (off + 1) + tq * (tq - 1) // 2


def block_pairs(blocks: torch.Tensor, block: int, tq: int, tk: int) -> torch.Tensor:
    """Causal (query, key) pairs inside the kept blocks, per head [Hq] int64."""
    return (blocks * pair_weights(*blocks.shape[1:], block, tq, tk, blocks.device)).sum(dim=(1, 2))


@functools.lru_cache(maxsize=4)
def pair_weights(nqb: int, nkb: int, block: int, tq: int, tk: int, device: torch.device) -> torch.Tensor:
    """Causal pairs in each block (m, n) [nQB, nKB] int64, made once per prompt shape (XAttention's dense gate
    weighs each layer's table with it: two kernels, where building it took ~15). In block (m, n) row i sees
    clamp(a + i, 0, w) keys (a = Tk - Tq + (m - n) * B + 1, w = the key block's width): summed over the R rows,
    S(a + R - 1) - S(a - 1) with S(t) = sum of min(j, w) for j = 1..t."""
    m = torch.arange(nqb, device=device)[:, None]
    n = torch.arange(nkb, device=device)[None]
    rows = torch.clamp((m + 1) * block, max=tq) - m * block
    w = torch.clamp((n + 1) * block, max=tk) - n * block
    a = (tk - tq) + (m - n) * block + 1

    def s(t):
        t = t.clamp(min=0)
        return torch.where(t <= w, t * (t + 1) // 2, w * (w + 1) // 2 + (t - w) * w)
    return s(a + rows - 1) - s(a - 1)


def _block_last(nqb: int, block: int, tq: int, tk: int, device) -> torch.Tensor:
    """Position of each query block's last row (queries are the last tq of tk positions)."""
    return (tk - tq) + torch.clamp(torch.arange(1, nqb + 1, device=device) * block, max=tq) - 1


def vertical_slash_keep(pat: VerticalSlash, tq: int, tk: int) -> torch.Tensor:
    """[Hq, nQB, Tk] bool: in query block m (first position m0) key c is kept if m0 - c lies in a slash run
    or c is a vertical column, and c is not past the block's last row."""
    bm, hq, dev = pat.block, pat.slash.shape[0], pat.slash.device
    nqb = -(-tq // bm)
    cols = torch.arange(tk, device=dev)
    m0 = (tk - tq) + torch.arange(nqb, device=dev) * bm
    t = m0[:, None] - cols[None]                                              # [nQB, Tk]
    at = (t + bm - 1).clamp_(0, tk + bm - 1)
    in_run = pat.covered(tk)[:, at] & (t > -bm)[None]                         # [Hq, nQB, Tk]
    isv = torch.zeros(hq, tk, dtype=torch.bool, device=dev)
    isv.scatter_(1, pat.vertical.long(), True)
    before = cols[None] <= _block_last(nqb, bm, tq, tk, dev)[:, None]
    return (in_run | isv[:, None]) & before[None]


def block_sparse_keep(blocks: torch.Tensor, block: int, tq: int, tk: int) -> torch.Tensor:
    """blocks [Hq, nQB, nKB] bool -> [Hq, nQB, Tk] bool."""
    nqb = blocks.shape[1]
    cols = torch.arange(tk, device=blocks.device)
    before = cols[None] <= _block_last(nqb, block, tq, tk, blocks.device)[:, None]
    return blocks[:, :, cols // block] & before[None]


# ------------------------------------------------------------------------------------------------ torch reference
def _masked_attention(q, k, v, scale, mask_rows, chunk=1024):
    """Attention under mask_rows(h, rows) -> [len(rows), Tk] bool, one head and row chunk at a time, fp32."""
    tq, hq, _ = q.shape
    g = hq // k.shape[1]
    out = torch.empty_like(q)
    pairs = torch.zeros(hq, dtype=torch.int64)
    for h in range(hq):
        kh, vh = k[:, h // g].float(), v[:, h // g].float()
        for a in range(0, tq, chunk):
            rows = torch.arange(a, min(tq, a + chunk), device=q.device)
            m = mask_rows(h, rows)
            s = (q[rows, h].float() @ kh.T) * scale
            s.masked_fill_(~m, float("-inf"))
            p = torch.softmax(s, dim=-1).nan_to_num_(0.0)
            out[rows, h] = (p @ vh).to(q.dtype)
            pairs[h] += int(m.sum())
    return out, pairs


def _keep_reference(q, k, v, keep: torch.Tensor, block: int, scale: float):
    """Attention under a keep table (every row of a query block sees its block's keys, up to causality)."""
    tq, tk = q.shape[0], k.shape[0]
    cols = torch.arange(tk, device=q.device)

    def mask(h, rows):
        return keep[h][rows // block] & (cols[None] <= (tk - tq + rows)[:, None])
    return _masked_attention(q, k, v, scale, mask)


def vertical_slash_reference(q, k, v, pat: VerticalSlash, scale: float):
    return _keep_reference(q, k, v, vertical_slash_keep(pat, q.shape[0], k.shape[0]), pat.block, scale)


def block_sparse_reference(q, k, v, blocks: torch.Tensor, block: int, scale: float):
    """blocks [Hq, nQB, nKB] bool."""
    return _keep_reference(q, k, v, block_sparse_keep(blocks, block, q.shape[0], k.shape[0]), block, scale)


def vertical_slash_attention(q, k, v, pat: VerticalSlash, scale: float, skip=None):
    """q [Tq, Hq, D], k/v [Tk, Hkv, D] -> ([Tq, Hq, D], pairs computed per head [Hq]). skip (CUDA): a device
    flag; where it is set the kernel computes nothing and its results mean nothing."""
    if q.is_cuda and triton is not None:
        from engine.ops.sparse_triton import vertical_slash_triton
        return vertical_slash_triton(q, k, v, pat, scale, skip=skip)
    return vertical_slash_reference(q, k, v, pat, scale)


def block_sparse_attention(q, k, v, blocks: torch.Tensor, block: int, scale: float, skip=None):
    """blocks [Hq, ceil(Tq / block), ceil(Tk / block)] bool -> ([Tq, Hq, D], pairs computed per head [Hq]).
    CUDA: our Triton kernel. (FlexAttention, engine/ops/flex_sparse.py, is timed beside it by `bench --kernels`:
    it leads only at high densities at 128K, costs a ~3 s compile per process and more host time per call; on the
    default model with XAttention, H100, ours gave 174.6K tok/s at 32K against its 139.2K, 59.4K against 56.9K
    at 8K.)"""
    if q.is_cuda and triton is not None:
        from engine.ops.sparse_triton import block_sparse_triton
        return block_sparse_triton(q, k, v, blocks, block, scale, skip=skip)
    return block_sparse_reference(q, k, v, blocks, block, scale)
