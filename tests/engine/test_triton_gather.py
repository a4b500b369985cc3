"""The row gather behind partial KV loads: the Triton kernel (interpreter on CPU, compiled on a GPU) vs the torch
reference, and what the reference itself does."""
import os

import pytest
import torch

if not torch.cuda.is_available():  # must precede any `import triton`
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from engine.ops.triton_gather import gather_rows, gather_rows_reference  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def test_reference_puts_each_heads_rows_in_order():
    src = torch.arange(6 * 2 * 2 * 8 * 4, dtype=torch.float32).view(6, 2, 2, 8, 4)   # 6 blocks of 8 tokens
    dst = torch.zeros(2, 2, 2, 8, 4)
    rows = torch.tensor([[0, 9, 47, -1], [3, 3, 8, 40]])
    gather_rows_reference(src, dst, rows)
    assert torch.equal(dst[0, :, 0, 1], src[1, :, 0, 1]) and torch.equal(dst[0, :, 0, 2], src[5, :, 0, 7])
    assert not dst[0, :, 0, 3].any()                                  # -1: skipped
    assert torch.equal(dst[0, :, 1, 3], src[5, :, 1, 0])
    fix = torch.zeros_like(dst)
    gather_rows_reference(src, fix, torch.tensor([[9, -1], [40, 8]]), torch.tensor([[12, 0], [5, 9]]))
    assert torch.equal(fix[1, :, 0, 4], src[1, :, 0, 1]) and torch.equal(fix[0, :, 1, 5], src[5, :, 1, 0])
    assert torch.equal(fix[1, :, 1, 1], src[1, :, 1, 0]) and fix.count_nonzero() == 3 * 2 * 4     # 3 rows, K and V


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_dst", [False, True])
@pytest.mark.parametrize("programs", [3, 32])         # 3: each program loops over several chunks
def test_kernel_equals_reference(dtype, with_dst, programs):
    torch.manual_seed(0)
    src = torch.randn(6, 2, 2, 32, 16, device=DEV).to(dtype)          # 6 blocks of 32 tokens, 2 kv heads
    rows = torch.randint(0, 6 * 32, (2, 37), device=DEV)               # a ragged count: 37 rows per head
    rows[0, 5] = rows[1, 36] = -1
    dst_rows = torch.randperm(64, device=DEV)[:37].repeat(2, 1) if with_dst else None
    want = torch.zeros(2, 2, 2, 32, 16, device=DEV, dtype=dtype)
    got = torch.zeros_like(want)
    gather_rows_reference(src, want, rows, dst_rows)
    gather_rows(src, got, rows, dst_rows, programs=programs)
    assert torch.equal(got, want) and want.count_nonzero() > 0


def test_repeated_launches_stay_exact():
    """From the second launch on (CUDA) the compiled kernel is launched directly: every later call, on other rows,
    another count, a view of rows off 16-byte alignment (another specialization), still equals the reference."""
    from engine.ops import triton_gather
    torch.manual_seed(1)
    src = torch.randn(6, 2, 2, 32, 16, device=DEV)
    plan = torch.randint(0, 6 * 32, (2, 2, 65), device=DEV)            # [parity, head, rows]: views of it are loaded
    before = set(triton_gather._COMPILED)
    for rows in (plan[0, :, :40], plan[1, :, :40], plan[1, :, :33], plan[0, :, 1:41], plan[1, :, 1:30]):
        want, got = torch.zeros(2, 2, 2, 32, 16, device=DEV), torch.zeros(2, 2, 2, 32, 16, device=DEV)
        gather_rows_reference(src, want, rows)
        gather_rows(src, got, rows, programs=4)
        assert torch.equal(got, want)
    if DEV == "cuda":
        assert len(set(triton_gather._COMPILED) - before) == 2    # rows at an even and an odd int64 offset
