"""The rows a packed decode buffer takes from the device, in one kernel inside the layer's CUDA graph.

A layerwise decode layer over packed rows (Quest's plan) attends to rows the device holds already: the sink and the
window's tokens right before the partly filled block (the runner's kept copies: each layer's last complete block,
then its sink) and the partly filled block's earlier tokens (the layer's decode buffer). Copied from
Python they were two or three eager kernels between the layers' graphs, each with a gap of ~2.5 µs while the
host issued it (H200, 128K, Qwen3-4B shape); here one program per (K or V, kv head) copies both runs, their
bounds read from a device row (`meta`, staged once a step with the graph's other inputs), so the graph records it.

Layouts: k_cache, v_cache [blocks, block_size, Hkv, D] views of the buffer (any strides, the last one 1); keep
[2, Hkv, n, D] and dbuf [2, Hkv, block_size, D] (K then V); meta [5] int64: n_keep, keep_start, n_dbuf, dbuf_start,
dbuf_at. Tokens keep[:, :, keep_start + i] go to the buffer's flat positions i (i < n_keep), tokens
dbuf[:, :, dbuf_start + i] to positions dbuf_at + i (i < n_dbuf). `place_tokens_reference` is the same in torch.
"""
import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs use the reference
    triton = None

BT = 32   # tokens a program copies per pass


def place_tokens_reference(k_cache, v_cache, keep, dbuf, meta) -> None:
    n_keep, keep_start, n_dbuf, dbuf_start, dbuf_at = (int(x) for x in meta.tolist())
    bs = k_cache.shape[1]
    for src, start, n, at in ((keep, keep_start, n_keep, 0), (dbuf, dbuf_start, n_dbuf, dbuf_at)):
        pos = torch.arange(at, at + n, device=k_cache.device)
        for i, cache in enumerate((k_cache, v_cache)):
            cache[pos // bs, pos % bs] = src[i, :, start:start + n].transpose(0, 1)


if triton is not None:
    @triton.jit
    def _place_kernel(kc, v_off, keep, dbuf, meta, bs, c_b, c_o, c_h, w_kv, w_h, w_t, d_kv, d_h, d_t, HKV,
                      D: tl.constexpr, DP: tl.constexpr, BT: tl.constexpr):
        kv, h = tl.program_id(0) // HKV, tl.program_id(0) % HKV
        n_keep, keep_start = tl.load(meta), tl.load(meta + 1)
        n_dbuf, dbuf_start, dbuf_at = tl.load(meta + 2), tl.load(meta + 3), tl.load(meta + 4)
        d = tl.arange(0, DP)
        md = d < D
        cache = kc + kv * v_off                                  # V's view: the same buffer, v_off further
        for j0 in range(0, n_keep + n_dbuf, BT):
            j = j0 + tl.arange(0, BT)
            from_keep = j < n_keep
            inside = j < n_keep + n_dbuf
            ki = tl.where(from_keep, keep_start + j, 0).to(tl.int64)
            di = tl.where(from_keep, 0, dbuf_start + j - n_keep).to(tl.int64)
            a = tl.load(keep + kv * w_kv + h * w_h + ki[:, None] * w_t + d[None, :],
                        mask=(from_keep[:, None]) & md[None, :], other=0.0)
            b = tl.load(dbuf + kv * d_kv + h * d_h + di[:, None] * d_t + d[None, :],
                        mask=(inside & ~from_keep)[:, None] & md[None, :], other=0.0)
            x = tl.where(from_keep[:, None], a, b)
            pos = tl.where(from_keep, j, dbuf_at + j - n_keep).to(tl.int64)
            at = (pos // bs) * c_b + (pos % bs) * c_o + h * c_h
            tl.store(cache + at[:, None] + d[None, :], x, mask=inside[:, None] & md[None, :])


def place_tokens(k_cache, v_cache, keep, dbuf, meta, kernel: bool | None = None) -> None:
    """The two runs of tokens (see the module docstring) into the buffer's K and V views, graph-safe (no host
    sync on CUDA). kernel: take the kernel (None: on CUDA; True: also the interpreter's CPU tensors, for tests)."""
    use = k_cache.is_cuda if kernel is None else kernel
    if triton is None or not use or any(x.stride(-1) != 1 for x in (k_cache, v_cache, keep, dbuf)):
        return place_tokens_reference(k_cache, v_cache, keep, dbuf, meta)
    assert k_cache.stride() == v_cache.stride() and k_cache.dtype == v_cache.dtype
    _, bs, hkv, d = k_cache.shape
    v_off = (v_cache.data_ptr() - k_cache.data_ptr()) // k_cache.element_size()
    _place_kernel[(2 * hkv,)](k_cache, v_off, keep, dbuf, meta, bs, *k_cache.stride()[:3], *keep.stride()[:3],
                              *dbuf.stride()[:3], hkv, D=d, DP=triton.next_power_of_2(d), BT=BT, num_warps=4)
