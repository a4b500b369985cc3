"""A packed decode buffer's rows from the device copies (one kernel in the layer's graph; interpreter on CPU) against
slice copies in torch, across block boundaries, with either run empty."""
import os

import pytest
import torch

if not torch.cuda.is_available():  # must precede any `import triton`
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from engine.ops.place_tokens import place_tokens, place_tokens_reference  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def copy_by_slices(buf, src, at, a, b):
    """Tokens a..b-1 of src [2, Hkv, n, D] -> flat positions at.. of buf [blocks, 2, Hkv, bs, D], block by block."""
    bs = buf.shape[3]
    while a < b:
        blk, off = at // bs, at % bs
        n = min(b - a, bs - off)
        buf[blk, :, :, off:off + n] = src[:, :, a:a + n]
        a, at = a + n, at + n


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_keep, keep_start, n_dbuf, dbuf_start, dbuf_at", [
    (12, 4, 5, 2, 30),     # the sink and recent rows across block 0 -> 1, the decode buffer's tail in block 3
    (4, 16, 0, 0, 0),      # the sink alone (the window inside the partly filled block, its newest token only)
    (0, 0, 7, 0, 9),       # rows loaded from the host: only the decode buffer's tail
    (40, 0, 35, 1, 41)])   # more than a program's pass (BT) in each run
def test_both_runs_land_where_the_slice_copies_put_them(dtype, n_keep, keep_start, n_dbuf, dbuf_start, dbuf_at):
    torch.manual_seed(0)
    blocks, bs, hkv, d = 6, 8 * 2, 2, 24                                   # d = 24: not a power of two
    buf = torch.randn(blocks, 2, hkv, bs, d, device=DEV).to(dtype)
    keep = torch.randn(2, hkv, 48, d, device=DEV).to(dtype)
    dbuf = torch.randn(2, hkv, bs * 3, d, device=DEV).to(dtype)
    meta = torch.tensor([n_keep, keep_start, n_dbuf, dbuf_start, dbuf_at], device=DEV)
    want = buf.clone()
    copy_by_slices(want, keep, 0, keep_start, keep_start + n_keep)
    copy_by_slices(want, dbuf, dbuf_at, dbuf_start, dbuf_start + n_dbuf)
    for fn, kw in ((place_tokens, {"kernel": True}), (place_tokens_reference, {})):
        got = buf.clone()
        fn(got[:, 0].transpose(1, 2), got[:, 1].transpose(1, 2), keep, dbuf, meta, **kw)
        assert torch.equal(got, want), fn.__name__
