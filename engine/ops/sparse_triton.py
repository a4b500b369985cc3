"""The sparse prefill patterns' Triton kernels (engine/ops/sparse_prefill.py defines the patterns and the torch
references they are tested against; its `*_attention` functions dispatch here on CUDA).

Each program is one (query head, query block of BM rows): its q stays in registers while key tiles of BN pass
through an online softmax (`_tile`), the tiles loaded by `_kv`: plain pointer loads, or, on Hopper, bulk copies
through tensor descriptors (TMA) where the strides allow. Tiles wholly before every row of the block run unmasked
in one flat loop (Triton pipelines it), the rest masked. Vertical-slash's columns come from a per-head gathered
copy of their keys and values (made before the launch), and those before a block's first row take one bias per
column instead of a mask per pair (`_tile`'s MASK 1). Both kernels count the pairs they computed. A dense gate may
launch a kernel before it knows its own answer: `SKIP` (a device flag) makes every program exit at once.
"""
from __future__ import annotations

import torch

from engine.ops.sparse_prefill import _BIG, VerticalSlash

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs use the references
    triton = None
try:
    from triton.tools.tensor_descriptor import TensorDescriptor   # (Triton >= 3.4)
except ImportError:
    TensorDescriptor = None

_LOG2E = 1.4426950408889634


if triton is not None:
    @triton.jit
    def _kv(k_src, v_src, c0, cols, ok, kvh, sk_t, sv_t, offs_d, BN: tl.constexpr, D: tl.constexpr,
            TMA: tl.constexpr, MASKED: tl.constexpr):
        """A tile's keys and values [BN, D] at columns `cols` (= c0 + arange(BN) where TMA). TMA: k_src / v_src are
        descriptors of [Tk, Hkv, D] (Hopper's bulk copies; out of range reads zeros), else the kv head's pointers."""
        if TMA:
            kt = k_src.load([c0, kvh, 0]).reshape(BN, D)
            vt = v_src.load([c0, kvh, 0]).reshape(BN, D)
        else:
            c64 = cols.to(tl.int64)
            if MASKED:
                kt = tl.load(k_src + c64[:, None] * sk_t + offs_d[None, :], mask=ok[:, None], other=0.0)
                vt = tl.load(v_src + c64[:, None] * sv_t + offs_d[None, :], mask=ok[:, None], other=0.0)
            else:
                kt = tl.load(k_src + c64[:, None] * sk_t + offs_d[None, :])
                vt = tl.load(v_src + c64[:, None] * sv_t + offs_d[None, :])
        return kt, vt

    @triton.jit
    def _tile(acc, m_i, l_i, n_pairs, q, kt, vt, cols, ok, pos, row_ok, qk_scale, MASK: tl.constexpr):
        """One tile of keys kt and values vt [BN, D] at `cols` (ok: which count) into the online softmax of the
        block's rows. MASK 0: the caller knows every key exists and precedes every row (no masks, no counting);
        1: every key precedes every row, `ok` says which columns count (one bias per column); 2: causal, per pair."""
        if MASK == 2:
            keep = ok[None, :] & (cols[None, :] <= pos[:, None]) & row_ok[:, None]
            s = tl.where(keep, tl.dot(q, tl.trans(kt)) * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            n_pairs += tl.sum(keep.to(tl.int32))
        elif MASK == 1:
            s = tl.dot(q, tl.trans(kt)) * qk_scale + tl.where(ok, 0.0, float("-inf"))[None, :]
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            n_pairs += tl.sum(ok.to(tl.int32)) * tl.sum(row_ok.to(tl.int32))
        else:
            s = tl.dot(q, tl.trans(kt)) * qk_scale
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = m_new
            n_pairs += s.shape[0] * s.shape[1]
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt)
        return acc, m_new, l_i * alpha + tl.sum(p, 1), n_pairs

    @triton.jit
    def _finish(O, PAIRS, acc, l_i, n_pairs, rows, row_ok, h, program, so_t, so_h, offs_d):
        """The block's output rows (a row with no key stays zero) and its count of computed pairs."""
        o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(O + rows[:, None].to(tl.int64) * so_t + h * so_h + offs_d[None, :], o.to(O.dtype.element_ty),
                 mask=row_ok[:, None])
        tl.store(PAIRS + program, n_pairs)

    @triton.jit
    def _columns(acc, m_i, l_i, n_pairs, q, vert, cov, kk, vv, j0, j1, m0, pos, row_ok, qk_scale, offs_d,
                 BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr, MASK: tl.constexpr):
        """A head's vertical columns j0..j1 (positions vert[j], keys and values kk / vv [j, D], gathered), a tile at a
        time; a column a slash run covers (cov, by m0 - column) is left out. MASK 1: every column precedes every row
        (one bias per column), 2: causal, per pair."""
        for j in range(j0, j1, BN):
            idx = j + tl.arange(0, BN)
            ok = idx < j1
            cols = tl.load(vert + idx, mask=ok, other=0)
            covered = tl.load(cov + (m0 - cols + BM - 1), mask=ok, other=1)
            kt, vt = _kv(kk, vv, 0, idx, ok, 0, D, D, offs_d, BN, D, False, True)
            acc, m_i, l_i, n_pairs = _tile(acc, m_i, l_i, n_pairs, q, kt, vt, cols, ok & (covered == 0), pos, row_ok,
                                           qk_scale, MASK)
        return acc, m_i, l_i, n_pairs

    # (prompt sizes, not specialized on: a new prompt length must not compile another kernel in the user's turn)
    @triton.jit(do_not_specialize=["tq", "offset", "n_vert", "n_grp", "cov_len"])
    def _vs_kernel(Q, K, V, KV_K, KV_V, O, VERT, DLO, DHI, COV, VBEF, VCNT, GCNT, PAIRS, SKIP, tq, offset, n_vert,
                   n_grp, cov_len, qk_scale, sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, so_t, so_h,
                   G: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr, SPLIT: tl.constexpr):
        if tl.load(SKIP) != 0:                                                # the dense gate said no (see _skip)
            return
        h, n_mb = tl.program_id(0), tl.num_programs(1)
        m = n_mb - 1 - tl.program_id(1)                                       # the longest rows first
        rows = m * BM + tl.arange(0, BM)
        row_ok = rows < tq
        pos = offset + rows
        m0 = offset + m * BM
        offs_d = tl.arange(0, D)
        q = tl.load(Q + rows[:, None].to(tl.int64) * sq_t + h * sq_h + offs_d[None, :], mask=row_ok[:, None],
                    other=0.0)
        k_ptr = K + (h // G).to(tl.int64) * sk_h
        v_ptr = V + (h // G).to(tl.int64) * sv_h
        acc = tl.zeros((BM, D), dtype=tl.float32)
        m_i = tl.full((BM,), float("-inf"), dtype=tl.float32)
        l_i = tl.zeros((BM,), dtype=tl.float32)
        n_pairs = tl.sum(tl.zeros((BM,), dtype=tl.int32))
        full_rows = m * BM + BM <= tq
        for gi in range(0, tl.load(GCNT + h * n_mb + m)):                   # slash runs, contiguous tiles
            lo = tl.load(DLO + h * n_grp + gi)
            hi = tl.load(DHI + h * n_grp + gi)
            start = tl.maximum(m0 - hi, 0)
            end = tl.minimum(m0 - lo + BM, offset + tq)                     # never past the last key
            split = start + tl.maximum(tl.minimum(end, m0 + 1) - start, 0) // BN * BN * full_rows.to(tl.int32)
            for n in range(start, split, BN):                               # inside the run, before every row
                cols = n + tl.arange(0, BN)                                 # (no masks: a loop Triton pipelines)
                kt, vt = _kv(k_ptr, v_ptr, n, cols, cols < end, 0, sk_t, sv_t, offs_d, BN, D, False, False)
                acc, m_i, l_i, n_pairs = _tile(acc, m_i, l_i, n_pairs, q, kt, vt, cols, cols < end, pos, row_ok,
                                               qk_scale, 0)
            for n in range(split, end, BN):                                 # the run's end, the diagonal
                cols = n + tl.arange(0, BN)
                kt, vt = _kv(k_ptr, v_ptr, n, cols, cols < end, 0, sk_t, sv_t, offs_d, BN, D, False, True)
                acc, m_i, l_i, n_pairs = _tile(acc, m_i, l_i, n_pairs, q, kt, vt, cols, cols < end, pos, row_ok,
                                               qk_scale, 2)
        if SPLIT:
            n_b = tl.load(VBEF + h * n_mb + m)                               # vertical columns before row m0
        else:
            n_b = 0
        n_v = tl.load(VCNT + h * n_mb + m)                                    # ... and before the block's end
        at = h.to(tl.int64) * n_vert                                          # this head's columns, gathered
        kk, vv, c_at = KV_K + at * D, KV_V + at * D, h * cov_len
        acc, m_i, l_i, n_pairs = _columns(acc, m_i, l_i, n_pairs, q, VERT + at, COV + c_at, kk, vv, 0, n_b, m0, pos,
                                          row_ok, qk_scale, offs_d, BM, BN, D, 1)     # before every row
        acc, m_i, l_i, n_pairs = _columns(acc, m_i, l_i, n_pairs, q, VERT + at, COV + c_at, kk, vv, n_b, n_v, m0,
                                          pos, row_ok, qk_scale, offs_d, BM, BN, D, 2)  # the block's own: causal
        _finish(O, PAIRS, acc, l_i, n_pairs, rows, row_ok, h, h * n_mb + m, so_t, so_h, offs_d)

    @triton.jit(do_not_specialize=["tq", "tk", "offset", "max_k"])
    def _bs_kernel(Q, K, V, O, IDX, CNT, FULL, PAIRS, SKIP, tq, tk, offset, max_k, qk_scale,
                   sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, so_t, so_h,
                   G: tl.constexpr, B: tl.constexpr, BN: tl.constexpr, D: tl.constexpr, TMA: tl.constexpr):
        """One query block of one head. Its kept key blocks, ascending: the first FULL lie before every row of the
        block (one flat loop of unmasked tiles, which Triton pipelines), the rest (the diagonal) masked. Programs
        run the longest rows first (grid: heads, then query blocks from the last). TMA: K and V are descriptors."""
        if tl.load(SKIP) != 0:                                             # the dense gate said no (see _skip)
            return
        h, n_mb = tl.program_id(0), tl.num_programs(1)
        m = n_mb - 1 - tl.program_id(1)
        rows = m * B + tl.arange(0, B)
        row_ok = rows < tq
        pos = offset + rows
        offs_d = tl.arange(0, D)
        q = tl.load(Q + rows[:, None].to(tl.int64) * sq_t + h * sq_h + offs_d[None, :], mask=row_ok[:, None],
                    other=0.0)
        kvh = h // G
        if TMA:
            k_src, v_src = K, V
        else:
            k_src, v_src = K + kvh.to(tl.int64) * sk_h, V + kvh.to(tl.int64) * sv_h
        acc = tl.zeros((B, D), dtype=tl.float32)
        m_i = tl.full((B,), float("-inf"), dtype=tl.float32)
        l_i = tl.zeros((B,), dtype=tl.float32)
        n_pairs = tl.sum(tl.zeros((B,), dtype=tl.int32))
        at = h * n_mb + m
        base = at.to(tl.int64) * max_k
        TPB: tl.constexpr = B // BN                                        # tiles per key block
        n_full = tl.load(FULL + at) * TPB
        for t in range(0, n_full):                                         # before every row: no masks
            c0 = tl.multiple_of(tl.load(IDX + base + t // TPB) * B + (t % TPB) * BN, BN)
            cols = c0 + tl.arange(0, BN)
            kt, vt = _kv(k_src, v_src, c0, cols, cols < tk, kvh, sk_t, sv_t, offs_d, BN, D, TMA, False)
            acc, m_i, l_i, n_pairs = _tile(acc, m_i, l_i, n_pairs, q, kt, vt, cols, cols < tk, pos, row_ok,
                                           qk_scale, 0)
        for t in range(n_full, tl.load(CNT + at) * TPB):                   # the diagonal (and a ragged last block)
            c0 = tl.load(IDX + base + t // TPB) * B + (t % TPB) * BN
            cols = c0 + tl.arange(0, BN)
            kt, vt = _kv(k_src, v_src, c0, cols, cols < tk, kvh, sk_t, sv_t, offs_d, BN, D, TMA, True)
            acc, m_i, l_i, n_pairs = _tile(acc, m_i, l_i, n_pairs, q, kt, vt, cols, cols < tk, pos, row_ok,
                                           qk_scale, 2)
        _finish(O, PAIRS, acc, l_i, n_pairs, rows, row_ok, h, at, so_t, so_h, offs_d)

    @triton.jit(do_not_specialize=["tq", "offset", "nkb"])
    def _plan_kernel(KEEP, CNT, IDX, FULL, tq, offset, nkb, s_h, s_m, B: tl.constexpr, NP: tl.constexpr):
        """One (head, query block): its kept key blocks in order (IDX), their count and how many lie before the
        block's first row (FULL: unmasked tiles; 0 for a ragged last block, whose rows are all masked)."""
        h, m, n_mb = tl.program_id(0), tl.program_id(1), tl.num_programs(1)
        n = tl.arange(0, NP)
        keep = tl.load(KEEP + h * s_h + m * s_m + n, mask=n < nkb, other=0) != 0
        at = h * n_mb + m
        tl.store(IDX + at.to(tl.int64) * nkb + tl.cumsum(keep.to(tl.int32), 0) - 1, n, mask=keep)
        tl.store(CNT + at, tl.sum(keep.to(tl.int32), 0))
        full = tl.sum((keep & (n < (offset + m * B + 1) // B)).to(tl.int32), 0)
        ragged = (m == n_mb - 1) & (tq % B != 0)
        tl.store(FULL + at, tl.where(ragged, 0, full))


def _check(q, k, v):
    d = q.shape[-1]
    if d & (d - 1) or q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("sparse prefill kernel: head_dim must be a power of two with contiguous last dims")


def _skip(flag: torch.Tensor | None, device) -> torch.Tensor:
    """A kernel's SKIP: a device scalar that, when nonzero, makes every program exit at once. A dense gate launches
    the kernel before it reads its own answer on the host, so in a sparse layer the GPU computes while the host
    waits for that read (engine/sparse/policy.py); None: never skip."""
    if flag is None:
        return torch.zeros((), dtype=torch.int32, device=device)
    return flag.to(torch.int32)


def vertical_slash_triton(q, k, v, pat: VerticalSlash, scale: float, block_n: int | None = None,
                          num_warps: int | None = None, num_stages: int | None = None, skip=None,
                          split: bool | None = None):
    """Tiles measured best (tools/tune_sparse.py; a sweep of splits, warps, stages and BN on the H100, bf16, bench's
    band + columns patterns at 32K and 128K): pattern block 128 at head_dim 128: BN 128, 8 warps, 3 stages; at
    head_dim 64: BN 64, 4 warps, 3 stages. split (default: pattern block >= 128): the columns before a block's first
    row take one bias per column instead of a mask per pair (block 128: vertical columns' pace 0.27 -> 0.44 of cuDNN
    at head_dim 64, 0.24 -> 0.38 at 128, 128K; at block 64 the per-pair mask measured faster)."""
    _check(q, k, v)
    (tq, hq, d), tk, bm = q.shape, k.shape[0], pat.block
    wide = bm >= 128 and d >= 128 and q.element_size() <= 2      # (fp32 tiles that wide need more shared memory)
    block_n, num_warps = block_n or (128 if wide else 64), num_warps or (8 if wide else 4)
    num_stages = num_stages or (3 if q.element_size() <= 2 else 2)
    split = bm >= 128 if split is None else split
    off, n_mb = tk - tq, -(-tq // bm)
    d_lo, d_hi = pat.groups()
    if d_lo.shape[1] == 0:
        d_lo = d_hi = torch.full((hq, 1), _BIG, dtype=torch.int32, device=q.device)
    m0 = off + torch.arange(n_mb, device=q.device, dtype=torch.int32) * bm
    bounds = (m0 + bm).expand(hq, -1).contiguous()
    vbef = torch.searchsorted(pat.vertical.contiguous(), m0.expand(hq, -1).contiguous()).int()   # before its row 0
    vcnt = torch.searchsorted(pat.vertical.contiguous(), bounds).int()     # verticals before the block's end
    gcnt = torch.searchsorted(d_lo, bounds).int()                          # runs that reach into [0, m0 + BM)
    cov = pat.covered(tk).to(torch.int8).contiguous()
    o = torch.empty_like(q)
    pairs = torch.empty(hq, n_mb, dtype=torch.int32, device=q.device)
    vert = pat.vertical.int().contiguous()
    kvh = (torch.arange(hq, device=q.device) // (hq // k.shape[1]))[:, None]
    kv_k, kv_v = (k[vert.long(), kvh], v[vert.long(), kvh]) if vert.shape[1] else (k, v)
    _vs_kernel[(hq, n_mb)](q, k, v, kv_k, kv_v, o, vert, d_lo, d_hi, cov, vbef, vcnt, gcnt, pairs,
                           _skip(skip, q.device), tq, off, vert.shape[1],
                           d_lo.shape[1], cov.shape[1], scale * _LOG2E, q.stride(0), q.stride(1), k.stride(0),
                           k.stride(1), v.stride(0), v.stride(1), o.stride(0), o.stride(1),
                           G=hq // k.shape[1], BM=bm, BN=block_n, D=d, SPLIT=split,
                           num_warps=num_warps, num_stages=num_stages)
    return o, pairs.sum(dim=1, dtype=torch.int64)


def block_sparse_triton(q, k, v, blocks: torch.Tensor, block: int, scale: float, block_n: int | None = None,
                        num_warps: int | None = None, num_stages: int | None = None, skip=None, tma: bool | None = None):
    """Tiles measured best (H100, block 128, bf16, one layer at 32K and 128K, densities 0.05-1): head_dim 128 BN
    128, 8 warps, 2 stages with TMA (pace 0.50-0.70 of cuDNN's dense at 32K, 0.66-0.78 at 128K), 3 stages
    without; head_dim 64 BN 64, 4 warps, 2 stages (0.43-0.76 / 0.71-0.79 with TMA; 8 warps had given 0.29-0.49).
    tma: K/V tiles by Hopper's bulk copies (None: where the GPU and the strides allow)."""
    _check(q, k, v)
    (tq, hq, d), tk = q.shape, k.shape[0]
    n_mb = blocks.shape[1]
    blocks = blocks.contiguous()
    max_k = blocks.shape[-1]                                             # (the widest row's count would be a sync)
    cnt = torch.empty(hq, n_mb, dtype=torch.int32, device=q.device)
    full, idx = torch.empty_like(cnt), torch.empty(hq, n_mb, max_k, dtype=torch.int32, device=q.device)
    _plan_kernel[(hq, n_mb)](blocks.view(torch.uint8), cnt, idx, full, tq, tk - tq, max_k, blocks.stride(0),
                             blocks.stride(1), B=block, NP=max(16, triton.next_power_of_2(max_k)), num_warps=4)
    o = torch.empty_like(q)
    pairs = torch.empty(hq, n_mb, dtype=torch.int32, device=q.device)
    wide = block >= 128 and d >= 128 and q.element_size() <= 2   # (fp32 tiles that wide need more shared memory)
    bn = min(block_n or (128 if wide else 64), block)
    tma = _tma_ok(k, v, bn) if tma is None else tma
    ks, vs = (_descriptor(k, bn), _descriptor(v, bn)) if tma else (k, v)
    _bs_kernel[(hq, n_mb)](q, ks, vs, o, idx, cnt, full, pairs, _skip(skip, q.device), tq, tk, tk - tq, max_k,
                           scale * _LOG2E, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
                           v.stride(0), v.stride(1), o.stride(0), o.stride(1),
                           G=hq // k.shape[1], B=block, BN=bn, D=d, TMA=tma,
                           num_warps=num_warps or (8 if wide else 4), num_stages=num_stages or (2 if tma or not wide else 3))
    return o, pairs.sum(dim=1, dtype=torch.int64)


def _tma_ok(k, v, bn: int) -> bool:
    """K/V tiles can come by TMA: a Hopper-or-later GPU, 2-byte elements, 16-byte aligned rows and bases."""
    if TensorDescriptor is None or not k.is_cuda or k.element_size() != 2 or torch.cuda.get_device_capability(k.device)[0] < 9:
        return False
    return all(x.stride(2) == 1 and x.stride(0) * 2 % 16 == 0 and x.stride(1) * 2 % 16 == 0 and x.data_ptr() % 16 == 0
               for x in (k, v))


def _descriptor(x: torch.Tensor, bn: int):
    """[Tk, Hkv, D] -> a descriptor of its [bn, 1, D] tiles."""
    return TensorDescriptor(x, list(x.shape), list(x.stride()), [bn, 1, x.shape[2]])
