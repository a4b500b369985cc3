"""StreamingLLM (Xiao et al., 2024): attend to the first tokens (the attention sink) and a window of recent ones.

The simplest decode baseline every sparse-attention paper reports. At each decode step a layer attends to
the sink (its first `sink` tokens), the most recent `window` tokens of the full KV blocks, and the block that
is being filled; everything in between is never loaded. Both are counted in pages of `page_size` tokens and
the window is rounded up so that sink + window fill whole KV blocks (the pages are packed block by block).
A context that fits in sink + window loads everything.
"""
from __future__ import annotations

import torch

from engine.errors import ConfigError
from engine.sparse.policy import KVLayout, LoadPlan, SparsePolicy
from engine.sparse.specs import SPECS
from engine.step import StepContext


class StreamingLLMPolicy(SparsePolicy):
    spec = SPECS["streamingllm"]
    plans_loads = True

    def __init__(self, **params):
        p = self.spec.validate(params)
        self.sink, self.window, self.page_size = p["sink"], p["window"], p["page_size"]
        self.sparse_steps = 0

    def initialize(self, layout: KVLayout) -> None:
        super().initialize(layout)
        if layout.block_size % self.page_size:
            raise ConfigError(f"streamingllm page_size {self.page_size} must divide the KV block size "
                              f"{layout.block_size}")
        self.pages_per_block = ppb = layout.block_size // self.page_size
        self.sink_pages = -(-self.sink // self.page_size)
        window = -(-self.window // self.page_size)
        self.window_pages = window + (-(self.sink_pages + window)) % ppb        # fill whole blocks

    def reset(self) -> None:
        self.sparse_steps = 0

    def plan_load(self, layer: int, n_blocks: int, ctx: StepContext) -> LoadPlan | None:
        total, s, w = n_blocks * self.pages_per_block, self.sink_pages, self.window_pages
        if s + w >= total:
            return None
        self.sparse_steps += 1
        ppb = self.pages_per_block
        blocks = ctx.block_table[:n_blocks]
        positions = torch.cat([torch.arange(s, device=blocks.device), torch.arange(total - w, total, device=blocks.device)])
        pages = (blocks[positions // ppb] * ppb + positions % ppb)[None].expand(self.layout.num_kv_heads, -1)
        return LoadPlan(pages, self.page_size, ("streamingllm", layer, n_blocks))

    def stats(self) -> dict:
        return {"sink_tokens": self.sink_pages * self.page_size, "window_tokens": self.window_pages * self.page_size,
                "sparse_loads": self.sparse_steps}
