"""Block-sparse prefill attention through FlexAttention (torch >= 2.5, CUDA), timed beside our Triton kernel.

`python -m bench --kernels` puts it beside engine/ops/sparse_triton.py's block-sparse kernel. It was XAttention's
kernel on the GPU while ours was slower (H100, density 0.07: 0.45x / 0.65-0.71x dense SDPA's pace at 32K / 128K
against 0.35x / 0.49x); ours now matches or beats it below density ~0.15 and runs without its ~3 s compile per
process (compiled once with dynamic shapes), so XAttention runs ours. `block_pairs` (the pairs a block table
computes) is used by both.

Our table `blocks` [Hq, nQB, nKB] (query block m: q rows [m*B, (m+1)*B); key block n: keys [n*B, (n+1)*B))
becomes a BlockMask of B x B blocks: the kept key blocks wholly before a query block's first row are "full"
(no mask evaluated), the others "partial" (the causal mask_mod, bottom-right aligned: q row i sits at position
Tk - Tq + i). The pairs computed per head are counted from the table, exactly.
"""
from __future__ import annotations

import functools
import inspect

import torch

from engine.ops.sparse_prefill import kept_first

_compiled = None
_FORWARD_ONLY = False     # BlockMask.from_kv_blocks takes compute_q_blocks (torch >= 2.6)


def available(q: torch.Tensor) -> bool:
    """FlexAttention can run here (CUDA, torch with flex_attention, bf16 or fp16: in fp32 at head_dim 64 it gave
    rows far from the masked reference on the H200, max error 0.48 with torch 2.11, where ours gave 0.003)."""
    global _compiled, _FORWARD_ONLY
    if _compiled is None:
        try:
            from torch.nn.attention.flex_attention import BlockMask, flex_attention
            _FORWARD_ONLY = "compute_q_blocks" in inspect.signature(BlockMask.from_kv_blocks).parameters
            _compiled = torch.compile(flex_attention, dynamic=True)    # one compile for every prompt length
        except Exception:  # noqa: BLE001 - an older torch: the Triton kernel runs instead
            _compiled = False
    return bool(_compiled) and q.is_cuda and q.dtype in (torch.bfloat16, torch.float16)


def _indices(keep: torch.Tensor):
    """[Hq, nQB, nKB] bool -> (counts [1, Hq, nQB], indices [1, Hq, nQB, nKB]) int32, kept blocks first."""
    cnt, idx = kept_first(keep, keep.shape[-1])
    return cnt[None], idx[None]


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


def block_sparse_flex(q, k, v, blocks: torch.Tensor, block: int, scale: float):
    """Same arguments and result as engine.ops.sparse_prefill.block_sparse_attention."""
    from torch.nn.attention.flex_attention import BlockMask
    tq, tk = q.shape[0], k.shape[0]
    off = tk - tq
    nqb, nkb = blocks.shape[1:]
    m = torch.arange(nqb, device=q.device)[:, None]
    n = torch.arange(nkb, device=q.device)[None]
    whole = (n + 1) * block - 1 <= off + m * block                                      # before the block's first row
    full = blocks & whole[None]
    partial = blocks & ~whole[None]
    offset = torch.tensor(off, device=q.device)

    def causal(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx + offset

    forward_only = {"compute_q_blocks": False} if _FORWARD_ONLY else {}    # no backward: skip its indices
    mask = BlockMask.from_kv_blocks(*_indices(partial), *_indices(full), BLOCK_SIZE=block, mask_mod=causal,
                                    seq_lengths=(tq, tk), **forward_only)
    out = _compiled(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], block_mask=mask,
                    scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1), block_pairs(blocks, block, tq, tk)
