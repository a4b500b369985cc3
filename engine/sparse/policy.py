"""The sparse-policy interface and the dense baseline every policy is compared to.

The offload modes call a policy at fixed points: `prefill_attention` for a layer's whole prompt,
`select_blocks` before loading a layer's host blocks at decode (when `requires_block_selection`), and
`on_prefill_offload` / `on_decode_offload` when a full block leaves the device (its keys still there, as a
head-major [Hkv, block_size, D] view of the device buffer, post-RoPE: valid until the hook returns).
"""
from __future__ import annotations

from abc import ABC
from dataclasses import dataclass, field

import torch

from engine.ops.attention import causal_attention
from engine.trace.recorder import NULL_RECORDER, Recorder


@dataclass
class KVLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    device: torch.device
    dtype: torch.dtype
    num_blocks: int = 0          # host (or paged) KV blocks: the block ids the hooks are given


@dataclass
class PolicyContext:
    layer: int
    query: torch.Tensor | None = None       # decode: [1, Hq, D]
    context_len: int = 0
    step: int = 0
    recorder: Recorder = field(default=NULL_RECORDER)


class SparsePolicy(ABC):
    name = "base"
    supports_prefill = False
    supports_decode = False
    requires_block_selection = False
    one_call_bytes = 2**29  # dense prefill: q up to 512 MiB (32K tokens of Qwen3-4B) in one call, longer per head

    def initialize(self, layout: KVLayout) -> None:
        self.layout = layout

    def reset(self) -> None:
        pass

    def prefill_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                          scale: float) -> torch.Tensor:
        """q [Tq, Hq, D] (the last Tq of Tk positions), k/v [Tk, Hkv, D] -> [Tq, Hq, D], dense causal. q may be
        consumed: a long one is done one kv head (and its query heads) at a time, each result written over its q
        (at 128K tokens of Qwen3-4B that saves a second 1 GiB tensor; 5% slower at 32K, so short ones are not)."""
        if q.numel() * q.element_size() <= self.one_call_bytes:
            return causal_attention(q, k, v, scale)
        hkv = k.shape[1]
        g = q.shape[1] // hkv
        for h in range(hkv):
            q[:, h * g:(h + 1) * g] = causal_attention(q[:, h * g:(h + 1) * g], k[:, h:h + 1], v[:, h:h + 1], scale)
        return q

    def select_blocks(self, blocks: list[int], ctx: PolicyContext) -> list[int]:
        return blocks

    def on_prefill_offload(self, block_id: int, layer_id: int, keys: torch.Tensor, valid_tokens: int) -> None:
        pass

    def on_decode_offload(self, block_id: int, layer_id: int, keys: torch.Tensor, valid_tokens: int) -> None:
        pass


class FullPolicy(SparsePolicy):
    """Attends to everything; loads everything."""
    name = "full"
