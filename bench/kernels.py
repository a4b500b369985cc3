"""Sparse prefill kernels alone, one layer of a real model's shape: estimate + sparse kernel vs dense attention.

    python -m bench --kernels --shape qwen3-4b --lengths 32768,131072

Random weights give flat attention, so the policies' own estimates pick nearly everything there (density ~0.9):
end-to-end runs on them measure the overhead, not the gain. Here each kernel runs on patterns of chosen
densities (0.02-0.5), the structure real heads show (MInference: a band of recent diagonals plus scattered
columns and diagonals; XAttention: the diagonal band plus scattered blocks), timed next to dense causal attention
(torch SDPA) on the same q, k, v: the pace table. CUDA events, medians.
"""
from __future__ import annotations

import statistics

import torch

from engine.ops.attention import causal_attention
from engine.ops.sparse_prefill import VerticalSlash, causal_pairs
from engine.ops.sparse_triton import block_sparse_triton, vertical_slash_triton
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


def _vs_pattern(tk, hq, density, device, g, block=128):
    """About `density` of the causal pairs: a band of recent diagonals (80%), scattered columns (20%), a few
    scattered diagonals and the first 64 columns."""
    band = max(1, int(0.8 * density * tk / 2))
    cols, diags = max(64, int(0.2 * density * tk)), 16

    def pick(n, extra, forced):
        rows = [torch.cat([forced, torch.randperm(n - len(forced), generator=g)[:extra] + len(forced)]).sort().values
                for _ in range(hq)]
        return torch.stack(rows).int().to(device)
    return VerticalSlash(pick(tk, cols - 64, torch.arange(64)), pick(tk, diags, torch.arange(band)), block)


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


DENSITIES = (0.02, 0.05, 0.1, 0.2, 0.5)


def _flash_ms(q, k, v, scale) -> float:
    """Dense causal attention on SDPA's flash backend alone (on an H100 SDPA picks cuDNN's kernel, ~1.8x faster
    at head_dim 128): the reference the sparse-prefill issue names. NaN where that backend cannot run."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    try:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return _time_ms(lambda: causal_attention(q, k, v, scale))
    except RuntimeError:
        return float("nan")


def run(shape_args, lengths: list[int], dtype=torch.bfloat16) -> list[str]:
    from engine.ops import flex_sparse
    a, dev = shape_args, torch.device("cuda")
    hq, hkv, d = a.num_heads, a.num_kv_heads, a.head_dim
    scale, g = d ** -0.5, torch.Generator().manual_seed(0)
    lines = [f"one layer: {hq} query heads, {hkv} kv heads, head_dim {d}, {str(dtype).removeprefix('torch.')}; ms "
             "(CUDA events, median of 3); pace = dense's time per pair / the kernel's (1.00 = dense SDPA's pace; in "
             "brackets against SDPA's flash backend)"]
    for tk in lengths:
        q = torch.randn(tk, hq, d, device=dev, dtype=dtype)
        k = torch.randn(hkv, tk, d, device=dev, dtype=dtype).transpose(0, 1)        # head-major, as layerwise gives
        v = torch.randn(hkv, tk, d, device=dev, dtype=dtype).transpose(0, 1)
        dense = _time_ms(lambda: causal_attention(q, k, v, scale))
        flash = _flash_ms(q, k, v, scale)
        pairs = causal_pairs(tk, tk) * hq
        mi, xa = MInferencePolicy(min_len=1), XAttentionPolicy(min_len=1)
        est_mi, est_xa = _time_ms(lambda: mi.estimate(q, k, scale)), _time_ms(lambda: xa.estimate(q, k, scale))
        lines.append(f"@{tk}: dense causal (SDPA, the fastest backend it picks) {dense:.1f} ms, SDPA's flash backend "
                     f"{flash:.1f} ms; index building: MInference's estimate "
                     f"{est_mi:.1f} ms ({100 * est_mi / dense:.1f}% of dense), XAttention's {est_xa:.1f} ms "
                     f"({100 * est_xa / dense:.1f}%)")
        lines.append(f"  {'target':>7} {'vertical-slash (Triton)':>30} {'block-sparse (Triton)':>30} "
                     f"{'block-sparse (FlexAttention)':>30}")
        for target in DENSITIES:
            row = f"  {target:>7.2f}"
            pat = _vs_pattern(tk, hq, target, dev, g)
            nb = -(-tk // 128)
            blocks = _band_blocks(tk, hq, 128, max(1, int(target * nb / 4)), max(1, int(target * nb / 4)), dev, g)
            cases = [lambda: vertical_slash_triton(q, k, v, pat, scale),
                     lambda: block_sparse_triton(q, k, v, blocks, 128, scale)]
            if flex_sparse.available(q):
                cases.append(lambda: flex_sparse.block_sparse_flex(q, k, v, blocks, 128, scale))
            for fn in cases:
                kern = _time_ms(fn)
                density = fn()[1].sum().item() / pairs
                row += f"   d {density:.3f} {kern:7.1f} ms pace {dense * density / kern:.2f} ({flash * density / kern:.2f})"
            lines.append(row)
        for name, est, fn in [("minference", est_mi, lambda: mi.kernel(q, k, v, mi.estimate(q, k, scale), scale)),
                              ("xattention", est_xa, lambda: xa.kernel(q, k, v, xa.estimate(q, k, scale), scale))]:
            kern = _time_ms(fn) - est
            density = fn()[1].sum().item() / pairs
            lines.append(f"  {name} own estimate on random data: density {density:.3f}, estimate {est:.1f} + kernel "
                         f"{kern:.1f} ms = {dense / (est + kern):.2f}x dense")
        del q, k, v
        torch.cuda.empty_cache()
    return lines
