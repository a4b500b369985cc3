"""Sparse prefill kernels (vertical-slash, block-sparse): Triton (interpreter on CPU) and torch vs dense masked math."""
import os

import pytest
import torch

if not torch.cuda.is_available():  # must precede any `import triton`
    os.environ.setdefault("TRITON_INTERPRET", "1")

from engine.ops.sparse_prefill import (VerticalSlash, block_sparse_reference, causal_pairs,  # noqa: E402
                                       vertical_slash_reference)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16] if DEV == "cuda" else [torch.float32]  # the interpreter's tl.dot
                                                                                # mishandles bf16 (Triton 3.9)


def dense_masked(q, k, v, allowed, scale):
    """The definition: softmax over the allowed keys of each (row, head); allowed [Hq, Tq, Tk]."""
    g = q.shape[1] // k.shape[1]
    kk = k.float().repeat_interleave(g, dim=1).transpose(0, 1)       # [Hq, Tk, D] (the test may repeat)
    vv = v.float().repeat_interleave(g, dim=1).transpose(0, 1)
    s = q.float().transpose(0, 1) @ kk.transpose(1, 2) * scale
    s = s.masked_fill(~allowed, float("-inf"))
    return (s.softmax(-1) @ vv).transpose(0, 1)


def vs_allowed(pat: VerticalSlash, tq, tk):
    """Vertical-slash pattern written out element by element from its definition."""
    off, bm = tk - tq, pat.block
    allowed = torch.zeros(pat.vertical.shape[0], tq, tk, dtype=torch.bool)
    for h in range(allowed.shape[0]):
        for i in range(tq):
            r, m0 = off + i, off + i // bm * bm
            for c in range(r + 1):
                run = any(m0 - d <= c <= m0 - d + bm - 1 for d in pat.slash[h].tolist())
                allowed[h, i, c] = run or c in pat.vertical[h].tolist()
    return allowed


def inputs(tq, tk, hq=4, hkv=2, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(tq, hq, d, generator=g)
    k = torch.randn(tk, hkv, d, generator=g)
    v = torch.randn(tk, hkv, d, generator=g)
    return q, k, v


def sorted_pick(n, hq, k, seed, forced=()):
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(hq):
        s = set(forced) | set(torch.randperm(n, generator=g)[:k].tolist())
        rows.append(sorted(s)[:k + len(forced)])
    width = min(len(r) for r in rows)
    return torch.tensor([r[:width] for r in rows], dtype=torch.int32)


@pytest.mark.parametrize("tq,tk", [(70, 70), (45, 77)])   # whole prompt; a prompt after a cached prefix
def test_vertical_slash_reference_is_masked_dense(tq, tk):
    q, k, v = inputs(tq, tk)
    pat = VerticalSlash(sorted_pick(tk, 4, 6, 1, forced=(0, 1)), sorted_pick(tk, 4, 5, 2, forced=(0,)), 16)
    allowed = vs_allowed(pat, tq, tk)
    out, pairs = vertical_slash_reference(q, k, v, pat, 0.25)
    assert torch.allclose(out, dense_masked(q, k, v, allowed, 0.25), atol=1e-5)
    assert pairs.tolist() == allowed.sum(dim=(1, 2)).tolist()
    assert 0 < pairs.sum() < 4 * causal_pairs(tq, tk)           # sparse: fewer pairs than dense causal


def test_full_patterns_equal_dense_causal():
    """Every diagonal (or every key block) selected: exactly dense causal attention."""
    q, k, v = inputs(40, 40)
    every = torch.arange(40, dtype=torch.int32)[None].expand(4, -1).contiguous()
    out, pairs = vertical_slash_reference(q, k, v, VerticalSlash(every[:, :1], every, 16), 0.3)
    causal = torch.ones(40, 40, dtype=torch.bool).tril()[None].expand(4, -1, -1)
    assert torch.allclose(out, dense_masked(q, k, v, causal, 0.3), atol=1e-5)
    assert pairs.tolist() == [causal_pairs(40, 40)] * 4
    out, pairs = block_sparse_reference(q, k, v, torch.ones(4, 3, 3, dtype=torch.bool), 16, 0.3)
    assert torch.allclose(out, dense_masked(q, k, v, causal, 0.3), atol=1e-5)


def test_block_sparse_reference_is_masked_dense():
    tq, tk, b = 45, 77, 16
    q, k, v = inputs(tq, tk)
    g = torch.Generator().manual_seed(3)
    blocks = torch.rand(4, 3, 5, generator=g) < 0.5
    blocks[:, torch.arange(3), torch.arange(3) + 2] = True      # each query block's own (diagonal) key block
    off = tk - tq
    rows, cols = torch.arange(tq), torch.arange(tk)
    allowed = blocks[:, rows // b][:, :, cols // b] & (cols[None] <= off + rows[:, None])
    out, pairs = block_sparse_reference(q, k, v, blocks, b, 0.25)
    assert torch.allclose(out, dense_masked(q, k, v, allowed, 0.25), atol=1e-5)
    assert pairs.tolist() == allowed.sum(dim=(1, 2)).tolist()


def test_groups_and_coverage():
    pat = VerticalSlash(torch.zeros(2, 1, dtype=torch.int32),
                        torch.tensor([[0, 3, 20, 40], [0, 16, 33, 34]], dtype=torch.int32), 16)
    lo, hi = pat.groups()
    assert lo.tolist()[0][:3] == [0, 20, 40] and hi.tolist()[0][:3] == [3, 20, 40]  # gaps <= 16 merge
    assert lo.tolist()[1][:2] == [0, 33] and hi.tolist()[1][:2] == [16, 34] and lo[1, 2] >= 2**30  # padded
    cov = pat.covered(64)
    t = torch.arange(-15, 65)                                   # t = m0 - c, for c <= r < m0 + 16
    want0 = (t <= 3) | ((t >= 5) & (t <= 20)) | ((t >= 25) & (t <= 40))
    assert cov[0].tolist() == want0.tolist()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tq,tk", [(70, 70), (45, 77)])
def test_vertical_slash_triton_equals_reference(dtype, tq, tk):
    pytest.importorskip("triton")
    from engine.ops.sparse_triton import vertical_slash_triton
    q, k, v = (x.to(DEV, dtype) for x in inputs(tq, tk))
    kt = k.transpose(0, 1).contiguous().transpose(0, 1)     # head-major storage, as the layerwise buffers give
    pat = VerticalSlash(sorted_pick(tk, 4, 6, 1, forced=(0, 1)).to(DEV), sorted_pick(tk, 4, 5, 2, forced=(0,)).to(DEV), 16)
    want, want_pairs = vertical_slash_reference(q, kt, v, pat, 0.25)
    got, pairs = vertical_slash_triton(q, kt, v, pat, 0.25, block_n=16)
    tol = (1e-4 if DEV == "cpu" else 2e-3) if dtype == torch.float32 else 2e-2   # (CUDA fp32 dots: tf32)
    assert torch.allclose(got.float(), want.float(), atol=tol, rtol=tol)
    assert pairs.cpu().tolist() == want_pairs.tolist()


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_vertical_slash_triton_many_columns(dtype, split):
    """Columns over several tiles (the kernel reads them from a per-head gathered copy), some inside slash runs (each
    pair counted once), GQA groups of 3, a ragged last query block; split: the columns before a block's first row
    masked per column, the rest per pair."""
    pytest.importorskip("triton")
    from engine.ops.sparse_triton import vertical_slash_triton
    tq, tk = 53, 90
    q, k, v = (x.to(DEV, dtype) for x in inputs(tq, tk, hq=6, hkv=2))
    vert, slash = sorted_pick(tk, 6, 40, 4, forced=(0, 1, 2)), sorted_pick(tk, 6, 3, 5, forced=(0, 30))
    want = dense_masked(q, k, v, vs_allowed(VerticalSlash(vert, slash, 16), tq, tk).to(DEV), 0.25)
    pat = VerticalSlash(vert.to(DEV), slash.to(DEV), 16)
    got, pairs = vertical_slash_triton(q, k, v, pat, 0.25, block_n=16, split=split)
    tol = (1e-4 if DEV == "cpu" else 2e-3) if dtype == torch.float32 else 2e-2
    assert torch.allclose(got.float(), want.float(), atol=tol, rtol=tol)
    assert pairs.cpu().tolist() == vertical_slash_reference(q, k, v, pat, 0.25)[1].tolist()


@pytest.mark.parametrize("seed,diagonal", [(1, False), (2, False), (3, True)])
def test_vertical_slash_triton_runs_off_the_diagonal(seed, diagonal):
    """Slash runs that never touch the diagonal: several merged diagonals (runs wider than a tile, with a narrower
    last tile), runs that cross key 0 in the first blocks, a ragged last block, with and without a run at the
    diagonal itself."""
    pytest.importorskip("triton")
    from engine.ops.sparse_triton import vertical_slash_triton
    tq, tk, bm = 75, 100, 32
    q, k, v = (x.to(DEV) for x in inputs(tq, tk, seed=seed))
    slash = sorted_pick(tk - bm, 4, 7, seed) + bm
    if diagonal:
        slash = torch.cat([torch.zeros(4, 1, dtype=torch.int32), slash], dim=1)
    vert = sorted_pick(tk, 4, 5, seed + 10)
    pat_cpu = VerticalSlash(vert, slash, bm)
    want = dense_masked(q, k, v, vs_allowed(pat_cpu, tq, tk).to(DEV), 0.25)
    pat = VerticalSlash(vert.to(DEV), slash.to(DEV), bm)
    got, pairs = vertical_slash_triton(q, k, v, pat, 0.25, block_n=16)
    tol = 1e-4 if DEV == "cpu" else 2e-3                                  # (CUDA fp32 dots: tf32)
    assert torch.allclose(got.float(), want.float(), atol=tol, rtol=tol)
    assert pairs.cpu().tolist() == vertical_slash_reference(q, k, v, pat, 0.25)[1].tolist()


@pytest.mark.parametrize("tma", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tq,tk,b,bn", [(45, 77, 16, 16), (64, 96, 32, 16), (96, 96, 32, 32)])
def test_block_sparse_triton_equals_reference(dtype, tq, tk, b, bn, tma):
    """Ragged last query and key blocks, a block in two tiles, whole blocks before every row (unmasked) and the
    diagonal (masked), a query block with no kept key block; K/V tiles by pointers and by TMA descriptors (the
    interpreter reads them too; out of range rows read zeros)."""
    pytest.importorskip("triton")
    from engine.ops.sparse_triton import block_sparse_triton
    q, k, v = (x.to(DEV, dtype) for x in inputs(tq, tk))
    g = torch.Generator().manual_seed(4)
    nq, nk = -(-tq // b), -(-tk // b)
    blocks = torch.rand(4, nq, nk, generator=g) < 0.4
    blocks[:, torch.arange(nq), torch.arange(nq) + (nk - nq)] = True
    blocks[1, 0] = False
    blocks = blocks.to(DEV)
    want, want_pairs = block_sparse_reference(q, k, v, blocks, b, 0.25)
    got, pairs = block_sparse_triton(q, k, v, blocks, b, 0.25, block_n=bn, tma=tma)
    tol = (1e-4 if DEV == "cpu" else 2e-3) if dtype == torch.float32 else 2e-2   # (CUDA fp32 dots: tf32)
    assert torch.allclose(got.float(), want.float(), atol=tol, rtol=tol)
    assert pairs.cpu().tolist() == want_pairs.tolist()


class _Unwritten:
    """torch, except that new tensors come filled (NaN, or -7 for integers): what a kernel did not write shows."""
    def __getattr__(self, name):
        return getattr(torch, name)

    def empty_like(self, x, **kw):
        return torch.full_like(x, float("nan") if x.is_floating_point() else -7, **kw)

    def empty(self, *shape, dtype=None, device=None):
        return torch.full(shape, -7, dtype=dtype, device=device)


@pytest.mark.parametrize("kind", ["block-sparse", "vertical-slash"])
def test_a_skipped_kernel_computes_nothing_and_an_unskipped_one_everything(kind, monkeypatch):
    """The dense gate launches the kernel before reading its answer: with the flag set no program writes a thing."""
    pytest.importorskip("triton")
    from engine.ops import sparse_triton
    monkeypatch.setattr(sparse_triton, "torch", _Unwritten())
    q, k, v = (x.to(DEV) for x in inputs(64, 96))
    if kind == "block-sparse":
        blocks = torch.ones(4, 4, 6, dtype=torch.bool, device=DEV)
        run = lambda skip: sparse_triton.block_sparse_triton(q, k, v, blocks, 16, 0.25, block_n=16, skip=skip)  # noqa: E731
        want = block_sparse_reference(q, k, v, blocks, 16, 0.25)[0]
    else:
        pat = VerticalSlash(sorted_pick(96, 4, 6, 1, forced=(0, 1)).to(DEV), sorted_pick(96, 4, 5, 2, forced=(0,)).to(DEV), 16)
        run = lambda skip: sparse_triton.vertical_slash_triton(q, k, v, pat, 0.25, block_n=16, skip=skip)  # noqa: E731
        want = vertical_slash_reference(q, k, v, pat, 0.25)[0]
    out, pairs = run(torch.tensor(True, device=DEV))
    assert out.isnan().all() and pairs.cpu().tolist() == [-7 * 4] * 4
    out, pairs = run(torch.tensor(False, device=DEV))
    tol = 1e-4 if DEV == "cpu" else 2e-3                                  # (CUDA fp32 dots: tf32)
    assert torch.allclose(out.float(), want.float(), atol=tol, rtol=tol) and (pairs > 0).all()


@pytest.mark.parametrize("tq,tk,block", [(70, 70, 16), (45, 77, 16), (64, 64, 32), (1, 40, 8)])
def test_block_pairs_counts_what_the_reference_computes(tq, tk, block):
    """FlexAttention's path counts its pairs from the table: the same numbers the masked reference computes."""
    from engine.ops.sparse_prefill import block_pairs
    q, k, v = inputs(tq, tk)
    blocks = torch.rand(4, -(-tq // block), -(-tk // block), generator=torch.Generator().manual_seed(3)) < 0.5
    assert block_pairs(blocks, block, tq, tk).tolist() == block_sparse_reference(q, k, v, blocks, block, 0.3)[1].tolist()


GATHER_CASES = [(70, 70, 16), (45, 77, 16), (64, 64, 16), (96, 96, 32), (40, 100, 16)]   # ragged, offset, aligned


@pytest.mark.parametrize("tq,tk,block", GATHER_CASES)
def test_gathered_vertical_slash_equals_the_definition(tq, tk, block):
    """The CPU path computes exactly the pattern's pairs (GQA: 4 query heads on 2 kv heads)."""
    from engine.ops.sparse_gather import gathered_attention
    from engine.ops.sparse_prefill import vertical_slash_keep
    q, k, v = inputs(tq, tk)
    pat = VerticalSlash(sorted_pick(tk, 4, 6, 1, forced=(0, 1)), sorted_pick(tk, 4, 5, 2, forced=(0,)), block)
    allowed = vs_allowed(pat, tq, tk)
    out, pairs = gathered_attention(q, k, v, vertical_slash_keep(pat, tq, tk), block, 0.25)
    assert torch.allclose(out, dense_masked(q, k, v, allowed, 0.25), atol=1e-5)
    assert pairs.tolist() == allowed.sum(dim=(1, 2)).tolist()


@pytest.mark.parametrize("fused", [True, False])    # torch's fused CPU kernel, or the plain fallback without it
@pytest.mark.parametrize("tq,tk,block", GATHER_CASES)
def test_gathered_block_sparse_equals_the_definition(tq, tk, block, fused, monkeypatch):
    """Both CPU paths of a block table, the keep table's and the whole blocks' (where the prompt starts at a block
    boundary and every own block is kept), compute exactly the pattern's pairs; the density the gate reads from the
    block table alone equals the keep table's, an upper bound of the pairs."""
    from engine.ops import attention
    from engine.ops.sparse_gather import block_keep_density, gathered_attention, gathered_blocks, keep_density
    from engine.ops.sparse_prefill import block_sparse_keep
    monkeypatch.setattr(attention, "_CPU_FLASH", fused and attention._CPU_FLASH)
    q, k, v = inputs(tq, tk)
    nqb, nkb = -(-tq // block), -(-tk // block)
    blocks = torch.rand(4, nqb, nkb, generator=torch.Generator().manual_seed(5)) < 0.4
    off = tk - tq
    blocks[:, torch.arange(nqb), (off + torch.arange(nqb) * block) // block] = True   # every own block kept
    rows, cols = torch.arange(tq), torch.arange(tk)
    allowed = blocks[:, rows // block][:, :, cols // block] & (cols[None] <= off + rows[:, None])
    want = dense_masked(q, k, v, allowed, 0.25)
    keep = block_sparse_keep(blocks, block, tq, tk)
    whole = gathered_blocks(q, k, v, blocks, block, 0.25)
    assert (whole is None) == (off % block != 0) and (whole is None or whole[0].is_contiguous())   # [Tq, Hq, D]
    for out, pairs in [gathered_attention(q, k, v, keep, block, 0.25)] + ([whole] if whole else []):
        assert torch.allclose(out, want, atol=1e-5)
        assert pairs.tolist() == allowed.sum(dim=(1, 2)).tolist()
    assert keep_density(keep, block, tq, tk) >= allowed.sum() / (4 * causal_pairs(tq, tk))   # an upper bound
    assert block_keep_density(blocks, block, tq, tk) == pytest.approx(keep_density(keep, block, tq, tk), rel=1e-12)
    blocks[1, 0] = False                                                               # head 1, block 0: no key
    assert gathered_blocks(q, k, v, blocks, block, 0.25) is None                      # own block 0 not kept
    allowed = blocks[:, rows // block][:, :, cols // block] & (cols[None] <= off + rows[:, None])
    keep = block_sparse_keep(blocks, block, tq, tk)
    out, pairs = gathered_attention(q, k, v, keep, block, 0.25)
    assert torch.allclose(out, dense_masked(q, k, v, allowed, 0.25).nan_to_num(0.0), atol=1e-5)   # empty rows: 0
    assert pairs.tolist() == allowed.sum(dim=(1, 2)).tolist()
    assert block_keep_density(blocks, block, tq, tk) == pytest.approx(keep_density(keep, block, tq, tk), rel=1e-12)


def test_gathered_blocks_without_their_own_block_equal_the_definition():
    """A block table that keeps no query block's own (diagonal) block: every block takes the exact-mask path."""
    from engine.ops.sparse_gather import gathered_attention, gathered_blocks
    from engine.ops.sparse_prefill import block_sparse_keep
    q, k, v = inputs(64, 64)
    blocks = torch.ones(4, 4, 4, dtype=torch.bool).tril(-1)                         # earlier blocks only
    assert gathered_blocks(q, k, v, blocks, 16, 0.25) is None
    rows, cols = torch.arange(64), torch.arange(64)
    allowed = blocks[:, rows // 16][:, :, cols // 16] & (cols[None] <= rows[:, None])
    out, pairs = gathered_attention(q, k, v, block_sparse_keep(blocks, 16, 64, 64), 16, 0.25)
    assert torch.allclose(out, dense_masked(q, k, v, allowed, 0.25).nan_to_num(0.0), atol=1e-5)
    assert pairs.tolist() == allowed.sum(dim=(1, 2)).tolist() and out[:16].abs().sum() == 0   # block 0: no key


def test_gathered_keep_everything_is_dense_causal():
    from engine.ops.sparse_gather import gathered_attention
    q, k, v = inputs(80, 80)
    ends = torch.arange(1, 6) * 16                                                    # each block's end
    keep = (torch.arange(80)[None] < ends[:, None])[None].expand(4, -1, -1)
    out, pairs = gathered_attention(q, k, v, keep, 16, 0.3)
    causal = torch.ones(80, 80, dtype=torch.bool).tril()[None].expand(4, -1, -1)
    assert torch.allclose(out, dense_masked(q, k, v, causal, 0.3), atol=1e-5)
    assert pairs.tolist() == [causal_pairs(80, 80)] * 4
