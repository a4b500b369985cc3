"""Quest's choice (three kernels) and correction (one program per kv head), and the torch versions they are
tested against (also the CPU path).

`choose(b, scale, k, prev)`: bounds b [Hkv, G, n] (float32, -inf: no candidate) -> a page's score, the attention
share its kv head's query heads would give it (softmax over the candidates per query head, summed over the group;
-1 for no candidate), and the k best pages per kv head: [Hkv, k] ascending, except the lowest-scored one, which
is last (its page loses its tail to the window), their scores, and how many of `prev` [Hkv, k] (the previous
choice) are among them. torch.topk and the two dozen small kernels around it took ~0.2 ms per layer on an H100
at 128K tokens. The kernels: each chunk of CHUNK pages of a head its query heads' max and sum of exp; each chunk
its pages' scores and the k it would choose on its own (any page the head chooses is among them); per head, the
k best of those candidates. A choice finds the k-th largest score by bisection on its bits, the keys held in
registers, and takes the pages tied at it in page order. One program per kv head holding all 8,196 pages of a 128K
context took 38 µs alone and 49 µs in a decode step on an H100 (8 of 132 SMs busy): the chunks spread it
(alone, CUDA graph replays, 8 kv heads of 4 query heads, 125 pages: 8,196 pages 39.1 -> 23.5 µs; a 32K context's
2,044 pages 16.8 -> 20.6 µs, the same under a 128K limit 18.6 -> 23.6 µs).
Its work follows the sequence's pages (`live`, a device scalar), not the `max_model_len` its graph was made for.

`correct(new, slots, page_ids, base, n_rows, page_size)`: a buffer's packed slots [Hkv, k] (the page each holds,
-1: none) and a choice `new` [Hkv, k] -> the host rows to fetch and where they go ([Hkv, k * page_size] each,
-1: nothing), the slots updated in place, the count of rows fetched. The pages `new` has that the slots lack go,
in order, into the slots whose pages `new` drops, in order; the last slot (cut by the window) must hold new's
last page, so a page elsewhere in the slots that belongs there is fetched again (at most one more). Slots that
hold nothing (no speculation was loaded: random weights at 128K) take page i in slot i, without the k x k match
(H200: 6.0 -> 4.5 us). `choose(..., fix=...)` runs the correction in the merge kernel, after its pages are written.
"""
import struct

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs use the torch versions
    triton = None

CHUNK = 512   # pages per program of the choice's first two kernels (H100: 256 and 1024 were slower)
CHOOSE_WARPS, MERGE_WARPS, CORRECT_WARPS = 4, 4, 4   # warps per program (tools/kernel_sweep.py)


def choose_reference(b: torch.Tensor, scale: float, k: int, prev: torch.Tensor):
    valid = b[:, 0] > float("-inf")
    s = torch.softmax(b * scale, dim=-1).sum(1).masked_fill_(~valid, -1.0)   # [Hkv, n]
    top = s.topk(k, dim=-1).indices                                            # best first
    top = torch.cat([top[:, :-1].sort(dim=1).values, top[:, -1:]], dim=1)      # ascending, the lowest last
    kept = (prev[:, :, None] == top[:, None, :]).any(-1).sum(1)
    return top, s.gather(1, top), kept


def correct_reference(new, slots, page_ids, base, n_rows, page_size: int):
    hkv, k = new.shape
    ar = torch.arange(k, device=new.device)
    keep = (slots[:, :, None] == new[:, None, :]).any(-1)                     # loaded and still chosen
    lowest = slots == new[:, -1:]
    keep &= ~lowest | (ar == k - 1)                                            # new's last: only in the last slot
    keep[:, -1] = lowest[:, -1]
    have = (new[:, :, None] == slots.masked_fill(~keep, -2)[:, None, :]).any(-1)
    missing = torch.argsort(have.to(torch.int8), dim=1, stable=True)          # the pages to fetch, in order
    free = torch.argsort(keep.to(torch.int8), dim=1, stable=True)             # the slots they go to, in order
    todo = ar[None] < (~have).sum(1, keepdim=True)
    fetch = new.gather(1, missing)
    t = torch.arange(page_size, device=new.device)
    rows = page_ids[fetch][:, :, None] * page_size + t
    dst = base + free[:, :, None] * page_size + t
    rows = rows.masked_fill_(~todo[:, :, None] | (dst >= n_rows), -1).flatten(1)
    slots.scatter_(1, free, torch.where(todo, fetch, slots.gather(1, free)))
    return rows, dst.flatten(1), (rows >= 0).sum()


if triton is not None:
    @triton.jit
    def _chunk(b, h, c, n_live, scale, s_bh, s_bg, G: tl.constexpr, GP: tl.constexpr, C: tl.constexpr):
        """Chunk c's bounds of head h, scaled [GP, C] (-inf past the live pages), and their pages."""
        g = tl.arange(0, GP)
        p = c * C + tl.arange(0, C)
        x = tl.load(b + h * s_bh + g[:, None] * s_bg + p[None, :], mask=(g[:, None] < G) & (p[None, :] < n_live),
                    other=float("-inf")) * scale
        return x, p

    @triton.jit
    def _stats_kernel(b, stats, live, n, scale, s_bh, s_bg, s_sh, s_sc, G: tl.constexpr, GP: tl.constexpr,
                      C: tl.constexpr):
        """Per (kv head, chunk of C pages): each query head's max and sum of exp over the chunk -> stats[h, c]."""
        h, c = tl.program_id(0), tl.program_id(1)
        x, _ = _chunk(b, h, c, tl.minimum(tl.load(live), n), scale, s_bh, s_bg, G, GP, C)
        m = tl.max(x, axis=1)
        safe = tl.where(m > float("-inf"), m, 0.0)
        z = tl.sum(tl.exp(x - safe[:, None]), 1)
        g = tl.arange(0, GP)
        tl.store(stats + h * s_sh + c * s_sc + g, m)
        tl.store(stats + h * s_sh + c * s_sc + GP + g, z)

    @triton.jit
    def _chunk_kernel(b, stats, scores, cand, live, n, k, scale, s_bh, s_bg, s_sh, s_sc, s_ch, s_cc, s_xh,
                      G: tl.constexpr, GP: tl.constexpr, C: tl.constexpr, NC: tl.constexpr, NCP: tl.constexpr,
                      KP: tl.constexpr, HI: tl.constexpr, ITERS: tl.constexpr):
        """Per (kv head, chunk): the chunk's pages' scores (+ 1; 0: no candidate) into `scores`, and the k it would
        choose on its own (the ties at its k-th score in page order) into cand[h, c] as (key, page), in page order:
        any page the head chooses is among them."""
        h, c = tl.program_id(0), tl.program_id(1)
        n_live = tl.minimum(tl.load(live), n)
        j = tl.arange(0, KP)
        at = cand + h * s_ch + c * s_cc
        if c * C >= n_live:                                     # past the sequence's pages: no candidate
            tl.store(at + j, tl.full([KP], -1, tl.int32))
            return
        cc = tl.arange(0, NCP)                                  # every chunk's stats -> the head's softmax
        g = tl.arange(0, GP)
        ok = (cc[:, None] < NC) & (g[None, :] < G)
        m_all = tl.load(stats + h * s_sh + cc[:, None] * s_sc + g[None, :], mask=ok, other=float("-inf"))
        z_all = tl.load(stats + h * s_sh + cc[:, None] * s_sc + GP + g[None, :], mask=ok, other=0.0)
        m = tl.max(m_all, axis=0)
        safe = tl.where(m > float("-inf"), m, 0.0)
        z = tl.sum(z_all * tl.exp(m_all - safe[None, :]), 0)
        zr = tl.where(z > 0, 1.0 / tl.maximum(z, 1e-30), 0.0)
        x, p = _chunk(b, h, c, n_live, scale, s_bh, s_bg, G, GP, C)
        sc = tl.sum(tl.exp(x - safe[:, None]) * zr[:, None], 0)
        sc = tl.where(tl.max(x, axis=0) > float("-inf"), sc + 1.0, 0.0)
        tl.store(scores + h * s_xh + p, sc, mask=p < n_live)
        key = tl.where(p < n_live, sc, -1.0).to(tl.int32, bitcast=True)
        _, sel, _, last, _ = _kth(key, key, k, HI, ITERS, False)
        take = sel | last
        pos = tl.cumsum(take.to(tl.int32), 0) - 1
        tl.store(at + j, tl.full([KP], -1, tl.int32))
        tl.debug_barrier()
        tl.store(at + pos, key, mask=take)
        tl.store(at + KP + pos, p, mask=take)

    @triton.jit
    def _merge_kernel(cand, scores, pages, out_scores, prev, kept, live, n, k, s_ch, s_xh, s_ph, s_oh, s_vh,
                      slots, page_ids, base, n_rows, rows, dst, count, plan, plan_par, plan_col, s_sh, s_rh, s_dh, s_pp,
                      s_plh, NC: tl.constexpr, KP: tl.constexpr, NP: tl.constexpr, NT: tl.constexpr,
                      HI: tl.constexpr, ITERS: tl.constexpr, FIX: tl.constexpr, PS: tl.constexpr, PSP: tl.constexpr,
                      PLAN: tl.constexpr):
        """Per kv head: the k best of the chunks' candidates (NC * KP, in page order: the first NP, then a tail of
        NT) -> pages (ascending, the lowest-scored last), their scores, and how many of prev are among them; with
        FIX, then the correction toward them (`_correct_head`, the arguments after s_vh)."""
        h = tl.program_id(0)
        i = tl.arange(0, NP)
        i2 = NP + tl.arange(0, NT)
        at = cand + h * s_ch + (i // KP) * 2 * KP + i % KP     # candidate i: chunk i // KP, place i % KP
        at2 = cand + h * s_ch + (i2 // KP) * 2 * KP + i2 % KP
        key = tl.load(at, mask=i < NC * KP, other=-1)
        key2 = tl.load(at2, mask=i2 < NC * KP, other=-1)
        lo, sel, sel2, last, last2 = _kth(key, key2, k, HI, ITERS, True)
        j = tl.arange(0, KP)                                    # kept: read prev before pages (maybe prev) is written
        n_live = tl.minimum(tl.load(live), n)
        pv = tl.load(prev + h * s_vh + j, mask=j < k, other=0)
        pk = tl.load(scores + h * s_xh + pv, mask=(j < k) & (pv >= 0) & (pv < n_live), other=-1.0).to(
            tl.int32, bitcast=True)
        tl.store(kept + h, tl.sum(((pk >= lo) & (j < k)).to(tl.int32), 0))
        pos = tl.cumsum(sel.to(tl.int32), 0) - 1
        pos2 = tl.cumsum(sel2.to(tl.int32), 0) - 1 + tl.sum(sel.to(tl.int32), 0)
        _put(pages, out_scores, h * s_ph, h * s_oh, pos, tl.load(at + KP, mask=sel | last, other=0), key, sel,
             last, k)
        _put(pages, out_scores, h * s_ph, h * s_oh, pos2, tl.load(at2 + KP, mask=sel2 | last2, other=0), key2,
             sel2, last2, k)
        if FIX:                                                 # the pages just written, read back by every thread
            tl.debug_barrier()
            _correct_head(h, pages, slots, page_ids, base, n_rows, rows, dst, count, plan, plan_par, plan_col, k, s_ph,
                          s_sh, s_rh, s_dh, s_pp, s_plh, KP, PS, PSP, PLAN)

    @triton.jit
    def _kth(key, key2, k, HI: tl.constexpr, ITERS: tl.constexpr, TWO: tl.constexpr):
        """Keys (int32 bits of non-negative floats; negative: never taken) in two parts (TWO; else key2 is not
        read) -> the k-th largest, by bisection on the bits, and which keys are taken: those above it and the
        first r equal to it, in order (r makes k in all), the r-th (`last`) apart. Fewer than k keys >= 0: every
        one of them."""
        one = 0x3F800000
        lo = tl.where(_count(key, key2, one, TWO) >= k, one, 0)
        hi = HI                                                 # count(key >= lo) >= k > count(key >= hi)
        for _ in range(ITERS):
            mid = lo + (hi - lo) // 2
            cnt = _count(key, key2, mid, TWO)
            lo = tl.where(cnt >= k, mid, lo)
            hi = tl.where(cnt >= k, hi, mid)
        r = k - _count(key, key2, lo + 1, TWO)
        tie = key == lo
        tie2 = key2 == lo
        rank = tl.cumsum(tie.to(tl.int32), 0) - 1
        rank2 = tl.cumsum(tie2.to(tl.int32), 0) - 1 + tl.sum(tie.to(tl.int32), 0)
        last = tie & (rank == r - 1)
        last2 = tie2 & (rank2 == r - 1)
        sel = ((key > lo) | (tie & (rank < r))) & ~last
        sel2 = ((key2 > lo) | (tie2 & (rank2 < r))) & ~last2
        return lo, sel, sel2, last, last2

    @triton.jit
    def _count(key, key2, x, TWO: tl.constexpr):
        """How many of the keys (both parts, or the first) are >= x."""
        if TWO:
            return tl.sum((key >= x).to(tl.int32), 0) + tl.sum((key2 >= x).to(tl.int32), 0)
        return tl.sum((key >= x).to(tl.int32), 0)

    @triton.jit
    def _put(pages, out_scores, at_p, at_o, pos, p, key, sel, last, k):
        """The chosen pages of one part at their places (and the lowest-scored one last), with their scores."""
        v = key.to(tl.float32, bitcast=True) - 1.0
        tl.store(pages + at_p + pos, p.to(tl.int64), mask=sel)
        tl.store(out_scores + at_o + pos, v, mask=sel)
        tl.store(pages + at_p + (k - 1) + p * 0, p.to(tl.int64), mask=last)
        tl.store(out_scores + at_o + (k - 1) + p * 0, v, mask=last)

    @triton.jit
    def _correct_kernel(new, slots, page_ids, base, n_rows, rows, dst, count, plan, plan_par, plan_col, k, s_nh, s_sh,
                        s_rh, s_dh, s_pp, s_ph, KP: tl.constexpr, PS: tl.constexpr, PSP: tl.constexpr,
                        PLAN: tl.constexpr):
        _correct_head(tl.program_id(0), new, slots, page_ids, base, n_rows, rows, dst, count, plan, plan_par, plan_col,
                      k, s_nh, s_sh, s_rh, s_dh, s_pp, s_ph, KP, PS, PSP, PLAN)

    @triton.jit
    def _correct_head(h, new, slots, page_ids, base, n_rows, rows, dst, count, plan, plan_par, plan_col, k, s_nh, s_sh,
                      s_rh, s_dh, s_pp, s_ph, KP: tl.constexpr, PS: tl.constexpr, PSP: tl.constexpr,
                      PLAN: tl.constexpr):
        """Kv head h's correction (see `correct`)."""
        i = tl.arange(0, KP)
        inside = i < k
        nw = tl.load(new + h * s_nh + i, mask=inside, other=-3, volatile=True).to(tl.int32)   # (the merge's own)
        t = tl.arange(0, PSP)
        at = i[:, None] * PS + t[None, :]
        m2 = inside[:, None] & (t[None, :] < PS)
        every = tl.load(page_ids + nw, mask=inside, other=0).to(tl.int64)   # each chosen page's pool page
        if PLAN:                                                # every chosen page's rows, for the next step's plan
            to_plan = plan + tl.load(plan_par) * s_pp + h * s_ph + tl.load(plan_col)
            tl.store(to_plan + at, every[:, None] * PS + t[None, :], mask=m2)
        old = tl.load(slots + h * s_sh + i, mask=inside, other=-4).to(tl.int32)
        if tl.max(old, 0) < 0:                                  # nothing loaded (no speculation): page i -> slot i
            to = tl.load(base) + at
            go = m2 & (to < tl.load(n_rows))
            tl.store(slots + h * s_sh + i, nw.to(tl.int64), mask=inside)
            tl.store(rows + h * s_rh + at, tl.where(go, every[:, None] * PS + t[None, :], -1), mask=m2)
            tl.store(dst + h * s_dh + at, to, mask=m2)
        else:
            low = tl.sum(tl.where(i == k - 1, nw, 0), 0)       # new's last page
            eq = nw[:, None] == old[None, :]                    # [new i, slot j]
            keep = tl.max(eq.to(tl.int32), axis=0) > 0
            keep = tl.where(i == k - 1, old == low, keep & (old != low)) & inside
            have = tl.max((eq & keep[None, :]).to(tl.int32), axis=1) > 0
            miss = ~have & inside
            free = ~keep & inside
            mrank = tl.cumsum(miss.to(tl.int32), 0) - 1
            frank = tl.cumsum(free.to(tl.int32), 0) - 1
            match = miss[:, None] & free[None, :] & (mrank[:, None] == frank[None, :])   # page i -> slot j
            slot = tl.sum(tl.where(match, i[None, :], 0), 1)    # [new i]
            filled = tl.sum(tl.where(match, nw[:, None], 0), 0)  # [slot j]
            tl.store(slots + h * s_sh + i, tl.where(free, filled, old).to(tl.int64), mask=inside)
            to = tl.load(base) + slot[:, None] * PS + t[None, :]
            go = miss[:, None] & (t[None, :] < PS) & (to < tl.load(n_rows))
            tl.store(rows + h * s_rh + at, tl.where(go, every[:, None] * PS + t[None, :], -1), mask=m2)
            tl.store(dst + h * s_dh + at, to, mask=m2)
        tl.atomic_add(count, tl.sum(tl.sum(go.to(tl.int32), 1), 0).to(tl.int64))


def choose(b: torch.Tensor, scale: float, k: int, prev: torch.Tensor, scratch: torch.Tensor, pages: torch.Tensor,
           scores: torch.Tensor, kept: torch.Tensor, kernel: bool = True, live: torch.Tensor | None = None,
           fix: tuple | None = None) -> bool:
    """Into pages [Hkv, k], scores [Hkv, k], kept [Hkv] (int32): the kernel (scratch [Hkv, n] float32) where
    `kernel` and Triton is there, else the torch version. `pages` may be `prev` itself (read before written).
    live: a device scalar, the kernel reads b's first `live` pages only (the rest are no candidates): its work
    follows the sequence, not the n pages of `max_model_len` its graph was captured for. fix: `correct`'s arguments
    after `new` (slots, page_ids, base, n_rows, page_size, rows, dst, count, plan): then the correction toward the
    choice, by the kernel's last program per kv head (one launch fewer) -> whether the next plan's rows were written
    (see `correct`)."""
    if not kernel or triton is None:
        top, sc, kp = choose_reference(b, scale, k, prev)
        pages.copy_(top), scores.copy_(sc), kept.copy_(kp)
        return False if fix is None else correct(pages, *fix[:8], kernel=False)
    hkv, g, n = b.shape
    nc, kp = triton.cdiv(n, CHUNK), triton.next_power_of_2(k)
    total = nc * kp                                                    # the candidates a head merges
    np2 = 1 << (total.bit_length() - 1)                                # the largest power of two <= total
    nt = triton.next_power_of_2(max(total - np2, 16))                  # the tail after it (masked where empty)
    hi = struct.unpack("<i", struct.pack("<f", g + 1.5))[0]               # above any key (scores sum to <= G)
    iters = (hi - 0x3F800000).bit_length()
    gp = triton.next_power_of_2(g)
    live = torch.full((), n, dtype=torch.long, device=b.device) if live is None else live
    stats = torch.empty(hkv, nc, 2, gp, dtype=torch.float32, device=b.device)
    cand = torch.empty(hkv, nc, 2, kp, dtype=torch.int32, device=b.device)       # (key, page) per chunk
    _stats_kernel[(hkv, nc)](b, stats, live, n, scale, b.stride(0), b.stride(1), stats.stride(0), stats.stride(1),
                             G=g, GP=gp, C=CHUNK, num_warps=CHOOSE_WARPS)
    _chunk_kernel[(hkv, nc)](b, stats, scratch, cand, live, n, k, scale, b.stride(0), b.stride(1), stats.stride(0),
                             stats.stride(1), cand.stride(0), cand.stride(1), scratch.stride(0), G=g, GP=gp, C=CHUNK,
                             NC=nc, NCP=triton.next_power_of_2(nc), KP=kp, HI=hi, ITERS=iters, num_warps=CHOOSE_WARPS)
    args, consts = _correct_args(*fix) if fix is not None else _no_fix(pages)
    _merge_kernel[(hkv,)](cand, scratch, pages, scores, prev, kept, live, n, k, cand.stride(0), scratch.stride(0),
                          pages.stride(0), scores.stride(0), prev.stride(0), *args, NC=nc, KP=kp, NP=np2, NT=nt, HI=hi,
                          ITERS=iters, FIX=fix is not None, **consts, num_warps=MERGE_WARPS)
    return fix is not None and fix[-1] is not None


def _no_fix(pages):     # the merge kernel's correction arguments where it corrects nothing (unread)
    return (pages,) * 10 + (0,) * 5, dict(PS=1, PSP=1, PLAN=False)


def _correct_args(slots, page_ids, base, n_rows, page_size: int, rows, dst, count, plan):
    """-> (the correction's ten tensors and five strides, as `_correct_head` takes them after `new`, leaving out k
    and new's stride), and its constants."""
    p, par, col = plan if plan is not None else (rows, base, base)
    return ((slots, page_ids, base, n_rows, rows, dst, count, p, par, col, slots.stride(0), rows.stride(0),
             dst.stride(0), p.stride(0), p.stride(1)),
            dict(PS=page_size, PSP=triton.next_power_of_2(page_size), PLAN=plan is not None))


def correct(new, slots, page_ids, base, n_rows, page_size: int, rows: torch.Tensor, dst: torch.Tensor,
            count: torch.Tensor, kernel: bool = True, plan=None) -> bool:
    """Into rows, dst [Hkv, k * page_size], slots updated, count (int64 [1]) += rows fetched; base and n_rows are
    device scalars (int64). The kernel where `kernel` and Triton is there, else the torch version. plan: (rows
    [2, Hkv, W], parity, column), the last two device scalars: the kernel also writes every page of `new` as rows
    (page_ids[page] * page_size + t) at plan[parity, h, column:] (the next step's plan; no small torch ops
    between the choice and the correction's gather). -> whether it did."""
    if not kernel or triton is None:
        r, d, c = correct_reference(new, slots, page_ids, base, n_rows, page_size)
        rows.copy_(r), dst.copy_(d), count.add_(c)
        return False
    hkv, k = new.shape
    args, consts = _correct_args(slots, page_ids, base, n_rows, page_size, rows, dst, count, plan)
    _correct_kernel[(hkv,)](new, *args[:10], k, new.stride(0), *args[10:], KP=triton.next_power_of_2(k), **consts,
                            num_warps=CORRECT_WARPS)
    return plan is not None
