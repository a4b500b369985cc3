"""Quest (Tang et al., 2024): at decode, attend only to the KV pages whose keys can matter to the current query.

Per layer the policy keeps, on the device, what a page (page_size tokens) is scored by, per kv head
(engine/sparse/page_index.py; post-RoPE keys, as attended): by default (`rank` r = 32) every key in the r leading
directions of its layer's keys, a page scored by its best token's logit there; with rank=0 the paper's
element-wise min and max of the page's keys (with `bound_tokens`, of each part of the page of that many tokens, a
page's bound the largest of its parts'), the upper bound of q·k over a page being sum_d max(q_d * min_d,
q_d * max_d) (each term is the larger of the two ends of its interval). A kv head scores a page by the attention
share its query heads would give it if each page's best key reached its score (a softmax of the scores over the
candidates per query head, summed over the group's heads), so every head of the group is served.

The budget B counts every token a layer attends to per kv head: the sink S (the first tokens, whole pages),
k pages chosen by score, and the recent window that ends at the new token, where
k = (B - S - recent) // page_size and R = B - S - k * page_size (recent <= R < recent + page_size): exactly B
whenever the context is longer than B. The candidates are the whole pages between the sink and the window.
The window starts at a page boundary, so no token falls between the candidates and the window: it holds the
R newest tokens and the g < page_size before them up to the boundary (measured on the default model, those g
tokens held up to a third of a head's attention when they were left out), and the g tokens are taken from the
end of the lowest-scored chosen page, so the count stays exactly B.
Layers below `dense_layers`, contexts up to B and contexts below `min_context` load everything.

At decode the runner loads each layer ahead of its query: `plan_load` hands out the rows of the sink, of the
pages chosen with the layer's previous query (the speculation), and of the window's part in the host pool.
`observe_query` then sees the layer's own query before its attention: it chooses, and the pages it chooses that
the buffer lacks are fetched in place of the ones it dropped (a `RowFix`), so attention always uses the current
query's choice; that choice is the next step's speculation. Where a choice kept less than half of the previous
one (random weights: ~10% at 128K), the next plan leaves the speculation out (it would only move bytes twice)
and the correction fetches every page. With `look_ahead` (layerwise), `observe_ahead` also sees a guess of the
layer's query made one layer early and fetches what that guess chooses before the layer runs. A buffer's slots
(the page each packed place holds) are tracked on the device; the last slot, cut short by the window, always
holds the lowest-scored chosen page, so what is attended never depends on what was loaded.

The decode work has static shapes (every page a sequence can have is scored, non-candidates masked; the step's
context enters through small device tensors set once per step), so on CUDA a layer's scoring, selection,
correction and next plan (engine/ops/quest_score.py, quest_select.py) are graphed and never wait for the host: with
`defer`, in the layer's graph beside the gather (`RowFix.select`, reading the runner's q; `defers` says when, so
the runner may record q, the choice and the attention as one graph), else in a graph of the policy's own.
A plan's rows are kept per context parity (the next step's loads read one copy while this step's choices go to the
other): [sink | the window's host part | the chosen pages], the last g rows of the last page past the plan's end.

What the policy reports (recall, pages fetched and kept, per step and per request) is in engine/sparse/quest_figures.py.
"""
from __future__ import annotations

import torch

from engine.errors import ConfigError
from engine.ops.quest_select import choose
from engine.sparse.page_index import KeySketch, PageBounds
from engine.sparse.policy import KVLayout, LoadPlan, RowFix, SparsePolicy
from engine.sparse.quest_figures import QuestFigures
from engine.sparse.specs import SPECS
from engine.step import StepContext


class QuestPolicy(QuestFigures, SparsePolicy):
    spec = SPECS["quest"]
    plans_loads = True

    def __init__(self, **params):
        p = self.spec.validate(params)
        self.token_budget, self.page_size, self.dense_layers = p["token_budget"], p["page_size"], p["dense_layers"]
        self.min_context, self.measure_recall = p["min_context"], p["recall"]
        self.min_layer_bytes, self._token_bytes = p["min_layer_mb"] * 2 ** 20, 0   # (bytes per token: initialize)
        self.looks_ahead, self.centroid = p["look_ahead"], p["centroid"]
        self.bound_tokens = p["bound_tokens"] or self.page_size
        if self.page_size % self.bound_tokens:
            raise ConfigError(f"quest bound_tokens {self.bound_tokens} must divide page_size {self.page_size} "
                              "(0: the page size)")
        self.parts = self.page_size // self.bound_tokens               # key bounds per page
        self.rank = p["rank"]
        if self.rank and (self.centroid or p["bound_tokens"]):
            raise ConfigError(f"quest centroid and bound_tokens refine the page bounds, which rank (now {self.rank}) "
                              "replaces: pass rank=0 with them")
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
        self._chosen: dict[int, tuple[int, int]] = {}   # layer -> (version, context its rows are written for) of
                                                        # its choice (in _pages; no entry: none yet)
        self._planned: dict[int, int] = {}        # layer -> context_len of the speculation its buffer was given
        self._picked: list[int] = []              # layers that chose this step, for the recorder
        self._fixed: list[int] = []               # layers whose speculation this step corrected
        self._chose: list[int] = []               # layers that chose this step after an earlier choice
        self._version = 0
        self.selections = self.fetched = self.fetched_ahead = self.fixes = self.plans = 0
        self.dense_reason = ""

    def initialize(self, layout: KVLayout) -> None:
        super().initialize(layout)
        if layout.block_size % self.page_size:
            raise ConfigError(f"quest page_size {self.page_size} must divide the KV block size {layout.block_size}")
        ps, dev, hkv, d, L = self.page_size, layout.device, layout.num_kv_heads, layout.head_dim, layout.num_layers
        self._token_bytes = 2 * hkv * d * layout.dtype.itemsize             # one token of one layer: K and V
        self.pages_per_block = ppb = layout.block_size // ps
        shape = (L, layout.num_blocks, layout.block_size, hkv, d)          # what each key's page scores come from
        self.index = (KeySketch(self.rank, *shape, ps, layout.dtype, dev, dev.type == "cuda") if self.rank else
                      PageBounds(*shape, ps, self.parts, self.centroid, layout.dtype, dev, dev.type == "cuda"))
        n = (layout.max_blocks_per_seq or layout.num_blocks) * ppb       # pages a sequence can have
        lng = dict(dtype=torch.long, device=dev)
        self._page_ids = torch.zeros(n, **lng)                  # the sequence's page -> pool page
        self._valid = torch.zeros(n, dtype=torch.bool, device=dev)   # this step's candidates
        self._live = torch.zeros((), **lng)      # the sequence's pages: the kernels score none after (max_model_len's)
        self._pages = torch.zeros(L, hkv, self.k, **lng)       # each layer's choice: sequence pages, ascending
        self._scores = torch.zeros(L, hkv, self.k, dtype=torch.float32, device=dev)
        self._plan = torch.full((2, L, hkv, self.token_budget + ps), -1, **lng)   # rows to load, by context parity
        self._next = torch.zeros(1, **lng)                      # the parity of the next step's context
        self._cols = torch.zeros(self.k * ps, **lng)            # the columns of its pages' rows
        self._base = torch.zeros((), **lng)                     # this step's: where the pages start, the row count
        self._n_rows = torch.zeros((), **lng)
        self._heads, self._kps = torch.arange(hkv, device=dev), torch.arange(self.k * ps, device=dev)
        self._fix_rows = torch.full((hkv, self.k * ps), -1, **lng)
        self._fix_dst = torch.zeros(hkv, self.k * ps, **lng)
        self._fetched = torch.zeros(2, L, **lng)                # rows fetched per layer: by the correction, ahead
        self._kept = torch.zeros(L, hkv, dtype=torch.int32, device=dev)   # pages of the previous choice kept
        self._counts_host, self._staged = None, False          # pinned copies of both (stage_step), and if current
        self._guess = torch.zeros(hkv, self.k, **lng)          # a guessed query's choice (ahead), its scores, kept
        self._guess_scores = torch.zeros(hkv, self.k, dtype=torch.float32, device=dev)
        self._guess_kept = torch.zeros(hkv, dtype=torch.int32, device=dev)
        self._scratch = torch.zeros(hkv, n, dtype=torch.float32, device=dev)   # the scores of every page
        self._kernels = dev.type == "cuda"                      # the selection's kernels (else torch)
        self._slots = torch.full((L, hkv, self.k), -1, **lng)  # the page each packed slot of a buffer holds (-1: none)
        self._ahead_rows = torch.full((L, hkv, self.k * ps), -1, **lng)   # the fetches one layer ahead, per layer
        self._ahead_dst = torch.zeros(L, hkv, self.k * ps, **lng)         # (the copy stream reads them later)
        self._bare = torch.full((2, L, hkv, self.token_budget + ps), -1, **lng)   # plans without the speculation
        self._speculate = [True] * L              # load the previous choice ahead (off where it kept < half its pages)
        self._ahead_at: dict[int, int] = {}       # layer -> context_len of the step its pages were fetched ahead
        self._rows_step = 0                       # rows the last step's fixes moved (end_step reads them)
        self._all_pages, self._in_page = torch.arange(n, device=dev), torch.arange(ps, device=dev)
        self._in_block = torch.arange(ppb, device=dev)
        self._q = self._q_ahead = None            # the observed query and a guessed one (static: graphs read them)
        self._scratch_ahead = torch.zeros_like(self._scratch) if self.looks_ahead else None
        self._setup_for: tuple | None = None
        self._plan_for = [None, None]                          # the context each parity's sink/window rows are for
        self._graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self._warm: set[tuple] = set()
        self._pool = self._pool_ahead = None                   # (graphs that may run at once share no pool)
        self._capture = layout.graphs and dev.type == "cuda" and not self.measure_recall   # recall reads the fix

    def whole_layers(self) -> tuple[int, ...]:
        return tuple(range(min(self.dense_layers, self.layout.num_layers)))

    def warm_up_tokens(self) -> int:
        gate = -(-int(self.min_layer_bytes) // self._token_bytes) if self._token_bytes else 0
        return max(self.min_context, self.token_budget + 1, gate)

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
        if context_len * self._token_bytes < self.min_layer_bytes:
            self.dense_reason = (f"a layer's KV at this context ({context_len * self._token_bytes / 2 ** 20:.1f} MiB) "
                                 f"is under min_layer_mb {self.min_layer_bytes / 2 ** 20:g}: loading all of it costs "
                                 "less than choosing (this model's reaches it at "
                                 f"{-(-int(self.min_layer_bytes) // self._token_bytes):,} tokens)")
            return False
        return True

    def observes(self, layer: int, context_len: int) -> bool:
        return self.sparse(layer, context_len + 1)          # (observe_query chooses for this step and the next)

    # ---------------------------------------------------------------- metadata
    def on_kv_written(self, layer: int, block_ids: list[int], keys: torch.Tensor, start: int, end: int) -> None:
        """keys [n, Hkv, block_size, D] of blocks whose tokens start..end-1 (laid end to end) were just written ->
        the index of the pages those tokens complete (at decode: one page every page_size tokens)."""
        self.index.write(layer, block_ids, keys, start, end)

    # ---------------------------------------------------------------- the runner's hooks
    def reset(self) -> None:
        """A new sequence: selections are made again from its own queries; figures start over."""
        for kept in (self._recall, self._chosen, self._planned, self._ahead_at):
            kept.clear()
        self._picked, self._fixed, self._chose, self._step = [], [], [], {}   # a stopped step's leftovers
        self._setup_for, self._plan_for = None, [None, None]
        self._speculate = [True] * self.layout.num_layers
        self._fetched.zero_()
        self._staged = False
        self.selections = self.fetched = self.fetched_ahead = self.fixes = self.plans = 0
        self.dense_reason = ""

    def forget(self) -> None:
        """After throwaway prompts: the sketch's basis is made again, in place, from the next prompt's keys."""
        self.index.forget()
        self.reset()

    def _rows(self, positions: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """Sequence token positions [..] -> rows of the layer's host pool (block * block_size + offset)."""
        bs = self.layout.block_size
        return ctx.block_table[positions // bs].long() * bs + positions % bs

    def plan_load(self, layer: int, context_len: int, ctx: StepContext) -> LoadPlan | None:
        """The rows of the sink, of the pages chosen with an earlier query (the speculation), and of the window's
        part in the host pool, for a step whose sequence has context_len tokens; None (load all) where the layer
        is dense or no choice was made yet. The rows are a view of this policy's plan for that context. Where the
        previous choice kept less than half of the one before it, the plan leaves the speculation out (its rows
        -1): the pages then come from the guess one layer ahead (`observe_ahead`) or the correction."""
        chosen = self._chosen.get(layer)
        if chosen is None or not self.sparse(layer, context_len):
            self._planned.pop(layer, None)
            return None
        par, S = context_len % 2, self.sink
        R, tail, base = self._layout_for(context_len)
        if self._plan_for[par] != context_len:            # once per step, every layer: the sink's and window's rows
            dev = self._pages.device                      # (the new token's block may not be in the table yet)
            fixed = self._rows(torch.cat([torch.arange(S, device=dev),
                                          torch.arange(context_len - R, context_len - tail, device=dev)]), ctx)
            self._plan[par, :, :, :base] = self._bare[par, :, :, :base] = fixed
            self._bare[par, :, :, base:] = -1
            self._plan_for[par] = context_len
        if chosen[1] != context_len:                      # chosen at another step than the one before: its rows
            self._begin_plan(context_len)
            self._write_pages(layer, self._pages[layer], torch.tensor([par], device=self._next.device))
            self._chosen[layer] = (chosen[0], context_len)
        self._planned[layer] = context_len
        self.plans += 1
        spec = self._speculate[layer]
        if spec:
            self._slots[layer].copy_(self._pages[layer])
        else:
            self._slots[layer].fill_(-1)
        plan = self._plan if spec else self._bare
        return LoadPlan(plan[par, layer, :, :self.token_budget - tail], tail,
                        ("quest", layer, chosen[0], context_len, spec), None if spec else base, S, base - S)

    def observe_query(self, layer: int, q: torch.Tensor, ctx: StepContext, defer: bool = False) -> RowFix | None:
        """This step's query of `layer` (q [Hq, D]), before its attention: choose the pages among the candidates;
        where this step loaded a speculation, fetch what it lacks in place of what it no longer wants."""
        end = ctx.context_len
        if not self.sparse(layer, end + 1):                        # neither now nor at the next step
            self._chosen.pop(layer, None)
            return None
        self._begin(end, ctx)
        fix = self._planned.get(layer) == end and layer in self._chosen   # its buffer holds this step's plan
        measure = fix and self.measure_recall and ctx.layer_keys is not None
        old = self._slots[layer].clone() if measure else None
        self._q = torch.empty_like(q) if self._q is None else self._q
        if layer in self._chosen:
            self._chose.append(layer)
        select = None                # `defer`: a correction's choice runs with the runner's gather (see RowFix)
        if defer and self._deferrable(layer, fix, ctx):
            self.index.prepare(layer)                                           # (eager: host work)
            select = lambda: self._select(layer, "fix", q)      # noqa: E731  (q: the caller's, static while it runs)
        else:
            self._q.copy_(q)
            self._run(layer, "fix" if fix else "choose")
        if measure:
            self._measure_recall(layer, q, old, end, ctx)
        self._version += 1
        self._chosen[layer] = (self._version, end + 1)
        self.selections += 1
        if ctx.recorder.enabled:
            self._picked.append(layer)
        if fix:
            self._fixed.append(layer)
        return RowFix(self._fix_rows, self._fix_dst, select) if fix else None

    def defers(self, layer: int, ctx: StepContext) -> bool:
        end = ctx.context_len
        return self.sparse(layer, end + 1) and self._deferrable(
            layer, self._planned.get(layer) == end and layer in self._chosen, ctx)

    def _deferrable(self, layer: int, fix: bool, ctx: StepContext) -> bool:
        """A correction (fix) whose choice may run in the runner's graph: not where recall reads the slots first
        or a guess one layer ahead chose with its own graph."""
        return fix and not (self.measure_recall and ctx.layer_keys is not None) and not self.looks_ahead

    def observe_ahead(self, layer: int, q: torch.Tensor, ctx: StepContext, run=None, gather=None) -> RowFix | None:
        """A guess of `layer`'s query (q [Hq, D], made one layer early from the residual stream), where this step's
        plan for it is loaded or loading: the pages it chooses that the plan lacks, to fetch ahead of the layer
        (on the copy stream); the layer's own query then corrects what is left (`observe_query`). CUDA: `run(work)`
        runs the choice and `gather(fix)` (the fetch; gather.tag: what it writes) as one graph on the copy stream,
        beside the compute stream's choice (own query, scratch and graph pool) -> None."""
        end = ctx.context_len
        if self._planned.get(layer) != end or layer not in self._chosen or not self.sparse(layer, end + 1):
            return None
        self._begin(end, ctx)                             # (on the compute stream: its choices read what it sets)
        self._q_ahead = torch.empty_like(q) if self._q_ahead is None else self._q_ahead
        fix = RowFix(self._ahead_rows[layer], self._ahead_dst[layer])
        self._ahead_at[layer] = end
        if run is None:
            self._q_ahead.copy_(q)
            self._run(layer, "ahead")
            return fix
        run(lambda: (self._q_ahead.copy_(q), self._run(layer, "ahead", lambda: gather(fix), gather.tag)))
        return None

    def _layout_for(self, context_len: int) -> tuple[int, int, int]:
        """A step of context_len tokens -> its window (page aligned: R plus the tokens before it in its first page),
        the window's newest tokens on the device (of the block being filled), and where a plan's pages start."""
        bs = self.layout.block_size
        window = self.window + (context_len - self.window) % self.page_size
        tail = min(window, context_len - (context_len - 1) // bs * bs)
        return window, tail, self.sink + window - tail

    def _begin_plan(self, context_len: int) -> None:
        """The columns the pages' rows of a plan for context_len go to."""
        torch.add(self._kps, self._layout_for(context_len)[2], out=self._cols)

    def _begin(self, end: int, ctx: StepContext) -> None:
        """Once per step: the sequence's pages as pool pages, the candidates (the whole pages between the sink and
        the window), and which copy of the plan the choices go to."""
        table = ctx.block_table
        key = (end, table.shape[0], table.data_ptr())
        if self._setup_for == key:
            return
        self._setup_for = key
        ppb, n = self.pages_per_block, table.shape[0] * self.pages_per_block
        self._page_ids[:n] = (table.long()[:, None] * ppb + self._in_block).flatten()
        first, stop = self.sink // self.page_size, (end - self.window) // self.page_size
        torch.logical_and(self._all_pages >= first, self._all_pages < stop, out=self._valid)
        self._live.fill_(stop)
        self._next.fill_((end + 1) % 2)
        self._begin_plan(end + 1)
        _, tail, base = self._layout_for(end)
        self._base.fill_(base)
        self._n_rows.fill_(self.token_budget - tail)
        self._n_candidates = stop                             # the recorder's page count

    def _run(self, layer: int, mode: str, then=lambda: None, tag=None) -> None:
        """The layer's selection, then `then()` (tag names what it touches): eager, or (CUDA graphs) captured on
        its second use and replayed after."""
        key = (layer, mode, tag)
        self.index.prepare(layer)                       # (eager: the sketch's basis, where its keys wait for it)
        graph = self._graphs.get(key)
        if graph is None and (not self._capture or key not in self._warm):
            self._warm.add(key)
            self._select(layer, mode)
            return then()
        if graph is None:
            ahead = mode == "ahead"
            graph = self._graphs[key] = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool_ahead if ahead else self._pool,
                                  capture_error_mode="thread_local"):
                self._select(layer, mode)
                then()
            setattr(self, "_pool_ahead" if ahead else "_pool", graph.pool())
        graph.replay()

    def _select(self, layer: int, mode: str, q: torch.Tensor | None = None) -> None:
        """Score every page (masked to the candidates) and keep the k best per kv head (engine/ops/quest_select.py).
        "choose": that is the layer's choice; "fix": also correct the loaded slots toward it (rows to _fix_rows);
        "ahead": a guessed query's choice, only corrects the slots (rows to the layer's _ahead_rows). Static
        shapes, no host sync."""
        ahead = mode == "ahead"
        n, live = (None, self._live) if self._kernels else (self._n_candidates, None)   # (graphs read `_live`)
        q = q if q is not None else self._q_ahead if ahead else self._q
        b = self.bounds(layer, q, self._page_ids[:n], self._valid[:n], live)
        pages = self._guess if ahead else self._pages[layer]
        scores = self._guess_scores if ahead else self._scores[layer]
        kept = self._guess_kept if ahead else self._kept[layer]
        fix = None                                      # the correction, in the choice's last kernel
        if mode != "choose":
            rows, dst = (self._ahead_rows[layer], self._ahead_dst[layer]) if ahead else (self._fix_rows, self._fix_dst)
            fix = (self._slots[layer], self._page_ids, self._base, self._n_rows, self.page_size, rows, dst,
                   self._fetched[int(ahead), layer:layer + 1], None if ahead else (self._plan[:, layer], self._next,
                                                                                   self._cols))
        planned = choose(b, self.layout.head_dim ** -0.5, self.k, self._pages[layer], self._scratch_ahead if ahead
                         else self._scratch, pages, scores, kept, self._kernels, live, fix)
        if not ahead and not planned:                   # (the kernel writes the next plan's rows with the fix)
            self._write_pages(layer, pages, self._next)

    def _write_pages(self, layer: int, pages: torch.Tensor, parity: torch.Tensor) -> None:
        """The rows of the chosen pages [Hkv, k] into the plan of context parity `parity` (a device index [1]), at
        the columns _begin_plan set."""
        rows = (self._page_ids[pages][:, :, None] * self.page_size + self._in_page).flatten(1)  # [Hkv, k * ps]
        self._plan[:, layer].index_put_((parity[:, None, None], self._heads[None, :, None], self._cols[None, None]),
                                        rows[None])

    # ---------------------------------------------------------------- selection
    def bounds(self, layer: int, q: torch.Tensor, pages: torch.Tensor, valid: torch.Tensor,
               live: torch.Tensor | None = None) -> torch.Tensor:
        """q [Hq, D] -> each of the pool pages' `pages` [n] score per query head [Hkv, G, n], -inf where not
        `valid` (engine/sparse/page_index.py; live: a device scalar the kernels read, no candidate at or after it)."""
        return self.index.scores(layer, q, pages, valid, live)
