"""One row times a weight matrix (a decode step's token through a linear layer), y = x W^T + b, in one kernel.

At one row a linear layer only streams its weights from memory, and cuBLAS's kernels for it reach ~2.1-2.6 TB/s
of the H100's ~3.35 (bf16, weights out of L2: qkv 6144x2560 14.7 us, o 2560x4096 12.7, gate/up 19456x2560 38.8,
down 2560x9728 22.8, the 151936x2560 head 273; some as split-K with a second reduce kernel). This kernel gives each
program BN rows and walks their K columns in BK-wide tiles, accumulating x * w in float32 and summing once at the
end: 12.9 / 9.6 / 34.3 / 21.0 / 246 us there, and 2.3-2.7 us against 3.6-5.3 on the default model's small shapes
(a scratch sweep of tile shapes, warps and stages: CUDA graph replays cycling through enough weight copies to miss
L2). `linear` picks it for one row on CUDA; everything else (prefill, the CPU) stays `F.linear`. `gemv_reference`
is the math in torch.
"""
import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs use F.linear
    triton = None

ROWS = 4          # BN: weight rows per program
WARPS = 8
STAGES = 3


def gemv_reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, w, b)


if triton is not None:
    @triton.jit
    def _gemv_kernel(x, w, b, y, N, K, s_w, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, BN: tl.constexpr,
                     BK: tl.constexpr):
        rn = tl.program_id(0) * BN + tl.arange(0, BN)
        inside = rn < N
        row = tl.where(inside, rn, 0).to(tl.int64) * s_w          # rows past N read row 0 (no mask on the loads)
        acc = tl.zeros((BN, BK), tl.float32)
        for k0 in range(0, K, BK):
            k = k0 + tl.arange(0, BK)
            if EVEN_K:
                wt = tl.load(w + row[:, None] + k[None, :])
                xk = tl.load(x + k)
            else:
                wt = tl.load(w + row[:, None] + k[None, :], mask=k[None, :] < K, other=0.0)
                xk = tl.load(x + k, mask=k < K, other=0.0)
            acc += wt.to(tl.float32) * xk.to(tl.float32)[None, :]
        out = tl.sum(acc, axis=1)
        if HAS_BIAS:
            out += tl.load(b + rn, mask=inside, other=0.0).to(tl.float32)
        tl.store(y + rn, out.to(y.dtype.element_ty), mask=inside)


def _tile(k: int) -> int:
    """BK: 512 for long rows (the 9728-wide down projection measured best there), else 128; a width that divides
    K where one does, so the loads need no mask."""
    for bk in ((512, 256, 128) if k >= 8192 else (128, 64)):
        if k % bk == 0:
            return bk
    return 128


def config(n: int, k: int) -> tuple[int, int, int]:
    """(BN, BK, warps) for an n x k weight. Tall matrices of short rows (n >= 4096, k <= 4096 a multiple of 512)
    take 8 rows of 512-wide tiles on 4 warps: H200, `python tools/kernel_sweep.py --parts gemv` (CUDA graph replays,
    weights out of L2), Qwen3-4B's qkv 6144x2560 11.0 -> 9.6 us, gate/up 19456x2560 27.6 -> 26.1 (of 72 tile
    shapes, warps and stages these were within 1% of the best); o 2560x4096 and down 2560x9728 were best as before
    (8.3 and 15.6 us against the best 8.2 and 15.6)."""
    if n >= 4096 and k <= 4096 and k % 512 == 0:
        return 8, 512, 4
    return ROWS, _tile(k), WARPS


def gemv(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None,
         out: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] holding one row, w [N, K] (rows contiguous), b [N] or None -> [..., N] in x's dtype (into `out`, N
    contiguous elements, if given)."""
    n, k = w.shape
    y = torch.empty(*x.shape[:-1], n, dtype=x.dtype, device=x.device) if out is None else out
    bn, bk, warps = config(n, k)
    _gemv_kernel[(triton.cdiv(n, bn),)](x, w, w if b is None else b, y, n, k, w.stride(0), HAS_BIAS=b is not None,
                                        EVEN_K=k % bk == 0, BN=bn, BK=bk, num_warps=warps, num_stages=STAGES)
    return y


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, with one row on CUDA through the kernel; into `out` if given (the kernel writes it itself)."""
    if (triton is not None and x.is_cuda and x.numel() == x.shape[-1] and x.stride(-1) == 1 and w.stride(-1) == 1
            and x.dtype == w.dtype and (out is None or (out.is_contiguous() and out.dtype == x.dtype))):
        return gemv(x, w, b, out)
    y = F.linear(x, w, b)
    return y if out is None else out.copy_(y)
