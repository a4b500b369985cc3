"""Quest's choice and correction as two kernels (one program per kv head each), and the torch versions they are
tested against (also the CPU path).

`choose(b, scale, k, prev)`: bounds b [Hkv, G, n] (float32, -inf: no candidate) -> a page's score, the attention
share its kv head's query heads would give it (softmax over the candidates per query head, summed over the group;
-1 for no candidate), and the k best pages per kv head: [Hkv, k] ascending, except the lowest-scored one, which
is last (its page loses its tail to the window), their scores, and how many of `prev` [Hkv, k] (the previous
choice) are among them. torch.topk and the two dozen small kernels around it took ~0.2 ms per layer on an H100
at 128K tokens; the kernel scores, finds the k-th largest score by bisection on its bits (the head's scores held in registers) and writes the pages.
Its work follows the sequence's pages (`live`, a device scalar), not the `max_model_len` its graph was made for.

`correct(new, slots, page_ids, base, n_rows, page_size)`: a buffer's packed slots [Hkv, k] (the page each holds,
-1: none) and a choice `new` [Hkv, k] -> the host rows to fetch and where they go ([Hkv, k * page_size] each,
-1: nothing), the slots updated in place, the count of rows fetched. The pages `new` has that the slots lack go,
in order, into the slots whose pages `new` drops, in order; the last slot (cut by the window) must hold new's
last page, so a page elsewhere in the slots that belongs there is fetched again (at most one more).
"""
import struct

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs use the torch versions
    triton = None

CHUNK = 1024   # pages per loop iteration of the softmax passes


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
    def _choose_kernel(b, scores, pages, out_scores, prev, kept, live, n, k, scale, s_bh, s_bg, s_sh, s_ph, s_oh, s_vh,
                       G: tl.constexpr, GP: tl.constexpr, C: tl.constexpr, KP: tl.constexpr, NP: tl.constexpr,
                       NT: tl.constexpr, N1: tl.constexpr, N2: tl.constexpr, HI: tl.constexpr, ITERS: tl.constexpr):
        h = tl.program_id(0)
        n_live = tl.minimum(tl.load(live), n)                   # the sequence's pages: the rest are never read
        g = tl.arange(0, GP)
        m = tl.full([GP], float("-inf"), tl.float32)
        z = tl.zeros([GP], tl.float32)
        for c0 in range(0, n_live, C):                          # per query head: max and sum of exp (online)
            p = c0 + tl.arange(0, C)
            x = tl.load(b + h * s_bh + g[:, None] * s_bg + p[None, :], mask=(g[:, None] < G) & (p[None, :] < n_live),
                        other=float("-inf")) * scale
            m_new = tl.maximum(m, tl.max(x, axis=1))
            safe = tl.where(m_new > float("-inf"), m_new, 0.0)
            z = z * tl.exp(tl.where(m > float("-inf"), m - safe, float("-inf"))) + tl.sum(tl.exp(x - safe[:, None]), 1)
            m = m_new
        safe = tl.where(m > float("-inf"), m, 0.0)
        zr = tl.where(z > 0, 1.0 / tl.maximum(z, 1e-30), 0.0)
        for c0 in range(0, n_live, C):                          # scores + 1, so that every key is >= 0 (-1 -> 0)
            p = c0 + tl.arange(0, C)
            x = tl.load(b + h * s_bh + g[:, None] * s_bg + p[None, :], mask=(g[:, None] < G) & (p[None, :] < n_live),
                        other=float("-inf")) * scale
            s = tl.sum(tl.exp(x - safe[:, None]) * zr[:, None], 0)
            tl.store(scores + h * s_sh + p, tl.where(tl.max(x, axis=0) > float("-inf"), s + 1.0, 0.0), mask=p < n_live)
        tl.debug_barrier()                                      # (the keys below are other threads' scores)
        # the head's keys are held in registers: as many as the sequence's pages need (three sizes, so that a short
        # context under a long max_model_len does not pay the long one's choice), the largest in two parts
        if n_live <= N2:
            _pick(scores, pages, out_scores, prev, kept, h, n_live, k, s_sh, s_ph, s_oh, s_vh, KP, N2, 16, HI, ITERS)
        elif n_live <= N1:
            _pick(scores, pages, out_scores, prev, kept, h, n_live, k, s_sh, s_ph, s_oh, s_vh, KP, N1, 16, HI, ITERS)
        else:
            _pick(scores, pages, out_scores, prev, kept, h, n_live, k, s_sh, s_ph, s_oh, s_vh, KP, NP, NT, HI, ITERS)

    @triton.jit
    def _pick(scores, pages, out_scores, prev, kept, h, n, k, s_sh, s_ph, s_oh, s_vh, KP: tl.constexpr,
              NP: tl.constexpr, NT: tl.constexpr, HI: tl.constexpr, ITERS: tl.constexpr):
        """The k best of the head's n keys (scores + 1), held in registers in two parts: the first NP pages (NP a
        power of two) and the NT after them (a tail: n = 8,196 pages, a 128K context with room for its answer,
        would pad to 16,384 otherwise) -> pages, out_scores and kept."""
        p = tl.arange(0, NP)
        p2 = NP + tl.arange(0, NT)
        key = tl.load(scores + h * s_sh + p, mask=p < n, other=-1.0).to(tl.int32, bitcast=True)
        key2 = tl.load(scores + h * s_sh + p2, mask=p2 < n, other=-1.0).to(tl.int32, bitcast=True)
        # the k-th largest key by bisection on the bits (non-negative floats order as their int32 bits); a
        # candidate's key is in [1, G + 1], no candidate's 0 (the answer where there are fewer than k candidates:
        # the bisection then never leaves 0)
        one = 0x3F800000
        lo = tl.where(_count(key, key2, one) >= k, one, 0)
        hi = HI                                                 # count(key >= lo) >= k > count(key >= hi)
        for _ in range(ITERS):
            mid = lo + (hi - lo) // 2
            cnt = _count(key, key2, mid)
            lo = tl.where(cnt >= k, mid, lo)
            hi = tl.where(cnt >= k, hi, mid)
        j = tl.arange(0, KP)                                    # kept: read prev before pages (maybe prev) is written
        pv = tl.load(prev + h * s_vh + j, mask=j < k, other=0)
        pk = tl.load(scores + h * s_sh + pv, mask=(j < k) & (pv >= 0) & (pv < n), other=-1.0).to(tl.int32,
                                                                                                   bitcast=True)
        tl.store(kept + h, tl.sum(((pk >= lo) & (j < k)).to(tl.int32), 0))
        r = k - _count(key, key2, lo + 1)                       # the first r keys equal to lo (by page) are in
        tie = (key == lo) & (p < n)
        tie2 = (key2 == lo) & (p2 < n)
        rank = tl.cumsum(tie.to(tl.int32), 0) - 1
        rank2 = tl.cumsum(tie2.to(tl.int32), 0) - 1 + tl.sum(tie.to(tl.int32), 0)
        last = tie & (rank == r - 1)                            # the lowest-scored chosen page: the last slot
        last2 = tie2 & (rank2 == r - 1)
        sel = ((key > lo) | (tie & (rank < r))) & ~last & (p < n)
        sel2 = ((key2 > lo) | (tie2 & (rank2 < r))) & ~last2 & (p2 < n)
        pos = tl.cumsum(sel.to(tl.int32), 0) - 1
        pos2 = tl.cumsum(sel2.to(tl.int32), 0) - 1 + tl.sum(sel.to(tl.int32), 0)
        _put(pages, out_scores, h * s_ph, h * s_oh, pos, p, key, sel, last, k)
        _put(pages, out_scores, h * s_ph, h * s_oh, pos2, p2, key2, sel2, last2, k)

    @triton.jit
    def _count(key, key2, x):
        """How many of the head's keys (both parts) are >= x."""
        return tl.sum((key >= x).to(tl.int32), 0) + tl.sum((key2 >= x).to(tl.int32), 0)

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
        h = tl.program_id(0)
        i = tl.arange(0, KP)
        inside = i < k
        nw = tl.load(new + h * s_nh + i, mask=inside, other=-3).to(tl.int32)
        t = tl.arange(0, PSP)
        at = i[:, None] * PS + t[None, :]
        m2 = inside[:, None] & (t[None, :] < PS)
        if PLAN:                                                # every chosen page's rows, for the next step's plan
            every = tl.load(page_ids + nw, mask=inside, other=0).to(tl.int64)
            to_plan = plan + tl.load(plan_par) * s_pp + h * s_ph + tl.load(plan_col)
            tl.store(to_plan + at, every[:, None] * PS + t[None, :], mask=m2)
        old = tl.load(slots + h * s_sh + i, mask=inside, other=-4).to(tl.int32)
        low = tl.sum(tl.where(i == k - 1, nw, 0), 0)           # new's last page
        eq = nw[:, None] == old[None, :]                        # [new i, slot j]
        keep = tl.max(eq.to(tl.int32), axis=0) > 0
        keep = tl.where(i == k - 1, old == low, keep & (old != low)) & inside
        have = tl.max((eq & keep[None, :]).to(tl.int32), axis=1) > 0
        miss = ~have & inside
        free = ~keep & inside
        mrank = tl.cumsum(miss.to(tl.int32), 0) - 1
        frank = tl.cumsum(free.to(tl.int32), 0) - 1
        match = miss[:, None] & free[None, :] & (mrank[:, None] == frank[None, :])   # page i -> slot j
        slot = tl.sum(tl.where(match, i[None, :], 0), 1)        # [new i]
        filled = tl.sum(tl.where(match, nw[:, None], 0), 0)     # [slot j]
        tl.store(slots + h * s_sh + i, tl.where(free, filled, old).to(tl.int64), mask=inside)
        pid = tl.load(page_ids + nw, mask=miss, other=0).to(tl.int64)
        to = tl.load(base) + slot[:, None] * PS + t[None, :]
        src = pid[:, None] * PS + t[None, :]
        go = miss[:, None] & (t[None, :] < PS) & (to < tl.load(n_rows))
        tl.store(rows + h * s_rh + at, tl.where(go, src, -1), mask=m2)
        tl.store(dst + h * s_dh + at, to, mask=m2)
        tl.atomic_add(count, tl.sum(tl.sum(go.to(tl.int32), 1), 0).to(tl.int64))


def choose(b: torch.Tensor, scale: float, k: int, prev: torch.Tensor, scratch: torch.Tensor, pages: torch.Tensor,
           scores: torch.Tensor, kept: torch.Tensor, kernel: bool = True, live: torch.Tensor | None = None) -> None:
    """Into pages [Hkv, k], scores [Hkv, k], kept [Hkv] (int32): the kernel (scratch [Hkv, n] float32) where
    `kernel` and Triton is there, else the torch version. `pages` may be `prev` itself (read before written).
    live: a device scalar, the kernel reads b's first `live` pages only (the rest are no candidates): its work
    follows the sequence, not the n pages of `max_model_len` its graph was captured for."""
    if not kernel or triton is None:
        top, sc, kp = choose_reference(b, scale, k, prev)
        pages.copy_(top), scores.copy_(sc), kept.copy_(kp)
        return
    hkv, g, n = b.shape
    np2 = 1 << (max(n, 16).bit_length() - 1)                           # the largest power of two <= n (and 16)
    nt = triton.next_power_of_2(max(n - np2, 16))                      # the tail after it (masked where empty)
    hi = struct.unpack("<i", struct.pack("<f", g + 1.5))[0]               # above any key (scores sum to <= G)
    live = torch.full((), n, dtype=torch.long, device=b.device) if live is None else live
    _choose_kernel[(hkv,)](b, scratch, pages, scores, prev, kept, live, n, k, scale, b.stride(0), b.stride(1),
                           scratch.stride(0), pages.stride(0), scores.stride(0), prev.stride(0), G=g,
                           GP=triton.next_power_of_2(g), C=CHUNK, KP=triton.next_power_of_2(k), NP=np2, NT=nt,
                           N1=max(np2 // 4, 16), N2=max(np2 // 16, 16), HI=hi, ITERS=(hi - 0x3F800000).bit_length(),
                           num_warps=8 if np2 <= 8192 else 16)


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
    p, par, col = plan if plan is not None else (rows, base, base)
    _correct_kernel[(hkv,)](new, slots, page_ids, base, n_rows, rows, dst, count, p, par, col, k, new.stride(0),
                            slots.stride(0), rows.stride(0), dst.stride(0), p.stride(0), p.stride(1),
                            KP=triton.next_power_of_2(k), PS=page_size, PSP=triton.next_power_of_2(page_size),
                            PLAN=plan is not None, num_warps=8)
    return plan is not None
