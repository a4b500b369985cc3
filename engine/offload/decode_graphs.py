"""CUDA graphs of one layer's decode compute in layerwise mode, per (layer, buffer, layout).

At batch 1 a decode layer is ~15 small kernels (norm, qkv, q/k norm + rope, KV store, split-K attention and its
reduce, o_proj, norm, MLP) whose launches cost more host time than their GPU time: measured on an H100 at 32K
tokens with Quest, ~2 ms of Python and launches per layer, 21 ms of GPU work per 36-layer step against 76 ms of
host time. A graph replays them in one launch. Everything around the compute stays eager and per step: waits
on the copy events, the partly filled block copied in, the offloads, the policy's planning, the prefetches.
A policy that looks at the layer's query before its attention (Quest's correction) splits the layer in two
graphs: q, k, v and the KV store (and, for a policy that looks ahead, the next layer's query guessed from this
layer's input: `q_next`); then, after the policy's eager step, the correction (Quest's choice, where the policy
leaves it to the runner, and its row gather: the policy's static tensors, so both are recorded in the graph, two
launches fewer per layer), the attention and the rest. Where the policy leaves all its work on q to the runner
(`SparsePolicy.defers`), its eager step runs first and the layer is one graph again (`run(early=True)`).

The graph body is the model's own decoder layer (`qkv_rows`, then paged decode attention over the buffer, then
`post_rows`) over static tensors: hidden state and residual (updated in place layer after layer) and rotary cos/sin,
which one more graph makes from the step's token and position (`begin_token`), and per layout a [4] meta row
(block and offset of the new token in the buffer, the context length the attention sees, its offset in the layer's
decode buffer): row 0 for buffers holding whole blocks, row 1 for buffers packed by a row gather. Given the decode
buffers (`dbuf`, the layers' partly filled blocks), the graph also keeps the new token's K, V there: one copy
launched from Python per layer fewer. A meta row is staged through a small ring of pinned host rows and copied with
non_blocking=True: no host sync in the layer loop. q comes out in a static tensor.

The graphs keep their `cudaGraph_t` (keep_graph=True, where torch has it): a whole step's capture
(engine/offload/step_graphs.py, `inline`) adds each layer's graph to itself as one child node
(engine/offload/child_graph.py) instead of running the layer's body from Python again; the graphs, and so their
memory pool, live as long as this object.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from engine.models.llama import CausalLM
from engine.offload import child_graph
from engine.ops.attention import decode_attention
from engine.ops.place_tokens import place_tokens
from engine.ops.store_tokens import store_tokens

STAGING_ROWS = 64   # pinned rows reused round robin: a step stages at most a few, and each step ends in a sync
META = 9            # a meta row: the new token's block and offset, tokens attended, its decode buffer offset; and
                    # (packed rows, layerwise) place_tokens' five bounds of the rows taken from the device
INPUTS = (None, None, None, "inputs")   # the graph key of begin_token's (layer keys: (layer, buffer, layout, part))
POSITION = (None, None, None, "position")   # ... and of inputs_from_position's


class DecodeGraphs:
    def __init__(self, model: CausalLM, kv_views: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
                 table: torch.Tensor, chunk_tokens: int = 0, dbuf: torch.Tensor | None = None):
        """kv_views(buf) -> K, V of a buffer as [blocks, offset, head, dim] views; table [1, blocks] int32 is the
        identity block table of a buffer; dbuf [L, 2, Hkv, block_size, D]: the decode buffers (None: not kept here)."""
        a = model.args
        p = model.embed_tokens.weight
        dev, dt = p.device, p.dtype
        self.model, self.kv_views, self.table, self.chunk, self.dbuf = model, kv_views, table, chunk_tokens, dbuf
        self.scale = model.layers[0].self_attn.scale
        self.h = torch.zeros(1, a.hidden_size, dtype=dt, device=dev)
        self.residual = torch.zeros_like(self.h)
        self.cos = torch.zeros(1, 1, a.head_dim, dtype=dt, device=dev)
        self.sin = torch.zeros_like(self.cos)
        self.q = torch.zeros(1, a.num_heads, a.head_dim, dtype=dt, device=dev)
        self.q_next = torch.zeros_like(self.q)
        self.meta = torch.zeros(2, META, dtype=torch.long, device=dev)
        self.token_pos = torch.zeros(2, dtype=torch.long, device=dev)     # begin_token's: the step's token, position
        self._staging = torch.zeros(STAGING_ROWS, META, dtype=torch.long, pin_memory=True)
        self._staging_np = self._staging.numpy()    # (written through numpy: a tensor's item writes cost µs each)
        self._next_row = 0
        self._meta_now: list[tuple | None] = [None, None]    # what each meta row holds (host copy)
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self.pool = None
        self._warm: set[tuple] = set()
        self.inline = False    # True while a whole step is captured: graphs become its nodes, no staging
        self.children = child_graph.supported()   # keep each graph's cudaGraph_t, to add it to a step's capture
        self._bs = 0
        self.kept: Callable[[int], torch.Tensor] | None = None   # layerwise: layer -> the runner's device copies
        # ([2, Hkv, n, D]); packed layouts then take their device rows in the graph (engine/ops/place_tokens.py)

    def drop_work(self) -> None:
        """Forget the graphs that run a policy's work (keys with a tag): a new policy's tensors may lie where the old
        one's did, so a tag of their addresses can match while the work's other tensors (the choice's) are gone."""
        self.graphs = {k: g for k, g in self.graphs.items() if len(k) < 5}
        self._warm = {k for k in self._warm if len(k) < 5}

    def drop_layout(self, v: int) -> None:
        """Forget the graphs of layout v (they read tensors that were made anew: the runner's kept copies)."""
        for key in [k for k in self.graphs if k[2] == v]:
            del self.graphs[key]
        self._warm = {k for k in self._warm if k[2] != v}

    def begin_token(self, token: int | torch.Tensor, position: int) -> None:
        """A new decode step from its token and position: one small copy through a pinned row, then one replay
        makes the static inputs (the token's embedding, a zero residual, rotary cos/sin), in place of ~15 launches
        from Python at the start of every step (measured on an H100's host: ~0.4 ms with the GPU idle). The token
        may be a device tensor [1] (the sampled one, not read yet: engine/offload/step_ahead.py)."""
        self.set_token(token, position)
        self._replay(INPUTS)

    def set_token(self, token: int | torch.Tensor, position: int) -> None:
        """The step's token and position -> `token_pos` on the device (one small copy through a pinned row)."""
        on_device = isinstance(token, torch.Tensor)
        row = self._stage((0 if on_device else token, position, 0, 0))
        self.token_pos.copy_(row[:2], non_blocking=True)
        if on_device:
            self.token_pos[:1].copy_(token.view(1))

    def inputs_from_position(self, block_size: int) -> None:
        """A whole step's graph starts here (engine/offload/step_graphs.py): the static inputs from `token_pos`,
        and the whole-block layout's meta row from the position alone (the new token at block p // bs, offset
        p % bs, p + 1 tokens attended, offset p % bs of the decode buffer), so that no row is staged per layer."""
        self._bs = block_size
        self._replay(POSITION)
        self._meta_now[0] = None

    def _position(self) -> None:
        self._inputs()
        p = self.token_pos[1:]
        self.meta[0, :4].copy_(torch.cat([p // self._bs, p % self._bs, p + 1, p % self._bs]))

    def prepare(self, keys: list[tuple], block_size: int) -> None:
        """Before a whole step's capture: record the graphs of `keys` that ran once but were not recorded yet (a
        graph cannot be recorded inside another capture), so that the capture adds each as one node instead of
        running its body from Python. POSITION may run eagerly first: the step starts from `token_pos` anyway."""
        if not self.children:
            return
        self._bs = block_size
        for key in keys:
            if key in self.graphs:
                continue
            if key == POSITION and key not in self._warm:
                self._warm.add(key)
                self._position()
                self._meta_now[0] = None
            if key in self._warm:
                self._capture(key)

    def _stage(self, values: tuple[int, ...]) -> torch.Tensor:
        i = self._next_row
        self._next_row = (i + 1) % STAGING_ROWS
        self._staging_np[i, :len(values)] = values
        self._staging_np[i, len(values):] = 0
        return self._staging[i]

    def _set_meta(self, v: int, values: tuple[int, ...]) -> None:
        if self._meta_now[v] != values:
            self.meta[v].copy_(self._stage(values), non_blocking=True)
            self._meta_now[v] = values

    def run(self, layer: int, buf: int, v: int, meta: tuple[int, ...],
            between: Callable[[torch.Tensor], tuple[tuple, Callable[[], None]] | None] | None = None,
            ahead: bool = False, early: bool = False) -> torch.Tensor:
        """Replay (capturing on first use) the layer's compute over buffer `buf` in layout v (0 whole blocks,
        1 packed rows), the new token at (block, offset) = meta[:2], meta[2] tokens attended, the new token at
        offset meta[3] of the layer's decode buffer (kept there when `dbuf` was given); with `kept` and packed rows,
        meta[4:9] bounds the rows the graph takes from the device (place_tokens). `between(q)`,
        if given, runs eagerly after q is made (and with `ahead` q_next) and before the attention; the work it
        may return, (tag, fn) with fn over static tensors that tag names (a correction's gather: the policy's
        tensors; a policy switch drops these graphs, drop_work), runs first in the attention's graph. `early`:
        between launches nothing that reads q (its work does, in the graph), so it runs first and the layer is one
        graph: q, the work, the attention (one replay a layer fewer).
        -> q [1, Hq, D] (static)."""
        if self.inline:      # inside a step graph's capture: meta[0] comes from the position (inputs_from_position)
            assert v == 0 and between is None, "a step graph holds whole-block layers only"
        else:
            self._set_meta(v, meta)
        if early and between is not None:
            work = between(self.q)
            between = None
            if work is not None:
                self._replay((layer, buf, v, "all", work[0]), work[1])
                return self.q
        if between is None:
            self._replay((layer, buf, v, "all"))
            return self.q
        self._replay((layer, buf, v, "guess" if ahead else "pre"))
        work = between(self.q)
        if work is None:
            self._replay((layer, buf, v, "post"))
        else:
            self._replay((layer, buf, v, "fix+post", work[0]), work[1])
        return self.q

    def _replay(self, key: tuple, work: Callable[[], None] | None = None) -> None:
        graph = self.graphs.get(key)
        if self.inline:      # recorded into the step's graph (a graph cannot be replayed inside a capture)
            if graph is not None and work is None and self.children:
                child_graph.add_child(graph)
            else:
                self._run(key, work)
            return
        if graph is None and key not in self._warm:   # first time: eager (compiles what the capture will record)
            self._warm.add(key)
            self._run(key, work)
            return
        if graph is None:
            graph = self._capture(key, work)
        graph.replay()

    def _capture(self, key: tuple, work: Callable[[], None] | None = None) -> torch.cuda.CUDAGraph:
        graph = self.graphs[key] = torch.cuda.CUDAGraph(keep_graph=True) if self.children else torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            self._run(key, work)
        if self.children:
            graph.instantiate()
        self.pool = graph.pool()
        return graph

    def _run(self, key: tuple, work: Callable[[], None] | None = None) -> None:
        if key == INPUTS:
            self._inputs()
        elif key == POSITION:
            self._position()
        else:
            self._body(*key[:4], work)

    def _inputs(self) -> None:
        m = self.model
        self.h.copy_(m.embed_tokens(self.token_pos[:1]))
        self.residual.zero_()
        cos, sin = m.rotary.cos_sin(self.token_pos[1:], self.h.dtype)
        self.cos.copy_(cos)
        self.sin.copy_(sin)

    def _body(self, layer: int, buf: int, v: int, part: str, work: Callable[[], None] | None = None) -> None:
        K, V = self.kv_views(buf)
        mod = self.model.layers[layer]
        if part in ("all", "pre", "guess"):
            if v == 1 and self.kept is not None and self.dbuf is not None:
                place_tokens(K, V, self.kept(layer), self.dbuf[layer], self.meta[1, 4:9])
            slots = self.meta[v, :2, None]
            keep = None if self.dbuf is None else self.dbuf[layer].transpose(1, 2)    # [2, block_size, Hkv, D]
            at = self.meta[v, 3:4]

            def store(k, v_, a, b):                                   # (and the decode buffer's copy of it)
                store_tokens(k, v_, K, V, slots, keep, at)
            q = mod.qkv_rows(self.h, self.residual, (self.cos, self.sin), store, self.chunk)
            self.q.copy_(q)
            if part == "guess" and layer + 1 < len(self.model.layers):
                self.q_next.copy_(self.model.layers[layer + 1].query(self.residual, (self.cos, self.sin)))
        if work is not None:
            work()
        if part in ("all", "post", "fix+post"):
            o = decode_attention(self.q, K, V, self.table, self.meta[v, 2:3], self.scale)
            mod.post_rows(o, self.h, self.residual, self.chunk)
