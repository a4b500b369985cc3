"""The CPU's partial attention on torch's fused kernel (engine/ops/attention.py: _lse_cpu) against the fp32
matmul-softmax reference: query heads stacked per kv head, the causal part bottom-right, merged by the log-sum-exp."""
import pytest
import torch

from engine.ops.attention import attention_lse, attention_lse_reference


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_partial_attention_on_the_cpu_equals_the_fp32_reference(dtype, tol):
    """Chunked offload's partial attention: a chunk over itself (causal), the last rows of a longer span (causal,
    bottom-right), earlier blocks, one query row; GQA groups of 3 and 4."""
    torch.manual_seed(3)
    for hq, hkv in ((9, 3), (8, 2)):
        for tq, tk, causal in ((64, 64, True), (30, 100, True), (64, 200, False), (1, 90, True), (1, 90, False)):
            q = torch.randn(tq, hq, 16).to(dtype)
            k, v = (torch.randn(tk, hkv, 16).to(dtype).transpose(0, 1) for _ in range(2))   # head-major views
            out, lse = attention_lse(q, k, v, 0.25, causal)
            want, want_lse = attention_lse_reference(q, k, v, 0.25, causal)
            assert out.dtype == lse.dtype == torch.float32 and out.shape == want.shape and lse.shape == want_lse.shape
            torch.testing.assert_close(out, want, atol=tol, rtol=tol)
            torch.testing.assert_close(lse, want_lse, atol=tol, rtol=tol)

