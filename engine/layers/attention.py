"""The attention layer: writes this step's K/V into the paged cache, then attends over it."""
from __future__ import annotations

import torch
from torch import nn

from engine.ops.attention import AttnMetadata, decode_attention, prefill_attention, store_kv


class PagedAttention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = num_heads, num_kv_heads, head_dim, scale
        self.k_cache = self.v_cache = torch.empty(0)  # bound by the model runner after KV allocation
        self.policy, self.layer_id = None, 0            # a sparse prefill policy, set by the model runner

    def _policy_attention(self, q, k, v):
        return self.policy.prefill_attention(q, k, v, self.layer_id, self.scale)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttnMetadata) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq, D]."""
        if self.k_cache.numel():
            store_kv(k, v, self.k_cache, self.v_cache, meta.slots)
        if meta.is_prefill:
            attend = self._policy_attention if self.policy is not None and self.policy.supports_prefill else None
            return prefill_attention(q, k, v, self.k_cache, self.v_cache, meta, self.scale, attend)
        return decode_attention(q, self.k_cache, self.v_cache, meta.block_tables, meta.context_lens, self.scale)
