"""XAttention's block shares: the torch form against the definition written out row by row, and the Triton kernel
(interpreter on CPU, compiled on a GPU) against the torch form."""
import os

import pytest
import torch

if not torch.cuda.is_available():  # must precede any `import triton`
    os.environ.setdefault("TRITON_INTERPRET", "1")

from engine.ops.xattn_estimate import block_shares_reference  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def definition(q, k, scale, s, b):
    """Each strided row r: antidiagonal sums sum_i q[r*S+S-1-i] . k[c*S+i] (missing rows count 0) over the
    columns c whose first key is not past the row's last position, softmax, summed into its block pair."""
    (tq, hq, d), (tk, hkv) = q.shape, k.shape[:2]
    off, cells = tk - tq, b // s
    share = torch.zeros(hq, -(-tq // b), -(-tk // b), dtype=torch.float64)
    for h in range(hq):
        kh = k[:, h // (hq // hkv)].double()
        for r in range(-(-tq // s)):
            last = off + r * s + s - 1
            cols = [c for c in range(-(-tk // b) * cells) if c * s <= last]
            scores = []
            for c in cols:
                acc = 0.0
                for i in range(s):
                    qi, ki = r * s + s - 1 - i, c * s + i
                    if qi < tq and ki < tk:
                        acc += float(q[qi, h].double() @ kh[ki])
                scores.append(acc * scale / s)
            p = torch.tensor(scores, dtype=torch.float64).softmax(0)
            for c, pc in zip(cols, p):
                share[h, r // cells, c // cells] += pc
        for m in range(share.shape[1]):
            share[h, m] /= min(cells, -(-tq // s) - m * cells)
    return share.float()


@pytest.mark.parametrize("tq,tk,s,b", [(40, 40, 4, 16), (37, 61, 4, 8), (21, 50, 2, 8)])  # ragged; after a prefix
def test_reference_equals_the_definition(tq, tk, s, b):
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(tq, 4, 8, generator=g), torch.randn(tk, 2, 8, generator=g)
    got = block_shares_reference(q, k, 0.4, s, b, chunk_rows=16)         # several chunks
    want = definition(q, k, 0.4, s, b)
    assert torch.allclose(got, want, atol=1e-5)
    assert torch.allclose(got.sum(-1), torch.ones(got.shape[:2]), atol=1e-5)   # each query block's shares sum to 1


triton = pytest.importorskip("triton")

from engine.ops.xattn_estimate import block_shares_triton  # noqa: E402


@pytest.mark.parametrize("tq,tk,hq,hkv,d,s,b,bm,bn", [
    (80, 80, 2, 1, 16, 4, 16, 16, 16),     # whole blocks, two row tiles, several column tiles
    (45, 77, 4, 2, 16, 4, 16, 16, 32),     # ragged rows after a cached prefix; GQA; a partial last cell
    (30, 30, 2, 2, 24, 2, 32, 16, 16),     # head_dim not a power of two; 16 strided rows per block: tiles = blocks
    (19, 19, 1, 1, 16, 8, 8, 16, 16),      # one strided row per block, a prompt shorter than a tile
])
def test_kernel_equals_reference(tq, tk, hq, hkv, d, s, b, bm, bn):
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(tq, hq, d, generator=g), torch.randn(tk, hkv, d, generator=g)
    want = block_shares_reference(q, k, d ** -0.5, s, b)
    got = block_shares_triton(q.to(DEV), k.to(DEV), d ** -0.5, s, b, block_m=bm, block_n=bn).cpu()
    assert got.shape == want.shape
    assert torch.allclose(got, want, atol=2e-5 if DEV == "cpu" else 2e-3)
