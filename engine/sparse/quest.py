"""Quest (Tang et al., 2024): at decode, attend only to the KV pages whose keys can matter to the current query.

Per page (page_size tokens) and layer the policy keeps, on the device, the element-wise min and max of the
page's keys for each kv head (post-RoPE keys, as attended). For a query q the upper bound of q·k over a page
is sum_d max(q_d * min_d, q_d * max_d) (each term is the larger of the two ends of its interval); a kv head's
score of a page is the max of that bound over the query heads of its group.

The budget B counts every token a layer attends to per kv head: the sink S (the first tokens, whole pages),
k pages chosen by score, and the recent window of R tokens that ends at the new token, where
k = (B - S - recent) // page_size and R = B - S - k * page_size (so recent <= R < recent + page_size): exactly B
whenever the context is longer than B. The candidates are the whole pages between the sink and the window.
Layers below `dense_layers`, contexts up to B and contexts below `min_context` load everything.

At decode the runner loads each layer ahead of its query: `plan_load` hands out the rows of the sink, of the
pages chosen with the layer's previous query (the speculation), and of the window's part in the host pool.
`observe_query` then sees the layer's own query before its attention: it scores the candidates, and the pages
it chooses that were not loaded are fetched in place of the ones it dropped (a `RowFix`), so attention always
uses the current query's choice; that choice is also the next step's speculation. All the selection state
lives here, per layer.
"""
from __future__ import annotations

import torch

from engine.errors import ConfigError
from engine.sparse.policy import KVLayout, LoadPlan, RowFix, SparsePolicy
from engine.sparse.specs import SPECS
from engine.step import StepContext


class QuestPolicy(SparsePolicy):
    spec = SPECS["quest"]
    plans_loads = True

    def __init__(self, **params):
        p = self.spec.validate(params)
        self.token_budget, self.page_size, self.dense_layers = p["token_budget"], p["page_size"], p["dense_layers"]
        self.min_context, self.measure_recall = p["min_context"], p["recall"]
        self.wants_layer_keys = self.measure_recall        # read the layer's whole K each sparse step (slow)
        ps = self.page_size
        self.sink = -(-p["sink"] // ps) * ps
        if self.token_budget < self.sink + p["recent"]:
            raise ConfigError(f"quest token_budget {self.token_budget} must hold the sink ({self.sink} tokens, whole "
                              f"pages) and the recent window ({p['recent']} tokens): raise token_budget or lower sink "
                              "or recent")
        self.k = (self.token_budget - self.sink - p["recent"]) // ps      # pages chosen by score
        self.window = self.token_budget - self.sink - self.k * ps          # R: recent <= R < recent + page_size
        self._recall: dict[str, dict[int, list[torch.Tensor]]] = {}   # kind -> layer -> per step, per query head
        self._step: dict[str, dict[int, float]] = {}                  # this step's figures, per layer
        self._chosen: dict[int, tuple[torch.Tensor, torch.Tensor, int]] = {}  # layer -> (positions, scores, version)
        self._planned: dict[int, tuple[torch.Tensor, int]] = {}      # layer -> (speculated positions, context_len)
        self._picks: list[tuple] = []                                # this step's, for the recorder
        self._candidates: tuple = (None, None)                       # (first, end, table) -> their page ids
        self._version = 0
        self.selections = self.fetched = self.fixes = 0
        self.dense_reason = ""

    def initialize(self, layout: KVLayout) -> None:
        super().initialize(layout)
        if layout.block_size % self.page_size:
            raise ConfigError(f"quest page_size {self.page_size} must divide the KV block size {layout.block_size}")
        self.pages_per_block = layout.block_size // self.page_size
        n = layout.num_blocks * self.pages_per_block
        shape = (layout.num_layers, n, layout.num_kv_heads, layout.head_dim)
        self.kmin = torch.full(shape, float("inf"), dtype=layout.dtype, device=layout.device)
        self.kmax = torch.full(shape, float("-inf"), dtype=layout.dtype, device=layout.device)
        self._fetched = torch.zeros(layout.num_layers, dtype=torch.long, device=layout.device)
        self._in_page = torch.arange(self.page_size, device=layout.device)

    def whole_layers(self) -> tuple[int, ...]:
        return tuple(range(min(self.dense_layers, self.layout.num_layers)))

    def sparse(self, layer: int, context_len: int) -> bool:
        """Does `layer` attend to part of a context of context_len tokens? (and why not, in dense_reason)"""
        if layer < self.dense_layers:
            return False
        if context_len <= self.token_budget:
            self.dense_reason = f"the context ({context_len} tokens) fits the budget of {self.token_budget}"
            return False
        if context_len < self.min_context:
            self.dense_reason = (f"the context ({context_len} tokens) is below min_context {self.min_context}: "
                                 "loading all of it costs less than choosing")
            return False
        return True

    # ---------------------------------------------------------------- metadata
    def on_kv_written(self, layer: int, block_id: int, keys: torch.Tensor, start: int, end: int) -> None:
        """keys [Hkv, block_size, D] of a block whose tokens start..end-1 were just written -> min/max of the pages
        those tokens complete (at decode: one page every page_size tokens)."""
        ps = self.page_size
        first, last = start // ps, end // ps                     # pages first..last-1 are complete and new
        if last <= first:
            return
        hkv, _, d = keys.shape
        pages = keys[:, first * ps:last * ps].reshape(hkv, last - first, ps, d)
        at = block_id * self.pages_per_block + first
        self.kmin[layer, at:at + last - first] = pages.amin(dim=2).transpose(0, 1)
        self.kmax[layer, at:at + last - first] = pages.amax(dim=2).transpose(0, 1)

    # ---------------------------------------------------------------- the runner's hooks
    def reset(self) -> None:
        """A new sequence: selections are made again from its own queries; figures start over."""
        self._recall.clear()
        self._chosen.clear()
        self._planned.clear()
        self._candidates = (None, None)
        self._picks, self._step = [], {}                  # a stopped step's leftovers
        self.selections = self.fetched = self.fixes = 0
        self.dense_reason = ""

    def _rows(self, positions: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """Sequence token positions [..] -> rows of the layer's host pool (block * block_size + offset)."""
        bs = self.layout.block_size
        return ctx.block_table[positions // bs] * bs + positions % bs

    def _page_tokens(self, pages: torch.Tensor) -> torch.Tensor:
        """Page numbers [Hkv, k] -> their token positions [Hkv, k * page_size], page by page."""
        return (pages[:, :, None] * self.page_size + self._in_page).flatten(1)

    def plan_load(self, layer: int, context_len: int, ctx: StepContext) -> LoadPlan | None:
        """The rows of the sink, of the pages chosen with an earlier query, and of the window's part in the host
        pool, for a step whose sequence has context_len tokens; None (load all) where the layer is dense or no
        choice was made yet."""
        chosen = self._chosen.get(layer)
        if chosen is None or not self.sparse(layer, context_len):
            self._planned.pop(layer, None)
            return None
        bs, hkv, dev = self.layout.block_size, self.layout.num_kv_heads, chosen[0].device
        partial = context_len - (context_len - 1) // bs * bs          # tokens of the block being filled
        device_tail = min(self.window, partial)
        tail = torch.arange(context_len - self.window, context_len - device_tail, device=dev)
        sink = torch.arange(self.sink, device=dev)
        tokens = torch.cat([sink.expand(hkv, -1), self._page_tokens(chosen[0]), tail.expand(hkv, -1)], dim=1)
        self._planned[layer] = (chosen[0], context_len)
        return LoadPlan(self._rows(tokens, ctx), device_tail, ("quest", layer, chosen[2], context_len))

    def observe_query(self, layer: int, q: torch.Tensor, ctx: StepContext) -> RowFix | None:
        """This step's query of `layer` (q [Hq, D]), before its attention: choose the pages among the candidates;
        where this step loaded another speculation, fetch what it lacks in place of what it no longer wants."""
        end = ctx.context_len
        if not self.sparse(layer, end + 1):                        # neither now nor at the next step
            self._chosen.pop(layer, None)
            return None
        n_pages = (end - self.window) // self.page_size             # candidates: whole pages before the window
        positions, scores = self.select(layer, q, self.sink // self.page_size, n_pages, ctx)
        fix, planned = None, self._planned.get(layer)
        if planned is not None and planned[1] == end:
            fix = self._fix(layer, planned[0], positions, ctx)
            if self.measure_recall and ctx.layer_keys is not None:
                self._measure_recall(layer, q, planned[0], positions, ctx)
        self._version += 1
        self._chosen[layer] = (positions, scores, self._version)
        self.selections += 1
        if ctx.recorder.enabled:
            self._picks.append((layer, n_pages, positions, scores, self._page_ids(positions, ctx)))
        return fix

    def _fix(self, layer: int, old: torch.Tensor, new: torch.Tensor, ctx: StepContext) -> RowFix:
        """Rows of the pages in `new` that `old` lacks -> the packed places of the pages of `old` not in `new`
        (both [Hkv, k]; page i of a speculation is packed at rows sink + i * page_size ...). -1: nothing to do."""
        k = new.shape[1]
        have = (new[:, :, None] == old[:, None, :]).any(-1)                  # chosen and already loaded
        keep = (old[:, :, None] == new[:, None, :]).any(-1)                  # loaded and still chosen
        missing = torch.argsort(have.to(torch.int8), dim=1, stable=True)    # the pages to fetch first
        free = torch.argsort(keep.to(torch.int8), dim=1, stable=True)       # the places to fetch them to first
        n_missing = (~have).sum(1, keepdim=True)
        todo = (torch.arange(k, device=new.device)[None] < n_missing).repeat_interleave(self.page_size, 1)
        rows = self._rows(self._page_tokens(new.gather(1, missing)), ctx).masked_fill(~todo, -1)
        dst = self.sink + self._page_tokens(free)
        self._fetched[layer] += n_missing.sum()
        return RowFix(rows, dst)

    def end_step(self, ctx: StepContext) -> None:
        """Once per step: the step's picks go to the recorder stacked (three copies to the host, asynchronous);
        the pages the corrections fetched are read (one small copy)."""
        picks, self._picks = self._picks, []
        if picks and ctx.recorder.enabled:
            layers, n_pages, positions, scores, pages = zip(*picks)
            ctx.recorder.quest_picks(list(layers), torch.stack(pages), torch.stack(scores), list(n_pages),
                                     torch.stack(positions), self.page_size)
        if self._planned:
            fetched = self._fetched.tolist()
            self._fetched.zero_()
            hkv = self.layout.num_kv_heads
            per_layer = {l: fetched[l] / hkv for l in self._planned}
            self._step["fetched"] = per_layer
            self.fetched += sum(per_layer.values())
            self.fixes += len(per_layer)

    def _measure_recall(self, layer: int, q: torch.Tensor, old: torch.Tensor, new: torch.Tensor,
                        ctx: StepContext) -> None:
        """The true attention mass on what this step attends to (the current choice) and on what the speculation
        alone would have given, from the layer's whole K."""
        k = ctx.layer_keys()                                                   # [Hkv, end, D]
        end = k.shape[1]
        scale = self.layout.head_dim ** -0.5
        for kind, pages in (("recall", new), ("recall_speculative", old)):
            attended = torch.zeros(k.shape[0], end, dtype=torch.bool, device=k.device)
            attended[:, :self.sink] = True
            attended[:, end - self.window:] = True
            attended.scatter_(1, self._page_tokens(pages), True)
            r = self.recall(q, k, attended, scale)
            self.note_recall(layer, r, kind)
            self._step.setdefault(kind, {})[layer] = r.mean().item()

    def step_metrics(self) -> dict:
        """This step's figures for its trace: recall (`quest_recall`: mean over the sparse layers,
        `quest_recall_min`, `quest_recall_l<layer>`) and pages fetched by the correction per kv head
        (`quest_fetched`, `quest_fetched_l<layer>`)."""
        step, self._step = self._step, {}
        out = {}
        for kind, name in (("recall", "quest_recall"), ("fetched", "quest_fetched")):
            per = step.get(kind)
            if per:
                out[name] = sum(per.values()) / len(per)
                out.update({f"{name}_l{l}": v for l, v in per.items()})
                if kind == "recall":
                    out[name + "_min"] = min(per.values())
        return out

    # ---------------------------------------------------------------- selection
    def _page_ids(self, positions: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """Sequence page numbers -> global page ids (host block * pages_per_block + page in block)."""
        ppb = self.pages_per_block
        return ctx.block_table[positions // ppb] * ppb + positions % ppb

    def scores(self, layer: int, q: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
        """q [Hq, D] -> upper bounds [Hkv, n_pages] of q·k over each page (global ids; max over the group's
        query heads)."""
        hkv = self.layout.num_kv_heads
        qg = q.float().reshape(hkv, -1, q.shape[-1])                                 # [Hkv, G, D]
        lo = self.kmin[layer, pages].float().transpose(0, 1)[:, None]                 # [Hkv, 1, P, D]
        hi = self.kmax[layer, pages].float().transpose(0, 1)[:, None]
        bound = torch.maximum(qg[:, :, None] * lo, qg[:, :, None] * hi).sum(-1)     # [Hkv, G, P]
        return bound.amax(dim=1)

    def select(self, layer: int, q: torch.Tensor, first: int, end: int, ctx: StepContext
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """The k best of the sequence's pages first..end-1 per kv head -> (their page numbers [Hkv, k],
        ascending; their scores)."""
        if self._candidates[0] != (first, end, ctx.block_table.data_ptr()):    # the same for every layer of a step
            self._candidates = ((first, end, ctx.block_table.data_ptr()),
                                self._page_ids(torch.arange(first, end, device=q.device), ctx))
        s = self.scores(layer, q, self._candidates[1])
        top = s.topk(min(self.k, end - first), dim=-1).indices.sort(dim=-1).values
        return top + first, s.gather(1, top)

    # ---------------------------------------------------------------- figures
    def recall(self, q: torch.Tensor, keys: torch.Tensor, loaded: torch.Tensor, scale: float) -> torch.Tensor:
        """The share of the true attention mass on the tokens that were loaded, per query head.

        q [Hq, D]; keys [Hkv, T, D], all of the layer's keys (the current token's last); loaded [Hkv, T] bool."""
        hkv, t, d = keys.shape
        qg = q.float().reshape(hkv, -1, d)                                          # [Hkv, G, D]
        p = torch.softmax(qg @ keys.float().transpose(1, 2) * scale, dim=-1)        # [Hkv, G, T]
        return (p * loaded[:, None]).sum(-1).flatten()

    def note_recall(self, layer: int, value: torch.Tensor, kind: str = "recall") -> None:
        self._recall.setdefault(kind, {}).setdefault(layer, []).append(value)

    def stats(self) -> dict:
        out = {"token_budget": self.token_budget, "page_size": self.page_size, "sink": self.sink,
               "window": self.window, "pages_per_head": self.k, "dense_layers": self.dense_layers,
               "selections": self.selections, "sparse": self.fixes > 0 or bool(self._planned),
               "fetched_pages_per_step": self.fetched / self.fixes if self.fixes else 0.0}
        if not out["sparse"]:
            out["reason"] = self.dense_reason or "no decode step attended to part of the context"
        for kind, layers in self._recall.items():
            per_layer = {l: torch.cat(v).mean().item() for l, v in sorted(layers.items())}
            out[kind] = sum(per_layer.values()) / len(per_layer)
            out[kind + "_min_head"] = min(torch.cat(v).min().item() for v in layers.values())
            out[kind + "_per_layer"] = {str(l): round(r, 4) for l, r in per_layer.items()}
        return out
