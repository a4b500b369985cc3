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

from engine.errors import ConfigError
from engine.ops.attention import causal_attention
from engine.ops.sparse_prefill import causal_pairs
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
    recorder: Recorder = NULL_RECORDER  # set by the runner: where the policy reports its decisions

    def stats(self) -> dict:
        """The policy's figures for the last request (JSON-ready): density, pages selected, ..."""
        return {}

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
        """The host blocks to load for ctx.layer at decode. Only policies with requires_block_selection choose;
        callers check that flag first, and asking any other policy is an error that says so."""
        raise ConfigError(f"the {self.name} policy does not select KV blocks (requires_block_selection is False): "
                          "load every block instead")

    def on_prefill_offload(self, block_id: int, layer_id: int, keys: torch.Tensor, valid_tokens: int) -> None:
        pass

    def on_decode_offload(self, block_id: int, layer_id: int, keys: torch.Tensor, valid_tokens: int) -> None:
        pass


def attach(policy: SparsePolicy, args, block_size: int, device, dtype, num_blocks: int,
           recorder: Recorder) -> SparsePolicy:
    """Ready `policy` for a model's KV (its layout) and give it the recorder it reports to."""
    policy.initialize(KVLayout(args.num_layers, args.num_kv_heads, args.head_dim, block_size, device, dtype,
                               num_blocks))
    policy.recorder = recorder
    return policy


class SparsePrefillPolicy(SparsePolicy):
    """A policy that computes prefill attention on a sparse pattern (MInference, XAttention), dense below
    `min_len` keys or when too few queries are new. Subclasses give `sparse_attention` -> (out, pairs computed
    per head, pattern) and `record` (the pattern and its density per head to the trace); this keeps the density
    per layer of the last prefill."""
    supports_prefill = True

    def __init__(self, min_len: int):
        if min_len < 1:
            raise ValueError(f"min_len must be >= 1 (got {min_len})")
        self.min_len = min_len
        self._pairs: dict[int, tuple[torch.Tensor, int]] = {}   # layer -> (pairs per head, dense causal pairs)

    def reset(self) -> None:
        self._pairs.clear()

    def sparse_attention(self, q, k, v, layer_id: int, scale: float):
        raise NotImplementedError

    def record(self, layer_id: int, pattern, density: list[float], n: int) -> None:
        raise NotImplementedError

    def prefill_attention(self, q, k, v, layer_id, scale):
        if k.shape[0] < self.min_len or q.shape[0] < 64:
            self._pairs.pop(layer_id, None)
            return super().prefill_attention(q, k, v, layer_id, scale)
        out, pairs, pattern = self.sparse_attention(q, k, v, layer_id, scale)
        self._pairs[layer_id] = (pairs, causal_pairs(q.shape[0], k.shape[0]))
        if self.recorder.enabled:
            self.record(layer_id, pattern, self.density(layer_id), k.shape[0])
        return out

    def density(self, layer_id: int) -> list[float] | None:
        """Per head: the fraction of causal (query, key) pairs computed in this layer's last sparse prefill."""
        if layer_id not in self._pairs:
            return None
        pairs, dense = self._pairs[layer_id]
        return (pairs.double() / dense).tolist()

    def stats(self) -> dict:
        if not self._pairs:
            return {"sparse_layers": 0, "density": 1.0}
        per_layer = {l: sum(self.density(l)) / len(self.density(l)) for l in sorted(self._pairs)}
        return {"sparse_layers": len(per_layer), "density": sum(per_layer.values()) / len(per_layer),
                "density_per_layer": {str(l): round(d, 4) for l, d in per_layer.items()}}


class FullPolicy(SparsePolicy):
    """Attends to everything; loads everything."""
    name = "full"

    def select_blocks(self, blocks: list[int], ctx: PolicyContext) -> list[int]:
        return list(blocks)
