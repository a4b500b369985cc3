"""A decode step's new tokens' K and V into the paged cache (and, for layerwise decode, the layer's decode buffer too),
in one kernel.

In torch each destination is an index_put per K and V: four kernels a layer where the decode buffer keeps a copy,
~3 µs each on an H200 (Qwen3-4B shape), on the layer's critical path. One program per (K or V, kv head, token)
reads the row once and writes it to both places. `store_tokens_reference` is the same in torch: the CPU path, long
prompts (more than MAX_TOKENS rows) and the test reference.

Layouts: k, v [T, Hkv, D]; caches [blocks, block_size, Hkv, D] (views with any strides, the last one 1); slots [2, T]
(block, offset) on the device, any strides (gpu mode's prefill passes the transpose of [T, 2] rows); keep
[2, block_size, Hkv, D] (K and V of the decode buffer) and at [1] (the offset there), both optional.
"""
from engine.ops.attention import store_kv

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs use the reference
    triton = None

MAX_TOKENS = 64   # rows a call takes the kernel for (a prompt's thousands go through torch)


def store_tokens_reference(k, v, k_cache, v_cache, slots, keep=None, at=None) -> None:
    store_kv(k, v, k_cache, v_cache, slots)
    if keep is not None:
        keep[0][at], keep[1][at] = k, v


if triton is not None:
    @triton.jit
    def _store_tokens_kernel(k, v, kc, vc, slots, keep, at, s_t, s_h, s_vt, s_vh, c_b, c_o, c_h, vc_b, vc_o, vc_h,
                             s_slot, s_st, w_kv, w_o, w_h, D: tl.constexpr, DP: tl.constexpr, KEEP: tl.constexpr):
        kv, h, t = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        d = tl.arange(0, DP)
        m = d < D
        blk = tl.load(slots + t * s_st).to(tl.int64)
        off = tl.load(slots + s_slot + t * s_st).to(tl.int64)
        if kv == 0:
            x = tl.load(k + t * s_t + h * s_h + d, mask=m)
            tl.store(kc + blk * c_b + off * c_o + h * c_h + d, x, mask=m)
        else:
            x = tl.load(v + t * s_vt + h * s_vh + d, mask=m)
            tl.store(vc + blk * vc_b + off * vc_o + h * vc_h + d, x, mask=m)
        if KEEP:
            tl.store(keep + kv * w_kv + tl.load(at).to(tl.int64) * w_o + h * w_h + d, x, mask=m)


def store_tokens(k, v, k_cache, v_cache, slots, keep=None, at=None, kernel: bool | None = None) -> None:
    """k_cache[slots[0], slots[1]] = k (and v), and keep[:, at] = (k, v) where keep is given (graph-safe, no host
    sync). kernel: take the kernel (None: on CUDA; True: also the interpreter's CPU tensors, for tests)."""
    t, hkv, d = k.shape
    use = k.is_cuda if kernel is None else kernel
    if (triton is None or not use or t > MAX_TOKENS or (keep is not None and t != 1)
            or any(x.stride(-1) != 1 for x in (k, v, k_cache, v_cache) + (() if keep is None else (keep,)))):
        return store_tokens_reference(k, v, k_cache, v_cache, slots, keep, at)
    w = keep if keep is not None else k_cache
    _store_tokens_kernel[(2, hkv, t)](
        k, v, k_cache, v_cache, slots, w, slots if at is None else at, k.stride(0), k.stride(1), v.stride(0),
        v.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3], *slots.stride(),
        *(w.stride()[:3] if keep is not None else (0, 0, 0)), D=d, DP=triton.next_power_of_2(d),
        KEEP=keep is not None, num_warps=1)
