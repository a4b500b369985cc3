"""Quest's page gather: the Triton kernel (interpreter on CPU, compiled on a GPU) vs the torch reference."""
import os

import pytest
import torch

if not torch.cuda.is_available():  # must precede any `import triton`
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from engine.ops.triton_gather import gather_pages, gather_pages_reference  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_equals_reference(dtype):
    torch.manual_seed(0)
    src = torch.randn(6, 2, 2, 32, 16, device=DEV).to(dtype)          # 6 blocks of 32 tokens, pages of 16
    pages = torch.tensor([[0, 11, 3, 4], [7, 1, 10, 2]], device=DEV)   # 4 pages per kv head, any order
    want = torch.zeros(2, 2, 2, 32, 16, device=DEV, dtype=dtype)
    got = torch.zeros_like(want)
    gather_pages_reference(src, want, pages, 16)
    gather_pages(src, got, pages, 16)
    assert torch.equal(got, want)
    assert torch.equal(got[0, :, 0, 16:], src[5, :, 0, 16:])          # head 0, packed page 1 = page 11
    assert torch.equal(got[1, :, 1, :16], src[5, :, 1, :16])          # head 1, packed page 2 = page 10
