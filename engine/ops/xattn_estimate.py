"""XAttention's block shares: how much of a query block's attention its antidiagonal estimate puts in each key block.

Queries are the last Tq of Tk positions (offset = Tk - Tq); blocks are B tokens, the stride S divides B and a
block holds C = B / S strided rows (or columns). Strided row r stands for q rows r*S .. r*S+S-1, strided column c
for keys c*S .. c*S+S-1; their score is the antidiagonal sum  sum_i q[r*S + S-1-i] . k[c*S + i]  (a dot product of
S*D-long reordered vectors), times scale / S. Each strided row's scores go through a causal softmax (column c is
masked past the row's last position, offset + r*S + S-1); strided rows past the prompt count for nothing.

    share[h, m, n] = sum over rows r of block m and columns c of block n of softmax(r)[c] / (valid rows of m)

so each query block's shares sum to 1 (key blocks after its last row are 0).

The selection (`select_blocks`): per head and query block, the key blocks with the largest shares until they hold
the threshold tau (a block is kept while the shares ranked before it, equal shares in index order, sum to less
than tau), plus the first key block (the sink) and the query block's own diagonal blocks. The torch form sorts
each row; the Triton kernel finds the last kept share by bisection on its bits (the shares are non-negative, so
their float bits order like integers) and never sorts: one launch for all rows.

`block_shares_reference` is the torch form (the CPU path and the tests' reference): per chunk of query blocks, every
kv head at once, a batched matmul of the reordered rows, a softmax and a sum (~10 small kernels each, a Python
loop). On CUDA the Triton kernel computes it in one launch: a program holds BM strided rows of one query head (whole
query blocks) and walks the key columns up to its last row twice, first for each row's softmax max and sum (online),
then to add each row's normalized probabilities into its block's shares. Nothing of size Tq/S x Tk/S is stored.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs use the reference
    triton = None

_LOG2E = 1.4426950408889634


def block_shares_reference(q: torch.Tensor, k: torch.Tensor, scale: float, stride: int, block: int,
                           chunk_rows: int = 2048, matmul_dtype: torch.dtype | None = None) -> torch.Tensor:
    """q [Tq, Hq, D], k [Tk, Hkv, D] -> share [Hq, ceil(Tq/B), ceil(Tk/B)] float32 (see the module docstring).
    Memory: Hq x chunk_rows/S x Tk/S floats at a time. `matmul_dtype`: the scores' matmul in that type (q and k
    rounded to it once), the softmax and the sums in float32 whatever it is."""
    (tq, hq, d), (tk, hkv) = q.shape, k.shape[:2]
    g, s, b = hq // hkv, stride, block
    off, nqb, nkb = tk - tq, -(-tq // b), -(-tk // b)
    cells = b // s                                                           # strided rows per block
    share = torch.zeros(hq, nqb, nkb, dtype=torch.float32, device=q.device)
    kpos = torch.arange(nkb * cells, device=q.device) * s                    # first key of each strided column
    qb_per_chunk = max(1, chunk_rows // b)          # (query rows, as the spec says: it had counted strided rows, so a
                                                    # chunk held S times as many and never cut a 7K prompt's square)
    if matmul_dtype is not None:
        q, k = q.to(matmul_dtype), k.to(matmul_dtype)
    # every kv head at once (one batched matmul and one pass of each elementwise op a chunk: the per-head loop's
    # small ops cost more than their work at a CPU's 7K prompt); the keys of each cell reversed, not the queries
    kh = F.pad(k, (0, 0, 0, 0, 0, nkb * b - tk)).view(nkb * cells, s, hkv, d).flip(1).permute(2, 0, 1, 3) \
        .reshape(hkv, nkb * cells, s * d)                                                   # [Hkv, Tk/S, S*D]
    for m0 in range(0, nqb, qb_per_chunk):
        m1 = min(nqb, m0 + qb_per_chunk)
        kb = min(nkb, (off + m1 * b - 1) // b + 1)              # key blocks after the chunk's last row: masked
        rows = q[m0 * b:m1 * b]                                                              # [r, Hq, D]
        if rows.shape[0] < (m1 - m0) * b:
            rows = F.pad(rows, (0, 0, 0, 0, 0, (m1 - m0) * b - rows.shape[0]))
        qs = rows.view(-1, s, hkv, g, d).permute(2, 3, 0, 1, 4).reshape(hkv, -1, s * d)      # [Hkv, G*r/S, S*D]
        a = torch.bmm(qs, kh[:, :kb * cells].transpose(1, 2)).float().mul_(scale / s).view(hq, -1, kb * cells)
        last = off + (m0 * cells + torch.arange(a.shape[1], device=q.device)) * s + s - 1
        a.masked_fill_(kpos[None, None, :kb * cells] > last[None, :, None], float("-inf"))
        a = a.softmax(dim=-1, dtype=torch.float32)
        if last[-1] - s + 1 >= tk:
            a[:, last - s + 1 >= tk] = 0                                        # padding rows past the prompt
        part = a.view(hq, m1 - m0, cells, kb, cells).sum(dim=(2, 4))            # [Hq, chunk, kb]
        share[:, m0:m1, :kb] = part / part.sum(dim=-1, keepdim=True).clamp_min(1e-30)
    return share


if triton is not None:
    @triton.jit
    def _scores(q_ptr, k_ptr, r, c, tq, tk, sq_t, sk_t, d, dm, S: tl.constexpr, BM: tl.constexpr,
                BN: tl.constexpr, PREC: tl.constexpr):
        """[BM, BN] antidiagonal sums of strided rows r and columns c (unscaled), fp32."""
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for i in range(S):
            qi = r * S + (S - 1 - i)
            ki = c * S + i
            qt = tl.load(q_ptr + qi[:, None].to(tl.int64) * sq_t + d[None, :], mask=(qi < tq)[:, None] & dm[None, :],
                         other=0.0)
            kt = tl.load(k_ptr + ki[:, None].to(tl.int64) * sk_t + d[None, :], mask=(ki < tk)[:, None] & dm[None, :],
                         other=0.0)
            acc += tl.dot(qt, tl.trans(kt), input_precision=PREC)
        return acc

    # (prompt sizes, not specialized on: a new prompt length must not compile another kernel in the user's turn)
    @triton.jit(do_not_specialize=["tq", "tk", "offset", "n_rows", "n_cols", "nqb", "nkb"])
    def _shares_kernel(Q, K, OUT, tq, tk, offset, n_rows, n_cols, nqb, nkb, qk_scale, sq_t, sq_h, sk_t, sk_h,
                       so_h, so_m, G: tl.constexpr, S: tl.constexpr, C: tl.constexpr, BM: tl.constexpr,
                       BN: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, PREC: tl.constexpr):
        h, n_tiles = tl.program_id(0), tl.num_programs(1)
        t = n_tiles - 1 - tl.program_id(1)                                   # the longest rows first
        r = t * BM + tl.arange(0, BM)
        row_ok = r < n_rows
        last = offset + r * S + S - 1                                        # each strided row's last position
        d = tl.arange(0, DP)
        dm = d < D
        q_ptr = Q + h.to(tl.int64) * sq_h
        k_ptr = K + (h // G).to(tl.int64) * sk_h
        r_hi = tl.minimum(t * BM + BM, n_rows) - 1
        end = tl.minimum(n_cols, (offset + r_hi * S + S - 1) // S + 1)      # columns up to the last row's end
        m_i = tl.full((BM,), float("-inf"), dtype=tl.float32)
        l_i = tl.zeros((BM,), dtype=tl.float32)
        for n in range(0, end, BN):                                           # pass 1: each row's max and sum
            c = n + tl.arange(0, BN)
            s = _scores(q_ptr, k_ptr, r, c, tq, tk, sq_t, sk_t, d, dm, S, BM, BN, PREC) * qk_scale
            s = tl.where(c[None, :] * S <= last[:, None], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            l_i = l_i * tl.exp2(m_i - m_new) + tl.sum(tl.exp2(s - m_new[:, None]), 1)
            m_i = m_new
        inv = tl.where(row_ok, 1.0 / l_i, 0.0)
        QB: tl.constexpr = BM // C
        KB: tl.constexpr = BN // C
        qb = t * QB + tl.arange(0, QB)
        rows_in = tl.minimum(tl.maximum(n_rows - qb * C, 1), C).to(tl.float32)   # valid strided rows per block
        out = OUT + h.to(tl.int64) * so_h + qb[:, None].to(tl.int64) * so_m
        for n in range(0, end, BN):                                           # pass 2: shares per block pair
            c = n + tl.arange(0, BN)
            s = _scores(q_ptr, k_ptr, r, c, tq, tk, sq_t, sk_t, d, dm, S, BM, BN, PREC) * qk_scale
            s = tl.where(c[None, :] * S <= last[:, None], s, float("-inf"))
            p = tl.exp2(s - m_i[:, None]) * inv[:, None]
            blk = tl.sum(tl.sum(tl.reshape(p, (QB, C, KB, C)), 3), 1) / rows_in[:, None]     # [QB, KB]
            kb = n // C + tl.arange(0, KB)
            tl.store(out + kb[None, :], blk, mask=(qb < nqb)[:, None] & (kb < nkb)[None, :])


def block_shares_triton(q: torch.Tensor, k: torch.Tensor, scale: float, stride: int, block: int,
                        block_m: int | None = None, block_n: int | None = None, num_warps: int = 8,
                        num_stages: int = 3) -> torch.Tensor:
    """The Triton kernel (one launch); tiles of block_m strided rows by block_n strided columns, each a multiple
    of the block's C = block / stride strided rows. Tiles measured best (tools/tune_sparse.py and a sweep with
    block_n 32 too; H200, bf16, stride 16, block 128): 128 x 128 at head_dim 128 (Qwen3-4B's shape: 1.52 ms at
    32K, 24.1 ms at 128K, against the torch form's 4.45 and 34.6), 64 x 128 at head_dim 64 (the default model's:
    0.12 ms at 8K, 0.42 ms at 32K, against 0.86 and 1.78); 8 warps, 3 stages."""
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError("xattention estimate kernel: q and k need contiguous last dims")
    (tq, hq, d), tk = q.shape, k.shape[0]
    cells = block // stride
    wide = q.element_size() <= 2                     # fp32 tiles of 128 x 128 need more shared memory than there is
    bm = max(cells, block_m or (128 if d >= 128 and wide else 64))
    bn = max(cells, block_n or (128 if wide else 64))
    num_stages = num_stages if wide else min(num_stages, 2)
    n_rows, nqb, nkb = -(-tq // stride), -(-tq // block), -(-tk // block)
    share = torch.zeros(hq, nqb, nkb, dtype=torch.float32, device=q.device)
    grid = (hq, triton.cdiv(n_rows, bm))
    _shares_kernel[grid](q, k, share, tq, tk, tk - tq, n_rows, nkb * cells, nqb, nkb, scale / stride * _LOG2E,
                         q.stride(0), q.stride(1), k.stride(0), k.stride(1), share.stride(0), share.stride(1),
                         G=hq // k.shape[1], S=stride, C=cells, BM=bm, BN=bn, D=d, DP=max(16, triton.next_power_of_2(d)),
                         PREC="ieee" if q.dtype == torch.float32 else "tf32",
                         num_warps=num_warps, num_stages=num_stages)
    return share


def select_blocks_reference(share: torch.Tensor, threshold: float, tq: int, tk: int, block: int) -> torch.Tensor:
    """share [Hq, nQB, nKB] -> kept blocks, bool (see the module docstring). A stable sort: equal shares are cut
    in index order (an unstable one may order them differently from run to run on CUDA)."""
    p, order = share.sort(dim=-1, descending=True, stable=True)
    before = p.cumsum(dim=-1) - p
    keep = torch.zeros_like(p, dtype=torch.bool).scatter_(-1, order, (before < threshold) & (p > 0))
    nqb, nkb, dev = share.shape[1], share.shape[2], share.device
    first = (tk - tq + torch.arange(nqb, device=dev) * block) // block              # the diagonal: a query block's
    last = (tk - tq + torch.clamp(torch.arange(1, nqb + 1, device=dev) * block, max=tq) - 1) // block  # own blocks
    n = torch.arange(nkb, device=dev)
    keep |= ((n[None] >= first[:, None]) & (n[None] <= last[:, None]))[None]
    keep[:, :, 0] = True
    return keep


if triton is not None:
    @triton.jit(do_not_specialize=["tq", "offset", "nkb"])
    def _select_kernel(SHARE, KEEP, tq, offset, nkb, threshold, s_h, s_m, k_h, k_m, B: tl.constexpr,
                       NP: tl.constexpr):
        h, m = tl.program_id(0), tl.program_id(1)
        n = tl.arange(0, NP)
        inside = n < nkb
        x = tl.load(SHARE + h * s_h + m * s_m + n, mask=inside, other=0.0)
        key = x.to(tl.int32, bitcast=True)
        lo = tl.sum(tl.zeros((NP,), tl.int32), 0) - 1              # F(t) = sum of the shares above t (bits)
        hi = lo * 0 + 0x3F800001                                   # F(lo) >= tau or lo = -1; F(hi) = 0 < tau
        for _ in range(31):
            mid = lo + (hi - lo) // 2
            below = tl.sum(tl.where(key > mid, x, 0.0), 0) < threshold
            hi = tl.where(below, mid, hi)
            lo = tl.where(below, lo, mid)
        t = tl.min(tl.where((key >= hi) & (x > 0), key, 0x7F800000), 0)   # the last kept share (inf: none)
        tie = (key == t) & inside
        tx = tl.where(tie, x, 0.0)
        before = tl.sum(tl.where(key > t, x, 0.0), 0) + tl.cumsum(tx, 0) - tx
        keep = ((key > t) | (tie & (before < threshold))) & (x > 0)
        first = (offset + m * B) // B
        last = (offset + tl.minimum((m + 1) * B, tq) - 1) // B
        keep = keep | (n == 0) | ((n >= first) & (n <= last))
        tl.store(KEEP + h * k_h + m * k_m + n, keep.to(tl.uint8), mask=inside)


def select_blocks(share: torch.Tensor, threshold: float, tq: int, tk: int, block: int) -> torch.Tensor:
    """The kept blocks [Hq, nQB, nKB] bool: the Triton kernel on CUDA (one launch; the torch form is ~15 small
    kernels, host time the GPU waits for on a small model), the torch form elsewhere."""
    if share.is_cuda and triton is not None:
        return select_blocks_triton(share, threshold, tq, tk, block)
    return select_blocks_reference(share, threshold, tq, tk, block)


def select_blocks_triton(share: torch.Tensor, threshold: float, tq: int, tk: int, block: int) -> torch.Tensor:
    hq, nqb, nkb = share.shape
    keep = torch.empty(hq, nqb, nkb, dtype=torch.bool, device=share.device)
    _select_kernel[(hq, nqb)](share, keep.view(torch.uint8), tq, tk - tq, nkb, threshold, share.stride(0),
                              share.stride(1), keep.stride(0), keep.stride(1), B=block,
                              NP=max(16, triton.next_power_of_2(nkb)), num_warps=4)
    return keep


def cpu_matmul_dtype(dtype: torch.dtype) -> torch.dtype | None:
    """The type of the estimate's matmul on this CPU: bfloat16 for float32 inputs where the CPU multiplies bfloat16
    in hardware, with AMX tiles or AVX-512 BF16 dot products (a 7K prompt's scores matmul, [3, 1311, 1024] x [1024,
    437]: 4.8 ms a head in float32 against 1.0 in bfloat16 on a Xeon with AMX; 31.0 against 9.2 ms for the three
    heads on a 2-core AMD EPYC with AVX-512 BF16, where a 7K layer's whole estimate took 27 -> 17 ms). Elsewhere
    bfloat16 may be slower than float32, so it stays. Only the block choice rests on it, as with a bf16 model's Triton
    kernel on CUDA: on three real layers of a 7K prefill (the default model, stride 16, tau 0.9) 2-4 of ~2,000-3,300
    kept blocks differed from the float32 estimate's and the density agreed to four digits (docs/sparse-policies.md)."""
    if dtype != torch.float32:
        return None
    hardware = (getattr(torch.cpu, name, None) for name in ("_is_amx_tile_supported", "_is_avx512_bf16_supported"))
    return torch.bfloat16 if any(has is not None and has() for has in hardware) else None


def block_shares(q: torch.Tensor, k: torch.Tensor, scale: float, stride: int, block: int,
                 chunk_rows: int = 2048) -> torch.Tensor:
    """The shares: the Triton kernel on CUDA, the torch form elsewhere (its matmul per `cpu_matmul_dtype`)."""
    if q.is_cuda and triton is not None:
        return block_shares_triton(q, k, scale, stride, block)
    return block_shares_reference(q, k, scale, stride, block, chunk_rows,
                                  cpu_matmul_dtype(q.dtype) if q.device.type == "cpu" else None)
