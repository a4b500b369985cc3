"""Quest (Tang et al., 2024): at decode, load only the KV pages whose keys can matter to the current query.

Per page (page_size tokens) and layer the policy keeps, on the device, the element-wise min and max of the
page's keys for each kv head (post-RoPE keys, as attended). For a query q the upper bound of q·k over a page
is sum_d max(q_d * min_d, q_d * max_d) (each term is the larger of the two ends of its interval); a kv head's
score of a page is the max of that bound over the query heads of its group. The top pages up to the token
budget are chosen per kv head; the first page (attention sink) and the most recent full page always are.
Layers below `dense_layers` stay dense, and so does any step whose pages already fit in the budget.

Page ids are global: host block b holds pages b * (block_size // page_size) + 0, 1, ...
"""
from __future__ import annotations

import torch

from engine.sparse.policy import KVLayout, SparsePolicy


class QuestPolicy(SparsePolicy):
    name = "quest"
    supports_decode = True
    requires_block_selection = True

    def __init__(self, token_budget: int = 2048, page_size: int = 32, dense_layers: int = 2, recall: bool = False):
        if page_size < 16 or page_size & (page_size - 1):
            raise ValueError(f"quest page_size must be a power of two >= 16 (got {page_size})")
        if token_budget < 2 * page_size:
            raise ValueError(f"quest token_budget {token_budget} must hold at least two pages of {page_size}")
        self.token_budget, self.page_size, self.dense_layers = token_budget, page_size, dense_layers
        self.measure_recall = recall  # debug: read the layer's whole K at each sparse step (slow) to measure recall
        self._recall: dict[str, dict[int, list[torch.Tensor]]] = {}   # kind -> layer -> per step, per query head
        self.selections = 0

    def initialize(self, layout: KVLayout) -> None:
        super().initialize(layout)
        if layout.block_size % self.page_size:
            raise ValueError(f"quest page_size {self.page_size} must divide the KV block size {layout.block_size}")
        self.pages_per_block = layout.block_size // self.page_size
        n = layout.num_blocks * self.pages_per_block
        shape = (layout.num_layers, n, layout.num_kv_heads, layout.head_dim)
        self.kmin = torch.full(shape, float("inf"), dtype=layout.dtype, device=layout.device)
        self.kmax = torch.full(shape, float("-inf"), dtype=layout.dtype, device=layout.device)

    @property
    def budget_pages(self) -> int:
        """Pages per kv head, rounded down to whole blocks (selected pages are packed block by block)."""
        return self.token_budget // self.layout.block_size * self.pages_per_block

    # ---------------------------------------------------------------- metadata (offload hooks)
    def on_prefill_offload(self, block_id: int, layer_id: int, keys: torch.Tensor, valid_tokens: int) -> None:
        self._note(block_id, layer_id, keys)

    def on_decode_offload(self, block_id: int, layer_id: int, keys: torch.Tensor, valid_tokens: int) -> None:
        self._note(block_id, layer_id, keys)

    def _note(self, block_id: int, layer: int, keys: torch.Tensor) -> None:
        """keys [Hkv, block_size, D] of one full block -> min/max per page."""
        hkv, _, d = keys.shape
        pages = keys.reshape(hkv, self.pages_per_block, self.page_size, d)
        first = block_id * self.pages_per_block
        self.kmin[layer, first:first + self.pages_per_block] = pages.amin(dim=2).transpose(0, 1)
        self.kmax[layer, first:first + self.pages_per_block] = pages.amax(dim=2).transpose(0, 1)

    # ---------------------------------------------------------------- selection
    def applies(self, layer: int, n_blocks: int) -> bool:
        """Sparse for this layer and context? (dense layers, and contexts that fit the budget, load all)"""
        return layer >= self.dense_layers and n_blocks * self.pages_per_block > self.budget_pages

    def page_ids(self, blocks: list[int] | torch.Tensor) -> torch.Tensor:
        """The global page ids of these host blocks, in sequence order."""
        b = torch.as_tensor(blocks, dtype=torch.long).to(self.kmin.device, non_blocking=True)
        return (b[:, None] * self.pages_per_block + torch.arange(self.pages_per_block, device=b.device)).flatten()

    def scores(self, layer: int, q: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
        """q [Hq, D] -> upper bounds [Hkv, n_pages] of q·k over each page (max over the group's query heads)."""
        hkv = self.layout.num_kv_heads
        qg = q.float().reshape(hkv, -1, q.shape[-1])                                 # [Hkv, G, D]
        lo = self.kmin[layer, pages].float().transpose(0, 1)[:, None]                 # [Hkv, 1, P, D]
        hi = self.kmax[layer, pages].float().transpose(0, 1)[:, None]
        bound = torch.maximum(qg[:, :, None] * lo, qg[:, :, None] * hi).sum(-1)     # [Hkv, G, P]
        return bound.amax(dim=1)

    def select(self, layer: int, q: torch.Tensor, blocks: list[int], k: int | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (positions [Hkv, k] into the sequence's page list, ascending; their scores). The sink (page 0)
        and the most recent page are always in. k defaults to budget_pages."""
        pages = self.page_ids(blocks)
        s = self.scores(layer, q, pages)
        forced = s.clone()
        forced[:, 0] = float("inf")
        forced[:, -1] = float("inf")
        k = min(self.budget_pages if k is None else k, pages.numel())
        top = forced.topk(k, dim=-1).indices.sort(dim=-1).values
        return top, s.gather(1, top)

    def select_blocks(self, blocks: list[int], ctx) -> list[int]:
        """Block granularity (the interface of DESIGN.md §2.3): the host blocks holding any page that any kv head
        chose for ctx.query [1, Hq, D]. The offload modes use `select` and load the pages themselves."""
        if ctx.query is None or not self.applies(ctx.layer, len(blocks)):
            return list(blocks)
        positions, _ = self.select(ctx.layer, ctx.query[0], blocks)
        keep = torch.unique(positions // self.pages_per_block).tolist()
        return [blocks[i] for i in keep]

    # ---------------------------------------------------------------- figures
    def recall(self, q: torch.Tensor, keys: torch.Tensor, loaded: torch.Tensor, scale: float) -> torch.Tensor:
        """The share of the true attention mass on the tokens that were loaded, per query head.

        q [Hq, D]; keys [Hkv, T, D], all of the layer's keys (the current token's last); loaded [Hkv, T] bool."""
        hkv, t, d = keys.shape
        qg = q.float().reshape(hkv, -1, d)                                          # [Hkv, G, D]
        p = torch.softmax(qg @ keys.float().transpose(1, 2) * scale, dim=-1)        # [Hkv, G, T]
        return (p * loaded[:, None]).sum(-1).flatten()

    def note_recall(self, layer: int, value: torch.Tensor, kind: str = "recall") -> None:
        """kind "recall": what was loaded; "recall_current_query": what this step's own query would have chosen."""
        self._recall.setdefault(kind, {}).setdefault(layer, []).append(value)

    def reset(self) -> None:
        self._recall.clear()
        self.selections = 0

    def stats(self) -> dict:
        out = {"token_budget": self.token_budget, "page_size": self.page_size, "dense_layers": self.dense_layers,
               "pages_per_head": self.budget_pages if hasattr(self, "layout") else None, "selections": self.selections}
        for kind, layers in self._recall.items():
            per_layer = {l: torch.cat(v).mean().item() for l, v in sorted(layers.items())}
            out[kind] = sum(per_layer.values()) / len(per_layer)
            out[kind + "_min_head"] = min(torch.cat(v).min().item() for v in layers.values())
            out[kind + "_per_layer"] = {str(l): round(r, 4) for l, r in per_layer.items()}
        return out
