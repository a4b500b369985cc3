"""Decode's per-layer kernels, one configuration against another, on CUDA: GPU time per call from CUDA graph replays.

    python tools/kernel_sweep.py                      # every part
    python tools/kernel_sweep.py --parts gemv,correct

Parts (Qwen3-4B's shapes, Quest at 128K tokens with budget 2048 and 16-token pages):
  gemv     engine/ops/gemv.py on the four projections: rows per program, K tile, warps, stages; weights cycled
           through enough copies that each call reads them from memory, not L2 (as in a decode step)
  choose   engine/ops/quest_select.py's choice: pages per chunk program, warps (the chunks', the merge's)
  correct  its correction: warps, with nothing loaded (no speculation) and with a speculation ~10% kept
  sketch   engine/ops/quest_score.py's sketch scores: pages per program, warps, broadcast product or tl.dot
Each call's time is the median over --repeats replays of a graph of many calls (16; GEMV: four passes over the weight
copies), divided by the calls. The six fastest configurations are printed, and the current one, marked with *.
"""
import argparse
import itertools
import statistics

import torch

from engine.ops import gemv as gm
from engine.ops import quest_score as qs
from engine.ops import quest_select as sel


def graph_us(fn, calls: int, repeats: int) -> float:
    """Median µs of fn(i) over a graph of `calls` calls (i = 0..calls-1)."""
    fn(0)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(calls):
            fn(i)
    g.replay()
    out = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) * 1e3 / calls)
    return statistics.median(out)


def row(name: str, us: float, best: float, current: bool) -> None:
    print(f"  {'*' if current else ' '} {name:40} {us:8.1f} us  {us / best:5.2f}x the best")


def sweep(title: str, configs: dict, current) -> None:
    best = min(configs.values())
    print(title)
    for cfg, us in sorted(configs.items(), key=lambda kv: kv[1])[:6] + ([(current, configs[current])]
                                                                        if current in configs else []):
        row(", ".join(f"{k}={v}" for k, v in cfg), us, best, cfg == current)


def gemv_part(a) -> None:
    dev = torch.device("cuda")
    for n, k in ((6144, 2560), (2560, 4096), (19456, 2560), (2560, 9728)):
        copies = max(2, -(-256 * 2 ** 20 // (n * k * 2)))                  # 256 MiB in all: past the 50 MB L2
        ws = [torch.randn(n, k, dtype=torch.bfloat16, device=dev) for _ in range(copies)]
        xk = torch.randn(k, dtype=torch.bfloat16, device=dev)
        y = torch.empty(n, dtype=torch.bfloat16, device=dev)
        ref = gm.gemv_reference(xk, ws[-1]).float()             # (the last call of a graph reads the last copy)
        out = {}
        for bn, bk, warps, stages in itertools.product((2, 4, 8, 16), (128, 256, 512), (4, 8), (2, 3, 4)):
            if k % bk:
                continue
            def call(i, bn=bn, bk=bk, warps=warps, stages=stages):
                w = ws[i % copies]
                gm._gemv_kernel[(-(-n // bn),)](xk, w, w, y, n, k, w.stride(0), HAS_BIAS=False, EVEN_K=True, BN=bn,
                                                 BK=bk, num_warps=warps, num_stages=stages)
            out[(("rows", bn), ("bk", bk), ("warps", warps), ("stages", stages))] = graph_us(call, 4 * copies,
                                                                                              a.repeats)
            assert torch.allclose(y.float(), ref, rtol=2e-2, atol=2e-1), (n, k, bn, bk)
        bn, bk, warps = gm.config(n, k)
        cur = (("rows", bn), ("bk", bk), ("warps", warps), ("stages", gm.STAGES))
        mb = n * k * 2 / 1e6
        sweep(f"gemv {n}x{k} ({mb:.1f} MB; the best {mb / min(out.values()):.2f} TB/s)", out, cur)


def quest_inputs(a):
    dev = torch.device("cuda")
    hkv, g, n, ps = 8, 4, a.tokens // 16, 16
    k = (a.budget - 16 - 32) // ps
    b = torch.randn(hkv, g, n, device=dev) * 3
    return dev, hkv, g, n, ps, k, b


def choose_part(a) -> None:
    dev, hkv, g, n, ps, k, b = quest_inputs(a)
    prev = torch.randint(0, n, (hkv, k), device=dev)
    scratch = torch.zeros(hkv, n, device=dev)
    pages, scores = torch.empty(hkv, k, dtype=torch.long, device=dev), torch.empty(hkv, k, device=dev)
    kept = torch.empty(hkv, dtype=torch.int32, device=dev)
    out = {}
    c0, w0, m0 = sel.CHUNK, sel.CHOOSE_WARPS, sel.MERGE_WARPS
    for chunk, warps, merge in itertools.product((256, 512, 1024), (2, 4, 8), (1, 2, 4, 8)):
        sel.CHUNK, sel.CHOOSE_WARPS, sel.MERGE_WARPS = chunk, warps, merge
        out[(("chunk", chunk), ("warps", warps), ("merge warps", merge))] = graph_us(
            lambda i: sel.choose(b, 0.088, k, prev, scratch, pages, scores, kept), 16, a.repeats)
        ref = sel.choose_reference(b, 0.088, k, prev)[0]
        assert torch.equal(pages.sort(1).values, ref.sort(1).values), (chunk, warps)
    sel.CHUNK, sel.CHOOSE_WARPS, sel.MERGE_WARPS = c0, w0, m0
    sweep(f"choose: {hkv} kv heads x {g} query heads, {n} pages, k {k}", out,
          (("chunk", c0), ("warps", w0), ("merge warps", m0)))


def correct_part(a) -> None:
    dev, hkv, g, n, ps, k, b = quest_inputs(a)
    lng = dict(dtype=torch.long, device=dev)
    new = torch.stack([torch.randperm(n, device=dev)[:k] for _ in range(hkv)])
    page_ids = torch.arange(n, **lng)
    base, n_rows = torch.full((), 48, **lng), torch.full((), a.budget - 32, **lng)
    rows, dst = torch.empty(hkv, k * ps, **lng), torch.empty(hkv, k * ps, **lng)
    count = torch.zeros(1, **lng)
    loaded = torch.stack([torch.randperm(n, device=dev)[:k] for _ in range(hkv)])
    loaded[:, : k // 10] = new[:, : k // 10]                          # ~10% kept
    for case, slots0 in (("nothing loaded: no speculation, random weights at 128K", torch.full_like(new, -1)),
                         ("a speculation loaded, ~10% of it kept", loaded)):
        slots = slots0.clone()
        out = {}
        w0 = sel.CORRECT_WARPS
        for warps in (1, 2, 4, 8, 16):
            sel.CORRECT_WARPS = warps
            def call(i):
                slots.copy_(slots0)
                sel.correct(new, slots, page_ids, base, n_rows, ps, rows, dst, count)
            out[(("warps", warps),)] = graph_us(call, 16, a.repeats)
        sel.CORRECT_WARPS = w0
        sweep(f"correct, {case}: {hkv} kv heads, k {k} (the slot copy before it included)", out, (("warps", w0),))
        prev, scratch = new.clone(), torch.zeros(hkv, n, device=dev)
        pages, scores = torch.empty_like(new), torch.empty(hkv, k, device=dev)
        kept = torch.empty(hkv, dtype=torch.int32, device=dev)
        fix = (slots, page_ids, base, n_rows, ps, rows, dst, count, None)
        def both(i, fused):
            slots.copy_(slots0)
            if fused:
                sel.choose(b, 0.088, k, prev, scratch, pages, scores, kept, fix=fix)
            else:
                sel.choose(b, 0.088, k, prev, scratch, pages, scores, kept)
                sel.correct(pages, *fix[:8])
        apart, one = (graph_us(lambda i, f=f: both(i, f), 16, a.repeats) for f in (False, True))
        print(f"    the choice and this correction: {apart:.1f} us apart, {one:.1f} us with the correction in its merge")


def sketch_part(a) -> None:
    dev, hkv, g, n, ps, k, b = quest_inputs(a)
    r = 32
    keys = torch.randn(hkv, n * ps, r, dtype=torch.bfloat16, device=dev).transpose(0, 1)   # head-major, as stored
    qr = torch.randn(hkv, g, r, dtype=torch.bfloat16, device=dev)
    pages = torch.arange(n, device=dev)
    valid = torch.ones(n, dtype=torch.bool, device=dev)
    ref = qs.sketch_scores_reference(keys, qr, pages, valid, ps)
    out = {}
    p0, w0, d0 = qs.SKETCH_PAGES, qs.SKETCH_WARPS, qs.SKETCH_DOT
    for pp, warps, dot in itertools.product((8, 16, 32, 64), (1, 2, 4, 8), (False, True)):
        qs.SKETCH_PAGES, qs.SKETCH_WARPS, qs.SKETCH_DOT = pp, warps, dot
        out[(("pages", pp), ("warps", warps), ("dot", dot))] = graph_us(
            lambda i: qs.sketch_scores(keys, qr, pages, valid, ps), 16, a.repeats)
        assert torch.allclose(qs.sketch_scores(keys, qr, pages, valid, ps), ref, rtol=1e-2, atol=1e-1), (pp, warps)
    qs.SKETCH_PAGES, qs.SKETCH_WARPS, qs.SKETCH_DOT = p0, w0, d0
    mb = keys.numel() * 2 / 1e6
    sweep(f"sketch: {hkv} kv heads, {n} pages of {ps}, r {r} ({mb:.0f} MB; the best "
          f"{mb / min(out.values()):.2f} TB/s)", out, (("pages", p0), ("warps", w0), ("dot", d0)))


PARTS = {"gemv": gemv_part, "choose": choose_part, "correct": correct_part, "sketch": sketch_part}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--parts", default=",".join(PARTS))
    p.add_argument("--tokens", type=int, default=131072)
    p.add_argument("--budget", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=10)
    a = p.parse_args()
    unknown = set(a.parts.split(",")) - set(PARTS)
    if unknown:
        p.error(f"unknown part(s) {', '.join(sorted(unknown))}: the parts are {', '.join(PARTS)}")
    if not torch.cuda.is_available():
        p.error("it times CUDA kernels: run it on a machine with a CUDA GPU")
    print(torch.cuda.get_device_name())
    for part in a.parts.split(","):
        PARTS[part](a)


if __name__ == "__main__":
    main()
