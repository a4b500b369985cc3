"""StreamingLLM (Xiao et al., 2024): attend to the first tokens (the attention sink) and a window of recent ones.

The simplest decode baseline every sparse-attention paper reports. At each decode step a layer attends to the
first `sink` tokens and the newest `window` tokens (the window ends at the new token): sink + window tokens per
kv head, exactly; everything in between is never loaded. A context that fits in sink + window loads everything.
"""
from __future__ import annotations

import torch

from engine.sparse.policy import LoadPlan, SparsePolicy
from engine.sparse.specs import SPECS
from engine.step import StepContext


class StreamingLLMPolicy(SparsePolicy):
    spec = SPECS["streamingllm"]
    plans_loads = True

    def __init__(self, **params):
        p = self.spec.validate(params)
        self.sink, self.window = p["sink"], p["window"]
        self.sparse_loads = 0

    def reset(self) -> None:
        self.sparse_loads = 0

    def plan_load(self, layer: int, context_len: int, ctx: StepContext) -> LoadPlan | None:
        if context_len <= self.sink + self.window:
            return None
        self.sparse_loads += 1
        bs = self.layout.block_size
        partial = context_len - (context_len - 1) // bs * bs          # tokens of the block being filled
        device_tail = min(self.window, partial)
        dev = ctx.block_table.device
        tokens = torch.cat([torch.arange(self.sink, device=dev),
                            torch.arange(context_len - self.window, context_len - device_tail, device=dev)])
        rows = ctx.block_table[tokens // bs] * bs + tokens % bs
        return LoadPlan(rows[None].expand(self.layout.num_kv_heads, -1), device_tail,
                        ("streamingllm", layer, context_len), tokens.shape[0], self.sink,
                        self.window - device_tail)

    def stats(self) -> dict:
        return {"sink_tokens": self.sink, "window_tokens": self.window, "sparse_loads": self.sparse_loads}
