"""Quest's page scores in one kernel each (Triton: the interpreter on CPU, compiled on a GPU) against the torch
versions, and the torch versions against their definitions (bounds: the largest q·k over the page's keys is at most
its bound; sketch: a page's score is its best key's logit in the sketch's coordinates)."""
import os

import pytest
import torch

if not torch.cuda.is_available():  # must precede any `import triton`
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from engine.ops.quest_score import (page_bounds, page_bounds_reference, sketch_scores,  # noqa: E402
                                    sketch_scores_reference)

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _pool(pool_pages, hkv, d, dtype, seed=0):
    """Random keys, 4 per page -> kb [pool_pages, Hkv, 2D] ([min | max]), and the keys themselves."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(pool_pages, hkv, 4, d, generator=g)
    kb = torch.cat([keys.amin(2), keys.amax(2)], -1).to(DEV, dtype)
    return kb, keys


@pytest.mark.parametrize("hkv,g,d", [(2, 3, 8), (2, 4, 24), (1, 1, 16)])    # 24: head_dim not a power of two
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_equals_reference(hkv, g, d, dtype):
    kb, _ = _pool(90, hkv, d, dtype)
    kb[7:9] = float("nan")                                 # pages never written (+-inf in the policy) are no candidates
    q = torch.randn(hkv * g, d, generator=torch.Generator().manual_seed(1)).to(DEV, dtype)
    pages = torch.randperm(90, generator=torch.Generator().manual_seed(2))[:70].to(DEV)   # 70: a ragged last program
    valid = torch.rand(70, generator=torch.Generator().manual_seed(3)) < 0.8
    valid[pages.cpu() == 7] = valid[pages.cpu() == 8] = False
    valid = valid.to(DEV)
    want = page_bounds_reference(kb, q, pages, valid)
    got = page_bounds(kb, q, pages, valid)
    assert got.shape == (hkv, g, 70) and got.dtype == torch.float32
    assert torch.equal(torch.isinf(got), ~valid.expand_as(got)) and valid.any()
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got[:, :, valid], want[:, :, valid], rtol=tol, atol=tol * d)


def test_bound_is_at_least_every_key_of_the_page():
    kb, keys = _pool(12, 2, 16, torch.float32, seed=5)
    q = torch.randn(6, 16, generator=torch.Generator().manual_seed(6)).to(DEV)
    pages = torch.arange(12, device=DEV)
    got = page_bounds(kb, q, pages, torch.ones(12, dtype=torch.bool, device=DEV))
    true = torch.einsum("hgd,phtd->hgpt", q.cpu().reshape(2, 3, 16), keys).amax(-1)   # [Hkv, G, pages]
    assert (got.cpu() >= true - 1e-4).all() and (got.cpu() - true).abs().min() < 5.0


@pytest.mark.parametrize("hkv,g,r,ps", [(2, 3, 8, 4), (2, 4, 12, 16), (1, 1, 32, 8)])   # 12: r not a power of two
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_major", [False, True])    # True: KeySketch's storage, [Hkv, row, r] seen as [row, Hkv, r]
def test_sketch_kernel_equals_reference_and_the_best_token(hkv, g, r, ps, dtype, head_major):
    gen = torch.Generator().manual_seed(7)
    pool_pages = 40
    keys = torch.randn(pool_pages * ps, hkv, r, generator=gen).to(DEV, dtype)
    if head_major:
        keys = keys.transpose(0, 1).contiguous().transpose(0, 1)
    qr = torch.randn(hkv, g, r, generator=gen).to(DEV, dtype)
    pages = torch.randperm(pool_pages, generator=gen)[:35].to(DEV)       # 35: a ragged last program (16 pages each)
    valid = (torch.rand(35, generator=gen) < 0.8).to(DEV)
    want = sketch_scores_reference(keys, qr, pages, valid, ps)
    got = sketch_scores(keys, qr, pages, valid, ps)
    assert got.shape == (hkv, g, 35) and got.dtype == torch.float32
    assert torch.equal(torch.isinf(got), ~valid.expand_as(got)) and valid.any()
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got[:, :, valid], want[:, :, valid], rtol=tol, atol=tol * r)
    k = keys.float().cpu().view(pool_pages, ps, hkv, r)[pages.cpu()]                  # [35, ps, Hkv, r]
    best = torch.einsum("hgr,pthr->hgpt", qr.float().cpu(), k).amax(-1)             # the definition
    torch.testing.assert_close(want.cpu()[:, :, valid.cpu()], best[:, :, valid.cpu()], rtol=tol, atol=tol * r)


@pytest.mark.parametrize("kind", ["bounds", "sketch"])
def test_kernels_read_nothing_after_the_live_pages(kind):
    """A graph made for max_model_len's pages scores the sequence's first `live` pages only: -inf after them, even
    where `valid` (stale) says otherwise and the pool there holds NaN (pages never written)."""
    hkv, g, d, ps, n, live = 2, 3, 16, 4, 150, 37                         # 37: inside a program's pages
    gen = torch.Generator().manual_seed(11)
    q = torch.randn(hkv * g, d, generator=gen).to(DEV)
    pages = torch.randperm(n, generator=gen).to(DEV)
    valid = torch.ones(n, dtype=torch.bool, device=DEV)
    if kind == "bounds":
        kb, _ = _pool(n, hkv, d, torch.float32, seed=12)
        kb[pages[live:]] = float("nan")
        got = page_bounds(kb, q, pages, valid, live=torch.tensor(live, device=DEV))
        want = page_bounds_reference(kb, q, pages[:live], valid[:live])
    else:
        keys = torch.randn(n * ps, hkv, 8, generator=gen).to(DEV)
        keys.view(n, ps, hkv, 8)[pages[live:]] = float("nan")
        qr = torch.randn(hkv, g, 8, generator=gen).to(DEV)
        got = sketch_scores(keys, qr, pages, valid, ps, live=torch.tensor(live, device=DEV))
        want = sketch_scores_reference(keys, qr, pages[:live], valid[:live], ps)
    assert got.shape == (hkv, g, n) and (got[..., live:] == float("-inf")).all()
    torch.testing.assert_close(got[..., :live], want, rtol=1e-4, atol=1e-3)
