"""Quest (Tang et al., 2024): at decode, load only the KV pages whose keys can matter to the current query.

Per page (page_size tokens) and layer the policy keeps, on the device, the element-wise min and max of the
page's keys for each kv head (post-RoPE keys, as attended). For a query q the upper bound of q·k over a page
is sum_d max(q_d * min_d, q_d * max_d) (each term is the larger of the two ends of its interval); a kv head's
score of a page is the max of that bound over the query heads of its group. The top pages up to the token
budget are chosen per kv head; the first page (attention sink) and the most recent full page always are.
Layers below `dense_layers` stay dense, and so does any step whose pages already fit in the budget.

Page ids are global: host block b holds pages b * (block_size // page_size) + 0, 1, ...

At decode the runner loads each layer ahead of its query: `plan_load` hands out the pages chosen with the
layer's query of the previous step, plus the newest full block's pages; `observe_query` then sees this step's
query, measures recall of what was loaded (with `recall` on) and chooses the pages of the next step. All the
selection state lives here, per layer: the chosen pages, their positions in the sequence, a version that
names each selection.
"""
from __future__ import annotations

import torch

from engine.errors import ConfigError
from engine.sparse.policy import KVLayout, LoadPlan, SparsePolicy
from engine.sparse.specs import SPECS
from engine.step import StepContext


class QuestPolicy(SparsePolicy):
    spec = SPECS["quest"]
    plans_loads = True

    def __init__(self, **params):
        p = self.spec.validate(params)
        self.token_budget, self.page_size, self.dense_layers = p["token_budget"], p["page_size"], p["dense_layers"]
        if self.token_budget < 2 * self.page_size:
            raise ConfigError(f"quest token_budget {self.token_budget} must hold at least two pages of {self.page_size}")
        self.measure_recall = self.wants_layer_keys = p["recall"]  # read the layer's whole K each step (slow)
        self._recall: dict[str, dict[int, list[torch.Tensor]]] = {}   # kind -> layer -> per step, per query head
        self._step_recall: dict[int, float] = {}      # layer -> recall measured in the step that runs
        self._chosen: dict[int, tuple[torch.Tensor, torch.Tensor, int]] = {}  # layer -> (pages, positions, version)
        self._planned: dict[int, int] = {}            # layer -> host blocks of the plan it loaded last
        self._version = 0
        self.selections = 0

    def initialize(self, layout: KVLayout) -> None:
        super().initialize(layout)
        if layout.block_size % self.page_size:
            raise ConfigError(f"quest page_size {self.page_size} must divide the KV block size {layout.block_size}")
        self.pages_per_block = layout.block_size // self.page_size
        if self.token_budget < layout.block_size:
            raise ConfigError(f"quest token_budget {self.token_budget} is below one KV block of {layout.block_size} "
                             "tokens: raise the budget or lower the block size")
        n = layout.num_blocks * self.pages_per_block
        shape = (layout.num_layers, n, layout.num_kv_heads, layout.head_dim)
        self.kmin = torch.full(shape, float("inf"), dtype=layout.dtype, device=layout.device)
        self.kmax = torch.full(shape, float("-inf"), dtype=layout.dtype, device=layout.device)

    @property
    def budget_pages(self) -> int:
        """Pages per kv head, rounded down to whole blocks (selected pages are packed block by block)."""
        return self.token_budget // self.layout.block_size * self.pages_per_block

    def whole_layers(self) -> tuple[int, ...]:
        return tuple(range(min(self.dense_layers, self.layout.num_layers)))

    # ---------------------------------------------------------------- metadata
    def on_kv_written(self, layer: int, block_id: int, keys: torch.Tensor) -> None:
        """keys [Hkv, block_size, D] of one full block -> min/max per page."""
        hkv, _, d = keys.shape
        pages = keys.reshape(hkv, self.pages_per_block, self.page_size, d)
        first = block_id * self.pages_per_block
        self.kmin[layer, first:first + self.pages_per_block] = pages.amin(dim=2).transpose(0, 1)
        self.kmax[layer, first:first + self.pages_per_block] = pages.amax(dim=2).transpose(0, 1)

    # ---------------------------------------------------------------- the runner's hooks
    def reset(self) -> None:
        """A new sequence: selections are made again from its own queries; figures start over."""
        self._recall.clear()
        self._chosen.clear()
        self._planned.clear()
        self.selections = 0

    def plan_load(self, layer: int, n_blocks: int, ctx: StepContext) -> LoadPlan | None:
        """The pages chosen for this layer (with an earlier query) plus the newest of the n_blocks blocks, or
        None (load all) for a dense layer, a context within the budget, or no selection yet."""
        chosen = self._chosen.get(layer)
        if chosen is None or not self.applies(layer, n_blocks):
            self._planned.pop(layer, None)
            return None
        pages, _, version = chosen
        newest = self.page_ids(ctx.block_table[n_blocks - 1:n_blocks])[None].expand(pages.shape[0], -1)
        self._planned[layer] = n_blocks
        return LoadPlan(torch.cat([pages, newest], dim=1), self.page_size, (layer, version, n_blocks))

    def observe_query(self, layer: int, q: torch.Tensor, n_blocks: int, ctx: StepContext) -> None:
        """This step's query of `layer` (q [Hq, D]): recall of what this step loaded (when measured), then the
        pages for the next step among the first n_blocks blocks (the newest is added at load time)."""
        if self.measure_recall and layer in self._planned and ctx.layer_keys is not None:
            self._measure_recall(layer, q, ctx)
        if not self.applies(layer, n_blocks + 1):
            self._chosen.pop(layer, None)
            return
        blocks = ctx.block_table[:n_blocks]
        positions, scores = self.select(layer, q, blocks, self.budget_pages - self.pages_per_block)
        pages = self.page_ids(blocks)[positions]
        self._version += 1
        self._chosen[layer] = (pages, positions, self._version)
        self.selections += 1
        rec = ctx.recorder
        if rec.enabled:
            for h in range(pages.shape[0]):
                rec.quest_pick(layer, h, pages[h], scores[h], n_blocks * self.pages_per_block, positions[h],
                               self.page_size)

    def _measure_recall(self, layer: int, q: torch.Tensor, ctx: StepContext) -> None:
        """The true attention mass on what this step loaded (the chosen pages, the newest full block, the partly
        filled one), and on what this step's own query would have chosen, from the layer's whole K."""
        n_host, end, bs = self._planned[layer], ctx.context_len, self.layout.block_size
        k = ctx.layer_keys()                                                   # [Hkv, end, D]
        ppb, p = self.pages_per_block, self.page_size
        positions = self._chosen[layer][1]
        loaded = torch.zeros(k.shape[0], end, dtype=torch.bool, device=k.device)
        pages = loaded[:, :n_host * bs].view(k.shape[0], n_host * ppb, p)
        pages.scatter_(1, positions[:, :, None].expand(-1, -1, p), True)
        loaded[:, (n_host - 1) * bs:] = True                               # newest full block + the partial one
        scale = self.layout.head_dim ** -0.5
        r = self.recall(q, k, loaded, scale)
        self.note_recall(layer, r)
        self._step_recall[layer] = r.mean().item()     # for this step's trace (recall already synchronises)
        now, _ = self.select(layer, q, ctx.block_table[:n_host - 1], positions.shape[1])
        loaded[:, :(n_host - 1) * bs] = False
        pages.scatter_(1, now[:, :, None].expand(-1, -1, p), True)
        self.note_recall(layer, self.recall(q, k, loaded, scale), "recall_current_query")

    def step_metrics(self) -> dict:
        """With recall measured: this step's mean over the sparse layers (`quest_recall`), the lowest layer's
        (`quest_recall_min`) and each layer's (`quest_recall_l<layer>`)."""
        recall, self._step_recall = self._step_recall, {}
        if not recall:
            return {}
        return {"quest_recall": sum(recall.values()) / len(recall), "quest_recall_min": min(recall.values()),
                **{f"quest_recall_l{l}": r for l, r in recall.items()}}

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

    def select(self, layer: int, q: torch.Tensor, blocks: list[int] | torch.Tensor, k: int | None = None
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

    def stats(self) -> dict:
        out = {"token_budget": self.token_budget, "page_size": self.page_size, "dense_layers": self.dense_layers,
               "pages_per_head": self.budget_pages if hasattr(self, "layout") else None, "selections": self.selections}
        for kind, layers in self._recall.items():
            per_layer = {l: torch.cat(v).mean().item() for l, v in sorted(layers.items())}
            out[kind] = sum(per_layer.values()) / len(per_layer)
            out[kind + "_min_head"] = min(torch.cat(v).min().item() for v in layers.values())
            out[kind + "_per_layer"] = {str(l): round(r, 4) for l, r in per_layer.items()}
        return out
