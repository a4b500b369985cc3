"""Chunked offload: the prompt goes through all layers one block-sized chunk at a time (DESIGN.md §2.1).

For chunk c (positions c*bs ..) and layer l: q, k, v of the chunk; k, v go to the layer's decode buffer (one
block per layer, on the device); attention of the chunk over itself (causal) and over each earlier block,
which streams through a ring of N one-block slots; the partial results merge by log-sum-exp. A full chunk
is offloaded to the host. The loads run ahead across layers: the ring walks one list of (layer, block) for
the whole chunk, so the next layer's first blocks load while this layer computes.

Activation memory is bounded by one block of queries (and a chunk's attention scores over one group of earlier
blocks, at most PREFILL_SCORES_BYTES), but every chunk re-reads all earlier blocks of every layer: prefill moves up
to L * block_bytes * C(C-1)/2 bytes host -> device for C chunks (a slot that still holds a group of the layer is not
loaded again). On CUDA those blocks stream in groups that fill a slot up to that scores bound (256-token blocks: 28
on the default model, 8 on Qwen3-4B): one load, one attention and one merge per group and layer, not per block.
Measured on an H100 (`python tools/chunked_prefill.py`: the default model's shape, random weights, bf16, four
engines of each kind in two runs, alternating): a fresh 5.8K-token prompt's time to first token 5.1-6.0 -> 1.5-2.3
s, a cached document with a 206-token question 0.77-0.92 -> 0.15-0.20 s. Each partial attention is then one flash
call that returns its log-sum-exp (attention_lse; it had been ~10 fp32 kernels and ~0.5 ms of host time): 1.25-1.94
-> 0.87-1.08 s and 110-174 -> 77-101 ms (H100, one engine per tree, two rounds, four prompts each); and as flash
keeps no scores, a group fills a whole slot (the Qwen3-4B shape had groups of 8 blocks): at 16K tokens of that shape
6.9-10.0 -> 4.6-7.0 s fresh, 146-271 -> 56-105 ms with the document cached (`.devrun` scratch, the same way). On
the CPU attention_lse is torch's fused kernel too (it was fp32 matmul-softmax, which kept the scores and was
faster one block at a time: 45.1 against 50.5 s on a 2-core machine), and there groups pay as well (the default
model's shape at 4K tokens, 2 cores: 20.1 -> 17.3 s fresh, 1.69 -> 1.29 s with the document cached); one block at a
time stays only where neither fused path runs (prefill_group 1).
Decode is the one-token chunk; there the cost is not the bytes but the pieces: one load, one attention and one
merge per earlier block and layer (at 6K tokens and 256-token blocks, 720 a token on the default model: 2
tokens/s on an H100). So a slot holds up to DECODE_GROUP_BYTES of one layer's blocks, and a decode step streams
each layer's earlier blocks in groups that fill a slot: one load, one attention and one merge per group (a whole
layer per group at these sizes).
On CUDA, where each layer's earlier blocks fit one slot with room for the partly filled block (and no policy plans
the loads), a decode step is layerwise decode over the ring: the partly filled block is copied in after the
earlier blocks and the layer's compute is one CUDA graph replay (engine/offload/decode_graphs.py), instead of ~20
launches per layer from Python (measured on an H100, the default model's shape at 6K tokens: 45.8 ms/token, of
which 8.4 ms on the GPU).

With a load-planning policy (Quest), a decode step streams for each layer what the policy plans: its pages,
packed per kv head by the page gather (the loads are issued before the layer's query exists, as in layerwise
mode); the policy then sees the layer's query. On CUDA, where a slot holds a layer's plan and its newest tokens,
that is one pack per layer and the step is layerwise decode over the ring with the layer's compute as graph
replays split around the policy's choice, as layerwise mode does (measured on an H200, the default model's shape at
6K tokens, Quest 1024 made sparse: 70.0 -> 9.4-12.2 ms/token; layerwise mode 9.3-10.4). Elsewhere (the CPU) the
plan streams in one-block packs, each attended and merged eagerly.
"""
from __future__ import annotations

import torch

from engine.ops.attention import attention_lse, fused_lse, lse_output, merge_lse
from engine.offload.decode_graphs import DecodeGraphs
from engine.offload.runner import OffloadRunner
from engine.offload.streams import wait_on
from engine.sequence import Sequence
from engine.step import StepContext
from engine.trace.base import NULL_SPAN
from engine.trace.events import COMPUTE, COMPUTING

DECODE_GROUP_BYTES = 256 << 20   # a ring slot's room for decode's groups of earlier blocks (one layer's KV)
PREFILL_SCORES_BYTES = 64 << 20  # a prefill chunk's attention scores over one group of earlier blocks (fp32; the
                                 # softmax makes a second such tensor): the activation bound of a prefill chunk where
                                 # attention_lse materializes them (not where it runs flash: there a whole slot)


class ChunkedRunner(OffloadRunner):
    mode = "chunked"

    def _make_offload_engine(self):
        self._pos = 0  # ring position, continuing across chunks and steps
        layer_block = self.block_bytes // self.args.num_layers            # one block of one layer
        self.group = max(1, min(self.max_blocks_per_seq, DECODE_GROUP_BYTES // layer_block))
        scores_per_block = self.args.num_heads * self.block_size ** 2 * 4      # a chunk over one block, fp32
        if fused_lse(self.device, self.dtype, self.args.head_dim):             # no scores in memory: a whole slot
            self.prefill_group = self.group
        elif self.device.type == "cuda":
            self.prefill_group = max(1, min(self.group, PREFILL_SCORES_BYTES // scores_per_block))
        else:                                                                  # one block at a time stays in cache
            self.prefill_group = 1
        oe = self._engine(self.config.ring_slots, self.group)
        table = torch.arange(self.group, dtype=torch.int32, device=self.device)[None]
        self.decode_graphs = (DecodeGraphs(self.model, oe.kv_views, table, self.chunk_tokens)
                              if self.device.type == "cuda" and not self.config.enforce_eager else None)
        return oe

    def forward(self, seq: Sequence, is_prefill: bool, ctx: StepContext):
        bs = self.block_size
        start = seq.num_cached_tokens if is_prefill else len(seq) - 1
        end = len(seq)
        out = None
        chunks = [start] + list(range((start // bs + 1) * bs, end, bs))     # each chunk's first position
        self._progress = (0, len(chunks) * len(self.model.layers))
        for i, a in enumerate(chunks):
            if len(chunks) > 1:       # the recorder times some chunks of a long prompt (TraceRecorder.begin_part)
                ctx.recorder.begin_part(i, len(chunks))
            out = self._chunk(seq, a, min(end, (a // bs + 1) * bs), is_prefill, ctx)
        return out

    def _chunk(self, seq: Sequence, a: int, b: int, is_prefill: bool, ctx: StepContext):
        """Positions a..b-1 (inside one block) through every layer -> logits of the last one."""
        oe, bs, rec, model, policy = self.oe, self.block_size, ctx.recorder, self.model, self.policy
        cb, off = a // bs, a % bs
        earlier = seq.block_table[:cb]
        observe = [not is_prefill and policy.observes(l, b) for l in range(len(model.layers))]
        graphed = (self.decode_graphs is not None and not is_prefill   # decode, each layer's earlier blocks (or
                   and 0 < len(earlier) < oe.slot_blocks)                # its plan) in one slot with room after
        loads, at, tails = [], [], []                   # at[l]: index of layer l's first load
        for l in range(len(model.layers)):
            at.append(len(loads))
            layer_loads, tail = self._layer_loads(l, earlier, b, is_prefill, ctx, graphed)
            loads += layer_loads
            tails.append(tail)
        at.append(len(loads))
        N = oe.ring_slots
        first = self._pos
        for i in range(min(N, len(loads))):
            self._issue((first + i) % N, loads[i])
        if graphed and len(loads) == len(model.layers):                   # one load per layer
            return self._graph_step(seq, cb, off, b, loads, tails, observe, first, ctx)
        h, residual, pos, cos_sin = self._inputs(seq, a, b)
        marks = rec.detail and self.device.type == "cuda"   # CUDA timeline: spans share their boundary marks
        mark = rec.mark() if marks else None
        for l, layer in enumerate(model.layers):
            with NULL_SPAN if marks else rec.span(COMPUTE, model.layer_names[l], l):
                with NULL_SPAN if marks else rec.span(COMPUTE, "attention", l):
                    if off == 0:  # a new block: its previous contents must have left for the host
                        wait_on(oe.dbuf_read[l], self.device, rec, l)
                    own = oe.dbuf[l]                                        # [2, Hkv, bs, D]

                    def store(k, v, r0, r1):
                        own[0, :, off + r0:off + r1] = k.transpose(0, 1)
                        own[1, :, off + r0:off + r1] = v.transpose(0, 1)
                    q = layer.qkv_rows(h, residual, cos_sin, store)
                    fix = policy.observe_query(l, q[-1], ctx) if observe[l] else None   # before the attention
                    lo, hi = b - cb * bs - (tails[l] or b - cb * bs), b - cb * bs   # the planned tail, or all
                    o, lse = attention_lse(q, own[0, :, lo:hi], own[1, :, lo:hi], self.scale, causal=True)
                    for i in range(at[l], at[l + 1]):
                        o, lse = self._earlier_block(q, o, lse, loads, first, i, rec, fix)
                if marks:                   # the layer, its attention and its MLP: three marks, the first shared
                    mid = rec.mark()
                    rec.add_event_span(COMPUTE, "attention", mark, mid, l)
                with NULL_SPAN if marks else rec.span(COMPUTE, "mlp", l):
                    layer.post_rows(lse_output(o, q.dtype), h, residual)
                if marks:
                    rec.add_event_span(COMPUTE, "mlp", mid, rec.mark(), l)
                if policy.plans_loads:
                    policy.on_kv_written(l, [seq.block_table[cb]], own[:1], off, b - cb * bs)
                if b % bs == 0:
                    oe.offload_dbuf(l, seq.block_table[cb])
                if policy.plans_loads and is_prefill and b == len(seq):   # the prompt's last query: a first choice
                    policy.observe_query(l, q[-1], ctx)
            if marks:
                began, mark = mark, rec.mark()
                rec.add_event_span(COMPUTE, model.layer_names[l], began, mark, l)
            done, total = self._progress
            self._progress = (done + 1, total)
            ctx.layer_done(done + 1, total)
        self._pos = first + len(loads)
        return self._logits(h, residual, ctx)

    def _graph_step(self, seq: Sequence, cb: int, off: int, end: int, loads, tails, observe, first: int,
                    ctx: StepContext):
        """One decode token, layer i over ring slot (first + i) % N, which holds the layer's earlier blocks or the
        policy's planned rows (packed per kv head): the partly filled block (or, after planned rows, the newest
        tokens the plan leaves on the device) copied in after them, then the layer's compute as graph replays (q,
        k, v, the new token's KV into the slot, attention, MLP; where the policy observes the query, split around
        it, its correction's gather recorded before the attention: as in layerwise mode); the new token's KV goes
        back to the decode buffer, which is offloaded when full."""
        oe, graphs, rec, N, policy, bs = (self.oe, self.decode_graphs, ctx.recorder, self.oe.ring_slots, self.policy,
                                          self.block_size)
        host_block = seq.block_table[cb]
        graphs.begin_token(seq.token_ids[-1], end - 1)
        for l, name in enumerate(self.model.layer_names):
            slot = (first + l) % N
            with rec.span(COMPUTE, name, l, slot=slot):
                for ev in oe.ready(slot):
                    wait_on(ev, self.device, rec, l, slot)
                if rec.detail:
                    rec.slot_state(slot, l, COMPUTING, end, oe.capacity_tokens)
                buf = oe.buffers[slot]
                between = (lambda q: self._query_fix(l, slot, q[0], ctx)) if observe[l] else None
                if tails[l] is None:             # whole blocks: the partly filled one right after them
                    oe.writing(slot, cb)
                    if off:
                        buf[cb].copy_(oe.dbuf[l])
                    new = (cb, off)
                    graphs.run(l, slot, 0, (cb, off, end, off), between)
                else:                            # planned rows, then the plan's newest tokens (the new one last)
                    n_rows = loads[l][1].shape[1]
                    self._copy_tokens(buf, n_rows, oe.dbuf[l], off + 1 - tails[l], off)
                    f = n_rows + tails[l] - 1
                    new = (f // bs, f % bs)
                    graphs.run(l, slot, 1, (*new, f + 1, off), between)
                if off == 0:                     # a new block: its previous contents must have left for the host
                    wait_on(oe.dbuf_read[l], self.device, rec, l)
                oe.dbuf[l][:, :, off].copy_(buf[new[0], :, :, new[1]])
                if policy.plans_loads:
                    policy.on_kv_written(l, [host_block], oe.dbuf[l][:1], off, off + 1)
                if end % self.block_size == 0:
                    oe.offload_dbuf(l, host_block)
                oe.release(slot, l, end)
                if l + N < len(loads):
                    self._issue(slot, loads[l + N])
            ctx.layer_done(l + 1, len(loads))
        self._pos = first + len(loads)
        return self._logits(graphs.h, graphs.residual, ctx)

    def _layer_loads(self, layer: int, earlier: list[int], end: int, is_prefill: bool, ctx: StepContext,
                     one_slot: bool = False) -> tuple[list[tuple], int | None]:
        """What layer `layer` streams for a chunk ending at token `end`: each earlier block, or the policy's planned
        rows in one-block packs (then also how many of the newest tokens it attends on the device); `one_slot`: the
        plan in one pack where a slot holds it and its newest tokens (a graphed decode step)."""
        plan = None
        if self.policy.plans_loads and not is_prefill and earlier:
            plan = self.policy.plan_load(layer, end, ctx)
        if plan is None:                       # whole blocks, in groups: at decode filling a slot, at prefill as many
            g = self.prefill_group if is_prefill else self.group   # as keep the chunk's scores in PREFILL_SCORES_BYTES
            return [(layer, list(earlier[i:i + g])) for i in range(0, len(earlier), g)], None
        n = plan.rows.shape[1]
        moved = n if plan.moved is None else plan.moved                  # the rows before it are not -1
        cap = self.oe.capacity_tokens
        pack = cap if one_slot and n + plan.device_tail <= cap else self.block_size
        return [(layer, plan.rows[:, j:j + pack], j, max(0, min(pack, moved - j))) for j in range(0, n, pack)], \
            plan.device_tail

    def _issue(self, slot: int, item: tuple) -> None:
        if isinstance(item[1], list):
            self.oe.load(slot, item[0], item[1])
        else:
            self.oe.load_rows(slot, item[0], item[1], item[3])

    def _earlier_block(self, q, o, lse, loads, first: int, i: int, rec, fix=None):
        """Attend to the i-th load of this chunk (an earlier block, a decode group of blocks, or a pack of planned
        rows: corrected first where the policy's fix puts rows into it), then hand its slot to load i + N."""
        oe, N, bs = self.oe, self.oe.ring_slots, self.block_size
        layer = loads[i][0]
        slot = (first + i) % N
        waited = None                   # (CUDA: the wait's end mark also times the slot's COMPUTING state)
        for ev in oe.ready(slot):
            waited = wait_on(ev, self.device, rec, layer, slot) or waited
        blocks = isinstance(loads[i][1], list)
        tokens = bs * len(loads[i][1]) if blocks else bs
        if rec.detail:
            rec.slot_state(slot, layer, COMPUTING, tokens, oe.capacity_tokens, event=waited)
        if blocks:                                                      # g whole blocks: [Hkv, g * bs, D]
            kv = oe.buffers[slot][:len(loads[i][1])].transpose(0, 2).flatten(2, 3)   # [Hkv, 2, g * bs, D]
            k, v = kv[:, 0], kv[:, 1]
        else:                                                           # a pack: rows j .. j + n of the plan
            j, n = loads[i][2], loads[i][1].shape[1]
            if fix is not None:
                here = (fix.dst >= j) & (fix.dst < j + n)
                oe.fix_rows(slot, layer, fix.rows.masked_fill(~here, -1), (fix.dst - j).clamp(0, n - 1))
            kv = oe.buffers[slot][0]
            k, v = kv[0][:, :n], kv[1][:, :n]
        part, part_lse = attention_lse(q, k, v, self.scale)
        o, lse = merge_lse(o, lse, part, part_lse)
        oe.release(slot, layer, tokens)
        if i + N < len(loads):
            self._issue(slot, loads[i + N])
        return o, lse
