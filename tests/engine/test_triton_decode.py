"""Paged decode attention: Triton kernel (interpreter on CPU, real on GPU) vs torch reference vs dense math."""
import math
import os

import pytest
import torch

if not torch.cuda.is_available():  # must precede any `import triton`; on a GPU the kernels run compiled
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")

from engine.ops.attention import decode_attention_reference  # noqa: E402
from engine.ops.triton_decode import (  # noqa: E402
    default_num_splits,
    paged_decode_attention,
)

# the interpreter runs CPU tensors only; on a real GPU these run there (device tensors)
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEV = "cpu" if INTERPRET or not torch.cuda.is_available() else "cuda"
needs_triton_device = pytest.mark.skipif(
    DEV == "cpu" and not INTERPRET, reason="Triton needs TRITON_INTERPRET=1 or a CUDA device"
)


def make_case(lens, hq, hkv, d, block_size, dtype=torch.float32, device=DEV, filler=-1, extra_blocks=1, seed=0,
              layout="shuffled"):
    """Random q and cache; each sequence's blocks are a shuffled, non-contiguous set (or, with layout="runs",
    consecutive ids in runs of up to three: what the allocator usually hands out); table tails hold `filler`."""
    gen = torch.Generator().manual_seed(seed)
    need = [math.ceil(n / block_size) for n in lens]
    max_blocks = max(need + [1]) + extra_blocks
    num_blocks = sum(need) + 3
    perm = torch.randperm(num_blocks, generator=gen)
    if layout == "runs":  # ascending, with a gap after every third block
        perm = torch.tensor([i + i // 3 for i in range(num_blocks)]) % num_blocks
    table = torch.full((len(lens), max_blocks), filler, dtype=torch.int32)
    used = 0
    for b, nb in enumerate(need):
        table[b, :nb] = perm[used:used + nb].to(torch.int32)
        used += nb
    q = torch.randn(len(lens), hq, d, generator=gen)
    k = torch.randn(num_blocks, block_size, hkv, d, generator=gen)
    v = torch.randn(num_blocks, block_size, hkv, d, generator=gen)
    cast = dict(dtype=dtype, device=device)
    return (q.to(**cast), k.to(**cast), v.to(**cast), table.to(device),
            torch.tensor(lens, dtype=torch.int32, device=device))


def dense_attention(q, k_cache, v_cache, table, lens, scale):
    """Independent float64 math: per head, K/V gathered token by token and repeated per query head."""
    B, hq, d = q.shape
    block_size, hkv = k_cache.shape[1], k_cache.shape[2]
    out = torch.zeros(B, hq, d, dtype=torch.float64)
    for b, n in enumerate(lens.tolist()):
        if n == 0:
            continue
        toks = [(int(table[b, t // block_size]), t % block_size) for t in range(n)]
        K = torch.stack([k_cache[i, j] for i, j in toks]).double().cpu()  # [n, hkv, d]
        V = torch.stack([v_cache[i, j] for i, j in toks]).double().cpu()
        K = K.repeat_interleave(hq // hkv, dim=1)  # [n, hq, d]
        V = V.repeat_interleave(hq // hkv, dim=1)
        for h in range(hq):
            w = torch.softmax((K[:, h] @ q[b, h].double().cpu()) * scale, dim=0)
            out[b, h] = w @ V[:, h]
    return out


CONFIGS = [  # (lens, hq, hkv, d, block_size)
    ([1, 17, 40], 4, 2, 16, 16),
    ([40, 1, 33], 6, 2, 32, 16),
    ([23, 0], 4, 4, 16, 16),  # MHA (G = 1); a padded batch slot with no tokens
    ([100, 300], 4, 1, 16, 128),  # G = 4, tiles of 64 inside 128-token blocks
]


@pytest.mark.parametrize("layout", ["shuffled", "runs"])
@pytest.mark.parametrize("lens,hq,hkv,d,block_size", CONFIGS)
def test_reference_matches_dense(lens, hq, hkv, d, block_size, layout):
    q, k, v, table, cl = make_case(lens, hq, hkv, d, block_size, device="cpu", layout=layout)
    scale = d ** -0.5
    ref = decode_attention_reference(q, k, v, table, cl, scale)
    torch.testing.assert_close(ref.double(), dense_attention(q, k, v, table, cl, scale), atol=1e-5, rtol=1e-5)


@needs_triton_device
@pytest.mark.parametrize("num_splits", [1, 2, 3, 5, None])
@pytest.mark.parametrize("lens,hq,hkv,d,block_size", CONFIGS[:3])
def test_triton_matches_reference(lens, hq, hkv, d, block_size, num_splits):
    # splits 3 and 5 leave some programs an empty range (ctx 1 and 17 span only 1-2 tiles of 16)
    q, k, v, table, cl = make_case(lens, hq, hkv, d, block_size, filler=-1 if hq != 6 else 0)
    scale = d ** -0.5
    out = paged_decode_attention(q, k, v, table, cl, scale, num_splits=num_splits)
    assert out.shape == q.shape and out.dtype == q.dtype
    ref = decode_attention_reference(q, k, v, table, cl, scale)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


@needs_triton_device
def test_triton_tiles_inside_large_blocks_and_strided_q():
    lens, hq, hkv, d, block_size = CONFIGS[3]
    q, k, v, table, cl = make_case(lens, hq, hkv, d, block_size, seed=1)
    qkv = torch.randn(len(lens), hq * 3, d, device=q.device)  # q as a slice of a fused projection
    qkv[:, :hq] = q
    q_view = qkv[:, :hq]
    out = torch.full_like(q, float("nan"))
    res = paged_decode_attention(q_view, k, v, table, cl, 0.3, num_splits=3, out=out)
    assert res is out
    torch.testing.assert_close(out, decode_attention_reference(q, k, v, table, cl, 0.3), atol=1e-4, rtol=1e-4)


@needs_triton_device
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_triton_half_cache(dtype):
    if dtype == torch.bfloat16 and INTERPRET:  # seen with Triton 3.9: np.matmul on the raw bf16 bits
        pytest.skip("the Triton interpreter's tl.dot mishandles bfloat16")
    q, k, v, table, cl = make_case([40, 9], 4, 2, 32, 16, dtype=dtype, seed=2)
    out = paged_decode_attention(q, k, v, table, cl, 32 ** -0.5, num_splits=2)
    assert out.dtype == dtype
    ref = decode_attention_reference(q, k, v, table, cl, 32 ** -0.5)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


def test_default_num_splits_depends_on_shapes_only():
    assert default_num_splits(1, 8, 32768, 132) == 66  # 8 * 66 = 528 = one wave of 4 programs x 132 SMs
    assert default_num_splits(4, 8, 32768, 132) == 16
    assert default_num_splits(64, 8, 32768, 132) == 1
    assert default_num_splits(1, 8, 512, 132) == 4  # short tables: at least 128 tokens a split
    assert default_num_splits(1, 8, 16, 132) == 1


# ---------------------------------------------------------------- GPU (real shapes, bf16, CUDA graphs)

gpu_only = pytest.mark.skipif(not torch.cuda.is_available() or INTERPRET, reason="needs CUDA, TRITON_INTERPRET unset")


def _rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("lens", [[32768], [32768, 1, 5000, 17001]])
@pytest.mark.parametrize("num_splits", [None, 1, 7])
@pytest.mark.parametrize("hq,hkv,d", [(32, 8, 128), (9, 3, 64), (16, 2, 256)])  # Qwen3-4B, SmolLM2, D=256
def test_gpu_real_shapes(lens, num_splits, hq, hkv, d):
    q, k, v, table, cl = make_case(lens, hq, hkv, d, 256, dtype=torch.bfloat16, device="cuda", seed=3)
    out = paged_decode_attention(q, k, v, table, cl, d ** -0.5, num_splits=num_splits)
    ref = decode_attention_reference(q, k, v, table, cl, d ** -0.5)
    assert torch.isfinite(out).all()
    assert _rel_err(out, ref) < 1e-2


@pytest.mark.gpu
@gpu_only
def test_gpu_cuda_graph_follows_context_lens():
    max_len, bs = 32768, 256
    lens = [max_len] * 4  # every table covers max_len, so any later length up to it is valid
    q, k, v, table, cl = make_case(lens, 32, 8, 128, bs, dtype=torch.bfloat16, device="cuda", extra_blocks=0, seed=4)
    cl.copy_(torch.tensor([max_len, 100, 5000, 0], dtype=torch.int32))
    out = torch.empty_like(q)
    scale = 128 ** -0.5
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and warm up outside the capture
        paged_decode_attention(q, k, v, table, cl, scale, out=out)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_decode_attention(q, k, v, table, cl, scale, out=out)
    for new_lens in ([max_len, 100, 5000, 0], [17, max_len, 1, 20000], [256, 257, 31999, 1]):
        cl.copy_(torch.tensor(new_lens, dtype=torch.int32))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref = decode_attention_reference(q, k, v, table, cl, scale)
        assert torch.isfinite(out).all()
        assert _rel_err(out, ref) < 1e-2, new_lens


@pytest.mark.parametrize("layout", ["shuffled", "runs"])
def test_reference_in_bf16_matches_dense(layout):
    """bf16 takes the grouped matmul path (CPU SDPA is slow there); fp32 takes SDPA over cache views."""
    q, k, v, table, cl = make_case([1, 40, 100], 6, 2, 32, 16, device="cpu", layout=layout)
    q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()
    ref = decode_attention_reference(q, k, v, table, cl, 32 ** -0.5)
    want = dense_attention(q, k, v, table, cl, 32 ** -0.5)
    torch.testing.assert_close(ref.double(), want, atol=2e-2, rtol=2e-2)


def _head_major(cache):
    """Same logical [block, offset, head, dim] values, stored [block, head, offset, dim] like the engine's."""
    return cache.transpose(1, 2).contiguous().transpose(1, 2)


@pytest.mark.parametrize("lens,hq,hkv,d,block_size", CONFIGS)
def test_head_major_cache_gives_the_same_result(lens, hq, hkv, d, block_size):
    q, k, v, table, cl = make_case(lens, hq, hkv, d, block_size, device="cpu", layout="runs")
    kh, vh = _head_major(k), _head_major(v)
    assert hkv == 1 or kh.stride(2) == block_size * d  # heads really are apart
    want = dense_attention(q, k, v, table, cl, d ** -0.5)
    torch.testing.assert_close(decode_attention_reference(q, kh, vh, table, cl, d ** -0.5).double(), want,
                               atol=1e-5, rtol=1e-5)
    if INTERPRET or DEV == "cuda":
        q, kh, vh, table, cl = (t.to(DEV) for t in (q, kh, vh, table, cl))
        out = paged_decode_attention(q, kh, vh, table, cl, d ** -0.5, num_splits=2)
        torch.testing.assert_close(out.double().cpu(), want, atol=1e-4, rtol=1e-4)
