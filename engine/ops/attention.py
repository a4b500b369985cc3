"""Attention over the paged KV cache: store, prefill (varlen, optional cached prefix), decode.

Cache layout: k_cache, v_cache [num_blocks, block_size, Hkv, D]; a token's slot is block * block_size + offset.
Backends: flash-attn's varlen kernel when importable (CUDA), else torch SDPA per sequence (GQA-native);
decode uses our Triton split-K kernel on CUDA and a grouped matmul-softmax-matmul on CPU.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

try:  # optional, used when importable
    from flash_attn import flash_attn_varlen_func  # type: ignore
except Exception:  # noqa: BLE001 - any import failure means "not available"
    flash_attn_varlen_func = None


@dataclass
class AttnMetadata:
    """What one forward step needs to know about its sequences. Host lists are for python loops only."""
    is_prefill: bool
    slot_mapping: torch.Tensor                 # [T] int64: cache slot of each new token
    block_tables: torch.Tensor | None = None   # [B, max_blocks] int32
    context_lens: torch.Tensor | None = None   # [B] int32: decode, tokens in cache incl. the new one
    q_lens: list[int] | None = None            # prefill: new tokens per sequence
    k_lens: list[int] | None = None            # prefill: cached prefix + new tokens per sequence
    cu_seqlens_q: torch.Tensor | None = None   # prefill, int32 [B+1] (flash-attn)
    cu_seqlens_k: torch.Tensor | None = None

    @property
    def has_prefix(self) -> bool:
        return self.k_lens is not None and any(k != q for q, k in zip(self.q_lens, self.k_lens))


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write new tokens' K/V ([T, Hkv, D]) into their cache slots (graph-safe, no host sync)."""
    k_cache.view(-1, *k.shape[1:]).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, *v.shape[1:]).index_copy_(0, slot_mapping, v)


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """One sequence's first `length` tokens of K or V from the paged cache -> [length, Hkv, D]."""
    n_blocks = -(-length // cache.shape[1])
    return cache[block_table[:n_blocks].long()].flatten(0, 1)[:length]


def prefill_attention(q, k, v, k_cache, v_cache, meta: AttnMetadata, scale: float) -> torch.Tensor:
    """Causal attention of the new tokens q [T, Hq, D] over their sequence's prefix + themselves."""
    if flash_attn_varlen_func is not None and q.is_cuda:
        if meta.has_prefix:
            return flash_attn_varlen_func(q, k_cache, v_cache, meta.cu_seqlens_q, meta.cu_seqlens_k,
                                          max(meta.q_lens), max(meta.k_lens), softmax_scale=scale,
                                          causal=True, block_table=meta.block_tables)
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
        out[start:start + q_len] = causal_attention(qi, ki, vi, scale)
        start += q_len
    return out


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [Lq, Hq, D] are the last Lq of Lk positions; k, v [Lk, Hkv, D] -> [Lq, Hq, D]."""
    lq, lk = q.shape[0], k.shape[0]
    qt, kt, vt = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    if lq == lk:
        o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale, enable_gqa=True)
    else:  # bottom-right aligned causal mask: query i sits at position lk - lq + i
        rows = torch.arange(lk - lq, lk, device=q.device)[:, None]
        mask = torch.arange(lk, device=q.device)[None, :] <= rows
        o = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale, enable_gqa=True)
    return o[0].transpose(0, 1)


def decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale) -> torch.Tensor:
    """One new token per sequence: q [B, Hq, D] over its cached context -> [B, Hq, D]."""
    if q.is_cuda:
        from engine.ops.triton_decode import paged_decode_attention
        return paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale)
    return decode_attention_reference(q, k_cache, v_cache, block_tables, context_lens, scale)


def decode_attention_reference(q, k_cache, v_cache, block_tables, context_lens, scale, chunk_tokens=1024):
    """Plain torch, fp32 math; also the engine's CPU path. Same arguments and result as the Triton kernel.

    K/V are gathered through the block table ~chunk_tokens at a time: small temporaries are reused by the
    allocator, where gathering a whole 32K-token sequence at once spends most of its time faulting in fresh pages
    (seen on CPU: 150-180 ms vs 40-55 ms per 32K-token layer, Hkv 8, D 128)."""
    B, Hq, D = q.shape
    _, block_size, Hkv, _ = k_cache.shape
    G = Hq // Hkv
    per = max(1, chunk_tokens // block_size)  # blocks per chunk
    out = torch.empty((B, Hq, D), dtype=q.dtype, device=q.device)
    for b, n in enumerate(context_lens.tolist()):
        if n <= 0:
            out[b].zero_()
            continue
        nb = -(-n // block_size)
        blocks = block_tables[b, :nb].long()
        qg = q[b].float().reshape(Hkv, G, D) * scale
        scores = torch.empty((Hkv, G, nb * block_size), dtype=torch.float32, device=q.device)
        for c in range(0, nb, per):
            k = k_cache[blocks[c:c + per]].flatten(0, 1).transpose(0, 1).float()  # [Hkv, tokens, D]
            scores[:, :, c * block_size:(c + per) * block_size] = torch.matmul(qg, k.transpose(1, 2))
        scores[:, :, n:] = float("-inf")  # the last block's unused rows
        p = torch.softmax(scores, dim=-1)  # [Hkv, G, tokens]
        acc = torch.zeros((Hkv, G, D), dtype=torch.float32, device=q.device)
        for c in range(0, nb, per):
            v = v_cache[blocks[c:c + per]].flatten(0, 1).transpose(0, 1).float()
            acc += torch.matmul(p[:, :, c * block_size:(c + per) * block_size], v)
        out[b] = acc.reshape(Hq, D).to(q.dtype)
    return out


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)
