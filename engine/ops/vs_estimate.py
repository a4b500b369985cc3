"""MInference's estimate: how much attention the last n queries give each key column and each diagonal.

Rows r = 0..n-1 are the prompt's last n queries, at positions pos_r = Tk - n + r; a[r, j] is row r's causal
softmax over the keys j <= pos_r (scaled dot products). Per query head:

    col[j]  = sum over r of a[r, j]                 (vertical lines: keys every late query looks at)
    diag[d] = sum over r of a[r, pos_r - d]         (slash lines: relative positions that matter), d in [0, Tk)

`vs_scores_reference` is the torch form (the CPU path and the tests' reference): per kv head a [G, n, Tk] matmul,
a softmax, a column sum and a scatter-add along the diagonals, ~10 kernels each in a Python loop. On CUDA two
Triton launches do it, storing nothing of size n x Tk:

- `_stats_kernel`, per (head, row tile, key split): each row's softmax max and sum over the split's keys (online).
- `_scores_kernel`, per (head, row tile, block of BD diagonals d0..d0+BD-1): the rows' stats combined over the
  splits, then the scores of the rows against the window of BM + BD keys that holds those diagonals for every
  row (key j = pos_r0 - d0 - BD + 1 + c, c < BM + BD), as one tensor-core product. Row i's diagonal d0 + t sits
  at window column c = BD - 1 + i - t, so a gather along the columns turns the tile's diagonals into columns, and
  a sum over the rows gives the diagonal scores. The column scores are the tile's column sums: the window's
  first BD columns belong to this diagonal block (the blocks' windows overlap by BM keys), and the first block
  also takes the keys after pos_r0. Tiles of rows add up with atomics (one tile, the default n = 64: each score
  is written once, so the result does not depend on the order).

Then the selection (`vs_select`): per head the largest columns and diagonals (forced ones first, equal scores in
index order), sorted, with the number of (query, key) pairs they reach; one launch on CUDA, a stable sort elsewhere.
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs use the reference
    triton = None

_LOG2E = 1.4426950408889634
_GATHER = triton is not None and hasattr(tl, "gather")   # (a Triton without tl.gather takes the torch form)
_SPLITS = 32             # key splits of the stats pass (the scores pass combines them)


def vs_scores_reference(q: torch.Tensor, k: torch.Tensor, scale: float, n: int) -> torch.Tensor:
    """q [Tq, Hq, D] (the last Tq of Tk positions), k [Tk, Hkv, D] -> [2, Hq, Tk] float32: (col, diag) of the
    last n queries (see the module docstring). Memory: G x n x Tk floats at a time (one kv head)."""
    tk, hkv, hq = k.shape[0], k.shape[1], q.shape[1]
    g = hq // hkv
    pos = torch.arange(tk - n, tk, device=q.device)
    cols = torch.arange(tk, device=q.device)
    future = cols[None] > pos[:, None]                                    # [n, Tk]
    diag = (pos[:, None] - cols[None]).clamp_(min=0).flatten()            # [n * Tk]: each entry's diagonal
    scores = torch.zeros(2, hq, tk, dtype=torch.float32, device=q.device)
    col_score, diag_score = scores
    for h in range(hkv):
        qh = q[-n:, h * g:(h + 1) * g].transpose(0, 1)                   # [G, n, D]
        a = (qh @ k[:, h].T).float().mul_(scale).masked_fill_(future, float("-inf")).softmax(dim=-1)
        col_score[h * g:(h + 1) * g] = a.sum(dim=1)
        diag_score[h * g:(h + 1) * g].scatter_add_(1, diag.expand(g, -1), a.flatten(1))
    return scores


if triton is not None:
    @triton.jit
    def _rows(Q, h, rt, n, tq, sq_t, sq_h, BM: tl.constexpr, DP: tl.constexpr, D: tl.constexpr):
        """The row tile's queries [BM, DP] (zeros past the n rows) and which rows are real."""
        r = rt * BM + tl.arange(0, BM)
        d = tl.arange(0, DP)
        ok = r < n
        q = tl.load(Q + h.to(tl.int64) * sq_h + (tq - n + r)[:, None].to(tl.int64) * sq_t + d[None, :],
                    mask=ok[:, None] & (d < D)[None, :], other=0.0)
        return q, r, ok

    @triton.jit
    def _keys(K, hk, j, tk, sk_t, sk_h, DP: tl.constexpr, D: tl.constexpr):
        d = tl.arange(0, DP)
        return tl.load(K + hk.to(tl.int64) * sk_h + j[:, None].to(tl.int64) * sk_t + d[None, :],
                       mask=((j >= 0) & (j < tk))[:, None] & (d < D)[None, :], other=0.0)

    @triton.jit(do_not_specialize=["n", "tq", "tk", "split"])
    def _stats_kernel(Q, K, M, L, n, tq, tk, split, qk_scale, sq_t, sq_h, sk_t, sk_h, G: tl.constexpr,
                      BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, NS: tl.constexpr,
                      PREC: tl.constexpr):
        h, rt, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        q, r, ok = _rows(Q, h, rt, n, tq, sq_t, sq_h, BM, DP, D)
        pos = tk - n + r
        m_i = tl.full((BM,), float("-inf"), dtype=tl.float32)
        l_i = tl.zeros((BM,), dtype=tl.float32)
        lo = s * split
        hi = tl.minimum(lo + split, tl.minimum(tk, tk - n + rt * BM + BM))   # keys after the tile's last row: none
        for j0 in range(lo, hi, BN):
            j = j0 + tl.arange(0, BN)
            kt = _keys(K, h // G, j, tk, sk_t, sk_h, DP, D)
            x = tl.dot(q, tl.trans(kt), input_precision=PREC) * qk_scale
            x = tl.where((j[None, :] <= pos[:, None]) & (j[None, :] < hi), x, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(x, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            l_i = l_i * tl.exp2(m_i - m_safe) + tl.sum(tl.exp2(x - m_safe[:, None]), 1)
            m_i = m_new
        at = (h * tl.num_programs(1) * BM + r) * NS + s
        tl.store(M + at, m_i, mask=ok)
        tl.store(L + at, l_i, mask=ok)

    @triton.jit(do_not_specialize=["n", "tq", "tk"])
    def _scores_kernel(Q, K, M, L, COL, DIAG, n, tq, tk, qk_scale, sq_t, sq_h, sk_t, sk_h, G: tl.constexpr,
                       BM: tl.constexpr, BD: tl.constexpr, BW: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
                       NS: tl.constexpr, PREC: tl.constexpr):
        h, rt, db = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        q, r, ok = _rows(Q, h, rt, n, tq, sq_t, sq_h, BM, DP, D)
        at = (h * tl.num_programs(1) * BM + r)[:, None] * NS + tl.arange(0, NS)[None, :]
        ms = tl.load(M + at, mask=ok[:, None], other=float("-inf"))            # [BM, NS] the splits' stats
        ls = tl.load(L + at, mask=ok[:, None], other=0.0)
        m_i = tl.max(ms, 1)
        m_i = tl.where(ok, m_i, 0.0)
        l_i = tl.sum(ls * tl.exp2(ms - m_i[:, None]), 1)
        inv = tl.where(ok, 1.0 / tl.where(ok, l_i, 1.0), 0.0)
        pos = tk - n + r
        d0 = db * BD
        c = tl.arange(0, BW)
        j = tk - n + rt * BM - d0 - BD + 1 + c                                  # the window's keys
        kt = _keys(K, h // G, j, tk, sk_t, sk_h, DP, D)
        x = tl.dot(q, tl.trans(kt), input_precision=PREC) * qk_scale
        live = (j[None, :] >= 0) & (j[None, :] <= pos[:, None]) & ok[:, None]
        p = tl.where(live, tl.exp2(x - m_i[:, None]) * inv[:, None], 0.0)     # [BM, BW]
        col = tl.sum(p, 0)
        own = ((c < BD) | (c * 0 + db == 0)) & (j >= 0) & (j < tk)    # (a block, not a scalar, for the interpreter)
        base = h.to(tl.int64) * tk
        tl.atomic_add(COL + base + j, col, mask=own, sem="relaxed")
        t = tl.arange(0, BD)
        idx = BD - 1 + tl.arange(0, BM)[:, None] - t[None, :]                   # row i's diagonal d0 + t
        dsum = tl.sum(tl.gather(p, idx, 1), 0)
        tl.atomic_add(DIAG + base + d0 + t, dsum, mask=d0 + t < tk, sem="relaxed")


def vs_scores_triton(q: torch.Tensor, k: torch.Tensor, scale: float, n: int, block_n: int = 128,
                     num_warps: int = 4) -> torch.Tensor:
    """The two Triton launches (see the module docstring); rows in tiles of 64, diagonals in blocks of 64."""
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError("minference estimate kernel: q and k need contiguous last dims")
    (tq, hq, d), tk = q.shape, k.shape[0]
    bm, bd = 64, 64
    rt = triton.cdiv(n, bm)
    split = triton.cdiv(triton.cdiv(tk, _SPLITS), block_n) * block_n
    m = torch.full((hq, rt * bm, _SPLITS), float("-inf"), dtype=torch.float32, device=q.device)
    l = torch.zeros_like(m)
    scores = torch.zeros(2, hq, tk, dtype=torch.float32, device=q.device)
    col, diag = scores
    common = dict(G=hq // k.shape[1], BM=bm, D=d, DP=max(16, triton.next_power_of_2(d)), NS=_SPLITS,
                  PREC="ieee" if q.dtype == torch.float32 else "tf32", num_warps=num_warps)
    qk = scale * _LOG2E
    _stats_kernel[(hq, rt, triton.cdiv(tk, split))](q, k, m, l, n, tq, tk, split, qk, q.stride(0), q.stride(1),
                                                    k.stride(0), k.stride(1), BN=block_n, **common)
    _scores_kernel[(hq, rt, triton.cdiv(tk, bd))](q, k, m, l, col, diag, n, tq, tk, qk, q.stride(0), q.stride(1),
                                                   k.stride(0), k.stride(1), BD=bd, BW=bm + bd, **common)
    return scores


if triton is not None:
    @triton.jit
    def _keys_of(row, i, tk, forced):
        """Scores as ordered int32 keys (non-negative floats order as their bits); forced ones +inf, padding -1."""
        x = tl.load(row + i, mask=i < tk, other=0.0)
        key = tl.where(i < forced, 0x7F800000, x.to(tl.int32, bitcast=True))
        return tl.where(i < tk, key, -1)

    @triton.jit
    def _reach_to(t, tq, tk):
        """R(t) = sum over offsets u = 0..t of min(tq, tk - u) (queries a diagonal or column at u reaches), int64."""
        t = t.to(tl.int64)
        off = tk - tq
        tail = off * tq + (tq * (tq + 1) - (tk - t - 1) * (tk - t)) // 2
        return tl.where(t < 0, 0, tl.where(t < off, (t + 1) * tq, tail))

    @triton.jit(do_not_specialize=["tq", "tk", "nv", "ns", "sink", "recent"])
    def _select_kernel(SC, OUT, REACH, tq, tk, nv, ns, sink, recent, s_w, s_h, o_w, o_h,
                       BM: tl.constexpr, CH: tl.constexpr):
        h, w = tl.program_id(0), tl.program_id(1)                       # w: 0 the columns, 1 the diagonals
        want = tl.where(w == 0, nv, ns)
        forced = tl.where(w == 0, sink, recent)
        row = SC + w.to(tl.int64) * s_w + h.to(tl.int64) * s_h
        out = OUT + w.to(tl.int64) * o_w + h.to(tl.int64) * o_h
        bins = tl.arange(0, 256)
        prefix = tl.sum(bins * 0, 0)                                   # (int32 scalars)
        high = prefix
        left = want + prefix                                           # how many still to take at or below prefix
        for step in tl.static_range(4):                                # radix select, 8 bits at a time
            shift = 24 - 8 * step
            hist = bins * 0
            for c0 in range(0, tk, CH):
                key = _keys_of(row, c0 + tl.arange(0, CH), tk, forced)
                match = ((key & high) == prefix) & (key >= 0)
                got = tl.histogram(tl.where(match, (key >> shift) & 255, 0), 256)
                hist += got - tl.where(bins == 0, CH - tl.sum(match.to(tl.int32), 0), 0)
            at_least = tl.sum(hist, 0) - tl.cumsum(hist, 0) + hist     # keys with this digit or a larger one
            digit = tl.max(tl.where(at_least >= left, bins, -1), 0)
            left -= tl.sum(tl.where(bins > digit, hist, 0), 0)
            prefix = prefix | (digit << shift)
            high = high | ((255 << shift) & 0x7FFFFFFF)                  # (keys are non-negative int32)
        taken = prefix * 0                                             # prefix is now the want-th largest key
        ties = taken
        for c0 in range(0, tk, CH):                                     # the kept ones, in index order
            i = c0 + tl.arange(0, CH)
            key = _keys_of(row, i, tk, forced)
            eq = key == prefix
            keep = (key > prefix) | (eq & (ties + tl.cumsum(eq.to(tl.int32), 0) - 1 < left))
            tl.store(out + taken + tl.cumsum(keep.to(tl.int32), 0) - 1, i, mask=keep)
            taken += tl.sum(keep.to(tl.int32), 0)
            ties += tl.sum(eq.to(tl.int32), 0)
        tl.debug_barrier()                                              # (this program's stores, read back below)
        total = tl.sum(tl.zeros((CH,), tl.int64), 0)
        for k0 in range(0, want, CH):                                   # the queries they reach
            k = k0 + tl.arange(0, CH)
            inside = k < want
            s = tl.load(out + k, mask=inside, other=0)
            before = tl.load(out + k - 1, mask=inside & (k > 0), other=-1)   # the previous kept diagonal
            lo = tl.maximum(tl.maximum(s - BM + 1, before + 1), 0)     # its run's offsets no earlier run covered
            run = _reach_to(s, tq, tk) - _reach_to(lo - 1, tq, tk)
            col = tl.minimum(tq, tk - s).to(tl.int64)
            total += tl.sum(tl.where(inside, tl.where(w == 0, col, run), 0), 0)
        tl.store(REACH + w * tl.num_programs(0) + h, total)


def vs_select_reference(scores: torch.Tensor, nv: int, ns: int, sink: int, recent: int):
    """The torch form of the selection (a stable sort: equal scores in index order) -> (vertical, slash)."""
    col, diag = scores.clone()
    col[:, :sink] = float("inf")
    diag[:, :recent] = float("inf")

    def pick(x, n):
        return x.sort(dim=1, descending=True, stable=True).indices[:, :n].sort(dim=1).values.int()
    return pick(col, nv), pick(diag, ns)


def vs_select(scores: torch.Tensor, nv: int, ns: int, sink: int, recent: int, block: int,
              tq: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """scores [2, Hq, Tk] (columns, diagonals) -> the kept ones, sorted: the nv largest columns and ns largest
    diagonals of each head, the first `sink` columns and `recent` diagonals always, equal scores taken in index
    order. On CUDA one launch (a program per head and kind: a radix select, 8 bits a pass, then the kept ones in
    order; torch's topk and sorts were ~0.6 ms of host-bound launches per layer on the H100), which also sums the
    queries they reach, [2, Hq] int64: per kept column min(tq, Tk - c), and over the offsets the diagonals' runs
    of `block` cover min(tq, Tk - t), as `VerticalSlash.covered` counts them (None elsewhere). Returns
    (vertical [Hq, nv], slash [Hq, ns] int32, reach)."""
    if not (scores.is_cuda and triton is not None):
        return (*vs_select_reference(scores, nv, ns, sink, recent), None)
    return vs_select_triton(scores, nv, ns, sink, recent, block, tq)


def vs_select_triton(scores: torch.Tensor, nv: int, ns: int, sink: int, recent: int, block: int, tq: int,
                     chunk: int = 4096, num_warps: int = 8):
    scores = scores.contiguous()
    _, hq, tk = scores.shape
    out = torch.empty(2, hq, max(nv, ns), dtype=torch.int32, device=scores.device)
    reach = torch.empty(2, hq, dtype=torch.int64, device=scores.device)
    _select_kernel[(hq, 2)](scores, out, reach, tq, tk, nv, ns, min(sink, nv), min(recent, ns), scores.stride(0),
                            scores.stride(1), out.stride(0), out.stride(1), BM=block, CH=chunk, num_warps=num_warps)
    return out[0, :, :nv], out[1, :, :ns], reach


def vs_scores(q: torch.Tensor, k: torch.Tensor, scale: float, n: int) -> torch.Tensor:
    """[2, Hq, Tk] (col, diag) scores: the Triton kernels on CUDA, the torch form elsewhere."""
    if q.is_cuda and _GATHER:
        return vs_scores_triton(q if q.stride(-1) == 1 else q.contiguous(), k if k.stride(-1) == 1 else k.contiguous(),
                                scale, n)
    return vs_scores_reference(q, k, scale, n)
