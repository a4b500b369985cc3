"""Quest's page bounds in one kernel (Triton: the interpreter on CPU, compiled on a GPU) against the torch version,
and the torch version against the definition (the largest q·k over the page's keys is at most its bound)."""
import os

import pytest
import torch

if not torch.cuda.is_available():  # must precede any `import triton`
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from engine.ops.quest_score import page_bounds, page_bounds_reference  # noqa: E402

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
