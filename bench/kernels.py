"""Sparse prefill kernels alone, one layer of a real model's shape: estimate + sparse kernel vs dense attention.

    python -m bench --kernels --shape qwen3-4b --lengths 32768,131072

Random weights give flat attention, so the policies' own estimates pick nearly everything there (density ~0.9):
end-to-end runs on them measure the overhead, not the gain. Here each kernel also runs on patterns of a chosen
density, the structure real heads show (MInference: recent diagonals plus scattered columns and diagonals;
XAttention: the diagonal band plus scattered blocks), timed next to dense causal attention (torch SDPA) on the
same q, k, v. CUDA events, medians.
"""
from __future__ import annotations

import statistics

import torch

from engine.ops.attention import causal_attention
from engine.ops.sparse_prefill import VerticalSlash, block_sparse_attention, causal_pairs, vertical_slash_attention
from engine.sparse import MInferencePolicy, XAttentionPolicy


def _time_ms(fn, repeats: int = 3) -> float:
    fn()
    out = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b))
    return statistics.median(out)


def _vs_pattern(tk, hq, recent, scattered_diag, columns, device, g):
    """Recent diagonals 0..recent-1 plus scattered diagonals and columns (the first 64 columns always)."""
    def pick(n, extra, forced):
        rows = [torch.cat([forced, torch.randperm(n - len(forced), generator=g)[:extra] + len(forced)]).sort().values
                for _ in range(hq)]
        return torch.stack(rows).int().to(device)
    return VerticalSlash(pick(tk, columns, torch.arange(64)), pick(tk, scattered_diag, torch.arange(recent)), 64)


def _band_blocks(tq, hq, block, band, extra, device, g):
    """Per query block: the sink, its `band` nearest key blocks and `extra` random earlier ones."""
    n = -(-tq // block)
    keep = torch.zeros(hq, n, n, dtype=torch.bool)
    m = torch.arange(n)
    for d in range(band):
        keep[:, m[d:], m[d:] - d] = True
    keep[:, :, 0] = True
    keep |= (torch.rand(hq, n, n, generator=g) < extra / max(1, n)) & (m[None, :, None] >= m[None, None, :])
    return keep.to(device)


def run(shape_args, lengths: list[int], dtype=torch.bfloat16) -> list[str]:
    a, dev = shape_args, torch.device("cuda")
    hq, hkv, d = a.num_heads, a.num_kv_heads, a.head_dim
    scale, g = d ** -0.5, torch.Generator().manual_seed(0)
    lines = [f"one layer: {hq} query heads, {hkv} kv heads, head_dim {d}, {str(dtype).removeprefix('torch.')}; ms "
             "(CUDA events, median of 3); speedup = dense / (estimate + kernel)"]
    for tk in lengths:
        q = torch.randn(tk, hq, d, device=dev, dtype=dtype)
        k = torch.randn(hkv, tk, d, device=dev, dtype=dtype).transpose(0, 1)        # head-major, as layerwise gives
        v = torch.randn(hkv, tk, d, device=dev, dtype=dtype).transpose(0, 1)
        dense = _time_ms(lambda: causal_attention(q, k, v, scale))
        lines.append(f"@{tk}: dense causal (SDPA) {dense:.1f} ms")
        pairs = causal_pairs(tk, tk) * hq
        mi = MInferencePolicy(min_len=1)
        est = _time_ms(lambda: mi.estimate(q, k, scale))
        for name, pat in [("own estimate on random data", mi.estimate(q, k, scale)),
                          ("recent 1024 + 1000 diagonals + 1000 columns", _vs_pattern(tk, hq, 1024, 1000, 1000, dev, g)),
                          ("recent 4096 + 2000 diagonals + 1000 columns", _vs_pattern(tk, hq, 4096, 2000, 1000, dev, g))]:
            kern = _time_ms(lambda: vertical_slash_attention(q, k, v, pat, scale))
            density = vertical_slash_attention(q, k, v, pat, scale)[1].sum().item() / pairs
            lines.append(f"  minference {name}: density {density:.3f}, estimate {est:.1f} + kernel {kern:.1f} ms, "
                         f"{dense / (est + kern):.2f}x; kernel alone {dense * density / kern:.2f}x dense's pace per pair")
        xa = XAttentionPolicy(min_len=1)
        est = _time_ms(lambda: xa.estimate(q, k, scale))
        for name, blocks in [("own estimate on random data", xa.estimate(q, k, scale)),
                             ("band 8 + 8 random blocks", _band_blocks(tk, hq, 128, 8, 8, dev, g)),
                             ("band 32 + 32 random blocks", _band_blocks(tk, hq, 128, 32, 32, dev, g))]:
            kern = _time_ms(lambda: block_sparse_attention(q, k, v, blocks, 128, scale))
            density = block_sparse_attention(q, k, v, blocks, 128, scale)[1].sum().item() / pairs
            lines.append(f"  xattention {name}: density {density:.3f}, estimate {est:.1f} + kernel {kern:.1f} ms, "
                         f"{dense / (est + kern):.2f}x; kernel alone {dense * density / kern:.2f}x dense's pace per pair")
        del q, k, v
        torch.cuda.empty_cache()
    return lines
