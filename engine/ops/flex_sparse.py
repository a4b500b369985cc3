"""Block-sparse prefill attention through FlexAttention (torch >= 2.5, CUDA), timed beside our Triton kernel.

`python -m bench --kernels` puts it beside engine/ops/sparse_triton.py's block-sparse kernel. It was XAttention's
kernel on the GPU while ours was slower (H100, density 0.07: 0.45x / 0.65-0.71x dense SDPA's pace at 32K / 128K
against 0.35x / 0.49x); ours now matches or beats it below density ~0.15 and runs without its ~3 s compile per
process (compiled once with dynamic shapes), so XAttention runs ours. Both count the pairs a block table computes
with engine/ops/sparse_prefill.py's `block_pairs`.

Our table `blocks` [Hq, nQB, nKB] (query block m: q rows [m*B, (m+1)*B); key block n: keys [n*B, (n+1)*B))
becomes a BlockMask of B x B blocks: the kept key blocks wholly before a query block's first row are "full"
(no mask evaluated), the others "partial" (the causal mask_mod, bottom-right aligned: q row i sits at position
Tk - Tq + i). The pairs computed per head are counted from the table, exactly.
"""
from __future__ import annotations

import inspect

import torch

from engine.ops.sparse_prefill import block_pairs, kept_first

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
