"""MInference's column and diagonal scores: the torch form against the definition written out entry by entry, and
the Triton kernels (interpreter on CPU, compiled on a GPU) against the torch form."""
import os

import pytest
import torch

if not torch.cuda.is_available():  # must precede any `import triton`
    os.environ.setdefault("TRITON_INTERPRET", "1")

from engine.ops.vs_estimate import vs_scores_reference  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def definition(q, k, scale, n):
    """Row r (position Tk - n + r) softmaxes over its keys j <= position; its probability of key j goes to column
    j and to diagonal position - j."""
    tk, hq, hkv = k.shape[0], q.shape[1], k.shape[1]
    col = torch.zeros(hq, tk, dtype=torch.float64)
    diag = torch.zeros(hq, tk, dtype=torch.float64)
    for h in range(hq):
        kh = k[:, h // (hq // hkv)].double()
        for r in range(n):
            pos = tk - n + r
            p = ((kh[:pos + 1] @ q[q.shape[0] - n + r, h].double()) * scale).softmax(0)
            for j in range(pos + 1):
                col[h, j] += p[j]
                diag[h, pos - j] += p[j]
    return col.float(), diag.float()


@pytest.mark.parametrize("tq,tk,n", [(20, 20, 20), (12, 47, 9)])    # the whole prompt; the last rows after a prefix
def test_reference_equals_the_definition(tq, tk, n):
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(tq, 4, 8, generator=g), torch.randn(tk, 2, 8, generator=g)
    col, diag = vs_scores_reference(q, k, 0.4, n)
    want_col, want_diag = definition(q, k, 0.4, n)
    assert torch.allclose(col, want_col, atol=1e-5) and torch.allclose(diag, want_diag, atol=1e-5)
    assert torch.allclose(col.sum(-1), torch.full((4,), float(n)), atol=1e-4)    # each row's softmax sums to 1


triton = pytest.importorskip("triton")

from engine.ops.vs_estimate import vs_scores_triton  # noqa: E402


@pytest.mark.parametrize("tq,tk,hq,hkv,d,n", [
    (64, 64, 2, 1, 16, 64),          # one row tile, the whole prompt
    (70, 200, 4, 2, 24, 64),         # after a cached prefix; GQA; head_dim padded; several diagonal blocks
    (130, 150, 2, 2, 16, 100),       # two row tiles (the second ragged): added by atomics
    (20, 90, 2, 1, 16, 17),          # fewer rows than a tile
])
def test_triton_equals_the_reference(tq, tk, hq, hkv, d, n):
    g = torch.Generator().manual_seed(1)
    q = (torch.randn(tq, hq, d, generator=g) * 2).to(DEV)       # peaked rows: a few keys and diagonals dominate
    k = torch.randn(tk, hkv, d, generator=g).to(DEV)
    col, diag = vs_scores_triton(q, k, d ** -0.5, n)
    want_col, want_diag = vs_scores_reference(q, k, d ** -0.5, n)
    tol = 1e-5 if DEV == "cpu" else 2e-3                          # (tf32-free fp32 on CPU; the GPU's dot may round)
    assert torch.allclose(col, want_col, atol=tol) and torch.allclose(diag, want_diag, atol=tol)
    assert torch.allclose(col.sum(-1).cpu(), torch.full((hq,), float(n)), atol=1e-3)


@pytest.mark.gpu          # (under the interpreter, Triton 3.9's bf16 tl.dot is off by orders of magnitude)
def test_triton_keeps_the_same_columns_and_diagonals_in_bf16():
    """What the policy does with the scores (the top columns and diagonals) comes out the same as with the torch
    form on the same bf16 inputs, apart from near-ties."""
    g = torch.Generator().manual_seed(2)
    q = (torch.randn(64, 2, 32, generator=g) * 2).to(DEV, torch.bfloat16)
    k = torch.randn(180, 1, 32, generator=g).to(DEV, torch.bfloat16)
    col, diag = vs_scores_triton(q, k, 32 ** -0.5, 64)
    want_col, want_diag = vs_scores_reference(q, k, 32 ** -0.5, 64)
    for got, want in ((col, want_col), (diag, want_diag)):
        top = set(got[0].topk(20).indices.tolist())
        assert len(top & set(want[0].topk(20).indices.tolist())) >= 18
        assert torch.allclose(got, want, atol=2e-2)


@pytest.mark.parametrize("tq,tk,nv,ns,sink,recent,block", [
    (2500, 3000, 100, 700, 4, 50, 64),      # ragged chunks, a cached prefix, many equal scores
    (300, 300, 300, 40, 4, 8, 16),          # every column kept
    (700, 1100, 9, 1100, 30, 1, 64),        # forced ones beyond what the scores would pick; every diagonal
])
def test_select_kernel_equals_the_sorted_rule_and_counts_the_reach(tq, tk, nv, ns, sink, recent, block):
    from engine.ops.sparse_prefill import VerticalSlash
    from engine.ops.vs_estimate import vs_select_reference, vs_select_triton
    g = torch.Generator().manual_seed(3)
    scores = (torch.randint(0, 40, (2, 3, tk), generator=g).float() / 7).to(DEV)   # ties everywhere; zeros
    vertical, slash, reach = vs_select_triton(scores, nv, ns, sink, recent, block, tq)
    want_v, want_s = vs_select_reference(scores, nv, ns, sink, recent)
    assert torch.equal(vertical, want_v) and torch.equal(slash, want_s)
    pat = VerticalSlash(want_v, want_s, block)                                  # the torch count of the same
    per_offset = torch.clamp(tk - torch.arange(tk, device=DEV), max=tq)
    runs = (pat.covered(tk)[:, block - 1:block - 1 + tk].long() * per_offset).sum(dim=1)
    cols = per_offset[want_v.long()].sum(dim=1)
    assert torch.equal(reach[0], cols) and torch.equal(reach[1], runs)
