"""The one-row linear kernel (decode's GEMV; interpreter on CPU, compiled on a GPU) against F.linear, and which
calls take it."""
import os

import pytest
import torch

if not torch.cuda.is_available():  # must precede any `import triton`
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from engine.layers.linear import Linear  # noqa: E402
from engine.ops import gemv as G  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k", [(37, 256), (8, 200), (5, 8192 + 512), (4100, 512)])   # ragged rows; K off every
# tile; long K; a tall matrix (8 rows a program, the last program's rows past n)
@pytest.mark.parametrize("bias", [False, True])
def test_kernel_equals_linear(dtype, n, k, bias):
    torch.manual_seed(0)
    w = torch.randn(n, k, device=DEV).to(dtype)
    b = torch.randn(n, device=DEV).to(dtype) if bias else None
    x = torch.randn(1, k, device=DEV).to(dtype)
    want = G.gemv_reference(x.float(), w.float(), None if b is None else b.float())
    got = G.gemv(x, w, b)
    assert got.shape == (1, n) and got.dtype == dtype
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert torch.allclose(got.float(), want, rtol=tol, atol=tol * want.abs().max().item())


def test_a_strided_weight_view_and_a_3d_row():
    w = torch.randn(12, 96, device=DEV)[::2]                           # rows 2 apart: stride(0) = 192
    x = torch.randn(1, 1, 96, device=DEV)
    got = G.gemv(x, w)
    assert got.shape == (1, 1, 6)
    assert torch.allclose(got, x @ w.T, atol=1e-4)


def test_only_one_row_on_cuda_takes_the_kernel(monkeypatch):
    calls = []
    monkeypatch.setattr(G, "gemv", lambda *a: calls.append(a) or G.gemv_reference(*a))
    lin = Linear(16, 8)
    x = torch.randn(1, 16)
    assert torch.equal(lin(x), torch.nn.functional.linear(x, lin.weight, lin.bias))
    lin(torch.randn(3, 16))
    assert calls == []                                                 # the CPU, and a prompt's rows: F.linear
    if torch.cuda.is_available():
        lin = lin.cuda()
        lin(torch.randn(1, 16, device="cuda"))
        lin(torch.randn(4, 16, device="cuda"))
        assert len(calls) == 1


def test_state_dict_names_are_nn_linears():
    assert set(Linear(4, 3).state_dict()) == set(torch.nn.Linear(4, 3).state_dict()) == {"weight", "bias"}


def test_a_row_into_a_given_output():
    """`out` (the decode graphs' static hidden state): the kernel writes the product there, in place; F.linear's
    path (several rows, or the CPU) copies it there. Either way out holds x W^T + b and is what is returned."""
    torch.manual_seed(1)
    layer = Linear(200, 37).to(DEV)
    for x in (torch.randn(1, 200, device=DEV), torch.randn(3, 200, device=DEV)):
        out = torch.full((x.shape[0], 37), float("nan"), device=DEV)
        got = layer(x, out=out)
        assert got.data_ptr() == out.data_ptr()
        assert torch.allclose(out, torch.nn.functional.linear(x, layer.weight, layer.bias), atol=1e-4)
    x = torch.randn(1, 200, device=DEV)
    out = torch.empty(1, 37, device=DEV)
    G.gemv(x, layer.weight, layer.bias, out=out)                        # the kernel itself (interpreter on CPU)
    assert torch.allclose(out, torch.nn.functional.linear(x, layer.weight, layer.bias), atol=1e-4)
