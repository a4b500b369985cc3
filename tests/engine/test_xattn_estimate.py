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


def test_a_bfloat16_matmul_keeps_the_shares_and_the_choice():
    """The CPU estimate where the CPU multiplies bfloat16 in hardware (`cpu_matmul_dtype`: AMX or AVX-512 BF16): the
    scores' matmul in bfloat16, the softmax and the sums in float32. Its shares stay within bf16's rounding of the
    definition's, and the choice of a prompt with a few strong keys (the sink, a vertical line) is the float32 choice."""
    from engine.ops.xattn_estimate import cpu_matmul_dtype, select_blocks_reference
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(40, 4, 8, generator=g), torch.randn(40, 2, 8, generator=g)
    got = block_shares_reference(q, k, 0.4, 4, 16, chunk_rows=16, matmul_dtype=torch.bfloat16)
    assert got.dtype == torch.float32
    assert torch.allclose(got, definition(q, k, 0.4, 4, 16), atol=2e-2)
    assert torch.allclose(got.sum(-1), torch.ones(got.shape[:2]), atol=1e-5)
    tq = 512
    q, k = torch.randn(tq, 4, 16, generator=g), torch.randn(tq, 2, 16, generator=g)
    k[:4] += 3 * q.mean(dim=(0, 1))                                     # a sink
    k[200:204] += 3 * q.mean(dim=(0, 1))                                # a vertical line
    exact = select_blocks_reference(block_shares_reference(q, k, 0.25, 8, 32), 0.9, tq, tq, 32)
    low = select_blocks_reference(block_shares_reference(q, k, 0.25, 8, 32, matmul_dtype=torch.bfloat16),
                                  0.9, tq, tq, 32)
    assert (exact != low).float().mean() < 0.01 and exact[:, 8:, 6].all()   # the vertical's block kept
    assert cpu_matmul_dtype(torch.bfloat16) is None and cpu_matmul_dtype(torch.float16) is None  # rounded once only


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


from engine.ops.xattn_estimate import select_blocks_reference, select_blocks_triton  # noqa: E402


def _forced(tq, tk, b, nqb, nkb):
    """The sink and each query block's own diagonal blocks, written out."""
    f = torch.zeros(nqb, nkb, dtype=torch.bool)
    f[:, 0] = True
    for m in range(nqb):
        for r in range(m * b, min(tq, (m + 1) * b)):
            f[m, (tk - tq + r) // b] = True
    return f


@pytest.mark.parametrize("tq,tk,b", [(640, 640, 16), (300, 1000, 32)])
@pytest.mark.parametrize("tau", [0.3, 0.9, 1.0])
def test_selection_kernel_equals_reference(tq, tk, b, tau):
    g = torch.Generator().manual_seed(2)
    q, k = torch.randn(tq, 2, 16, generator=g) * 2, torch.randn(tk, 1, 16, generator=g) * 2
    share = block_shares_reference(q, k, 0.25, 4, b)
    want = select_blocks_reference(share, tau, tq, tk, b)
    assert want.equal(select_blocks_triton(share.to(DEV), tau, tq, tk, b).cpu())
    forced = _forced(tq, tk, b, *share.shape[1:])
    assert (want | forced).equal(want)                                         # sink and diagonal always in
    assert (share.where(want, 0).sum(-1) >= tau - 1e-5).all()                  # each row reaches the threshold
    free = ~forced[None]                                                       # the largest shares first:
    least_kept = share.where(want & free, 2.0).amin(-1)                        # every kept share beats every
    most_dropped = share.where(~want & free, -1.0).amax(-1)                    # dropped one
    assert (least_kept >= most_dropped).all()
    if tau < 1:
        assert (~want & free & (share > 0)).any()                              # (and the threshold drops some)


@pytest.mark.parametrize("kernel", [False, True])
def test_equal_shares_are_cut_in_index_order(kernel):
    """Equal shares keep the first blocks, the same ones on every run and in every mode (an unstable sort orders
    ties as it likes)."""
    share = torch.full((2, 1, 4096), 1 / 4096)
    select = select_blocks_triton if kernel else select_blocks_reference
    kept = select(share.to(DEV if kernel else "cpu"), 0.5, 1, 4096, 1).cpu()
    assert kept[:, 0, :2048].all() and not kept[:, 0, 2048:-1].any() and kept[:, 0, -1].all()   # -1: the diagonal
