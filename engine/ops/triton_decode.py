"""Decode attention over a paged KV cache: one new query token per sequence (flash-decoding).

Kernel 1 (`_split_kernel`), grid (B, Hkv, num_splits). A program takes one sequence, one kv head and
all G = Hq // Hkv query heads that share it (padded to >= 16 rows, masked, so `tl.dot` applies):
each K/V byte is read once per group, never once per query head. Split s covers the tokens
[s * chunk, (s + 1) * chunk) with chunk = ceil(ctx / num_splits) rounded up to BLOCK_N; ctx is
loaded from `context_lens` inside the kernel, so the grid depends on shapes only and the launch can
be captured in a CUDA graph and replayed after the lengths change in place. The program walks its
range in tiles of BLOCK_N tokens; BLOCK_N divides block_size and tiles start at multiples of
BLOCK_N, so a tile lies in one cache block: one block-table load per tile, then BLOCK_N rows of
Hkv*D stride. Only blocks below ceil(ctx / block_size) are ever looked up. Online softmax in fp32
with exp2 (log2(e) folded into the scale) gives a partial output [B, Hq, S, D] and its log-sum-exp
[B, Hq, S] (natural log; -inf and zeros for a split with no tokens).

Kernel 2 (`_reduce_kernel`), grid (B, Hq), merges the splits with weights exp(lse_s - max lse)
into `out` (q's dtype); it runs for num_splits == 1 too (a variant of kernel 1 that wrote `out`
itself needed 140 registers instead of 128, so 3 instead of 4 programs per SM: slower, see below).
A sequence with context_len 0 (a padded batch slot) gets zeros.

Measured (Triton 3.6, bf16, Hq 32, Hkv 8, D 128, block_size 256, CUDA-graph replays, default splits):
H100: B=1 x 32K tokens 53 us/layer (2.54 TB/s; a device copy reaches 3.0), B=4 x 32K 185 us (2.9 TB/s).
H200: B=1 x 32K 39 us (3.4 TB/s of 4.26), B=4 x 32K 129 us (4.17 TB/s).
"""
import functools

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs use engine.ops.attention.decode_attention_reference
    triton = None

_LOG2E = 1.4426950408889634
PROGRAMS_PER_SM = 4  # resident at once on sm_90 (128 registers x 128 threads, ~39 KB shared memory each)
MIN_TOKENS_PER_SPLIT = 128  # two tiles of 64


def default_num_splits(batch: int, num_kv_heads: int, max_tokens: int, num_sms: int = 132) -> int:
    """Splits per (sequence, kv head), from shapes only (CUDA-graph safe).

    The most splits that still fit all B * Hkv * splits programs in ONE wave of PROGRAMS_PER_SM * num_sms
    resident programs: every program streams an equal share at once, with no partial second wave (on an
    H200 a wave 1.1-1.3x full ran up to 30% slower than a full one). No split shorter than
    MIN_TOKENS_PER_SPLIT of the longest possible sequence (max_blocks * block_size). When B * Hkv alone
    exceeds a wave, 1 (many waves, small tail). E.g. 132 SMs, Hkv 8, 32K-token tables: B=1 -> 66,
    B=2 -> 33, B=4 -> 16, B=8 -> 8, B>=34 -> 1.
    """
    fit = PROGRAMS_PER_SM * num_sms // max(1, batch * num_kv_heads)
    cap = max_tokens // MIN_TOKENS_PER_SPLIT
    return max(1, min(fit, cap))


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132


if triton is not None:

    @triton.jit
    def _split_kernel(
        Q, K, V, BT, CL, PO, PL, scale_log2, num_splits,
        sq_b, sq_h, sk_n, sk_t, sk_h, sv_n, sv_t, sv_h, sbt_b, spo_b, spo_h, spo_s, spl_b, spl_h,
        G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, DOT_PREC: tl.constexpr,
    ):
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        s = tl.program_id(2)
        ctx = tl.load(CL + b)
        chunk = tl.cdiv(tl.cdiv(ctx, num_splits), BLOCK_N) * BLOCK_N
        start = s * chunk
        end = tl.minimum(start + chunk, ctx)

        offs_g = tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, D)
        offs_n = tl.arange(0, BLOCK_N)
        g_mask = offs_g < G
        heads = kvh * G + offs_g
        q = tl.load(Q + b * sq_b + heads[:, None] * sq_h + offs_d[None, :], mask=g_mask[:, None], other=0.0)
        q = q.to(K.dtype.element_ty)

        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, D], tl.float32)
        k_ptrs = K + kvh * sk_h + offs_n[:, None] * sk_t + offs_d[None, :]
        v_ptrs = V + kvh * sv_h + offs_n[:, None] * sv_t + offs_d[None, :]
        bt_row = BT + b.to(tl.int64) * sbt_b
        for t in range(start, end, BLOCK_N):
            blk = tl.load(bt_row + t // BLOCK_SIZE).to(tl.int64)
            row = t % BLOCK_SIZE
            n_mask = (t + offs_n) < end
            k = tl.load(k_ptrs + (blk * sk_n + row * sk_t), mask=n_mask[:, None], other=0.0)
            qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * scale_log2
            qk = tl.where(n_mask[None, :], qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(qk - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_ptrs + (blk * sv_n + row * sv_t), mask=n_mask[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
            m_i = m_new

        has = l_i > 0.0
        l_safe = tl.where(has, l_i, 1.0)
        po_ptrs = PO + b * spo_b + heads[:, None] * spo_h + s * spo_s + offs_d[None, :]
        tl.store(po_ptrs, acc / l_safe[:, None], mask=g_mask[:, None])
        lse = tl.where(has, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))  # natural log
        tl.store(PL + b * spl_b + heads * spl_h + s, lse, mask=g_mask)

    @triton.jit
    def _reduce_kernel(
        PO, PL, O, num_splits, spo_b, spo_h, spo_s, spl_b, spl_h, so_b, so_h,
        D: tl.constexpr, SPLITS_P2: tl.constexpr,
    ):
        b = tl.program_id(0)
        h = tl.program_id(1)
        offs_s = tl.arange(0, SPLITS_P2)
        offs_d = tl.arange(0, D)
        s_mask = offs_s < num_splits
        lse = tl.load(PL + b * spl_b + h * spl_h + offs_s, mask=s_mask, other=float("-inf"))
        m = tl.max(lse, 0)
        m = tl.where(m == float("-inf"), 0.0, m)
        w = tl.where(lse == float("-inf"), 0.0, tl.exp(lse - m))
        po = tl.load(PO + b * spo_b + h * spo_h + offs_s[:, None] * spo_s + offs_d[None, :],
                     mask=s_mask[:, None], other=0.0)
        denom = tl.sum(w, 0)
        o = tl.sum(w[:, None] * po, 0) / tl.where(denom > 0.0, denom, 1.0)
        tl.store(O + b * so_b + h * so_h + offs_d, o.to(O.dtype.element_ty))


def paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale, num_splits=None, out=None):
    """q: [B, Hq, D]; k_cache, v_cache: [num_blocks, block_size, Hkv, D] (contiguous); block_tables: int32 [B, max_blocks]
    (entries past a sequence's blocks may hold anything, e.g. -1 or 0); context_lens: int32 [B] (tokens of KV per sequence,
    including the current token whose K/V is already stored in the cache). Returns out [B, Hq, D] in q's dtype.
    Hq % Hkv == 0 (GQA). block_size is a power of two >= 16. D in {64, 128} at least (any power of two 16..256 is nice).

    num_splits: None picks `default_num_splits` from the shapes. out: optional [B, Hq, D] tensor of q's dtype to
    write into (its last stride must be 1). No host reads of context_lens: safe inside CUDA-graph capture.
    """
    if triton is None:
        raise RuntimeError("paged_decode_attention needs triton; use engine.ops.attention.decode_attention_reference")
    B, Hq, D = q.shape
    _, block_size, Hkv, Dk = k_cache.shape
    if Dk != D or v_cache.shape != k_cache.shape or Hq % Hkv:
        raise ValueError(f"shapes do not fit: q {tuple(q.shape)}, k {tuple(k_cache.shape)}, v {tuple(v_cache.shape)}")
    if D < 16 or D & (D - 1) or block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"head_dim {D} and block_size {block_size} must be powers of two >= 16")
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1 or block_tables.stride(-1) != 1:
        raise ValueError("q, k_cache, v_cache and block_tables need a contiguous last dimension")
    G = Hq // Hkv
    block_n = min(block_size, 64 if D <= 128 else 32)
    if num_splits is None:
        num_splits = default_num_splits(B, Hkv, block_tables.shape[1] * block_size, _num_sms(q.device))
    num_splits = max(1, int(num_splits))
    if out is None:
        out = torch.empty((B, Hq, D), dtype=q.dtype, device=q.device)
    if B == 0:
        return out
    po = torch.empty((B, Hq, num_splits, D), dtype=torch.float32, device=q.device)
    pl = torch.empty((B, Hq, num_splits), dtype=torch.float32, device=q.device)
    # num_stages=3: the pipeliner loads the block id two tiles ahead and K/V (cp.async) one tile ahead;
    # the latency of the rest is hidden by 4 resident programs per SM (see default_num_splits)
    _split_kernel[(B, Hkv, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens, po, pl, float(scale) * _LOG2E, num_splits,
        q.stride(0), q.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3], block_tables.stride(0),
        po.stride(0), po.stride(1), po.stride(2), pl.stride(0), pl.stride(1),
        G=G, BLOCK_G=max(16, triton.next_power_of_2(G)), D=D, BLOCK_N=block_n, BLOCK_SIZE=block_size,
        DOT_PREC="ieee" if k_cache.dtype == torch.float32 else "tf32", num_warps=4, num_stages=3,
    )
    _reduce_kernel[(B, Hq)](
        po, pl, out, num_splits, po.stride(0), po.stride(1), po.stride(2), pl.stride(0), pl.stride(1),
        out.stride(0), out.stride(1), D=D, SPLITS_P2=max(2, triton.next_power_of_2(num_splits)), num_warps=4,
    )
    return out
