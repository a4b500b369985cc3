"""Attention over the paged KV cache: store, prefill (varlen, optional cached prefix), decode.

Cache layout: k_cache, v_cache are indexed [block, offset, kv head, dim]. The model runner stores them head-major
([block, kv head, offset, dim] in memory, handed out as a permuted view), so one head's tokens of a block are one
contiguous run: the Triton kernel reads whole tiles, and the CPU path multiplies blocks in place.
Backends: flash-attn's varlen kernel when importable (CUDA), else torch SDPA per sequence (GQA-native);
decode uses our Triton split-K kernel on CUDA and a grouped matmul-softmax-matmul on CPU.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

try:  # optional, used when importable
    from flash_attn import flash_attn_varlen_func  # type: ignore
except Exception:  # noqa: BLE001 - any import failure means "not available"
    flash_attn_varlen_func = None


@dataclass
class AttnMetadata:
    """What one forward step needs to know about its sequences. Host lists are for python loops only."""
    is_prefill: bool
    slots: torch.Tensor                        # [2, T] int64: (block, offset) where each new token's KV goes
    block_tables: torch.Tensor | None = None   # [B, max_blocks] int32
    context_lens: torch.Tensor | None = None   # [B] int64: decode, tokens in cache incl. the new one
    q_lens: list[int] | None = None            # prefill: new tokens per sequence
    k_lens: list[int] | None = None            # prefill: cached prefix + new tokens per sequence
    cu_seqlens_q: torch.Tensor | None = None   # prefill, int32 [B+1] (flash-attn)

    @property
    def has_prefix(self) -> bool:
        return self.k_lens is not None and any(k != q for q, k in zip(self.q_lens, self.k_lens))


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slots: torch.Tensor) -> None:
    """Write new tokens' K/V ([T, Hkv, D]) at their (block, offset) slots (graph-safe, no host sync)."""
    k_cache[slots[0], slots[1]] = k
    v_cache[slots[0], slots[1]] = v


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """One sequence's first `length` tokens of K or V from the paged cache -> [length, Hkv, D]."""
    n_blocks = -(-length // cache.shape[1])
    return cache[block_table[:n_blocks].long()].flatten(0, 1)[:length]


def prefill_attention(q, k, v, k_cache, v_cache, meta: AttnMetadata, scale: float, attend=None,
                      step: int | None = None) -> torch.Tensor:
    """Causal attention of the new tokens q [T, Hq, D] over their sequence's prefix + themselves.
    `attend(q, k, v)` replaces dense causal attention per sequence (a sparse policy's prefill); `step`: the engine
    step's number (causal_attention)."""
    if attend is None and flash_attn_varlen_func is not None and q.is_cuda and not meta.has_prefix:  # its paged mode wants token-major
        return flash_attn_varlen_func(q, k, v, meta.cu_seqlens_q, meta.cu_seqlens_q, max(meta.q_lens),
                                      max(meta.q_lens), softmax_scale=scale, causal=True)
    out = torch.empty_like(q)
    start = 0
    for i, (q_len, k_len) in enumerate(zip(meta.q_lens, meta.k_lens)):
        qi = q[start:start + q_len]
        if k_len == q_len:
            ki, vi = k[start:start + q_len], v[start:start + q_len]
        else:
            ki = gather_kv(k_cache, meta.block_tables[i], k_len)
            vi = gather_kv(v_cache, meta.block_tables[i], k_len)
        out[start:start + q_len] = causal_attention(qi, ki, vi, scale, step) if attend is None else attend(qi, ki, vi)
        start += q_len
    return out


# A whole causal prompt on CUDA: SDPA picks cuDNN's kernel, faster than flash from ~2K tokens (H100, bf16, warm:
# 0.60-0.66x flash's time at head_dim 64, 0.51-0.60x at 128), but cuDNN builds a graph for every new shape, 43-59 ms
# each in a kernel alone on the H100, 45-95 ms in a prefill (and ~0.7 s for the first in a process); flash builds
# nothing. A user's prompts are mostly lengths never seen before (the first question about each document): so a
# length runs flash in the first two engine steps that meet it (in every layer of each), and cuDNN from the third
# (its graph built once, then kept): a turn run again with another policy compares like with like, a benchmark's
# repeats get cuDNN's pace. Past FLASH_NEW_WORK (lq² · Hq · D of one layer) cuDNN's gain over a prefill's layers
# outweighs its build: the break-even measured ~10K tokens at 32 heads of 128 (Qwen3-4B: 36 layers, 30 ms lost to
# flash at 8K), ~30K at 9 heads of 64 (the default model). Calls without a step get SDPA's own choice. (sdpa_kernel
# sets process-wide flags for the call: the app's engine has a process of its own.)
FLASH_NEW_WORK = 2 ** 39
FLASH_STEPS = 2
_FLASH = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
_seen: dict[tuple, list[int]] = {}     # (lq, Hq, D, Hkv, dtype, device) -> [the last step that ran it, steps that did]


def _flash_first(lq: int, q: torch.Tensor, k: torch.Tensor, step: int | None) -> bool:
    if step is None or not q.is_cuda or lq * lq * q.shape[1] * q.shape[2] >= FLASH_NEW_WORK:
        return False
    seen = _seen.setdefault((lq, *q.shape[1:], k.shape[1], q.dtype, q.device), [step, 1])
    if seen[0] != step:
        seen[0], seen[1] = step, seen[1] + 1
    return seen[1] <= FLASH_STEPS


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                     step: int | None = None) -> torch.Tensor:
    """q [Lq, Hq, D] are the last Lq of Lk positions; k, v [Lk, Hkv, D] -> [Lq, Hq, D]. `step`: the engine step
    that asks (see above: a new prompt length runs flash on CUDA), None for SDPA's own choice."""
    lq, lk = q.shape[0], k.shape[0]
    qt, kt, vt = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    if lq == lk:
        if _flash_first(lq, q, k, step):
            with sdpa_kernel(_FLASH):
                o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale, enable_gqa=True)
        else:
            o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale, enable_gqa=True)
    elif q.device.type == "cpu" and _CPU_FLASH:
        o = _after_prefix_cpu(q, k, v, scale)
    else:  # bottom-right aligned causal: query i sits at position lk - lq + i. Not as a boolean mask: on an H100 that
        # went to cuDNN, which built a graph per new (lq, lk), up to 1.4 s, so each question about a cached document
        # waited that long in its first layer; as a CausalBias it runs the flash kernel, no build. (Imported here:
        # the module imports torch._dynamo, ~3 s of every process's start on a CPU.)
        from torch.nn.attention.bias import causal_lower_right
        o = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=causal_lower_right(lq, lk), scale=scale,
                                           enable_gqa=True)
    return o[0].transpose(0, 1)


_CPU_FLASH = hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu")   # torch's, with the LSE


def _after_prefix_cpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """causal_attention's new tokens after a cached prefix, on the CPU -> [1, Hq, Lq, D] (see _lse_cpu). A lower-right
    CausalBias is a mask on the CPU: over a 7K prefix it took 1.07x this time for 30 new tokens, 1.4-2.2x for
    100-3,500 (2 cores)."""
    lq, hq, d = q.shape
    o = _lse_cpu(q, k.transpose(0, 1), v.transpose(0, 1), scale, causal=True)[0]    # [Hkv, G, Lq, D]
    return o.reshape(1, hq, lq, d)


def _lse_cpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool):
    """attention_lse's arguments on torch's fused CPU kernel -> out [Hkv, G, Tq, D] in q's dtype, lse fp32. Keys
    before the new tokens' own (all of them when not causal, or for one query) need no mask: each kv head's query
    heads are stacked as one longer query. The new tokens' own keys (causal, Tq of them at the end) go in a second
    call with each query head of a group in the batch, merged by the log-sum-exp. Heads stay equal in each call (see
    flash_cpu). Against the fp32 matmul-softmax reference (2 cores): 256 queries over 256-2,048 keys 3.6-6x faster."""
    tq, hq, d = q.shape
    hkv, tk = k.shape[:2]
    g = hq // hkv
    p = tk - tq if causal and tq > 1 else tk                                            # keys every query sees
    qg = q.reshape(tq, hkv, g, d)
    out = lse = None
    if p > 0:
        out, lse = flash_cpu(qg.permute(1, 2, 0, 3).reshape(1, hkv, g * tq, d), k[None, :, :p], v[None, :, :p], scale)
        out, lse = out.view(hkv, g, tq, d), lse.view(hkv, g, tq)
    if p < tk:
        own, own_lse = flash_cpu(qg.permute(2, 1, 0, 3), *(x[None, :, p:].expand(g, -1, -1, -1) for x in (k, v)),
                                 scale, causal=True)                                    # [G, Hkv, Tq, D]
        own, own_lse = own.transpose(0, 1), own_lse.transpose(0, 1)
        if out is None:
            return own, own_lse
        w = torch.sigmoid(own_lse - lse)[..., None].to(out.dtype)
        out = torch.lerp(out, own, w)                       # = (out e^lse + own e^own_lse) / (e^lse + e^own_lse)
        lse = torch.logaddexp(lse, own_lse)
    return out, lse


def flash_cpu(q, k, v, scale, mask=None, causal=False):
    """(out, log-sum-exp) of attention [B, H, Lq, D] x [B, H, Lk, D]: torch's fused CPU kernel, which takes a
    broadcast additive mask, returns the LSE and aligns `causal` top-left; plain matmul-softmax-matmul where that op
    is missing or q is not on the CPU. Equal head counts: the kernel takes GQA inputs, but torch 2.5.1 computed them
    wrongly (NaN, or errors of 1e37)."""
    if _CPU_FLASH and q.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=mask,
                                                                           scale=scale)[:2]
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if causal:
        s.masked_fill_(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    if mask is not None:
        s = s + mask
    lse = torch.logsumexp(s, dim=-1)
    return torch.matmul(torch.exp(s - lse[..., None]).nan_to_num_(0.0), v), lse


def warm_up_prefill(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device) -> None:
    """Load what a prefill's attention kernels load on their first call (cuDNN ~0.7 s, flash ~10 ms on an H100), so
    that no user's prompt pays it: one short causal call on each."""
    q = torch.zeros(64, num_heads, head_dim, dtype=dtype, device=device)
    kv = torch.zeros(64, num_kv_heads, head_dim, dtype=dtype, device=device)
    causal_attention(q, kv, kv, 1.0)
    causal_attention(q[:32], kv, kv, 1.0)


def decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale) -> torch.Tensor:
    """One new token per sequence: q [B, Hq, D] over its cached context -> [B, Hq, D]."""
    if q.is_cuda:
        from engine.ops.triton_decode import paged_decode_attention
        return paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale)
    return decode_attention_reference(q, k_cache, v_cache, block_tables, context_lens, scale)


def decode_attention_reference(q, k_cache, v_cache, block_tables, context_lens, scale) -> torch.Tensor:
    """Plain torch (fp32 softmax); also the engine's CPU path. Same arguments and result as the Triton kernel.

    Blocks are multiplied in place, batched over (block, kv head): with the head-major cache each block of one
    head is a contiguous [block_size, D] matrix, so nothing is gathered and K/V are never repeated per query
    head (SmolLM2 at 6K context, CPU: 0.6 ms per layer, vs 1.2-1.5 for SDPA over token-major views)."""
    B, Hq, D = q.shape
    _, block_size, Hkv, _ = k_cache.shape
    G = Hq // Hkv
    out = torch.empty((B, Hq, D), dtype=q.dtype, device=q.device)
    tables = block_tables.tolist()
    for b, n in enumerate(context_lens.tolist()):
        if n <= 0:
            out[b].zero_()
            continue
        runs = _block_runs(tables[b][:-(-n // block_size)])
        qg = q[b].float().reshape(Hkv, G, D) * scale
        scores = torch.cat([torch.matmul(qg, _blocks(k_cache, f, c).transpose(-1, -2)) for f, c in runs])
        nb = scores.shape[0]                                                   # [blocks, Hkv, G, block_size]
        flat = scores.permute(1, 2, 0, 3).reshape(Hkv, G, nb * block_size)
        flat[:, :, n:] = float("-inf")  # the last block's unused rows
        p = torch.softmax(flat, dim=-1).view(Hkv, G, nb, block_size).permute(2, 0, 1, 3)
        acc, start = None, 0
        for first, count in runs:
            part = torch.matmul(p[start:start + count], _blocks(v_cache, first, count)).sum(0)
            acc = part if acc is None else acc + part
            start += count
        out[b] = acc.reshape(Hq, D).to(q.dtype)
    return out


def _block_runs(blocks: list[int]) -> list[tuple[int, int]]:
    """[7, 8, 9, 3, 4] -> [(7, 3), (3, 2)]: maximal runs of consecutive block ids."""
    runs: list[list[int]] = []
    for blk in blocks:
        if runs and blk == runs[-1][0] + runs[-1][1]:
            runs[-1][1] += 1
        else:
            runs.append([blk, 1])
    return [(first, count) for first, count in runs]


def _blocks(cache: torch.Tensor, first: int, count: int) -> torch.Tensor:
    """Blocks first..first+count-1 of one layer's cache as [count, Hkv, block_size, D] fp32 (a view when the
    cache is fp32: contiguous per block and head in the head-major layout)."""
    return cache[first:first + count].transpose(1, 2).float()


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)


def attention_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool = False):
    """Partial attention with its log-sum-exp, to be merged with `merge_lse` (chunked offload).

    q [Tq, Hq, D]; k, v head-major [Hkv, Tk, D] (any strides). causal: q are the last Tq of the Tk positions
    (bottom-right mask). -> out fp32 [Hkv, G, Tq, D], lse fp32 [Hkv, G, Tq] (G = Hq // Hkv query heads per
    kv head; K/V are never repeated per query head). On CUDA in 16 bits: one flash kernel call, which returns the
    log-sum-exp too (a chunked prefill of the default model's 5.8K-token sample on an H100 made 1,350 of these
    calls, each ~10 kernels and ~0.5 ms of host time in fp32). On the CPU: torch's fused kernel (_lse_cpu)."""
    if flash_lse(q.device, q.dtype, q.shape[-1]):
        return _flash_lse(q, k, v, scale, causal)
    if q.device.type == "cpu" and _CPU_FLASH:
        out, lse = _lse_cpu(q, k, v, scale, causal)
        return out.float(), lse.float()
    return attention_lse_reference(q, k, v, scale, causal)


def flash_lse(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """attention_lse runs one flash kernel here (no [Tq, Tk] scores in memory), else the fp32 reference."""
    return device.type == "cuda" and dtype in (torch.float16, torch.bfloat16) and head_dim % 8 == 0 and \
        head_dim <= 256 and _flash_gpu(device.index if device.index is not None else torch.cuda.current_device())


def fused_lse(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """attention_lse keeps no [Tq, Tk] scores in memory here: flash on CUDA, torch's fused kernel on the CPU."""
    return flash_lse(device, dtype, head_dim) or (device.type == "cpu" and _CPU_FLASH)


@functools.lru_cache(maxsize=None)
def _flash_gpu(index: int) -> bool:
    """SDPA's flash kernel runs on this GPU (compute capability 8.0 and up: Ampere, Hopper, ...)."""
    return torch.cuda.get_device_capability(index) >= (8, 0)


def _flash_lse(q, k, v, scale: float, causal: bool):
    """attention_lse on SDPA's flash kernel (GQA-native; its causal mask is bottom-right aligned when Tq < Tk)."""
    tq, hq, d = q.shape
    hkv = k.shape[0]
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention(
        q.transpose(0, 1)[None], k[None], v[None], 0.0, causal and tq > 1, False, scale=scale)[:2]
    return out[0].float().view(hkv, hq // hkv, tq, d), lse[0, :, :tq].reshape(hkv, hq // hkv, tq)


def attention_lse_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool = False):
    """attention_lse in plain torch, fp32: the reference both fused paths are tested against, and the path where
    neither runs (a torch without the fused CPU kernel, a GPU older than flash's)."""
    tq, hq, d = q.shape
    hkv, tk = k.shape[0], k.shape[1]
    qg = q.float().reshape(tq, hkv, hq // hkv, d).permute(1, 2, 0, 3) * scale      # [Hkv, G, Tq, D]
    s = torch.matmul(qg, k.float().unsqueeze(1).transpose(-1, -2))                 # [Hkv, G, Tq, Tk]
    if causal and tq > 1:
        rows = torch.arange(tk - tq, tk, device=q.device)[:, None]
        s.masked_fill_(torch.arange(tk, device=q.device)[None, :] > rows, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    return torch.matmul(torch.exp(s - lse[..., None]), v.float().unsqueeze(1)), lse


def merge_lse(out: torch.Tensor, lse: torch.Tensor, part: torch.Tensor, part_lse: torch.Tensor):
    """Combine two partial attentions over disjoint keys (log-sum-exp weights) -> (out, lse)."""
    m = torch.maximum(lse, part_lse)
    w, pw = torch.exp(lse - m), torch.exp(part_lse - m)
    total = w + pw
    return (out * w[..., None] + part * pw[..., None]) / total[..., None], m + torch.log(total)


def lse_output(out: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[Hkv, G, Tq, D] fp32 -> [Tq, Hq, D] in the activations' dtype."""
    hkv, g, tq, d = out.shape
    return out.permute(2, 0, 1, 3).reshape(tq, hkv * g, d).to(dtype)
