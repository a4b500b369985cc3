"""The new tokens' K/V store (one kernel for the paged cache and the decode buffer's copy; interpreter on CPU)
against index_put in torch."""
import os

import pytest
import torch

if not torch.cuda.is_available():  # must precede any `import triton`
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from engine.ops.store_tokens import store_tokens, store_tokens_reference  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def caches(blocks=3, bs=8, hkv=2, d=24, dtype=torch.float32):
    """Two buffers laid out as the offload engine's ([blocks, 2, Hkv, bs, D], K and V as [blocks, bs, Hkv, D] views)
    and a decode buffer's K and V ([2, bs, Hkv, D] view of [2, Hkv, bs, D])."""
    buf = torch.randn(blocks, 2, hkv, bs, d, device=DEV).to(dtype)
    dbuf = torch.randn(2, hkv, bs, d, device=DEV).to(dtype)
    return buf, dbuf


@pytest.mark.parametrize("keep", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_token_lands_in_the_cache_and_the_decode_buffer(keep, dtype):
    torch.manual_seed(0)
    got = caches(dtype=dtype)
    want = [t.clone() for t in got]
    k, v = torch.randn(2, 1, 2, 24, device=DEV).to(dtype)                 # d = 24: not a power of two
    slots = torch.tensor([[2], [5]], device=DEV)
    at = torch.tensor([5], device=DEV)
    for (buf, dbuf), kernel in ((got, True), (want, None)):
        K, V = buf[:, 0].transpose(1, 2), buf[:, 1].transpose(1, 2)
        w = dbuf.transpose(1, 2) if keep else None
        (store_tokens if kernel else store_tokens_reference)(k, v, K, V, slots, w, at if keep else None,
                                                             **({"kernel": True} if kernel else {}))
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(got[0][2, 0, :, 5], k[0]) and torch.equal(got[0][2, 1, :, 5], v[0])
    assert torch.equal(got[1][0, :, 5], k[0]) == keep


def test_several_tokens_of_a_strided_row_across_blocks():
    """Tokens of a batch at their own slots (a gpu-mode decode step), k a view of a wider qkv row."""
    buf, _ = caches()
    want = buf.clone()
    qkv = torch.randn(3, 5, 24, device=DEV)                               # [T, q + k + v heads, D]
    k, v = qkv[:, 1:3], qkv[:, 3:5]
    slots = torch.tensor([[0, 1, 2], [7, 0, 3]], device=DEV)
    for b, kernel in ((buf, True), (want, False)):
        K, V = b[:, 0].transpose(1, 2), b[:, 1].transpose(1, 2)
        store_tokens(k, v, K, V, slots, kernel=kernel)
    assert torch.equal(buf, want)
    assert torch.equal(buf[1, 0, :, 0], k[1])


def test_a_prefills_slots_as_a_transposed_view():
    """gpu mode's prefill builds slots as [T, 2] rows and passes their transpose ([2, T], stride 1 between block and
    offset): a short prompt (up to MAX_TOKENS rows) takes the kernel, which must follow both strides."""
    buf, _ = caches(blocks=4)
    want = buf.clone()
    k, v = torch.randn(2, 11, 2, 24, device=DEV)
    rows = [(3, o) for o in range(3, 8)] + [(0, o) for o in range(6)]      # (block, offset) per token, [T, 2]
    slots = torch.tensor(rows, device=DEV).T
    assert slots.stride() == (1, 2)
    for b, kernel in ((buf, True), (want, False)):
        K, V = b[:, 0].transpose(1, 2), b[:, 1].transpose(1, 2)
        store_tokens(k, v, K, V, slots, kernel=kernel)
    assert torch.equal(buf, want)
    assert torch.equal(buf[0, 1, :, 5], v[10])
