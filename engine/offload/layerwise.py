"""Layerwise offload: each step runs all its tokens through one layer at a time (DESIGN.md §2.1).

Per layer l (buffer = its resident buffer, or ring slot j % N for the j-th streamed layer of the run):
  wait until the buffer's load has landed (the host blocks before this step) and its last offload read it
  -> copy the decode buffer's partly filled block in after them (decode only)
  -> q, k, v for the new tokens (in row chunks at prefill), k, v written into the buffer
  -> attention over the buffer (the policy's prefill attention / paged decode attention), o_proj, MLP
  -> offload the blocks this step completed (D2H, async), keep the partly filled block in the decode buffer
  -> release the buffer and load the layer N streamed layers ahead into it (at decode, wrapping around to the
     next step's first layers, so the next token's loads start while this one computes).
At decode a load-planning policy (Quest) may ask for pages instead of whole blocks: they are packed into the
buffer's first positions, the partly filled block after them; where a plan's only host rows are the sink and the
tokens right before the partly filled block, nothing is loaded: they come from the device copies each layer keeps (its
sink, made at prefill, and its last complete block). On CUDA each decode layer's compute is one
CUDA graph replay (engine/offload/decode_graphs.py). Prefill reads nothing from the host unless the prompt
starts with cached blocks (prefix cache).
"""
from __future__ import annotations

import torch

from engine.ops.attention import decode_attention, store_kv
from engine.offload.decode_graphs import DecodeGraphs
from engine.offload.planner import ResidencyPlan, plan_residency
from engine.offload.runner import OffloadRunner
from engine.offload.step_ahead import StepAhead
from engine.offload.step_graphs import StepGraphs
from engine.offload.streams import wait_on
from engine.sequence import Sequence
from engine.step import StepContext
from engine.trace.events import COMPUTE, COMPUTING
from engine.trace.recorder import NULL_RECORDER, NULL_SPAN


class LayerwiseRunner(OffloadRunner):
    mode = "layerwise"

    def _make_offload_engine(self):
        a, cfg = self.args, self.config
        layer_bytes = self.max_blocks_per_seq * self.block_bytes // a.num_layers
        budget = None if cfg.gpu_kv_budget_gb is None else int(cfg.gpu_kv_budget_gb * 2**30)
        self.plan: ResidencyPlan = plan_residency(a.num_layers, cfg.ring_slots, layer_bytes, self.block_bytes,
                                                  budget, self.policy.whole_layers())
        self.streamed = self.plan.streamed
        self._steps = 0  # ring positions continue across steps: streamed layer j of step k is at k * S + j
        self.table = torch.arange(self.max_blocks_per_seq, dtype=torch.int32, device=self.device)[None]
        oe = self._engine(self.plan.ring_slots, self.max_blocks_per_seq, self.plan.resident)
        self.decode_graphs = (DecodeGraphs(self.model, oe.kv_views, self.table, self.chunk_tokens, oe.dbuf)
                        if self.device.type == "cuda" and not cfg.enforce_eager else None)
        if self.decode_graphs is not None:
            self.decode_graphs.kept = lambda l: self._keep[l]     # (made by _load before a packed layer runs)
        self._packed: list = [None] * len(oe.buffers)  # buffer -> (layer, rows, device tail, plan key, sink and
                                                        # recent rows taken from the device copies: their token
                                                        # counts, 0 where loaded) if by rows
        self.keep_sink = True          # a plan's sink and recent rows from device copies, not the host
        self._keep: torch.Tensor | None = None   # [L, 2, Hkv, bs + sink, D]: each layer's last complete block, then
        self._sink_ok = [False] * a.num_layers   # its first tokens (made by this sequence's prefill)
        self._prev_blk = [-1] * a.num_layers     # the sequence's block each layer's copy holds (-1: none)
        self.step_graphs = StepGraphs(self)
        self.ahead = StepAhead(self)
        return oe

    def issued_for(self, seqs: list[Sequence], is_prefill: bool) -> bool:
        return len(seqs) == 1 and self.ahead.holds(seqs[0], is_prefill)

    def set_policy(self, policy) -> None:
        """The next requests' policy; the layers it reads whole every step (Quest's dense layers) become the
        resident ones where the plan keeps any (the same buffers, given to other layers: between requests only)."""
        super().set_policy(policy)
        if getattr(self, "plan", None) is None:     # (while the runner is being made)
            return
        self.step_graphs.clear()
        cfg = self.config
        plan = plan_residency(self.args.num_layers, cfg.ring_slots, self.plan.layer_bytes, self.plan.dbuf_bytes,
                              self.plan.budget_bytes, self.policy.whole_layers())
        if plan.resident != self.plan.resident:
            oe = self.oe
            bufs = sorted(oe.resident.values())
            oe.resident = dict(zip(plan.resident, bufs))
            for b in bufs:                           # they hold other layers' blocks now: nothing counts as held
                oe.held[b], oe.owner[b], self._packed[b] = {}, None, None
            self.plan, self.streamed = plan, plan.streamed

    def close(self) -> None:
        self.step_graphs.clear()
        super().close()

    def _buffer(self, layer: int) -> int:
        j = self.streamed.index(layer) if layer not in self.oe.resident else 0
        return self.oe.buffer_for(layer, self._steps * len(self.streamed) + j)

    def forward(self, seq: Sequence, is_prefill: bool, ctx: StepContext) -> torch.Tensor:
        graphs = None if is_prefill else self.decode_graphs
        issued = self.ahead.take(seq, is_prefill)        # its first layers, run after the last step's logits
        if issued is None and graphs is not None and self.step_graphs.run(seq, ctx):   # the whole step, one replay
            n = len(self.model.layers)
            ctx.layer_done(n, n)
            self._steps += 1
            return self._logits(graphs.h, graphs.residual, ctx)
        start, end = (seq.num_cached_tokens if is_prefill else len(seq) - 1), len(seq)
        if is_prefill:
            self._sink_ok, self._prev_blk = [False] * len(self.model.layers), [-1] * len(self.model.layers)
        if issued is not None:
            inputs = issued.inputs
        elif graphs is not None:     # decode: each layer's compute is one or two graph replays over static inputs
            graphs.begin_token(seq.token_ids[-1], start)
            inputs = graphs.h, graphs.residual, None, None, None
        else:
            inputs = self.eager_inputs(seq, start, end)
        self._layers(seq, is_prefill, ctx, graphs, *inputs, first=0 if issued is None else issued.layers)
        self._steps += 1
        return self._logits(inputs[0], inputs[1], ctx)

    def eager_inputs(self, seq: Sequence | None, start: int, end: int, ids: torch.Tensor | None = None) -> tuple:
        """An eager step's inputs for positions start..end-1: h, residual, pos, cos/sin, their (block, offset)."""
        h, residual, pos, cos_sin = self._inputs(seq, start, end, ids)
        return h, residual, pos, cos_sin, torch.stack([pos // self.block_size, pos % self.block_size])

    def _sample(self, seq: Sequence, logits: torch.Tensor, ctx: StepContext) -> list[int]:
        """The token, and where the next decode step's first layers need nothing from the host, those layers
        issued before the token is read (engine/offload/step_ahead.py)."""
        n = self.ahead.layers(seq, ctx)
        if not n:
            return super()._sample(seq, logits, ctx)
        token, read = self.sampler.stage_greedy(logits)
        self.ahead.issue(seq, ctx, token, n)
        return read()

    def _layers(self, seq: Sequence, is_prefill: bool, ctx: StepContext, graphs: DecodeGraphs | None,
                h: torch.Tensor, residual: torch.Tensor, pos, cos_sin, slots, ahead: bool = True,
                first: int = 0, stop: int | None = None) -> None:
        """The step's loads and every layer's compute (what a step graph records, engine/offload/step_graphs.py);
        `ahead`: and the next decode step's first loads (a step graph issues those after its replay). Layers
        first..stop-1 only: a decode step's first layers issued ahead (engine/offload/step_ahead.py), then the rest;
        the step's first loads are issued with layer 0."""
        oe, bs, rec, model, policy = self.oe, self.block_size, ctx.recorder, self.model, self.policy
        start = seq.num_cached_tokens if is_prefill else len(seq) - 1
        end = len(seq)
        n_host, n_done = start // bs, end // bs      # complete blocks before / after this step
        table = seq.block_table
        observe = policy.plans_loads       # each layer's last query (at prefill the prompt's: the first choice)
        S, N = len(self.streamed), oe.ring_slots
        marks = rec.detail and self.device.type == "cuda"   # CUDA timeline: layers share their boundary marks
        mark = rec.mark() if marks else None
        for layer in oe.resident if first == 0 else ():   # cached prefix of resident layers (no-op once held)
            self._load(oe.resident[layer], layer, table[:n_host], end, is_prefill, ctx)
        for j in range(min(N, S) if first == 0 else 0):   # no-op where last step's prefetch already did it
            self._load(self._buffer(self.streamed[j]), self.streamed[j], table[:n_host], end, is_prefill, ctx)
        for l in range(first, len(model.layers) if stop is None else stop):
            layer = model.layers[l]
            buf = self._buffer(l)
            packed = self._packed[buf] if self._packed[buf] and self._packed[buf][0] == l else None
            slot = buf if buf < N else None
            with (NULL_SPAN if marks else rec.span(COMPUTE, model.layer_names[l], l, slot=slot)):
                for ev in oe.ready(buf):
                    wait_on(ev, self.device, NULL_RECORDER if marks else rec, l, slot, stream=oe.compute,
                            waited=oe.compute_waited)
                if marks:                            # the wait, then the layer: three marks in all, one shared
                    began = rec.mark()
                    rec.add_event_span(COMPUTE, "wait for copy", mark, began, l, slot=slot)
                if rec.detail and slot is not None:
                    rec.slot_state(buf, l, COMPUTING, end, oe.capacity_tokens, event=began if marks else None)
                new, context, place = self._place_newest(l, buf, packed, n_host, start, end, graphs is not None)
                q_last = None
                looks = observe and (is_prefill or policy.observes(l, end)   # decode: it sees q before attention
                                     or policy.looks_ahead and policy.observes(l + 1, end))   # (or guesses l + 1's)
                waited = not looks and oe.wait_ahead(buf, rec, l)
                if looks and policy.wants_layer_keys:
                    ctx.layer_keys = lambda: self._layer_keys(l, buf, new, n_host, end, ctx)
                if graphs is not None:               # decode: q out, h and residual in place
                    between = None if not looks else (
                        lambda q: self._observe(l, buf, q[0], ctx, lambda: graphs.q_next[0], defer=True))
                    if oe.dbuf_read[l] is not None:  # the graph writes the decode buffer: its last offload read it
                        wait_on(oe.dbuf_read[l], self.device, stream=oe.compute)
                        oe.dbuf_read[l] = None
                    graphs.run(l, buf, int(packed is not None), (*new, context, (end - 1) % bs, *place), between,
                               policy.looks_ahead, early=looks and policy.defers(l, ctx))
                else:
                    att = (rec.mark() if waited else began) if marks else None   # (after a wait for the fetch ahead)
                    with NULL_SPAN if marks else rec.span(COMPUTE, "attention", l):
                        K, V = oe.kv_views(buf)
                        where = slots if packed is None else self._slot_of(pos, end, new)
                        q = layer.qkv_rows(h, residual, cos_sin, lambda k, v, a, b: store_kv(
                            k, v, K, V, where[:, a:b]), self.chunk_tokens)
                        if observe and is_prefill:   # observed once its blocks' keys are written (below)
                            q_last = q[-1].clone()   # (the prefill attention may consume q)
                        elif looks:                  # decode: before the attention, which uses its choice
                            self._observe(l, buf, q[-1], ctx, lambda: model.layers[l + 1].query(
                                residual[-1:], cos_sin)[0])
                        if is_prefill:
                            o = self._prefill_attention(q, buf, end, l, ctx)
                        else:
                            o = decode_attention(q, K, V, self.table[:, :-(-context // bs)],
                                                 torch.full((1,), context, device=self.device), self.scale)
                        del q                        # long prompts: q and o are 1 GiB each at 128K
                    if marks:                        # attention and MLP share a mark, attention the wait's end
                        mid = rec.mark()
                        rec.add_event_span(COMPUTE, "attention", att, mid, l)
                    with NULL_SPAN if marks else rec.span(COMPUTE, "mlp", l):
                        layer.post_rows(o, h, residual, self.chunk_tokens)
                        del o
                    if marks:
                        rec.add_event_span(COMPUTE, "mlp", mid, rec.mark(), l)
                self._after_layer(seq, l, buf, packed, n_host, n_done, start, end, new, kept=graphs is not None)
                if is_prefill and observe:
                    self._keep_sink(l, buf, end)
                if marks:
                    mark = rec.mark()
                    rec.add_event_span(COMPUTE, model.layer_names[l], began, mark, l, slot=slot)
                oe.release(buf, l, end, event=mark)
                if q_last is not None:
                    policy.observe_query(l, q_last, ctx)
            if buf < N:
                self._prefetch(seq, self.streamed.index(l), n_host, n_done, is_prefill, ctx, ahead)
            ctx.layer_done(l + 1, len(model.layers))

    def _slot_of(self, pos: torch.Tensor, end: int, new: tuple[int, int]) -> torch.Tensor:
        """The new token's (block, offset) in a packed buffer as a device tensor [2, 1], made from its position on
        the device (a tensor from host ints would be a synchronous copy in the layer loop)."""
        bs = self.block_size
        flat = pos + (new[0] * bs + new[1] - (end - 1))
        return torch.stack([flat // bs, flat % bs])

    def _observe(self, l: int, buf: int, q: torch.Tensor, ctx: StepContext, guess, defer: bool = False):
        """Decode: show the policy the layer's query (q [Hq, D]) before its attention; apply the correction it
        returns (defer: return it as (tag, work) for the attention's graph instead). A policy that looks ahead then sees
        the next layer's query as guessed from this layer's input (`guess()`), and what it asks for is fetched
        on the copy stream into the next layer's buffer while this layer computes (the buffer's load for this
        step is issued already where the ring has two slots or more; the policy checks). On CUDA the guess's
        choice runs on the copy stream too, issued before this layer's own choice: the fetch overlaps this
        layer's choice, correction and attention, and neither choice waits for the other."""
        policy = self.policy
        nxt = self._buffer(l + 1) if policy.looks_ahead and l + 1 < len(self.model.layers) else buf
        if nxt != buf and self.device.type == "cuda":
            gather = lambda fix: self.oe.fix_rows(nxt, l + 1, fix.rows, fix.dst, ahead=True)   # noqa: E731
            gather.tag = nxt
            policy.observe_ahead(l + 1, guess(), ctx, lambda work: self.oe.ahead(nxt, l + 1, work, defer=True), gather)
        elif nxt != buf:
            ahead = policy.observe_ahead(l + 1, guess(), ctx)
            if ahead is not None:
                self.oe.fetch_rows(nxt, l + 1, ahead.rows, ahead.dst)
        self.oe.wait_ahead(buf, ctx.recorder, l)
        work = self._query_fix(l, buf, q, ctx)
        if work is not None and not defer:
            work[1]()
            work = None
        return work

    def _place_newest(self, l: int, buf: int, packed, n_host: int, start: int, end: int, in_graph: bool = False):
        """Decode: put the partly filled block's tokens where the attention expects them -> the new token's
        (block, offset) in the buffer, the context the attention sees, and (packed rows) the bounds of the rows
        taken from the device. Whole blocks: the partial block right after the host blocks. Packed rows: the plan's
        device tail (the newest tokens) right after the rows, and where nothing was loaded the recent rows and the
        sink first, in that order (attention does not depend on the rows' order), from their device copies;
        `in_graph`: the layer's graph copies them (engine/ops/place_tokens.py), else copied here."""
        oe, bs = self.oe, self.block_size
        if packed is None:
            oe.writing(buf, n_host)
            if start > n_host * bs:                  # the partly filled block, kept on the device
                oe.buffers[buf][n_host].copy_(oe.dbuf[l])
            return (n_host, start % bs), end, ()
        n_rows, tail, sink, r = packed[1], packed[2], packed[4], packed[5]
        partial = end - n_host * bs                  # tokens of the block being filled, the new one included
        keep = (sink + r, bs - r) if sink else (0, 0)
        if not in_graph:
            self._copy_tokens(oe.buffers[buf], 0, self._keep[l], keep[1], keep[1] + keep[0])
            self._copy_tokens(oe.buffers[buf], n_rows, oe.dbuf[l], partial - tail, partial - 1)
        f = n_rows + tail - 1
        return (f // bs, f % bs), n_rows + tail, (*keep, tail - 1, partial - tail, n_rows)

    def _prefill_attention(self, q, buf: int, end: int, l: int, ctx: StepContext) -> torch.Tensor:
        """The policy's prefill attention over the layer's whole K, V (cached prefix + new tokens)."""
        nb = -(-end // self.block_size)
        b = self.oe.buffers[buf][:nb]                                  # [nb, 2, Hkv, bs, D]
        hkv, d = b.shape[2], b.shape[4]
        k = b[:, 0].transpose(0, 1).reshape(hkv, -1, d)[:, :end]      # head-major copies [Hkv, end, D]
        v = b[:, 1].transpose(0, 1).reshape(hkv, -1, d)[:, :end]
        return self.policy.prefill_attention(q, k.transpose(0, 1), v.transpose(0, 1), l, self.scale, ctx)

    def _after_layer(self, seq, l, buf, packed, n_host, n_done, start, end, new, kept: bool = False) -> None:
        """Offload the blocks completed in this step, keep the partly filled one in the decode buffer (the policy
        sees its keys; `kept`: the layer's decode graph wrote the new token there already)."""
        oe, bs, policy = self.oe, self.block_size, self.policy
        table = seq.block_table
        if packed is None:
            if n_done > n_host:                                         # blocks completed in this step
                positions = list(range(n_host, n_done))
                oe.offload(buf, l, positions, table[n_host:n_done])
                if policy.plans_loads:                                   # (a 32K prompt: 125 blocks at once)
                    self._keep_block(l, oe.buffers[buf][n_done - 1], n_done - 1)
                    policy.on_kv_written(l, table[n_host:n_done], oe.buffers[buf][n_host:n_done, 0],
                                         max(0, start - n_host * bs), (n_done - n_host) * bs)
            if end % bs:                                                # the partly filled block stays here
                if not kept:
                    wait_on(oe.dbuf_read[l], self.device, stream=oe.compute)
                    oe.dbuf[l].copy_(oe.buffers[buf][n_done])
                if policy.plans_loads:
                    policy.on_kv_written(l, [table[n_done]], oe.dbuf[l][:1], max(0, start - n_done * bs), end % bs)
        else:                                                           # decode over packed rows: one new token
            partial = end - n_host * bs
            if not kept:
                if partial == 1:
                    wait_on(oe.dbuf_read[l], self.device, stream=oe.compute)   # the last block's offload has read it
                oe.dbuf[l][:, :, partial - 1].copy_(oe.buffers[buf][new[0], :, :, new[1]])
            if policy.plans_loads:
                policy.on_kv_written(l, [table[n_host]], oe.dbuf[l][:1], partial - 1, partial)
            if partial == bs:
                self._keep_block(l, oe.dbuf[l], n_host)
                oe.offload_dbuf(l, table[n_host])

    def _layer_keys(self, l: int, buf: int, new: tuple, n_host: int, end: int, ctx: StepContext) -> torch.Tensor:
        """All of layer l's keys [Hkv, end, D]: the host blocks before this step, the partly filled block's earlier
        tokens (decode buffer) and the new token's (in the buffer)."""
        oe, bs = self.oe, self.block_size
        oe.synchronize()                                                  # the host copies of earlier blocks
        k = oe.host[l, ctx.block_table[:n_host].to(oe.host.device), 0].to(self.device)   # [n, Hkv, bs, D]
        partial = end - n_host * bs
        return torch.cat([k.transpose(0, 1).flatten(1, 2), oe.dbuf[l][0, :, :partial - 1],
                          oe.buffers[buf][new[0], 0, :, new[1]:new[1] + 1]], dim=1)

    def _load(self, buf: int, layer: int, blocks: list[int], context_len: int, is_prefill: bool,
              ctx: StepContext) -> None:
        """Load a layer's host blocks into a buffer: all of them, or, at decode, the rows the policy plans for a
        step of context_len tokens (packed per kv head)."""
        plan = None
        if self.policy.plans_loads and not is_prefill and layer not in self.oe.resident:
            plan = self.policy.plan_load(layer, context_len, ctx)
        if plan is None:
            self._packed[buf] = None
            self.oe.load(buf, layer, blocks)
            return
        if self._packed[buf] is not None and self._packed[buf][3] == plan.key:
            return                   # already loaded (the previous step's prefetch)
        bs, kept = self.block_size, self._kept()   # the recent rows on the device: the block before the newest
        recent = plan.recent if plan.recent == 0 or (plan.recent <= bs and self._prev_blk[layer] ==
                                                     (context_len - 1) // bs - 1) else -1
        sink = plan.sink if (self.keep_sink and plan.sink and recent >= 0 and plan.moved == plan.sink + recent
                             and self._sink_ok[layer] and kept.shape[3] == bs + plan.sink) else 0
        if sink:                     # the plan's only host rows are the sink and the recent rows, on the device
            self.oe.packing(buf)     # already (keep_sink off: tools' A/B)
        else:
            self.oe.load_rows(buf, layer, plan.rows, plan.moved)
        self._packed[buf] = (layer, plan.rows.shape[1], plan.device_tail, plan.key, sink, recent if sink else 0)

    def _kept(self) -> torch.Tensor:
        """The device copies of each layer's last complete block and sink, [L, 2, Hkv, bs + sink, D] (made anew,
        none valid, where the policy's sink changed)."""
        bs, s, a = self.block_size, self.policy.sink, self.args
        if self._keep is None or self._keep.shape[3] != bs + s:
            if self._keep is not None and self.decode_graphs is not None:
                self.decode_graphs.drop_layout(1)        # (their graphs read the old copies)
            self._keep = torch.zeros((a.num_layers, 2, a.num_kv_heads, bs + s, a.head_dim), dtype=self.dtype,
                                     device=self.device)
            self._sink_ok, self._prev_blk = [False] * a.num_layers, [-1] * a.num_layers
        return self._keep

    def _keep_block(self, l: int, block: torch.Tensor, index: int) -> None:
        """Block `index` of the sequence ([2, Hkv, bs, D]) was completed in layer l: keep a device copy, for the
        plans whose recent rows lie in it (Quest's window right after a block boundary: a load launched for those
        few rows cost the host ~0.1 ms a layer, 128K on an H200; once a block, 1 MiB on the device, for Qwen3-4B)."""
        if self.keep_sink:
            self._kept()[l, :, :, :self.block_size].copy_(block)
            self._prev_blk[l] = index

    def _keep_sink(self, l: int, buf: int, end: int) -> None:
        """Prefill: layer l's first tokens (the sink every load plan starts with), from its buffer to a device copy.
        A decode step whose plan for a layer moves nothing else from the host then loads nothing: a load launched
        from Python for the sink alone cost ~0.1 ms of host time a layer (Quest at 128K on an H200, where the
        correction fetches every page and the window is on the device), more than its 32 KB take on PCIe. Where
        the host sets the pace that shows (Quest look_ahead at 128K: 20.5 -> 18.0 ms/step, one process, steps
        alternating); where the GPU does, it does not (without look_ahead 14.0 -> 14.1)."""
        s = self.policy.sink
        if not self.keep_sink or not 0 < s <= min(end, self.block_size):
            return
        self._kept()[l, :, :, self.block_size:].copy_(self.oe.buffers[buf][0, :, :, :s])
        self._sink_ok[l] = True

    def prefetch_next(self, seq: Sequence, ctx: StepContext) -> None:
        """The next decode step's first loads, into the slots of this step's last streamed layers (after a step
        graph's replay, which leaves them out: issued from here they overlap the sampling and the next launch)."""
        S, N, n = len(self.streamed), self.oe.ring_slots, (len(seq) - 1) // self.block_size
        for j in range(max(0, S - N), S):
            self._prefetch(seq, j, n, n, False, ctx)

    def _prefetch(self, seq, j: int, n_host: int, n_done: int, is_prefill: bool, ctx: StepContext,
                  ahead: bool = True) -> None:
        """Slot of streamed layer j is free: load streamed layer j + N into it (this step, or, with `ahead`, the
        next one)."""
        S, N = len(self.streamed), self.oe.ring_slots
        nxt = j + N
        if nxt < S:  # this step's: dense in a prefill (a stale selection must not leak into it)
            layer, blocks, k, prefill, length = self.streamed[nxt], seq.block_table[:n_host], self._steps, \
                is_prefill, len(seq)
        elif ahead and not is_prefill and len(seq) < self.max_model_len:   # the next decode step's layers
            layer, blocks, k, prefill, length = self.streamed[nxt - S], seq.block_table[:n_done], self._steps + 1, \
                False, len(seq) + 1
        else:
            return
        self._load(self.oe.buffer_for(layer, k * S + self.streamed.index(layer)), layer, blocks, length, prefill, ctx)
