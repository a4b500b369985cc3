"""Quest's page scores, per query head, for every page of a sequence, each in one kernel:

- bounds: for a query q and each page's element-wise key min and max, the upper bound of q·k over the page,
  sum_d max(q_d * min_d, q_d * max_d) (`page_bounds`);
- sketch: for a query already projected into a layer's r leading key directions and every key kept there, the
  page's largest estimated logit, max over its tokens of qr·kr (`sketch_scores`; engine/sparse/page_index.py).

Layouts: kb [pool_pages, Hkv, 2D] (a page's [min | max] per kv head, one layer), q [Hq, D] (the group of kv head
h is query heads h*G .. h*G+G-1), pages [n] pool page of each sequence page, valid [n] the candidates.
Out [Hkv, G, n] float32, -inf where not valid.

The torch version gathers the n pages' bounds (a 33 MB copy per layer at 128K for Qwen3-4B), transposes them and
multiplies; measured on an H100 that was most of Quest's scoring time. The kernel reads each candidate page's
bounds once, straight from the pool, and never reads the others. `page_bounds_reference` is the torch version:
the CPU path and the tests' reference.
"""
import os

import torch

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs use the reference
    triton = None

PAGES = 64   # pages per program (bounds)
SKETCH_PAGES = 8    # pages per program (sketch: each page's page_size keys of r values are read)
SKETCH_WARPS = 2    # warps per sketch program. H200, 8,192 pages, r 32 (tools/kernel_sweep.py): 23.1 us; the
                    # broadcast product's best 27.6 (8 pages, 1 warp), 29.0 at its old 32 pages on 4 warps
SKETCH_DOT = True   # 16-bit keys: a program's logits as one tl.dot (tensor cores) rather than a broadcast product


def page_bounds_reference(kb: torch.Tensor, q: torch.Tensor, pages: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """sum_d max(q_d min_d, q_d max_d) = [min(q, 0) | max(q, 0)] · [min | max]: one batched matmul."""
    hkv, d = kb.shape[1], q.shape[-1]
    qg = q.reshape(hkv, -1, d).to(kb.dtype)
    qq = torch.cat([qg.clamp(max=0), qg.clamp(min=0)], dim=-1)                  # [Hkv, G, 2D]
    b = torch.bmm(qq, kb.index_select(0, pages).permute(1, 2, 0)).float()       # [Hkv, G, n]
    return b.masked_fill_(~valid, float("-inf"))


if triton is not None:
    @triton.jit
    def _program_pages(pages, valid, n, live, P: tl.constexpr):
        """This program's P sequence pages: their index, which are inside n, which are candidates (before `live`'s
        count), their pool ids, and the live count. The three loads are independent (none waits for another)."""
        p = tl.program_id(1) * P + tl.arange(0, P)
        inside = p < n
        page = tl.load(pages + p, mask=inside, other=0).to(tl.int64)
        v = tl.load(valid + p, mask=inside, other=0)
        n_live = tl.load(live)
        return p, inside, (v != 0) & inside & (p < n_live), page, n_live

    @triton.jit
    def _beyond(n_live, out, h, n, s_oh, s_og, G: tl.constexpr, P: tl.constexpr):
        """Whether this program's pages all lie at or after n_live (no candidates): then it writes -inf there and
        reads nothing more."""
        p = tl.program_id(1) * P + tl.arange(0, P)
        past = tl.program_id(1) * P >= n_live
        if past:
            for g in tl.static_range(G):
                tl.store(out + h * s_oh + g * s_og + p, tl.full([P], float("-inf"), tl.float32), mask=p < n)
        return past

    @triton.jit
    def _page_bounds_kernel(kb, q, pages, valid, live, out, n, s_kp, s_kh, s_qh, s_oh, s_og,
                            G: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, P: tl.constexpr):
        h = tl.program_id(0)
        p, inside, ok, page, n_live = _program_pages(pages, valid, n, live, P)
        if _beyond(n_live, out, h, n, s_oh, s_og, G, P):
            return
        d = tl.arange(0, DP)
        at = page[:, None] * s_kp + h * s_kh + d[None, :]
        m = ok[:, None] & (d[None, :] < D)
        kmin = tl.load(kb + at, mask=m, other=0.0).to(tl.float32)
        kmax = tl.load(kb + at + D, mask=m, other=0.0).to(tl.float32)
        for g in tl.static_range(G):
            qv = tl.load(q + (h * G + g) * s_qh + d, mask=d < D, other=0.0).to(tl.float32)[None, :]
            b = tl.sum(tl.maximum(qv * kmin, qv * kmax), axis=1)
            tl.store(out + h * s_oh + g * s_og + p, tl.where(ok, b, float("-inf")), mask=inside)


def _live(live: torch.Tensor | None, n: int, device) -> torch.Tensor:
    """The kernels' page count past which nothing is read: `live`, or all n pages."""
    return torch.full((), n, dtype=torch.long, device=device) if live is None else live


def page_bounds(kb: torch.Tensor, q: torch.Tensor, pages: torch.Tensor, valid: torch.Tensor,
                kernel: bool = True, live: torch.Tensor | None = None) -> torch.Tensor:
    """-> [Hkv, G, n] float32 bounds (see the module docstring); the kernel where `kernel` and Triton is there,
    else the reference. live: a device scalar, no page at or after it is a candidate: the kernel reads nothing
    there (-inf out), so its work follows the sequence rather than the n pages its graph was captured for."""
    if not kernel or triton is None or kb.stride(-1) != 1 or q.stride(-1) != 1:
        return page_bounds_reference(kb, q, pages, valid)
    hkv, d, n = kb.shape[1], q.shape[-1], pages.shape[0]
    g = q.shape[0] // hkv
    out = torch.empty(hkv, g, n, dtype=torch.float32, device=q.device)
    _page_bounds_kernel[(hkv, triton.cdiv(n, PAGES))](
        kb, q, pages, valid.view(torch.uint8), _live(live, n, q.device), out, n, kb.stride(0), kb.stride(1),
        q.stride(0), out.stride(0), out.stride(1), G=g, D=d, DP=triton.next_power_of_2(d), P=PAGES, num_warps=4)
    return out


def sketch_scores_reference(keys: torch.Tensor, qr: torch.Tensor, pages: torch.Tensor, valid: torch.Tensor,
                            page_size: int) -> torch.Tensor:
    """keys [pool_rows, Hkv, r] (pool page p's tokens at rows p * page_size ..), qr [Hkv, G, r], pages [n],
    valid [n] -> [Hkv, G, n] float32: max over each page's tokens of qr·k, -inf where not valid."""
    hkv, g, _ = qr.shape
    rows = (pages[:, None] * page_size + torch.arange(page_size, device=pages.device)).flatten()
    k = keys.index_select(0, rows)                                             # [n * ps, Hkv, r]
    logits = torch.bmm(qr.to(keys.dtype), k.permute(1, 2, 0)).float()          # [Hkv, G, n * ps]
    best = logits.view(hkv, g, -1, page_size).amax(-1)
    return best.masked_fill_(~valid, float("-inf"))


if triton is not None:
    @triton.jit
    def _sketch_scores_kernel(keys, qr, pages, valid, live, out, n, s_kr, s_kh, s_qh, s_qg, s_oh, s_og,
                              G: tl.constexpr, R: tl.constexpr, RP: tl.constexpr, PS: tl.constexpr,
                              PSP: tl.constexpr, P: tl.constexpr, DOT: tl.constexpr, GQ: tl.constexpr,
                              UPCAST: tl.constexpr):
        h = tl.program_id(0)
        p, inside, ok, page, n_live = _program_pages(pages, valid, n, live, P)
        if _beyond(n_live, out, h, n, s_oh, s_og, G, P):
            return
        t = tl.arange(0, PSP)
        j = tl.arange(0, RP)
        row = page[:, None] * PS + t[None, :]                                  # [P, PSP] pool rows
        if DOT:                                  # [P * PSP, RP] keys x [RP, GQ] queries on the tensor cores
            at = tl.reshape(row, [P * PSP])
            use = tl.reshape(ok[:, None] & (t[None, :] < PS), [P * PSP])
            k2 = tl.load(keys + at[:, None] * s_kr + h * s_kh + j[None, :], mask=use[:, None] & (j[None, :] < R),
                         other=0.0)
            gq = tl.arange(0, GQ)
            qt = tl.load(qr + h * s_qh + gq[None, :] * s_qg + j[:, None], mask=(gq[None, :] < G) & (j[:, None] < R),
                         other=0.0).to(k2.dtype)
            if UPCAST:                           # (the interpreter multiplies bfloat16 bits as integers)
                k2, qt = k2.to(tl.float32), qt.to(tl.float32)
            logit = tl.reshape(tl.dot(k2, qt), [P, PSP, GQ])
            best = tl.max(tl.where((t < PS)[None, :, None], logit, float("-inf")), axis=1)          # [P, GQ]
            tl.store(out + h * s_oh + gq[None, :] * s_og + p[:, None], tl.where(ok[:, None], best, float("-inf")),
                     mask=inside[:, None] & (gq[None, :] < G))
            return
        m = (ok[:, None] & (t[None, :] < PS))[:, :, None] & (j[None, None, :] < R)
        k = tl.load(keys + row[:, :, None] * s_kr + h * s_kh + j[None, None, :], mask=m, other=0.0).to(tl.float32)
        for g in tl.static_range(G):
            qv = tl.load(qr + h * s_qh + g * s_qg + j, mask=j < R, other=0.0).to(tl.float32)
            logit = tl.sum(k * qv[None, None, :], axis=2)                       # [P, PSP]
            logit = tl.where(t[None, :] < PS, logit, float("-inf"))
            best = tl.max(logit, axis=1)
            tl.store(out + h * s_oh + g * s_og + p, tl.where(ok, best, float("-inf")), mask=inside)


def sketch_scores(keys: torch.Tensor, qr: torch.Tensor, pages: torch.Tensor, valid: torch.Tensor, page_size: int,
                  kernel: bool = True, live: torch.Tensor | None = None) -> torch.Tensor:
    """-> [Hkv, G, n] float32 (see `sketch_scores_reference`): one kernel where `kernel` and Triton is there (it
    reads each candidate page's keys once, straight from the sketch; the torch version copies every page's keys
    out first, then multiplies and reduces), else the torch version. live: as in `page_bounds`."""
    if not kernel or triton is None or keys.stride(-1) != 1 or qr.stride(-1) != 1:
        return sketch_scores_reference(keys, qr, pages, valid, page_size)
    hkv, g, r = qr.shape
    n = pages.shape[0]
    out = torch.empty(hkv, g, n, dtype=torch.float32, device=qr.device)
    dot = SKETCH_DOT and keys.dtype in (torch.bfloat16, torch.float16)       # (tl.dot's tiles: 16 at least)
    rp = max(16, triton.next_power_of_2(r)) if dot else triton.next_power_of_2(r)
    _sketch_scores_kernel[(hkv, triton.cdiv(n, SKETCH_PAGES))](
        keys, qr, pages, valid.view(torch.uint8), _live(live, n, qr.device), out, n, keys.stride(0), keys.stride(1),
        qr.stride(0), qr.stride(1), out.stride(0), out.stride(1), G=g, R=r, RP=rp, PS=page_size,
        PSP=triton.next_power_of_2(page_size), P=SKETCH_PAGES, DOT=dot, GQ=max(16, triton.next_power_of_2(g)),
        UPCAST=_INTERPRETED, num_warps=SKETCH_WARPS)
    return out


def page_scores(kb: torch.Tensor, q: torch.Tensor, pages: torch.Tensor, valid: torch.Tensor, parts: int = 1,
                centroid: bool = False, kernel: bool = True, live: torch.Tensor | None = None) -> torch.Tensor:
    """A page's score per query head [Hkv, G, n] (-inf where not valid), for Quest's choice. kb [pool_pages *
    parts, Hkv, 2D or 3D] holds each page's `parts` rows in a run (pool page p's at p * parts ..): the page's
    score is the largest of its parts' bounds; with `centroid` (kb's third D: the part's mean key) each part's
    bound is first averaged with q·(its mean key) (a torch gather beside the kernel)."""
    n, d = pages.shape[0], q.shape[-1]
    if parts > 1:
        pages = (pages[:, None] * parts + torch.arange(parts, device=pages.device)).flatten()
        valid = valid[:, None].expand(n, parts).flatten()
    b = page_bounds(kb[..., :2 * d], q, pages, valid, kernel, None if live is None or parts > 1 else live)
    if centroid:
        mean = kb.index_select(0, pages)[..., 2 * d:]                                   # [n * parts, Hkv, D]
        qg = q.reshape(mean.shape[1], -1, d).to(mean.dtype)
        b.add_(torch.bmm(qg, mean.permute(1, 2, 0)).float()).mul_(0.5)                 # -inf stays -inf
    return b if parts == 1 else b.view(*b.shape[:2], n, parts).amax(-1)
